"""Every private JAX name in _src/jax_internals.py, checked against what we rely on."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np

from jaxworks.stages_aot._src import jax_internals


def f(x):
  return jnp.sin(x) @ x.T


SPEC = jax.ShapeDtypeStruct((3, 4), jnp.float32)


def test_stock_jit_is_jax_jit():
  # In a process that swapped nothing, the bound stock jit is jax.jit itself.
  assert jax_internals.stock_jit is jax.jit
  assert jax_internals.stock_jit(f)(np.ones((3, 4), np.float32)).shape == (3, 3)


def test_module_reader_imports_what_jax_extend_mlir_exposes():
  import jax.extend.mlir
  import jax.extend.mlir.ir
  from jaxlib import _jax
  import jaxlib.mlir.ir

  source = jax_internals.MODULE_READER_SOURCE
  assert (
    "from jaxlib import _jax" in source
    and "from jaxlib.mlir import ir" in source
  )
  assert (
    jax.extend.mlir.deserialize_portable_artifact
    is _jax.mlir.deserialize_portable_artifact
  )
  assert jax.extend.mlir.ir.Context is jaxlib.mlir.ir.Context
  assert jax.extend.mlir.ir.RankedTensorType is jaxlib.mlir.ir.RankedTensorType
  for name in (
    "IntegerAttr",
    "StringAttr",
    "TypeAttr",
    "FunctionType",
    "ShapedType",
  ):
    assert getattr(jax.extend.mlir.ir, name) is getattr(jaxlib.mlir.ir, name)
  # The child runs the source as a script and answers one JSON line.
  from jaxworks.stages_aot._src import module_reader

  exp = jax.export.export(jax.jit(f), platforms=("cpu", "tpu"))(SPEC)
  (answer,) = module_reader.describe_modules([exp.mlir_module_serialized])
  assert answer["attributes"] == {
    "mhlo.num_partitions": 1,
    "mhlo.num_replicas": 1,
  }
  assert [t["text"] for t in answer["inputs"]] == [
    "tensor<i32>",
    "tensor<3x4xf32>",
  ]
  assert answer["results"] == [
    {"text": "tensor<3x3xf32>", "shape": [3, 3], "element": "f32"}
  ]
