"""What a jaxworks test asks of the backend it runs on (every jaxworks_test
can import it, as JAX's own tests use ``jax._src.test_util``).

A test asks for the devices it uses, inside the test or a fixture, never at
import time: 8 host CPU devices on a ``_cpu`` target, the devices present on
an accelerator (a TPU v5e machine has one chip). What needs more devices than
exist skips, naming the count. Dtypes the backend lacks are asked of the
backend and skipped, never compiled (a TPU aborts the whole process on some).

    import jaxworks_testing as jwt

    def test_rows_over_eight():
      mesh = jwt.mesh((8,), ("x",))          # skips below 8 devices
      ...

    @settings(max_examples=jwt.examples(200))  # fewer on an accelerator
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import socket
from typing import Any

import jax
import numpy as np
import pytest

# What XLA's backends can hold and compute on, as JAX's own test utilities
# list them (jax._src.test_util.supported_dtypes) for a TPU and a GPU, by
# name. The CPU keeps every dtype the tests use (the float8 and int2/int4
# types included), as it always has.
_ACCELERATOR_DTYPES = {
  "tpu": {
    "bool",
    "int4",
    "int8",
    "int16",
    "int32",
    "uint4",
    "uint8",
    "uint16",
    "uint32",
    "bfloat16",
    "float16",
    "float32",
    "complex64",
    "float8_e4m3fn",
    "float8_e4m3b11fnuz",
    "float8_e5m2",
  },
  "gpu": {
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
    "float8_e4m3fn",
    "float8_e5m2",
  },
}
_X64 = {"int64", "uint64", "float64", "complex128"}

# Hypothesis examples on an accelerator, as a fraction of the CPU's count:
# every example compiles programs, and many tiny compiles are far slower on
# a TPU than on a CPU.
ACCELERATOR_EXAMPLES_DIVISOR = 10


def platform() -> str:
  """The platform of JAX's default backend: ``cpu``, ``gpu`` or ``tpu``."""
  return jax.default_backend()


def on_accelerator() -> bool:
  return platform() != "cpu"


def device_count() -> int:
  return len(jax.devices())


def _need(n: int) -> str:
  return (
    f"needs {n} devices; {platform()} has {device_count()} "
    "(the _cpu target runs it on 8 host devices)"
  )


def require_devices(n: int) -> None:
  """Skips the calling test unless JAX has at least ``n`` devices."""
  if device_count() < n:
    pytest.skip(_need(n))


def devices(n: int | None = None) -> list[Any]:
  """The first ``n`` devices (all present when ``n`` is None); skips the
  test when there are fewer."""
  present = jax.devices()
  if n is None:
    return present
  require_devices(n)
  return present[:n]


def needs_devices(n: int):
  """A marker for tests that need ``n`` devices (decided at run time)."""
  return pytest.mark.skipif(
    "len(__import__('jax').devices()) < " + str(int(n)),
    reason=f"needs {n} devices (the _cpu target runs it on 8 host devices)",
  )


def mesh(shape, names, **kwargs):
  """``jax.make_mesh(shape, names, **kwargs)``; skips the test when there are
  fewer than prod(shape) devices."""
  n = math.prod(shape)
  require_devices(n)
  if n == device_count():
    return jax.make_mesh(tuple(shape), tuple(names), **kwargs)
  return jax.make_mesh(tuple(shape), tuple(names), devices=devices(n), **kwargs)


def fit(shape) -> tuple[int, ...]:
  """``shape``, each axis made smaller (largest first) until the product is
  at most the number of devices: (4, 2) stays on 8 devices, is (2, 2) on 4
  and (1, 1) on one chip."""
  shape = list(shape)
  while math.prod(shape) > device_count():
    i = max(range(len(shape)), key=lambda k: shape[k])
    p = next(q for q in range(2, shape[i] + 1) if shape[i] % q == 0)
    shape[i] //= p
  return tuple(shape)


def mesh_fit(shape, names, **kwargs):
  """A mesh of ``shape`` where the devices suffice (``jax.make_mesh``, as
  on the CPU target's 8), else of ``fit(shape)``, the same rank and names
  over the devices present: for tests whose point holds on any mesh."""
  small = fit(shape)
  if small == tuple(shape):
    return mesh(shape, names, **kwargs)
  return jax.make_mesh(
    small, tuple(names), devices=devices(math.prod(small)), **kwargs
  )


def device(i: int):
  """The i-th device, or with fewer devices ``jax.devices()[i % count]``
  (one chip: always that chip)."""
  present = jax.devices()
  return present[i % len(present)]


def device_array(shape, names=None):
  """The first prod(shape) devices as a numpy array of that shape."""
  n = math.prod(shape)
  return np.array(devices(n)).reshape(shape)


def dtype_name(dtype) -> str:
  return np.dtype(dtype).name


def supports_dtype(dtype) -> bool:
  """Whether the backend holds and computes on ``dtype``: every dtype on the
  CPU; on an accelerator those of its table (JAX's own list). A 64-bit type
  counts as its 32-bit twin while jax_enable_x64 is off (JAX canonicalizes
  it) and as itself when it is on (a TPU has none)."""
  allowed = _ACCELERATOR_DTYPES.get(platform())
  if allowed is None:
    return True
  name = dtype_name(dtype)
  if name in _X64 and not jax.config.read("jax_enable_x64"):
    return True
  return name in allowed


def require_dtype(dtype) -> None:
  """Skips the calling test when the backend lacks ``dtype``."""
  if not supports_dtype(dtype):
    pytest.skip(f"{platform()} has no {dtype_name(dtype)}")


def has_x64() -> bool:
  """Whether the backend computes in float64 under jax_enable_x64 (a CPU and
  a GPU do, a TPU does not)."""
  allowed = _ACCELERATOR_DTYPES.get(platform())
  return allowed is None or "float64" in allowed


def require_x64() -> None:
  """Skips on an accelerator without 64-bit floats (a TPU)."""
  if not has_x64():
    pytest.skip(f"{platform()} has no float64 (jax_enable_x64)")


def examples(n: int) -> int:
  """A hypothesis ``max_examples``: ``n`` on the CPU, a tenth of it (at
  least 2) on an accelerator."""
  if not on_accelerator():
    return n
  return max(2, n // ACCELERATOR_EXAMPLES_DIVISOR)


def skip_on_accelerator(reason: str) -> None:
  """Skips the calling test on an accelerator, saying why."""
  if on_accelerator():
    pytest.skip(f"not on {platform()}: {reason}")


def require_child_processes() -> None:
  """Skips a test whose child processes open the backend: a TPU is held by
  this process, and one process at a time may open it."""
  if on_accelerator():
    pytest.skip(
      f"starts processes that open the {platform()}, which this process "
      "holds (one process at a time may open a TPU)"
    )


@functools.cache
def tcp_sockets() -> str | None:
  """None when a TCP server and client can talk on 127.0.0.1, else why not."""
  try:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  except OSError as e:
    return f"socket(AF_INET): {e}"
  try:
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    client = socket.create_connection(server.getsockname(), timeout=5)
    client.close()
  except OSError as e:
    return f"127.0.0.1: {e}"
  finally:
    server.close()
  return None


def require_tcp_sockets() -> None:
  """Skips a test that opens TCP sockets on 127.0.0.1 (jax.distributed, an
  object-store server) on a machine that refuses them."""
  why = tcp_sockets()
  if why is not None:
    pytest.skip(f"needs TCP sockets on 127.0.0.1, refused here ({why})")


def hardware_run() -> bool:
  """True under tools/hardware_tests.py (no Bazel)."""
  return os.environ.get("JAXWORKS_HARDWARE_TESTS") == "1"


def pick(present, *indices):
  """The devices at ``indices`` of ``present`` (each taken modulo how many
  there are, repeats dropped): ``pick(d, 4, 5)`` is ``d[4:6]`` on 8 devices,
  ``[d[0]]`` on one chip."""
  out = []
  for i in indices:
    d = present[i % len(present)]
    if d not in out:
      out.append(d)
  return out


def exact_matmuls():
  """A context for comparing two programs' float32 numbers: on an
  accelerator, matrix products at float32 precision
  (``jax.default_matmul_precision("highest")``; a TPU's default rounds
  their inputs to bfloat16); nothing on the CPU, which computes them so."""
  if on_accelerator():
    return jax.default_matmul_precision("highest")
  return contextlib.nullcontext()


def tolerance(rtol: float, atol: float = 0.0) -> dict[str, float]:
  """``assert_allclose`` tolerances: as given on the CPU, 20 times looser on
  an accelerator, whose transcendental functions (tanh, exp) agree with
  each other's other programs to four or five digits."""
  k = 20.0 if on_accelerator() else 1.0
  return {"rtol": rtol * k, "atol": atol * k}
