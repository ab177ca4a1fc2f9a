"""Program-table keys, stages and the table bound, compared with jax.pmap.

Each static argument is part of the program: values that Python calls equal
but that trace differently (``1``/``1.0``/``True``, ``0.0``/``-0.0``, tuples
of those) must not share one. Every check runs the same calls through a fresh
stock ``jax.pmap`` and compares values and dtypes (incl. weak types).
"""

import functools
import inspect
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
import numpy as np
import pytest

# Private imports below: test_static_key_function covers the key function
# itself.
from jaxworks.pmap_chunked import UnhashableStaticError
from jaxworks.pmap_chunked import pmap
from jaxworks.pmap_chunked._src.arguments import static_key

N = 8
pytestmark = pytest.mark.skipif(
  jax.device_count() < N, reason="needs 8 devices (XLA_FLAGS)"
)


def _same(ours, stock):
  assert ours.shape == stock.shape
  assert ours.dtype == stock.dtype
  assert ours.weak_type == stock.weak_type
  np.testing.assert_array_equal(np.asarray(ours), np.asarray(stock))
  # Same bits: tells -0.0 from 0.0 and compares NaNs.
  assert np.asarray(ours).tobytes() == np.asarray(stock).tobytes()


def _stock(fun, static, x):
  """Stock pmap of a fresh function per value. Stock keys its program cache
  by the function and compares statics with ``==`` within one type, so with
  one function ``(1, 2.0)`` would reuse ``(1.0, 2)``'s program and ``-0.0``
  ``0.0``'s: the fresh function gives stock's answer for this value alone."""
  fresh = lambda *args: fun(*args)  # noqa: E731
  return jax.pmap(fresh, static_broadcasted_argnums=1)(x, static)


def test_static_int_float_bool_are_different_programs():
  # f(x, 1) then f(x, 1.0): the second call traces its own program and
  # returns float32, as stock does (one shared program would return int32).
  x = jnp.ones(N, jnp.int32)
  mul = lambda v, k: v * k
  f = pmap(mul, static_broadcasted_argnums=1)
  for k in (1, 1.0, True, np.int32(1), np.float32(1), np.int8(1), 1 + 0j):
    _same(f(x, k), _stock(mul, k, x))
  assert f.cache_info().misses == 7 and f.cache_info().entries == 7
  _same(f(x, 1.0), _stock(mul, 1.0, x))  # equal value, same type
  assert f.cache_info().hits == 1


def test_static_signed_zero_and_nan():
  x = jnp.ones(N, jnp.float32)
  inv = lambda v, k: 1 / (v * k)  # -inf for -0.0
  f = pmap(inv, static_broadcasted_argnums=1)
  for k in (0.0, -0.0, np.float32(0.0), np.float32(-0.0)):
    _same(f(x, k), _stock(inv, k, x))
  assert f.cache_info().entries == 4
  add = lambda v, k: v + k
  g = pmap(add, static_broadcasted_argnums=1)
  _same(g(x, float("nan")), _stock(add, float("nan"), x))
  _same(g(x, float("nan")), _stock(add, float("nan"), x))
  # A NaN is a NaN: the second (a new object) finds the first's program.
  info = g.cache_info()
  assert (info.hits, info.misses, info.entries) == (1, 1, 1)


def test_static_tuples_and_frozensets_of_mixed_types():
  x = jnp.ones(N, jnp.int32)

  def fun(v, ks):
    return tuple(v * k for k in sorted(ks, key=float))

  f = pmap(fun, static_broadcasted_argnums=1)
  # (1, 2.0) == (1.0, 2) in Python, but the programs' dtypes differ.
  cases = [
    (1, 2.0),
    (1.0, 2),
    (1, 2),
    (True, 2),
    (np.int32(1), 2),
    frozenset({1, 2.0}),
    frozenset({1.0, 2}),
  ]
  for ks in cases:
    for ours, stock in zip(f(x, ks), _stock(fun, ks, x), strict=True):
      _same(ours, stock)
  assert f.cache_info().entries == len(cases)
  nested = pmap(lambda v, ks: v * ks[0][0], static_broadcasted_argnums=1)
  _same(nested(x, ((1,),)), _stock(lambda v, ks: v * ks[0][0], ((1,),), x))
  _same(nested(x, ((1.0,),)), _stock(lambda v, ks: v * ks[0][0], ((1.0,),), x))


def test_static_key_function():
  assert static_key(1) != static_key(1.0) != static_key(True)
  assert static_key(0.0) != static_key(-0.0)
  assert static_key(float("nan")) == static_key(float("nan"))
  assert static_key(np.float32(0)) != static_key(np.float32(-0.0))
  assert static_key(np.float32(1)) != static_key(np.float64(1))
  assert static_key((1, 2.0)) != static_key((1.0, 2))
  assert static_key(frozenset({1})) != static_key(frozenset({1.0}))
  assert static_key(("a", 1)) == static_key(("a", 1))
  hash(static_key((1, frozenset({2.0}), np.int8(3), "s", None)))


def test_user_objects_compare_with_their_type_and_eq():
  @functools.total_ordering
  class Scale:
    def __init__(self, k):
      self.k = k

    def __eq__(self, other):
      return isinstance(other, Scale) and self.k == other.k

    def __lt__(self, other):
      return self.k < other.k

    def __hash__(self):
      return hash(self.k)

  class OtherScale(Scale):
    pass

  x = jnp.ones(N)
  f = pmap(lambda v, s: v * s.k, static_broadcasted_argnums=1)
  np.testing.assert_array_equal(f(x, Scale(2)), 2 * np.ones(N))
  np.testing.assert_array_equal(f(x, Scale(2)), 2 * np.ones(N))
  assert f.cache_info().hits == 1  # equal objects: one program
  np.testing.assert_array_equal(f(x, OtherScale(2)), 2 * np.ones(N))
  assert f.cache_info().entries == 2  # another type: another one


def test_unhashable_static_is_a_value_error_as_in_stock():
  f = pmap(lambda v, k: v, static_broadcasted_argnums=1)
  stock = jax.pmap(lambda v, k: v, static_broadcasted_argnums=1)
  for bad in ([1], np.ones(2), {"a": 1}):
    with pytest.raises(ValueError) as stock_err:
      stock(jnp.ones(N), bad)
    with pytest.raises(
      type(stock_err.value), match="static argument 1 .* must be hashable"
    ) as ours:
      f(jnp.ones(N), bad)
    assert isinstance(ours.value, (UnhashableStaticError, TypeError))


def test_lower_and_trace_keep_weak_types():
  # A bf16 input times a weakly typed Python scalar: the stages' output is
  # bf16, as the call's is (a strongly typed scalar would make it float32).
  x = jnp.ones(N, jnp.bfloat16)
  fun = lambda v, s: v * s
  f = pmap(fun, in_axes=(0, None))
  stock = jax.pmap(fun, in_axes=(0, None))
  out = f(x, 2.0)
  assert out.dtype == jnp.bfloat16 == stock(x, 2.0).dtype
  assert f.lower(x, 2.0).out_info.dtype == jnp.bfloat16
  assert stock.lower(x, 2.0).out_info.dtype == jnp.bfloat16
  assert f.trace(x, 2.0).out_info.dtype == jnp.bfloat16
  # A weak jax.Array and a weak ShapeDtypeStruct stay weak too.
  weak = jnp.asarray(3.0)
  assert weak.weak_type
  assert f.lower(x, weak).out_info.dtype == jnp.bfloat16
  sds = jax.ShapeDtypeStruct((), jnp.float32, weak_type=True)
  assert f.lower(x, sds).out_info.dtype == jnp.bfloat16
  # A strong float32 argument promotes, as in a call.
  assert f.lower(x, np.float32(2)).out_info.dtype == jnp.float32
  assert f(x, np.float32(2)).dtype == jnp.float32


def test_lower_args_info_is_the_users_structure_and_compiles():
  f = pmap(lambda v, k, w: v * k + w["a"], static_broadcasted_argnums=1)
  x = jnp.arange(N, dtype=jnp.float32)
  lowered = f.lower(x, 3, {"a": x})
  stock = jax.pmap(
    lambda v, k, w: v * k + w["a"], static_broadcasted_argnums=1
  ).lower(x, 3, {"a": x})
  assert jax.tree_util.tree_structure(
    lowered.args_info
  ) == jax.tree_util.tree_structure(stock.args_info)
  assert [a.shape for a in jax.tree_util.tree_leaves(lowered.args_info)] == [
    a.shape for a in jax.tree_util.tree_leaves(stock.args_info)
  ]
  compiled = lowered.compile()
  np.testing.assert_array_equal(compiled(x, {"a": x}), f(x, 3, {"a": x}))
  with pytest.raises(
    TypeError,
    match=r"Argument 'flat_args\[0\]' compiled "
    "with float32.* called with int32",
  ):
    compiled(x.astype(jnp.int32), {"a": x})


def test_program_table_is_an_lru_with_a_bound():
  f = pmap(lambda v, k: v + k, static_broadcasted_argnums=1, maxsize=3)
  x = jnp.zeros(N, jnp.int32)
  for k in range(5):
    np.testing.assert_array_equal(f(x, k), np.full(N, k))
  info = f.cache_info()
  assert (info.entries, info.misses, info.evictions, info.maxsize) == (
    3,
    5,
    2,
    3,
  )
  f(x, 3)  # held: a hit, now recent
  f(x, 0)  # evicted: built again
  info = f.cache_info()
  assert (info.hits, info.misses, info.evictions) == (1, 6, 3)
  f(x, 3)  # still held (was recent)
  assert f.cache_info().hits == 2
  default = inspect.signature(pmap).parameters["maxsize"].default
  assert pmap(lambda v: v).cache_info().maxsize == default
  f.clear_cache()
  assert f.cache_info().entries == 0
  with pytest.raises(TypeError, match="maxsize must be an int >= 1"):
    pmap(lambda v: v, maxsize=0)


def test_table_drops_the_evicted_programs():
  f = pmap(lambda v, k: v + k, static_broadcasted_argnums=1, maxsize=2)
  x = jnp.zeros(N)
  f(x, 1)
  first = next(iter(f._entries.values())).jitted
  f(x, 2)
  f(x, 3)
  assert all(e.jitted is not first for e in f._entries.values())
  assert len(f._args._flat_axes) <= 2


def test_nested_list_in_axes_as_in_stock():
  x = jnp.ones((N, 2))
  fun = lambda a: a[0] + a[1]
  ours = pmap(fun, in_axes=([0, None],))([x, x[0]])
  _same(ours, jax.pmap(fun, in_axes=([0, None],))([x, x[0]]))
  ours = pmap(lambda a: a["p"][0] + a["p"][1].T, in_axes=({"p": [0, 1]},))
  out = ours({"p": [x, x.T]})
  np.testing.assert_array_equal(out, 2 * np.ones((N, 2)))


def test_backend_argument():
  x = jnp.arange(N * 2.0).reshape(N, 2)
  out = pmap(lambda v: v * 2, backend="cpu")(x)
  _same(out, jax.pmap(lambda v: v * 2, backend="cpu")(x))
  assert isinstance(out.sharding, NamedSharding)
  with pytest.raises(RuntimeError) as stock_err:
    jax.pmap(lambda v: v, backend="no_such_backend")(x)
  with pytest.raises(type(stock_err.value)):
    pmap(lambda v: v, backend="no_such_backend")(x)


def test_static_self_of_a_method():
  class Model:
    def __init__(self, k):
      self.k = k

    @functools.partial(pmap, static_broadcasted_argnums=(0,))
    def apply(self, v):
      return v * self.k

  x = jnp.ones(N)
  np.testing.assert_array_equal(Model(2).apply(x), 2 * np.ones(N))
  np.testing.assert_array_equal(Model(3).apply(x), 3 * np.ones(N))
  assert isinstance(Model.__dict__["apply"], type(pmap(lambda v: v)))


def test_lower_accepts_abstract_values_as_stock():
  aval = jax.ShapeDtypeStruct((N, 2), jnp.float32)
  shaped = jax.typeof(jnp.ones((N, 2), jnp.float32))  # a ShapedArray
  f = pmap(lambda v: v * 2)
  stock = jax.pmap(lambda v: v * 2)
  for arg in (aval, shaped):
    ours = f.lower(arg).out_info
    theirs = stock.lower(arg).out_info
    assert (ours.shape, ours.dtype) == (theirs.shape, theirs.dtype)


def test_equivalent_input_sharding_shares_one_program():
  # An input laid out like the program expects but under another mesh/axis
  # name (device_put_replicated's, a user's Mesh) is passed under the
  # program's sharding without a copy: one trace, and the outputs of
  # successive calls have the very same sharding object (as stock).
  from jax.sharding import Mesh
  from jax.sharding import PartitionSpec as P

  data = np.arange(N * 2.0).reshape(N, 2)
  users = NamedSharding(
    Mesh(np.array(jax.devices()), ("batch",)), P("batch", None)
  )
  f = pmap(lambda v: v)
  x = jax.device_put(data, users)
  before = [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]
  out1 = f(x)
  out2 = f(out1)
  out3 = f(out2)
  assert out1.sharding is out2.sharding is out3.sharding
  entry = next(iter(f._entries.values()))
  assert entry.jitted.cache_info().traces == 1
  assert [s.data.unsafe_buffer_pointer() for s in x.addressable_shards] == (
    before
  )
  np.testing.assert_array_equal(out3, data)
  # Donated: passed as it is, and deleted as by stock.
  g = pmap(lambda v: v + 1, donate_argnums=0)
  stock = jax.pmap(lambda v: v + 1, donate_argnums=0)
  mine, theirs = jax.device_put(data, users), jax.device_put(data, users)
  np.testing.assert_array_equal(g(mine), stock(theirs))
  assert mine.is_deleted() == theirs.is_deleted()
