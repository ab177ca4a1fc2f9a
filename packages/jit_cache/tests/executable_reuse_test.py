"""Re-created closures reuse compiled executables; near misses never do."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks.jit_cache import jit


def _compiles_for(make, *args, jit_kwargs=None, **call_kwargs):
  """Builds a fresh wrapper around make(); returns (compiles, reuses, out)."""
  f = jit(make(), **(jit_kwargs or {}))
  out = f(*args, **call_kwargs)
  info = f.cache_info()
  assert info.traces == 1
  return info.compiles, info.executable_reuses, out


def _check(make_a, make_b, args, *, reuse: bool, jit_kwargs_a=None,
           jit_kwargs_b=None, args_b=None):
  """make_a's program compiles; make_b's reuses it iff `reuse`; results equal
  jax.jit's."""
  args_b = args if args_b is None else args_b
  fresh = lambda xs: [jnp.array(a, copy=True) for a in xs]  # donation-proof
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    want_a = jax.jit(make_a(), **(jit_kwargs_a or {}))(*fresh(args))
    want_b = jax.jit(make_b(), **(jit_kwargs_b or {}))(*fresh(args_b))
    ca, ra, out_a = _compiles_for(make_a, *fresh(args), jit_kwargs=jit_kwargs_a)
    cb, rb, out_b = _compiles_for(make_b, *fresh(args_b),
                                  jit_kwargs=jit_kwargs_b)
  assert (ca, ra) == (1, 0) or (ca, ra) == (0, 1)
  if reuse:
    assert (cb, rb) == (0, 1), "expected the executable to be reused"
  else:
    assert (cb, rb) == (1, 0), "a near miss must compile anew"
  for got, want in ((out_a, want_a), (out_b, want_b)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.dtype == want.dtype


def scale(c):
  return lambda: (lambda x: jnp.sin(x) * c)


X = jnp.linspace(0.0, 1.0, 8)


def test_recreated_closure_reuses_executable():
  _check(scale(2.5), scale(2.5), (X,), reuse=True)


def test_many_recreations_compile_once():
  total = 0
  for _ in range(5):
    f = jit(lambda x: jnp.cos(x) * 7.0 + 1.0)
    f(X)
    total += f.cache_info().compiles
  assert total <= 1


def test_near_miss_literal():
  _check(scale(2.5), scale(3.5), (X,), reuse=False)


def test_near_miss_literal_sign_of_zero():
  _check(scale(0.0), scale(-0.0), (X,), reuse=False)


def test_numpy_constant_by_content():
  base = np.arange(8.0, dtype=np.float32)
  _check(lambda: (lambda x: x + base), lambda: (lambda x: x + base.copy()),
         (X,), reuse=True)
  _check(lambda: (lambda x: x + base), lambda: (lambda x: x + (base + 1)),
         (X,), reuse=False)


def test_small_jax_constant_by_content():
  a = jnp.arange(8.0)
  b = jnp.arange(8.0)  # another object, same content and placement
  _check(lambda: (lambda x: x * a), lambda: (lambda x: x * b), (X,),
         reuse=True)
  c = jnp.arange(8.0) + 1
  _check(lambda: (lambda x: x * a), lambda: (lambda x: x * c), (X,),
         reuse=False)


def test_large_jax_constant_by_identity():
  big = jnp.ones((128, 256))  # 128 KiB: keyed by identity
  twin = jnp.ones((128, 256))
  y = jnp.ones((256,))
  _check(lambda: (lambda v: big @ v), lambda: (lambda v: big @ v), (y,),
         reuse=True)
  _check(lambda: (lambda v: big @ v), lambda: (lambda v: twin @ v), (y,),
         reuse=False)


def test_near_miss_dtype():
  _check(scale(2.0), scale(2.0), (X,), args_b=(X.astype(jnp.float16),),
         reuse=False)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices")
def test_near_miss_sharding():
  on0 = jax.device_put(X, jax.devices()[0])
  on1 = jax.device_put(X, jax.devices()[1])
  _check(scale(2.0), scale(2.0), (on0,), args_b=(on1,), reuse=False)
  f = jit(scale(2.0)())
  assert list(f(on1).devices()) == [jax.devices()[1]]


def test_near_miss_donation():
  _check(scale(2.0), scale(2.0), (X,), reuse=False,
         jit_kwargs_b={"donate_argnums": 0})


def test_near_miss_platform_choice():
  # backend= pins placement (it becomes in/out shardings): another program.
  _check(scale(2.0), scale(2.0), (X,), reuse=False,
         jit_kwargs_b={"backend": jax.devices()[0].platform})


def test_near_miss_x64():
  _check(scale(2.0), scale(2.0), (X,), reuse=True)
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    c, r, out = _compiles_for(scale(2.0), X)
  finally:
    jax.config.update("jax_enable_x64", prev)
  assert (c, r) == (1, 0)
  np.testing.assert_array_equal(out, jnp.sin(X) * 2.0)


def test_near_miss_compiler_options():
  if jax.devices()[0].platform != "cpu":
    pytest.skip("CPU compiler option")
  _check(scale(2.0), scale(2.0), (X,), reuse=False,
         jit_kwargs_b={"compiler_options": {"xla_cpu_enable_fast_math": False}})


def test_debug_print_format_is_part_of_the_key(capfd):
  def printing(fmt):
    def make():
      def f(x):
        jax.debug.print(fmt, x=x[0])
        return x + 1
      return f
    return make

  _check(printing("a {x}"), printing("a {x}"), (X,), reuse=True)
  _check(printing("a {x}"), printing("b {x}"), (X,), reuse=False)
  jax.effects_barrier()
  out = capfd.readouterr().out
  assert "a 0.0" in out and "b 0.0" in out


def test_host_callback_function_is_part_of_the_key():
  def calling(fn):
    def make():
      def f(x):
        return jax.pure_callback(fn, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
      return f
    return make

  _check(calling(np.sin), calling(np.sin), (X,), reuse=True)
  _check(calling(np.sin), calling(np.cos), (X,), reuse=False)


def test_debug_callback_closures_never_shared():
  seen = []

  def make():
    def f(x):
      jax.debug.callback(lambda v: seen.append(float(v)), x[1])
      return x * 2
    return f

  _check(make, make, (X,), reuse=False)
  jax.effects_barrier()
  assert len(seen) >= 2


def test_custom_jvp_rules_do_not_block_reuse():
  make = lambda: (lambda x: jax.nn.relu(x) + jax.nn.gelu(x))
  _check(make, make, (X,), reuse=True)


def test_out_shardings_are_part_of_the_key():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices")
  mesh = jax.make_mesh((8,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
  split = jax.sharding.NamedSharding(mesh, jax.P("i"))
  whole = jax.sharding.NamedSharding(mesh, jax.P())
  _check(scale(2.0), scale(2.0), (X,), reuse=False,
         jit_kwargs_a={"out_shardings": split},
         jit_kwargs_b={"out_shardings": whole})
