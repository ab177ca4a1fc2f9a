"""Re-created closures reuse compiled executables; near misses never do."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import gc
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks import jit_cache
from jaxworks.jit_cache import jit


def _counts(f):
  info = f.cache_info()
  assert info.traces == 1
  return info.compiles, info.executable_reuses


def _check(
  make_a,
  make_b,
  args,
  *,
  reuse: bool,
  jit_kwargs_a=None,
  jit_kwargs_b=None,
  args_b=None,
):
  """From empty caches, make_a's program compiles exactly once; make_b's then
  reuses it iff `reuse` (exact counts); results and dtypes equal jax.jit's."""
  args_b = args if args_b is None else args_b
  fresh = lambda xs: [jnp.array(a, copy=True) for a in xs]  # donation-proof
  jit_cache.clear_caches()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    want_a = jax.jit(make_a(), **(jit_kwargs_a or {}))(*fresh(args))
    want_b = jax.jit(make_b(), **(jit_kwargs_b or {}))(*fresh(args_b))
    fa = jit(make_a(), **(jit_kwargs_a or {}))
    out_a = fa(*fresh(args))
    fb = jit(make_b(), **(jit_kwargs_b or {}))  # fa is still alive
    out_b = fb(*fresh(args_b))
  assert _counts(fa) == (1, 0), "the first program must compile"
  if reuse:
    assert _counts(fb) == (0, 1), "expected the executable to be reused"
  else:
    assert _counts(fb) == (1, 0), "a near miss must compile anew"
  for got, want in ((out_a, want_a), (out_b, want_b)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert got.dtype == want.dtype


def scale(c):
  return lambda: lambda x: jnp.sin(x) * c


X = jnp.linspace(0.0, 1.0, 8)


def test_recreated_closure_reuses_executable():
  _check(scale(2.5), scale(2.5), (X,), reuse=True)


def test_many_recreations_compile_once():
  jit_cache.clear_caches()
  counts = []
  for _ in range(5):
    f = jit(lambda x: jnp.cos(x) * 7.0 + 1.0)  # the previous f dies here
    np.testing.assert_array_equal(f(X), jnp.cos(X) * 7.0 + 1.0)
    counts.append(_counts(f))
  assert counts == [(1, 0)] + [(0, 1)] * 4


def test_near_miss_literal():
  _check(scale(2.5), scale(3.5), (X,), reuse=False)


def test_near_miss_literal_sign_of_zero():
  _check(scale(0.0), scale(-0.0), (X,), reuse=False)


def test_numpy_constant_by_content():
  base = np.arange(8.0, dtype=np.float32)
  _check(
    lambda: lambda x: x + base,
    lambda: lambda x: x + base.copy(),
    (X,),
    reuse=True,
  )
  _check(
    lambda: lambda x: x + base,
    lambda: lambda x: x + (base + 1),
    (X,),
    reuse=False,
  )


def test_small_jax_constant_by_content():
  a = jnp.arange(8.0)
  b = jnp.arange(8.0)  # another object, same content and placement
  _check(lambda: lambda x: x * a, lambda: lambda x: x * b, (X,), reuse=True)
  c = jnp.arange(8.0) + 1
  _check(lambda: lambda x: x * a, lambda: lambda x: x * c, (X,), reuse=False)


def test_large_jax_constant_by_identity():
  big = jnp.ones((128, 256))  # 128 KiB: keyed by identity
  twin = jnp.ones((128, 256))
  y = jnp.ones((256,))
  _check(lambda: lambda v: big @ v, lambda: lambda v: big @ v, (y,), reuse=True)
  _check(
    lambda: lambda v: big @ v, lambda: lambda v: twin @ v, (y,), reuse=False
  )


def test_near_miss_dtype():
  _check(
    scale(2.0), scale(2.0), (X,), args_b=(X.astype(jnp.float16),), reuse=False
  )


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices")
def test_near_miss_sharding():
  on0 = jax.device_put(X, jax.devices()[0])
  on1 = jax.device_put(X, jax.devices()[1])
  _check(scale(2.0), scale(2.0), (on0,), args_b=(on1,), reuse=False)
  f = jit(scale(2.0)())
  assert list(f(on1).devices()) == [jax.devices()[1]]


def test_near_miss_donation():
  _check(
    scale(2.0),
    scale(2.0),
    (X,),
    reuse=False,
    jit_kwargs_b={"donate_argnums": 0},
  )


def test_near_miss_platform_choice():
  # backend= pins placement (it becomes in/out shardings): another program.
  _check(
    scale(2.0),
    scale(2.0),
    (X,),
    reuse=False,
    jit_kwargs_b={"backend": jax.devices()[0].platform},
  )


def test_near_miss_x64():
  _check(scale(2.0), scale(2.0), (X,), reuse=True)
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    f = jit(scale(2.0)())
    out = f(X)
  finally:
    jax.config.update("jax_enable_x64", prev)
  assert _counts(f) == (1, 0)
  np.testing.assert_array_equal(out, jnp.sin(X) * 2.0)


def test_near_miss_compiler_options():
  if jax.devices()[0].platform != "cpu":
    pytest.skip("CPU compiler option")
  _check(
    scale(2.0),
    scale(2.0),
    (X,),
    reuse=False,
    jit_kwargs_b={"compiler_options": {"xla_cpu_enable_fast_math": False}},
  )


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
  make = lambda: lambda x: jax.nn.relu(x) + jax.nn.gelu(x)
  _check(make, make, (X,), reuse=True)


def test_out_shardings_are_part_of_the_key():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 devices")
  mesh = jax.make_mesh((8,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
  split = jax.sharding.NamedSharding(mesh, jax.P("i"))
  whole = jax.sharding.NamedSharding(mesh, jax.P())
  _check(
    scale(2.0),
    scale(2.0),
    (X,),
    reuse=False,
    jit_kwargs_a={"out_shardings": split},
    jit_kwargs_b={"out_shardings": whole},
  )


# -- equation contexts are in the key -----------------------------------------


def _uniform(partitionable):
  """A body drawing random bits under an inner threefry_partitionable block."""

  def make():
    def f(x):
      key = jax.random.key(0)
      if partitionable is None:
        return x + jax.random.uniform(key, x.shape)
      with jax.threefry_partitionable(partitionable):
        return x + jax.random.uniform(key, x.shape)

    return f

  return make


def test_threefry_partitionable_block_in_the_body_is_part_of_the_key():
  default = jax.config.jax_threefry_partitionable
  _check(_uniform(None), _uniform(default), (X,), reuse=True)
  _check(_uniform(None), _uniform(not default), (X,), reuse=False)
  _check(_uniform(True), _uniform(False), (X,), reuse=False)


def test_xla_metadata_and_compute_type_are_part_of_the_key():
  from jax.experimental.compute_on import compute_on  # pylint: disable=g-import-not-at-top
  from jax.experimental.xla_metadata import set_xla_metadata  # pylint: disable=g-import-not-at-top

  def meta(value):
    def make():
      def f(x):
        with set_xla_metadata(tag=value):
          return jnp.sin(x) * 2

      return f

    return make

  _check(meta("a"), meta("a"), (X,), reuse=True)
  _check(meta("a"), meta("b"), (X,), reuse=False)
  _check(scale(2.0), meta("a"), (X,), reuse=False)
  plain = jax.make_jaxpr(lambda x: jnp.sin(x))(X)
  with compute_on("device_host"):
    host = jax.make_jaxpr(lambda x: jnp.sin(x))(X)
  # Private imports below: the key itself must differ (no public view of the
  # fingerprint).
  from jaxworks.jit_cache._src import fingerprint as fpmod  # pylint: disable=g-import-not-at-top

  assert host.jaxpr.eqns[0].ctx.compute_type == "device_host"
  assert fpmod.fingerprint(plain) != fpmod.fingerprint(host)


def test_abstract_mesh_of_the_equations_is_part_of_the_key():
  mesh = jax.sharding.AbstractMesh(
    (1,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,)
  )

  def make_mesh():
    def f(x):
      with jax.sharding.use_abstract_mesh(mesh):
        return jnp.sin(x) * 2

    return f

  _check(lambda: lambda x: jnp.sin(x) * 2, make_mesh, (X,), reuse=False)


def test_default_matmul_precision_inside_and_outside_the_body():
  m = jnp.linspace(0.0, 1.0, 64, dtype=jnp.float32).reshape(8, 8)

  def inside(precision):
    def make():
      def f(a):
        with jax.default_matmul_precision(precision):
          return a @ a

      return f

    return make

  _check(inside("highest"), inside("highest"), (m,), reuse=True)
  _check(inside("highest"), inside("bfloat16"), (m,), reuse=False)
  make = lambda: lambda a: a @ a
  jit_cache.clear_caches()
  f1 = jit(make())
  f1(m)
  with jax.default_matmul_precision("bfloat16"):
    f2 = jit(make())
    out = f2(m)
    want = jax.jit(make())(m)
  assert _counts(f2) == (1, 0)
  np.testing.assert_array_equal(out, want)


# -- opaque parameter objects compare by identity -----------------------------


@dataclasses.dataclass(frozen=True)
class AddK:
  """A frozen dataclass callback whose field is left out of __eq__."""

  k: float = dataclasses.field(compare=False)

  def __call__(self, x):
    return x + np.float32(self.k)


class AlwaysEqual:
  """A callback whose __eq__ says every instance is equal."""

  def __init__(self, k):
    self.k = k

  def __eq__(self, other):
    return True

  def __hash__(self):
    return 0

  def __call__(self, x):
    return x + np.float32(self.k)


def _pure(cb):
  def make():
    def f(x):
      return jax.pure_callback(cb, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    return f

  return make


@pytest.mark.parametrize("cls", [AddK, AlwaysEqual])
def test_callback_objects_with_their_own_eq_are_compared_by_identity(cls):
  ones = jnp.ones(3)
  one, two = cls(1), cls(2)
  _check(_pure(one), _pure(two), (ones,), reuse=False)
  _check(_pure(one), _pure(one), (ones,), reuse=True)
  f = jit(_pure(two)())
  np.testing.assert_array_equal(f(ones), np.full(3, 3.0, np.float32))


def test_debug_callback_with_lying_eq_objects():
  seen = []

  class Recorder(AlwaysEqual):
    def __call__(self, v):
      seen.append((self.k, float(v)))

  def make(rec):
    def inner():
      def f(x):
        jax.debug.callback(rec, x[0])
        return x * 2

      return f

    return inner

  a, b = Recorder("a"), Recorder("b")
  jit_cache.clear_caches()
  fa, fb = jit(make(a)()), jit(make(b)())
  fa(X)
  fb(X)
  jax.effects_barrier()
  assert sorted(k for k, _ in seen) == ["a", "b"]
  assert _counts(fb) == (1, 0)


# -- mutable numpy constants: a re-created closure sees their content now ------


def test_numpy_constant_mutated_after_the_first_compile():
  c = np.ones(3, np.float32)
  stock_inner = jax.jit(lambda x: x + c)  # one inner jaxpr, cached by jax
  make = lambda: lambda x: stock_inner(x) * 2
  ones = jnp.ones(3)
  jit_cache.clear_caches()
  f1 = jit(make())
  np.testing.assert_array_equal(f1(ones), jax.jit(make())(ones))
  c[:] = 5.0  # in place, after the first compile
  f2 = jit(make())
  got, want = f2(ones), jax.jit(make())(ones)
  np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(got, np.full(3, 12.0, np.float32))
  assert _counts(f2) == (1, 0)


def test_numpy_constant_in_a_cached_inner_jit_of_ours():
  c = np.arange(3, dtype=np.float32)
  inner = jit(lambda x: x * c)
  make = lambda: lambda x: inner(x) + 1
  ones = jnp.ones(3)
  jit_cache.clear_caches()
  f1 = jit(make())
  f1(ones)
  c += 10
  f2 = jit(make())
  np.testing.assert_array_equal(f2(ones), jax.jit(make())(ones))


# -- what outlives a function -------------------------------------------------


def test_reuse_after_the_first_function_died():
  jit_cache.clear_caches()
  f = jit(scale(1.5)())
  f(X)
  del f
  gc.collect()
  g = jit(scale(1.5)())
  np.testing.assert_array_equal(g(X), jnp.sin(X) * 1.5)
  assert _counts(g) == (0, 1)


def test_executable_holding_a_callback_dies_with_its_function():
  class Callback:
    def __call__(self, x):
      return x * 2

  cb = Callback()
  cb_ref = weakref.ref(cb)
  jit_cache.clear_caches()
  f = jit(_pure(cb)())
  np.testing.assert_array_equal(f(X), X * 2)
  assert jit_cache.stats().executables == 1
  del f, cb
  gc.collect()
  assert cb_ref() is None
  assert jit_cache.stats().executables == 0
