"""The dtypes the batched_transfer tests place, save and restore (shared by several test files)."""

import ml_dtypes
import numpy as np

#: Every numpy dtype jax.device_put accepts with x64 on.
NUMPY_DTYPES = [
  np.dtype(t)
  for t in (
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.complex64,
    np.complex128,
  )
]

#: Every ml_dtypes type JAX supports (the ones .npy files cannot name).
ML_DTYPES = [
  np.dtype(t)
  for t in (
    ml_dtypes.bfloat16,
    ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e4m3fnuz,
    ml_dtypes.float8_e5m2fnuz,
    ml_dtypes.float8_e4m3b11fnuz,
    ml_dtypes.float8_e3m4,
    ml_dtypes.float8_e4m3,
    ml_dtypes.float8_e8m0fnu,
    ml_dtypes.float4_e2m1fn,
    ml_dtypes.int4,
    ml_dtypes.uint4,
    ml_dtypes.int2,
    ml_dtypes.uint2,
  )
]

DTYPES = NUMPY_DTYPES + ML_DTYPES
