"""axis_names when a program swaps JAX entry points (each in a fresh process).

jaxworks.jit_cache builds on axis_names, and a program may assign
``jax.jit = jaxworks.jit_cache.jit`` (or swap ``jax.pmap``, ``jax.device_put``)
for the whole process. axis_names binds the stock JAX callables it uses when
it is imported, so its core cases give stock JAX's results under the plain
swap, and never call a swapped entry point at all (a poisoned swap proves
it).
"""

import os
import pathlib
import subprocess
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest

_SCRIPT = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

stock_jit = jax.jit
from jaxworks import axis_names

X = jnp.arange(8.0) / 8 + 0.25


def vjp_fn(name):
  @jax.custom_vjp
  def f(x):
    return lax.psum(x, name) * jnp.sin(x)

  f.defvjp(lambda x: (f(x), x),
           lambda x, g: (lax.psum(g * jnp.cos(x), name) + g,))
  return f


def cases(jit):
  # (renamed function, hand-renamed stock function, how to run them)
  g = axis_names.rename_axes(vjp_fn("i"), {"i": "k"})
  ref = vjp_fn("k")
  mesh_k = jax.make_mesh((8,), ("k",), axis_types=(AxisType.Auto,))
  shard = lambda fn: jit(jax.shard_map(fn, mesh=mesh_k, in_specs=P("k"),
                                       out_specs=P("k")))
  return [
      (g, ref, lambda fn: jit(jax.vmap(fn, axis_name="k"))(X)),
      (g, ref, lambda fn: jit(jax.vmap(jax.grad(fn), axis_name="k"))(X)),
      (g, ref, lambda fn: shard(fn)(X)),
      (g, ref, lambda fn: jax.grad(lambda x: shard(fn)(x).sum())(X)),
  ]


expected = [np.asarray(run(ref)) for _, ref, run in cases(stock_jit)]

mode = sys.argv[1]
if mode == "jit_cache":
  from jaxworks import jit_cache
  jax.jit = jit_cache.jit  # the plain swap
  user_jit = jax.jit
else:
  def poisoned(name):
    def call(*args, **kwargs):
      raise AssertionError(f"jax.{name} looked up at call time")
    return call
  for name in ("jit", "pmap", "device_put", "make_jaxpr"):
    setattr(jax, name, poisoned(name))
  user_jit = stock_jit

n = 0
for (g, _, run), want in zip(cases(user_jit), expected):
  np.testing.assert_array_equal(np.asarray(run(g)), want)
  n += 1

# Analysis, checks and the report on a function with an inner jit.
inner = user_jit(lambda v: lax.psum(v, "i"))
fn = lambda v: inner(v) * lax.axis_index("j")
assert axis_names.used_axis_names(fn, X) == {"i", "j"}
assert axis_names.check_axis_names(fn, X, axis_sizes={"i": 2, "j": 4}) == {
    "i", "j"}
report = axis_names.collective_report(fn, X, axis_sizes={"i": 2, "j": 4})
assert set(report.axis_names) == {"i", "j"}, report
try:
  axis_names.check_axis_names(fn, X, axis_sizes={"i": 2})
except axis_names.AxisNameError as e:
  assert e.axis_name == "j", e
else:
  raise AssertionError("check_axis_names accepted an unbound name")
n += 4
print("cases", n)
"""


@pytest.mark.parametrize("mode", ["jit_cache", "poisoned"])
def test_core_cases_under_a_swap_in_a_fresh_process(mode):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
  proc = subprocess.run(
    [sys.executable, "-c", _SCRIPT, mode],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
    cwd=str(pathlib.Path(__file__).resolve().parent),
  )
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert "cases 8" in proc.stdout
  assert "RecursionError" not in proc.stderr
