"""jit has jax.jit's semantics: results compared with jax.jit on a corpus."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import functools
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from jaxworks import jit_cache
from jaxworks.jit_cache import jit


def _same(a, b):
  """Same pytree, shapes, dtypes, weak types and values."""
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    x, y = jnp.asarray(x), jnp.asarray(y)
    assert x.shape == y.shape and x.dtype == y.dtype, (x, y)
    assert getattr(x, "weak_type", None) == getattr(y, "weak_type", None)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _vals(a, b):
  """Same values (for hand-written expectations)."""
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class Pair(NamedTuple):
  a: jax.Array
  b: jax.Array


class Params(NamedTuple):
  w: jax.Array

  @jit
  def scaled(self, x):
    return x * self.w


def _poly(x, y):
  return {"s": x * 2 + y, "t": (x - y, jnp.sum(x))}


CORPUS = [
  ("scalars", lambda x, y: x * y + 1, (2.0, 3)),
  ("weak_and_strong", lambda x, y: x + y, (jnp.float32(1.5), 2.0)),
  ("int_weak", lambda x, y: x + y, (jnp.arange(3), 7)),
  (
    "numpy_args",
    lambda x, y: x @ y,
    (np.ones((2, 3), np.float32), np.ones((3, 2), np.float32)),
  ),
  (
    "pytree_dict",
    lambda d: d["a"] * d["b"][0],
    ({"a": jnp.arange(4.0), "b": [jnp.full(4, 2.0), None]},),
  ),
  (
    "namedtuple",
    lambda p: Pair(p.b, p.a + 1),
    (Pair(jnp.ones(2), jnp.zeros(2)),),
  ),
  ("nested_out", _poly, (jnp.arange(3.0), jnp.ones(3))),
  ("bool_int", lambda x, b: jnp.where(b, x, -x), (jnp.arange(3), True)),
  ("complex", lambda z: z * 1j, (jnp.ones(2, jnp.complex64),)),
  ("empty_tuple_out", lambda x: (), (jnp.ones(1),)),
  ("prng_key", lambda k: jax.random.uniform(k, (3,)), (jax.random.key(1),)),
  ("raw_key", lambda k: jax.random.normal(k, (2,)), (jax.random.PRNGKey(0),)),
]


@pytest.mark.parametrize("name,fun,args", CORPUS, ids=[c[0] for c in CORPUS])
def test_corpus_matches_jax_jit(name, fun, args):
  del name
  ours = jit(fun)
  _same(ours(*args), jax.jit(fun)(*args))
  _same(ours(*args), jax.jit(fun)(*args))  # second call: C++ fast path


def test_kwargs_and_static_argnames():
  def f(x, n, *, mode="mul", scale=1.0):
    return (x * n if mode == "mul" else x + n) * scale

  ours = jit(f, static_argnums=1, static_argnames="mode")
  ref = jax.jit(f, static_argnums=1, static_argnames="mode")
  x = jnp.arange(4.0)
  for args, kwargs in [
    ((x, 3), {}),
    ((x, 3), {"mode": "add"}),
    ((x,), {"n": 2}),
    ((x, 2), {"scale": 0.5}),
  ]:
    _same(ours(*args, **kwargs), ref(*args, **kwargs))


def test_static_argnames_inferred_from_argnums_and_back():
  calls = []

  def f(x, n):
    calls.append(n)
    return x * n

  by_num = jit(f, static_argnums=1)
  x = jnp.ones(2)
  _vals(by_num(x, n=3), x * 3)  # passed by name: still static
  by_name = jit(f, static_argnames="n")
  _vals(by_name(x, 4), x * 4)  # passed by position: still static
  assert calls == [3, 4]


def test_negative_static_argnums():
  f = jit(lambda x, n: x * n, static_argnums=-1)
  _vals(f(jnp.ones(2), 5), jnp.full(2, 5.0))
  assert f.cache_info().traces == 1
  f(jnp.ones(2), 6)
  assert f.cache_info().traces == 2


def test_static_values_compare_with_type():
  f = jit(lambda x, n: x * n, static_argnums=1)
  r_int = f(jnp.ones(2, jnp.int32), 1)
  r_float = f(jnp.ones(2, jnp.int32), 1.0)
  assert r_int.dtype == jnp.int32 and r_float.dtype == jnp.float32
  _same(
    r_float,
    jax.jit(lambda x, n: x * n, static_argnums=1)(jnp.ones(2, jnp.int32), 1.0),
  )


@pytest.mark.parametrize("x64", [False, True])
def test_x64_on_and_off(x64):
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", x64)
  try:
    ours = jit(lambda x, y: x * y + 1)
    ref = jax.jit(lambda x, y: x * y + 1)
    for args in [(np.arange(3), 2), (np.ones(3), 2.5), (1, 2.0)]:
      _same(ours(*args), ref(*args))
  finally:
    jax.config.update("jax_enable_x64", prev)


def test_x64_toggle_retraces():
  f = jit(lambda x: x + 1)
  a = f(np.arange(3))
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    b = f(np.arange(3))
  finally:
    jax.config.update("jax_enable_x64", prev)
  assert a.dtype == jnp.int32 and b.dtype == jnp.int64
  assert f.cache_info().traces == 2


def test_donation_matches_jax():
  ours = jit(lambda a, b: a + b, donate_argnums=0)
  a, b = jnp.ones(8), jnp.arange(8.0)
  out = ours(a, b)
  assert a.is_deleted() and not b.is_deleted()
  _vals(out, jnp.arange(8.0) + 1)
  by_name = jit(lambda a, b: a * b, donate_argnames="b")
  a, b = jnp.ones(8), jnp.arange(8.0)
  _vals(by_name(a, b=b), jnp.arange(8.0))
  assert b.is_deleted()


needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices")


@needs_8
def test_in_and_out_shardings_on_8_devices():
  mesh = jax.make_mesh((8,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
  s = NamedSharding(mesh, P("i"))
  r = NamedSharding(mesh, P())
  ours = jit(lambda v: v * 2, in_shardings=s, out_shardings=r)
  ref = jax.jit(lambda v: v * 2, in_shardings=s, out_shardings=r)
  x = jnp.arange(16.0)
  out, want = ours(x), ref(x)
  _same(out, want)
  assert out.sharding == want.sharding == r


@needs_8
def test_committed_input_sharding_propagates():
  mesh = jax.make_mesh((8,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
  xs = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("i")))
  ours, ref = jit(jnp.sin), jax.jit(jnp.sin)
  assert ours(xs).sharding == ref(xs).sharding
  on_dev3 = jax.device_put(jnp.ones(4), jax.devices()[3])
  out = ours(on_dev3)
  assert out.sharding == ref(on_dev3).sharding
  assert list(out.devices()) == [jax.devices()[3]]


@needs_8
def test_active_mesh_is_part_of_the_key():
  def body(x):
    mesh = jax.sharding.get_abstract_mesh()
    return x + (0 if mesh.empty else mesh.size)

  ours, ref = jit(body), jax.jit(body)
  x = jnp.ones(2)
  explicit = (jax.sharding.AxisType.Explicit,)
  mesh8 = jax.make_mesh((8,), ("i",), axis_types=explicit)
  mesh4 = jax.make_mesh(
    (4,), ("i",), axis_types=explicit, devices=jax.devices()[:4]
  )
  _same(ours(x), ref(x))
  for mesh in (mesh8, mesh4):
    with jax.set_mesh(mesh):
      _same(ours(x), ref(x))
      inner = jax.make_jaxpr(lambda v: ours(v))(x).eqns[0]  # pylint: disable=unnecessary-lambda
      assert inner.params["ctx_mesh"].shape_tuple == mesh.shape_tuple
  _same(ours(x), ref(x))
  assert ours.cache_info().traces == 3


def test_decorator_forms_and_partial():
  @jit
  def a(x):
    return x + 1

  @jit(static_argnums=1)
  def b(x, n):
    return x + n

  @functools.partial(jit, static_argnames="n")
  def c(x, n):
    return x - n

  x = jnp.zeros(2)
  _vals(a(x), x + 1)
  _vals(b(x, 2), x + 2)
  _vals(c(x, n=3), x - 3)

  def scale(k, x):
    return x * k

  d = jit(functools.partial(scale, 4.0))
  _vals(d(x + 1), jnp.full(2, 4.0))
  assert d.trace(x).fun_name == "scale"
  assert (
    d.trace(x).fun_name
    == jax.jit(functools.partial(scale, 4.0)).trace(x).fun_name
  )
  assert a.__name__ == "a" and a.__wrapped__ is not None


def test_methods():
  class Model:
    def __init__(self, w):
      self.w = w

    def __hash__(self):
      return hash(self.w)

    def __eq__(self, other):
      return isinstance(other, Model) and other.w == self.w

    @functools.partial(jit, static_argnums=0)
    def apply(self, x):
      return x * self.w

  m = Model(3.0)
  _vals(m.apply(jnp.ones(2)), jnp.full(2, 3.0))
  _vals(Model(2.0).apply(jnp.ones(2)), jnp.full(2, 2.0))
  assert Model.apply.cache_info().traces == 2

  _vals(Params(jnp.full(2, 3.0)).scaled(jnp.ones(2)), jnp.full(2, 3.0))
  _vals(Params(jnp.full(2, 4.0)).scaled(jnp.ones(2)), jnp.full(2, 4.0))
  assert Params.scaled.cache_info().traces == 1  # self is a dynamic pytree


def test_keep_unused_and_inline():
  f = jit(lambda x, unused: x + 1, keep_unused=True)
  _vals(f(jnp.ones(2), jnp.ones(3)), jnp.full(2, 2.0))
  g = jit(lambda x: x * 3, inline=True)
  jaxpr = jax.make_jaxpr(lambda x: g(x) + 1)(1.0)
  assert all(e.primitive.name != "jit" for e in jaxpr.eqns)
  _vals(jax.jit(lambda x: g(x) + 1)(1.0), 4.0)


def test_compiler_options_top_level():
  f = jit(lambda x: x + 1, compiler_options={"xla_cpu_enable_fast_math": False})
  if jax.devices()[0].platform != "cpu":
    f = jit(lambda x: x + 1)
  _vals(f(jnp.ones(2)), jnp.full(2, 2.0))


def test_disable_jit_runs_python():
  calls = []

  @jit
  def f(x):
    calls.append(type(x))
    return x + 1

  with jax.disable_jit():
    f(jnp.ones(2))
    f(jnp.ones(2))
    jax.vmap(f)(jnp.ones((3, 2)))  # under a transformation too
  assert len(calls) == 3 and not issubclass(calls[0], jax.core.Tracer)
  assert f.cache_info().traces == 0


def test_debug_nans_defers_to_jax():
  f = jit(lambda x: jnp.log(x))
  with jax.debug_nans(True):
    with pytest.raises(FloatingPointError):
      f(jnp.array(-1.0))


# -- errors ---------------------------------------------------------------------


def test_unhashable_static_error():
  f = jit(lambda x, n: x * len(n), static_argnums=1)
  with pytest.raises(
    ValueError,
    match=r"jaxworks.jit_cache.jit: Non-hashable "
    r"static arguments are not supported: static argument 1 "
    r"of <lambda> is not hashable: list \[1, 2\]",
  ):
    f(jnp.ones(2), [1, 2])


def test_static_argnums_out_of_range_error():
  def f(x, y):
    return x + y

  with pytest.raises(
    ValueError,
    match="static_argnums 2 out of range for f with 2 positional args",
  ):
    jit(f, static_argnums=2)
  with pytest.raises(
    ValueError, match="static_argnames .'z'. are not parameters of f"
  ):
    jit(f, static_argnames="z")
  with pytest.raises(TypeError, match="static_argnums must be an int"):
    jit(f, static_argnums="x")


def test_bad_argument_error_names_path():
  f = jit(lambda x, cfg: x)
  with pytest.raises(
    TypeError,
    match=r"argument to <lambda> .* of type <class 'str'> and was passed to "
    r"the function at path cfg\['name'\]\. It is not a valid JAX type; mark "
    r"the argument static",
  ):
    f(jnp.ones(1), {"name": "abc"})


def test_not_callable_and_bad_maxsize():
  with pytest.raises(TypeError, match="Expected a callable value, got int"):
    jit(3)
  with pytest.raises(
    TypeError,
    match=r"jit_cache.eval_shape: Expected a "
    r"callable value, got int 3; pass a function",
  ):
    jit_cache.eval_shape(3, 1.0)
  with pytest.raises(
    TypeError,
    match=r"jit_cache.make_jaxpr: Expected a "
    r"callable value, got str",
  ):
    jit_cache.make_jaxpr("f")
  with pytest.raises(ValueError, match="maxsize must be an int >= 1"):
    jit(lambda x: x, maxsize=0)


def test_jax_errors_pass_through():
  f = jit(lambda x, y: x + y)
  with pytest.raises(TypeError, match="add got incompatible shapes"):
    f(jnp.ones(2), jnp.ones(3))


def test_public_api_surface():
  # The release number itself is checked against the README's table and the
  # wheels by tests/repo_test.py and tests/wheel_install_test.py.
  assert re.fullmatch(r"\d+\.\d+\.\d+", jit_cache.__version__)
  for name in jit_cache.__all__:
    assert hasattr(jit_cache, name), name
