"""The smoke test an installed jaxworks passes (sdist_test, python_matrix_test),
and the clean environment the install tests run pip and Python in.

Run as ``python -c SMOKE`` from a neutral directory in a virtualenv holding
the five packages: every package imports from that virtualenv, and one call
through each C++ extension's API equals stock JAX's result.
"""

import os


def clean_env() -> dict:
  """This environment without what would leak the build's Python, pip or JAX
  settings into a fresh virtualenv; CPU JAX."""
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("PYTHON", "PIP_", "RUNFILES", "JAX_", "XLA_"))
  }
  env["JAX_PLATFORMS"] = "cpu"
  return env


SMOKE = r"""
import os, sys
import jax, jax.numpy as jnp, numpy as np
from jaxworks import axis_names, batched_transfer, jit_cache, pmap_chunked
from jaxworks import stages_aot
from jaxworks.batched_transfer import _checked_read, _grouping
from jaxworks.jit_cache import _signature
for m in (_checked_read, _grouping, _signature, jit_cache, stages_aot):
  assert m.__file__.startswith(sys.prefix), (m.__file__, sys.prefix)
for m in (_checked_read, _grouping, _signature):
  assert m.__file__.endswith(".so"), m.__file__
f = lambda x, y: jnp.sin(x) * y + 1
x = np.arange(6.0, dtype=np.float32).reshape(2, 3)
np.testing.assert_array_equal(jit_cache.jit(f)(x, 2.0), jax.jit(f)(x, 2.0))
tree = {"w": x, "b": np.ones(3, np.float32)}
device = jax.devices()[-1]
got, want = batched_transfer.device_put(tree, device), jax.device_put(tree, device)
for k in tree:
  assert got[k].devices() == {device}
  np.testing.assert_array_equal(got[k], want[k])
# A checkpoint round trip: its checked read (C++ where the CPU has the vector
# CRC-32C) passes the data and fails a flipped byte.
import tempfile
big = {"a": np.random.default_rng(0).random((3, 2**20)).astype(np.float32)}
ckpt = os.path.join(tempfile.mkdtemp(), "ckpt")
batched_transfer.save(ckpt, big)
np.testing.assert_array_equal(batched_transfer.restore(ckpt, big)["a"], big["a"])
name = os.path.join(ckpt, next(n for n in os.listdir(ckpt) if n.endswith(".npy")))
with open(name, "r+b") as fh:
  fh.seek(-5, 2)
  byte = fh.read(1)
  fh.seek(-5, 2)
  fh.write(bytes([byte[0] ^ 1]))
try:
  batched_transfer.restore(ckpt, big)
except ValueError as err:
  assert "checksum" in str(err).lower() or "crc" in str(err).lower(), err
else:
  raise AssertionError("restore passed a flipped byte")
print("smoke ok", sys.version_info[:2], jax.__version__)
"""
