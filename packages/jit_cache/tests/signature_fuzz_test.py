"""Fuzz of the extension: arbitrary objects and pytrees never crash it.

Every input either gives a Signature or a TypeError with a clear message (or
the error a leaf's own __eq__/__hash__/attribute raises); and memory stays
flat over 1e6 calls of the extension (driven from C by ``map``, so the million
calls take about 2 s), RSS checked after a warm-up.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import collections
import gc
import itertools
import operator
import sys

from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Private imports below: the subject is the C++ signature and its Python twin.
from jaxworks.jit_cache import _signature as ext
from jaxworks.jit_cache._src import jax_internals as ji
from jaxworks.jit_cache._src import signature as sig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import signature_twin  # noqa: E402


class _Weird:
  """Objects whose dunder methods misbehave."""

  def __init__(self, mode):
    self.mode = mode

  def __eq__(self, other):
    if self.mode == "eq":
      raise ValueError("eq")
    return self is other

  def __hash__(self):
    if self.mode == "hash":
      raise ValueError("hash")
    return 7

  def __getattr__(self, name):
    if self.mode == "getattr" and name in _PROBED:
      raise RuntimeError(f"getattr {name}")
    raise AttributeError(name)

  def __repr__(self):
    return f"_Weird({self.mode!r})"


_PROBED = frozenset(
  {
    "aval",
    "_sharding",
    "sharding",
    "_committed",
    "shape",
    "dtype",
    "weak_type",
    "__jax_array__",
  }
)


class _Later:
  """Placeholder for a _Weird leaf, built inside the test (hypothesis itself
  hashes and compares what it generates)."""

  def __init__(self, mode):
    self.mode = mode

  def __repr__(self):
    return f"_Weird({self.mode!r})"


def _realize(tree):
  return jax.tree_util.tree_map(
    lambda x: _Weird(x.mode) if isinstance(x, _Later) else x, tree
  )


_ARRAYS = [
  jnp.ones(2),
  jnp.zeros((1, 3), jnp.int32),
  jnp.asarray(1.0) + 0,
  jax.random.key(0),
]

leaf = st.one_of(
  st.none(),
  st.booleans(),
  st.integers(),
  st.floats(),
  st.complex_numbers(),
  st.text(max_size=5),
  st.binary(max_size=5),
  st.sampled_from(
    [
      object(),
      object,
      type,
      len,
      Ellipsis,
      NotImplemented,
      slice(1, 2),
      range(3),
      np.float32(1.5),
      np.int64(7),
      np.bool_(True),
      np.ones(3),
      np.zeros((2, 0)),
      np.array("s"),
      np.array([object()]),
      jax.ShapeDtypeStruct((2,), jnp.float32),
    ]
    + _ARRAYS
  ),
  st.sampled_from(["eq", "hash", "getattr"]).map(lambda m: _Later(m)),
)
pytrees = st.recursive(
  leaf,
  lambda children: st.one_of(
    st.lists(children, max_size=4),
    st.tuples(children, children),
    st.dictionaries(st.text(max_size=3), children, max_size=3),
  ),
  max_leaves=12,
)

_BARE = ext.SignatureBuilder(
  (ji.ArrayImpl,), jax.core.Tracer, np.ndarray, np.generic, None
)


def _check(builder, twin, leaves):
  """A Signature or an asserted error, exactly as the Python twin does."""
  got, want = _outcome(builder, leaves), _outcome(twin, leaves)
  assert got[0] == want[0], f"C++ {got} vs Python {want} on {leaves!r}"
  if got[0] is TypeError:
    assert got[1], "TypeError without a message"
    return None
  if got[0] != "ok":
    # Only a leaf's own methods may raise anything else.
    assert got[0] in (ValueError, RuntimeError), got
    assert got[1] in ("hash", "eq") or got[1].startswith("getattr"), got
    return None
  s = got[1]
  assert len(s) == len(leaves)
  again = builder(leaves)
  assert s == again and hash(s) == hash(again)
  assert want[1] == twin(leaves)
  s.describe()
  repr(s)
  return s


@settings(
  max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(pytrees)
def test_fuzz_flattened_pytrees(tree):
  leaves, _ = jax.tree_util.tree_flatten(_realize(tree))
  _check(sig.signature, signature_twin.py_signature, leaves)
  _check(_BARE, _bare_twin, leaves)
  _check(sig.signature, signature_twin.py_signature, tuple(leaves))


@settings(max_examples=200, deadline=None)
@given(st.one_of(leaf, pytrees))
def test_fuzz_raw_objects_as_the_leaves_argument(obj):
  """Anything, even a non-sequence, passed where the leaf list goes: a
  Signature, or exactly the error the Python twin gives."""
  obj = _realize(obj)
  got, want = _outcome(_BARE, obj), _outcome(_bare_twin, obj)
  assert got[0] == want[0], (got, want)
  if got[0] == "ok":
    assert len(got[1]) == len(obj)
  elif got[0] is TypeError:
    assert "leaves must be a list or tuple" in got[1] or "leaf" in got[1]
  else:  # raised by a leaf's own methods
    assert got[1] in ("hash", "eq") or got[1].startswith("getattr"), got


def _outcome(fn, *args):
  """("ok", value) or (exception class, message): never swallowed, compared
  by the caller."""
  try:
    return ("ok", fn(*args))
  except Exception as e:  # pylint: disable=broad-except
    return (type(e), str(e))


def _bare_twin(leaves):
  """py_signature without the fallback, as _BARE is configured."""
  if not isinstance(leaves, (list, tuple)):
    raise TypeError("leaves must be a list or tuple")
  out = []
  for i, x in enumerate(leaves):
    t = type(x)
    if (
      t is ji.ArrayImpl
      or t in (float, int, bool, complex)
      or isinstance(x, (jax.core.Tracer, np.generic))
      or t is np.ndarray
    ):
      out.append(x)
    else:
      raise TypeError(f"leaf {i} has type {t.__name__}")
  return signature_twin.py_signature(out)


def _equal(a, b):
  return a == b


@settings(
  max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(pytrees, pytrees)
def test_fuzz_equality_matches_python_twin(a, b):
  """The extension and its pure-Python twin agree on every input: both build
  (then equality and hash agree), or both raise the same exception class."""
  la, _ = jax.tree_util.tree_flatten(_realize(a))
  lb, _ = jax.tree_util.tree_flatten(_realize(b))
  sa, pa = (
    _outcome(sig.signature, la),
    _outcome(signature_twin.py_signature, la),
  )
  sb, pb = (
    _outcome(sig.signature, lb),
    _outcome(signature_twin.py_signature, lb),
  )
  assert sa[0] == pa[0], f"C++ {sa} vs Python {pa} on {la!r}"
  assert sb[0] == pb[0], f"C++ {sb} vs Python {pb} on {lb!r}"
  if sa[0] != "ok" or sb[0] != "ok":
    return
  cxx = _outcome(_equal, sa[1], sb[1])
  py = _outcome(_equal, pa[1], pb[1])
  assert cxx[0] == py[0], f"equality: C++ {cxx} vs Python {py}"
  if cxx[0] == "ok":
    assert cxx[1] == py[1], f"C++ says {cxx[1]}, Python {py[1]}: {la} {lb}"
    if cxx[1]:
      assert hash(sa[1]) == hash(sb[1])
  else:
    assert cxx[1] == py[1] == "eq"  # a leaf whose __eq__ raises
  assert len(sa[1]) == len(pa[1]) == len(la)


#: Leaves that are easy to confuse: same value, other kind, dtype, weak type,
#: shape or placement.
_CONFUSABLE = [
  True,
  False,
  1,
  0,
  1.0,
  0.0,
  -0.0,
  1j,
  np.int32(1),
  np.int64(1),
  np.float32(1),
  np.bool_(True),
  np.ones(()),
  np.ones((1,)),
  np.ones((), np.int32),
  jnp.ones(()),
  jnp.ones((), jnp.int32),
  jnp.ones(1),
  jnp.asarray(1.0),
  jnp.asarray(1.0) * 1,
  jax.device_put(jnp.ones(()), jax.devices()[-1]),
  jax.ShapeDtypeStruct((), jnp.float32),
  jax.random.key(0),
]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
  st.lists(st.integers(0, len(_CONFUSABLE) - 1), min_size=1, max_size=3),
  st.data(),
)
def test_fuzz_confusable_leaves_agree_with_twin(idx_a, data):
  """Equality of near-identical leaf lists: the extension and the twin agree
  (b differs from a in one position, drawn from the same confusable pool)."""
  pos = data.draw(st.integers(0, len(idx_a) - 1))
  idx_b = list(idx_a)
  idx_b[pos] = data.draw(st.integers(0, len(_CONFUSABLE) - 1))
  la = [_CONFUSABLE[i] for i in idx_a]
  lb = [_CONFUSABLE[i] for i in idx_b]
  sa, sb = sig.signature(la, "x"), sig.signature(lb, "x")
  pa, pb = (
    signature_twin.py_signature(la, "x"),
    signature_twin.py_signature(lb, "x"),
  )
  assert (sa == sb) == (pa == pb), (
    f"C++ {sa == sb}, Python {pa == pb}: {la!r} vs {lb!r}"
  )
  if sa == sb:
    assert hash(sa) == hash(sb)


def test_unsupported_leaf_error_is_clear():
  with pytest.raises(
    TypeError,
    match=r"leaf 0 has type str, which is not a "
    r"jax Array, tracer, numpy array or Python scalar",
  ):
    _BARE(["x"])


def _rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _consume(iterable) -> None:
  collections.deque(iterable, maxlen=0)


def _cycle(seq, n):
  return itertools.islice(itertools.cycle(seq), n)


def _raising_calls(calls, n):
  for i in range(n):
    builder, leaves = calls[i % len(calls)]
    try:
      builder(leaves, "extra")
    except TypeError:
      pass
  return n


def _burst(n, tracers=()):
  """n extension calls on every C++ path, driven from C by map() where they
  succeed (the Python loop would cost more than the calls); returns n."""
  by_type = ext.SignatureBuilder(
    (ji.ArrayImpl,), jax.core.Tracer, np.ndarray, np.generic, type
  )
  mixes = [
    [jnp.ones(2), 1.0, np.ones(3)],
    (np.float32(1), True, 3, 2j),
    [jnp.ones(3)] * 8,
    list(tracers) or [np.int8(1)],
  ]
  others = [["abc", object(), None, b"x"]]  # fallback=type: keys are types
  extras = [("extra", 0), ("extra", 1), ("extra", 2)]
  contexts = [(1, i, None) for i in range(7)]
  interner = ext.ContextInterner(4)
  build = sig.signature
  n_ok, n_raise = n * 8 // 20, n // 20
  # Builds then hashes, pairs of builds then ==, fallback builds, interning
  _consume(map(hash, map(build, _cycle(mixes, n_ok), _cycle(extras, n_ok))))
  _consume(
    map(
      operator.eq,
      map(build, _cycle(mixes, n_ok // 2), _cycle(extras, n_ok // 2)),
      map(build, _cycle(mixes, n_ok // 2), _cycle(extras, n_ok // 2)),
    )
  )
  _consume(
    map(
      hash, map(by_type, _cycle(others, n_ok // 4), _cycle(extras, n_ok // 4))
    )
  )
  _consume(map(interner, _cycle(contexts, n_ok // 4)))
  # ... and the raising paths: an unsupported leaf without a fallback, a
  # fallback that raises, and one that returns an unhashable key.
  _raising_calls(
    [
      (_BARE, ["bad"]),
      (ext.SignatureBuilder((), None, None, None, len), [3]),
      (ext.SignatureBuilder((), None, None, None, list), ["ab"]),
    ],
    n_raise,
  )
  return n_ok + n_ok + n_ok // 4 + n_ok // 4 + n_raise


def test_no_reference_is_leaked():
  """Exact reference counts of everything a signature reads or returns, after
  10^4 builds on each path (RSS cannot see a leaked reference to a shared
  object)."""
  x, nd, key = jnp.ones(3), np.ones(2, np.float32), ("fallback", "key")
  extra, ctx_items = ("extra",), (object(), object())
  watched = [
    x,
    x.aval,
    x._sharding,
    nd,
    nd.dtype,
    extra,
    key,  # pylint: disable=protected-access
    *ctx_items,
  ]
  with_key = ext.SignatureBuilder(
    (ji.ArrayImpl,), None, np.ndarray, None, lambda leaf: key
  )
  unhashable = ext.SignatureBuilder((), None, None, None, lambda leaf: [key])
  interner = ext.ContextInterner(2)
  before = [sys.getrefcount(o) for o in watched]
  for _ in range(10_000):
    s = with_key([x, nd, 1.0, "other"], extra)
    assert s == with_key([x, nd, 2.0, "more"], extra=extra)
    s.describe()
    for bad in (unhashable, _BARE):
      with pytest.raises(TypeError):
        bad(["leaf"], extra)
    interner(ctx_items)
    interner((1,))
    interner((2,))  # evicts ctx_items' key
  del s
  gc.collect()
  assert [sys.getrefcount(o) for o in watched] == before


@pytest.mark.skipif(
  not sys.platform.startswith("linux"), reason="RSS via /proc"
)
def test_memory_is_flat_over_a_million_calls():
  """1e6 extension calls (builds with and without the fallback, hashes,
  equality, interning, tracer leaves, raising paths): RSS grows < 8 MiB."""
  seen = {}

  def traced(x, y):
    seen["calls"] = _burst(100_000, tracers=(x, y, x))
    return x

  jax.make_jaxpr(traced)(jnp.ones(2), 1.0)  # tracer leaves, under a trace
  _burst(100_000)  # warm up allocator pools and caches
  gc.collect()
  before = _rss_bytes()
  calls = _burst(1_000_000)
  gc.collect()
  grown = _rss_bytes() - before
  assert calls >= 1_000_000 and seen["calls"] >= 100_000
  assert grown < 8 * 2**20, f"RSS grew by {grown / 2**20:.1f} MiB"
