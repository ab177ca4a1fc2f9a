"""Structural fingerprints of jaxprs (the executable-reuse key)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxworks.jit_cache._src import fingerprint as fpmod


def fp(f, *args):
  return fpmod.fingerprint(jax.make_jaxpr(f)(*args))


X = jnp.ones(4)


def test_equal_structure_equal_fingerprint():
  a = fp(lambda x: jnp.sin(x) * 2.0 + x, X)
  b = fp(lambda y: jnp.sin(y) * 2.0 + y, X)
  assert a == b and hash(a) == hash(b)


def test_differences_are_detected():
  base = fp(lambda x: jnp.sin(x) * 2.0, X)
  assert base != fp(lambda x: jnp.cos(x) * 2.0, X)  # primitive
  assert base != fp(lambda x: jnp.sin(x) * 2.5, X)  # literal
  assert base != fp(lambda x: jnp.sin(x) * 2.0, X[:3])  # aval
  assert base != fp(lambda x: (jnp.sin(x) * 2.0, x), X)  # outputs
  assert base != fp(lambda x: jnp.sin(x * 1.0) * 2.0, X)  # extra eqn
  assert fp(lambda x: x * 0.0, X) != fp(lambda x: x * -0.0, X)
  assert fp(lambda x: x + 1, X.astype(jnp.int32)) != fp(
    lambda x: x + 2, X.astype(jnp.int32)
  )


def test_params_and_subjaxprs():
  a = fp(lambda x: jax.lax.reduce_precision(x, 5, 10), X)
  b = fp(lambda x: jax.lax.reduce_precision(x, 5, 9), X)
  assert a != b
  body = lambda c, _: (c * 2, None)
  s1 = fp(lambda x: jax.lax.scan(body, x, None, length=3)[0], X)
  s2 = fp(lambda x: jax.lax.scan(body, x, None, length=4)[0], X)
  s3 = fp(
    lambda x: jax.lax.scan(lambda c, _: (c * 2, None), x, None, length=3)[0], X
  )
  assert s1 != s2 and s1 == s3
  c1 = fp(lambda x: jax.lax.cond(x[0] > 0, jnp.sin, jnp.cos, x), X)
  c2 = fp(lambda x: jax.lax.cond(x[0] > 0, jnp.cos, jnp.sin, x), X)
  assert c1 != c2


def test_constants_by_content_or_identity():
  n1, n2 = np.arange(4.0, dtype=np.float32), np.arange(4.0, dtype=np.float32)
  assert fp(lambda x: x + n1, X) == fp(lambda x: x + n2, X)
  assert fp(lambda x: x + n1, X) != fp(lambda x: x + n1 * 2, X)
  j1, j2 = jnp.arange(4.0), jnp.arange(4.0)
  assert fp(lambda x: x * j1, X) == fp(lambda x: x * j2, X)
  big1, big2 = jnp.ones((130, 130)), jnp.ones((130, 130))  # > 64 KiB
  y = jnp.ones(130)
  assert fp(lambda v: big1 @ v, y) == fp(lambda v: big1 @ v, y)
  assert fp(lambda v: big1 @ v, y) != fp(lambda v: big2 @ v, y)


def test_numpy_content_keys_around_the_raw_bytes_bound():
  # Up to 64 bytes an array is keyed by its bytes, above by a digest: either
  # way equal content gives equal keys and one flipped bit different keys
  # (NaN payloads and the sign of zero included).
  vk = fpmod.value_key
  for n in (1, 16, 17, 1000):  # float32: 4, 64, 68 and 4000 bytes
    a = np.linspace(-1, 1, n, dtype=np.float32)
    b = a.copy()
    assert vk(a) == vk(b)
    b.view(np.uint32)[-1] ^= 1
    assert vk(a) != vk(b)
  assert vk(np.float32(0.0)) != vk(np.float32(-0.0))
  nan = np.array([np.nan], np.float32)
  other_nan = nan.copy()
  other_nan.view(np.uint32)[0] |= 1  # another payload
  assert np.isnan(other_nan[0]) and vk(nan) != vk(other_nan)
  assert vk(np.zeros(4, np.int8)) != vk(np.zeros((2, 2), np.int8))
  assert vk(np.zeros(4, np.int8)) != vk(np.zeros(2, np.int16))
  assert vk(np.asarray(np.arange(6.0).reshape(2, 3)).T) == vk(
    np.ascontiguousarray(np.arange(6.0).reshape(2, 3).T)
  )


def test_value_keys():
  vk = fpmod.value_key
  assert vk(1) != vk(1.0) != vk(True)
  assert vk(float("nan")) == vk(float("nan"))
  assert vk((1, [2])) == vk((1, [2])) and vk((1, [2])) != vk((1, (2,)))
  assert vk({"b": 1, "a": 2}) == vk({"a": 2, "b": 1})
  p1 = functools.partial(np.add, 1)
  assert vk(p1) == vk(functools.partial(np.add, 1))
  assert vk(p1) != vk(functools.partial(np.add, 2))
  f = lambda: 0
  assert vk(f) == vk(f) and vk(f) != vk(lambda: 0)


def test_unkeyable_values_give_none():
  class Unhashable:
    __hash__ = None

  u = Unhashable()  # an opaque object: by identity, hashable or not
  assert fpmod.params_key({"x": u}) == fpmod.params_key({"x": u})
  assert fpmod.params_key({"x": u}) != fpmod.params_key({"x": Unhashable()})
  assert fpmod.params_key({"x": np.array([object()])}) is None
  assert fpmod.params_key({"x": np.ma.masked_array([1.0])}) is None
  assert fpmod.params_key({"x": 1, "jaxpr": Unhashable()}) is not None


def test_sub_jaxpr_fingerprints_are_memoized():
  inner = jax.jit(jnp.sin)
  closed = jax.make_jaxpr(lambda x: inner(inner(x)))(X)
  sub = closed.jaxpr.eqns[0].params["jaxpr"]
  assert closed.jaxpr.eqns[1].params["jaxpr"] is sub
  fpmod.fingerprint(closed)
  assert sub in fpmod._MEMO  # pylint: disable=protected-access


def test_jaxprs_holding_numpy_data_are_never_memoized():
  c = np.ones(4, np.float32)
  inner = jax.jit(lambda v: v * c)
  closed = jax.make_jaxpr(lambda x: inner(inner(x)))(X)
  sub = closed.jaxpr.eqns[0].params["jaxpr"]
  before = fpmod.fingerprint(closed)
  assert sub not in fpmod._MEMO  # pylint: disable=protected-access
  c[0] = 2.0  # in place: the next fingerprint sees it
  assert fpmod.fingerprint(closed) != before


def test_equation_context_is_part_of_the_fingerprint():
  def random(x):
    return x + jax.random.uniform(jax.random.key(0), x.shape)

  def random_off(x):
    with jax.threefry_partitionable(False):
      return random(x)

  assert fp(random, X) == fp(random, X)
  assert fp(random, X) != fp(random_off, X)


def test_opaque_objects_compare_by_identity():
  class Liar:
    def __eq__(self, other):
      return True

    def __hash__(self):
      return 0

  a, b = Liar(), Liar()
  vk = fpmod.value_key
  assert vk(a) == vk(a) and vk(a) != vk(b)

  @dataclasses.dataclass(frozen=True)
  class UserData:
    k: int = dataclasses.field(compare=False)

  assert vk(UserData(1)) != vk(UserData(1))  # user dataclass: identity
  # JAX's own dataclasses and named tuples: field by field, so a user object
  # inside is still compared by identity.
  closed = jax.make_jaxpr(
    lambda x: jax.pure_callback(
      np.sin, jax.ShapeDtypeStruct((), jnp.float32), x
    )
  )(1.0)
  wrapper = closed.jaxpr.eqns[0].params["callback"]  # JAX's _FlatCallback
  assert dataclasses.is_dataclass(wrapper)
  flat = lambda fn: type(wrapper)(fn, wrapper.in_tree)
  assert vk(flat(np.sin)) == vk(flat(np.sin))
  assert flat(a) == flat(b)  # its own __eq__ is fooled ...
  assert vk(flat(a)) != vk(flat(b))  # ... the key is not
  dn = jax.lax.GatherDimensionNumbers((0,), (1,), (0,))
  assert vk(dn) == vk(jax.lax.GatherDimensionNumbers((0,), (1,), (0,)))
