"""The call path in C: the argument key read in one pass, jax Arrays read
from their fields, and JitFunction's calls forwarded to the C++ dispatcher."""

import collections
import copy
import functools
import gc
import os
import pickle
import weakref

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Private imports below: the subject is the C++ signature builder and its Python
# twin.
from jaxworks import jit_cache
from jaxworks.jit_cache import _signature as ext
from jaxworks.jit_cache._src import jax_internals as ji
from jaxworks.jit_cache._src import signature as sig

FLATTEN = ji.tracing_registry.flatten
CTX = ext.ContextInterner(4)(("ctx",))


def _reference(tree, statics=(), ctx=CTX):
  leaves, treedef = FLATTEN(tree)
  return leaves, treedef, sig.signature(leaves, (treedef, statics, ctx))


def _check_agrees(tree, statics=()):
  leaves, treedef, s = sig.key(tree, statics, CTX)
  ref_leaves, ref_treedef, ref = _reference(tree, statics)
  assert len(leaves) == len(ref_leaves)
  assert all(a is b for a, b in zip(leaves, ref_leaves))
  assert treedef == ref_treedef
  assert s.describe() == ref.describe()
  assert s.extra == ref.extra
  return s


Point = collections.namedtuple("Point", "x y")


@jax.tree_util.register_pytree_node_class
class Node:
  def __init__(self, a, b):
    self.a, self.b = a, b

  def tree_flatten(self):
    return (self.b, self.a), None  # reversed: only JAX knows the order

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[1], children[0])


TREES = [
  ((), {}),
  ((jnp.ones(2),), {}),
  ((jnp.ones(2), 1.0, 2, True, 1j, np.float32(1), np.ones(3)), {}),
  (([jnp.ones(2), None, (jnp.zeros(3), [])],), {"b": jnp.ones(1), "a": 3.0}),
  (({"z": 1.0, "y": {"q": jnp.ones(2), "p": None}},), {}),
  ((Point(jnp.ones(2), 2.0),), {}),  # a registered node: flatten decides
  ((Node(jnp.ones(2), jnp.zeros(3)),), {}),
  (({1: jnp.ones(2), 0: 2.0},), {}),  # non-str keys
  ((collections.OrderedDict(b=1.0, a=jnp.ones(2)),), {}),
  ((jax.random.key(0), jax.ShapeDtypeStruct((2,), jnp.float32)), {}),
]


@pytest.mark.parametrize("tree", TREES, ids=range(len(TREES)))
def test_key_agrees_with_flatten_and_signature(tree):
  first = _check_agrees(tree)
  again = _check_agrees(tree)  # the tree structure from the memo
  assert first == again and hash(first) == hash(again)


def _trees(leaf):
  return st.recursive(
    leaf,
    lambda children: st.one_of(
      st.lists(children, max_size=4).map(tuple),
      st.lists(children, max_size=4),
      st.dictionaries(st.sampled_from("abcde"), children, max_size=4),
      st.just(None),
    ),
    max_leaves=12,
  )


LEAVES = st.sampled_from(
  [jnp.ones(2), jnp.zeros((2, 1), jnp.int32), 1.0, 3, np.ones(2), None]
)


@settings(max_examples=150, deadline=None)
@given(_trees(LEAVES), _trees(LEAVES))
def test_keys_equal_exactly_when_flatten_and_signature_are(a, b):
  ka, kb = _check_agrees((a,)), _check_agrees((b,))
  ra, rb = _reference((a,))[2], _reference((b,))[2]
  assert (ka == kb) == (ra == rb)
  if ka == kb:
    assert hash(ka) == hash(kb)


def test_wide_trees_read_in_blocks_agree():
  """Leaves are read in blocks of 32 (their fields loaded ahead): trees of
  sizes around and across block edges, kinds mixed, agree with flatten."""
  mesh = jax.make_mesh((8,), ("x",))
  kinds = [
    lambda i: jnp.full((i % 3 + 1,), i, jnp.float32),
    lambda i: jax.device_put(jnp.ones(8), jax.NamedSharding(mesh, jax.P("x"))),
    lambda i: float(i),
    lambda i: np.ones(i % 4),
    lambda i: jax.device_put(jnp.int8(i % 100), jax.devices()[i % 8]),
  ]
  for n in (31, 32, 33, 64, 65, 200):
    leaves = [kinds[(i * 7) % len(kinds)](i) for i in range(n)]
    _check_agrees((tuple(leaves),))
    _check_agrees(([leaves[: n // 2], {"a": leaves[n // 2 :]}],))
    rows = _check_agrees((tuple(leaves),))
    swapped = list(leaves)
    swapped[n - 1] = jnp.ones((9,))  # the last block's last leaf differs
    assert _check_agrees((tuple(swapped),)) != rows
  assert sig.signature.reads_array_fields()


def test_key_under_a_trace_and_statics():
  def f(x, y):
    s = _check_agrees(((x, {"k": y}), {}), statics=(7,))
    assert s.has_tracer
    return x

  jax.make_jaxpr(f)(jnp.ones(2), jnp.ones(3))


def test_key_of_a_bad_leaf_raises_type_error():
  with pytest.raises(TypeError, match="not a valid JAX type"):
    sig.key(((object(),), {}), (), CTX)
  with pytest.raises(TypeError, match="3 arguments"):
    sig.key(((),))


def test_key_of_a_list_changed_by_a_getter_does_not_crash():
  """A tracer's ``aval`` getter that empties the list being read."""
  victims = []

  class T:
    @property
    def aval(self):
      victims[0].clear()
      return "aval"

  builder = ext.SignatureBuilder((), T, None, None, None, flatten=FLATTEN)
  tree = [T(), T(), T()]
  victims.append(tree)
  leaves, _, s = builder.key(tree, (), None)
  assert len(leaves) == len(s) == 0  # what flatten saw afterwards


def test_jax_arrays_are_read_from_their_fields_as_their_getters_say():
  sig.signature([jnp.ones(2)])
  assert sig.signature.reads_array_fields()
  by_getters = ext.SignatureBuilder((ji.ArrayImpl,), None, None, None, None)
  mesh = jax.make_mesh((8,), ("x",))
  arrays = [
    jnp.ones(3),
    jnp.asarray(1.0) + 0,  # weakly typed
    jax.device_put(jnp.ones(3), jax.devices()[3]),  # committed
    jax.device_put(jnp.ones(8), jax.NamedSharding(mesh, jax.P("x"))),
    jnp.zeros((2, 2), jnp.int8),
  ]
  for x in arrays:
    fields = sig.signature([x]).describe()
    assert fields == by_getters([x]).describe()
    assert fields[0][1:] == (x.aval, x._sharding, x._committed)  # pylint: disable=protected-access
  donated = jnp.ones(4)
  donated.delete()
  assert sig.signature([donated]) == by_getters([donated])


def test_an_uninitialised_array_object_goes_through_the_getters():
  blank = ji.ArrayImpl.__new__(ji.ArrayImpl)
  sig.signature([jnp.ones(1)])  # fields learnt
  with pytest.raises(Exception):  # what the getter raises, no crash
    sig.signature([blank])


def test_a_replaced_getter_is_followed():
  x = jnp.ones(2)
  sig.signature([x])
  original = ji.ArrayImpl.aval
  try:
    ji.ArrayImpl.aval = property(lambda self: "patched")
    assert sig.signature([x]).describe()[0][1] == "patched"
  finally:
    ji.ArrayImpl.aval = original
  assert sig.signature([x]).describe()[0][1] is x.aval
  assert sig.signature.reads_array_fields()


# -- JitFunction's calls, forwarded in C ------------------------------------------


def add(x, y):
  return x + y


def test_calls_reach_the_dispatcher_without_python():
  f = jit_cache.jit(add)
  x = jnp.ones(3)
  f(x, x)
  f(x, y=x)
  before = f.cache_info()
  for _ in range(3):
    f(x, x)
    f(x, y=x)
  after = f.cache_info()
  assert (after.hits, after.misses) == (before.hits, before.misses)
  assert f._cache_size() == 2  # pylint: disable=protected-access
  assert type(f).__call__ is ext.Forwarder.__call__


def test_wrapper_keeps_its_python_behaviour():
  f = jit_cache.jit(add)
  assert f.__name__ == "add" and f.__wrapped__ is add
  ref = weakref.ref(f)
  assert ref() is f
  g = pickle.loads(pickle.dumps(f))
  assert isinstance(g, jit_cache.JitFunction)
  assert float(g(1.0, 2.0)) == 3.0
  h = copy.deepcopy(f)
  assert float(h(1.0, 2.0)) == 3.0

  class C:
    @functools.partial(jit_cache.jit, static_argnums=0)
    def m(self, y):
      return y * 2

  assert float(C().m(2.0)) == 4.0
  del f, g, h
  gc.collect()
  assert ref() is None


def test_errors_of_the_dispatcher_and_of_tracing():
  f = jit_cache.jit(lambda x, n: x * n, static_argnums=1)
  with pytest.raises(ValueError, match="jaxworks.jit_cache") as info:
    f(jnp.ones(2), [1])
  chain, e = [], info.value.__cause__
  while e is not None:
    chain.append(str(e))
    e = e.__cause__
  assert any("Non-hashable static arguments" in c for c in chain)  # stock's
  with pytest.raises(TypeError, match="positional"):
    jit_cache.jit(add)(1.0)

  def boom(x):
    raise KeyError("from the user's function")

  with pytest.raises(KeyError, match="user's function"):
    jit_cache.jit(boom)(1.0)


def test_forwarder_errors():
  bare = ext.Forwarder()
  with pytest.raises(TypeError, match="not initialised"):
    bare(1)
  with pytest.raises(TypeError, match="callable"):
    bare._forward_to(1, None)  # pylint: disable=protected-access

  def hook(self, error, args, kwargs):
    assert self is bare and args == (1,) and kwargs == {"k": 2}
    return RuntimeError(f"instead of {type(error).__name__}")

  def fails(*args, **kwargs):
    raise ValueError("original")

  bare._forward_to(fails, hook)  # pylint: disable=protected-access
  with pytest.raises(RuntimeError, match="instead of ValueError") as info:
    bare(1, k=2)
  assert str(info.value.__cause__) == "original"
  bare._forward_to(fails, lambda *a: None)  # pylint: disable=protected-access
  with pytest.raises(ValueError, match="original"):
    bare(1)

  def hook_fails(*a):
    raise LookupError("hook")

  bare._forward_to(fails, hook_fails)  # pylint: disable=protected-access
  with pytest.raises(LookupError) as info:
    bare(1)
  assert str(info.value.__context__) == "original"


def test_calls_with_a_tracer_first_as_stock():
  """A tracer first goes to the cache-miss path from C (not through the
  dispatcher); with jit disabled, the function runs un-jitted, as stock."""
  calls = {"stock": 0, "ours": 0}

  def make(who):
    def f(x):
      calls[who] += 1
      return x * 2

    return f

  for who, jit in (("stock", jax.jit), ("ours", jit_cache.jit)):
    g = jit(make(who))
    with jax.disable_jit():
      assert jax.vmap(g)(jnp.arange(3.0)).tolist() == [0.0, 2.0, 4.0]
      jax.vmap(g)(jnp.arange(3.0))
  assert calls["ours"] == calls["stock"] == 2
  g = jit_cache.jit(make("ours"))
  jaxpr = jax.make_jaxpr(lambda v: g(g(v)))(1.0)
  assert [e.primitive.name for e in jaxpr.eqns] == ["jit", "jit"]
  assert g.cache_info().traces == 1 and g.cache_info().hits == 1
  with pytest.raises(ValueError, match="jaxworks.jit_cache"):
    jax.make_jaxpr(
      lambda v: jit_cache.jit(lambda a, n: a * n, static_argnums=1)(v, [2])
    )(1.0)
