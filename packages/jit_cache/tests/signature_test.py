"""The C++ Signature: what it records, equality, hashing, errors."""

import gc
import os
import sys
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

from jaxworks.jit_cache import _signature as ext
from jaxworks.jit_cache._src import jax_internals as ji
from jaxworks.jit_cache._src import signature as sig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import signature_twin  # noqa: E402

S = sig.signature


def test_kinds():
  cases = {
    "jax_array": jnp.ones(2),
    "ndarray": np.ones(2),
    "numpy_scalar": np.float32(1),
    "bool": True,
    "int": 1,
    "float": 1.0,
    "complex": 1j,
    "other": jax.random.key(0),
  }
  for kind, leaf in cases.items():
    assert sig.signature.classify(leaf) == kind, kind
    assert S([leaf]).describe()[0][0] == kind


def test_values_do_not_matter_abstract_properties_do():
  assert S([jnp.ones(3)]) == S([jnp.zeros(3)])
  assert hash(S([jnp.ones(3)])) == hash(S([jnp.zeros(3)]))
  assert S([jnp.ones(3)]) != S([jnp.ones(4)])
  assert S([jnp.ones(3)]) != S([jnp.ones(3, jnp.int32)])
  weak = jnp.asarray(1.0) + 0  # weakly typed result
  strong = jnp.float32(1.0)
  assert weak.weak_type and not strong.weak_type
  assert S([weak]) != S([strong])
  assert S([np.ones(3, np.float32)]) == S([np.zeros(3, np.float32)])
  assert S([np.ones(3, np.float32)]) != S([np.ones(3, np.float64)])
  assert S([np.ones(3, "<f4")]) != S([np.ones(3, ">f4")])
  assert S([1]) == S([2]) and S([1]) != S([1.0]) and S([True]) != S([1])
  assert S([np.float32(1)]) == S([np.float32(2)])
  assert S([np.float32(1)]) != S([np.int32(1)])
  assert S([jnp.ones(3)]) != S([np.ones(3, np.float32)])  # kinds differ


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices")
def test_sharding_and_committed_are_recorded():
  a = jnp.ones(3)
  on1 = jax.device_put(jnp.ones(3), jax.devices()[1])
  on0 = jax.device_put(jnp.ones(3), jax.devices()[0])
  assert not a._committed and on0._committed  # pylint: disable=protected-access
  assert S([a]) != S([on0])  # committed differs
  assert S([on0]) != S([on1])  # sharding differs
  assert S([on1]) == S([jax.device_put(jnp.zeros(3), jax.devices()[1])])
  kind, aval, sharding, committed = S([on1]).describe()[0]
  assert (kind, aval, sharding, committed) == (
    "jax_array",
    on1.aval,
    on1.sharding,
    True,
  )


def test_extra_is_part_of_the_signature():
  leaves = [jnp.ones(2)]
  assert S(leaves, "a") != S(leaves, "b")
  assert S(leaves, ("t", 1)) == S(leaves, ("t", 1))
  assert S(leaves, "a").extra == "a"
  assert S(leaves) != 3 and (S(leaves) == 3) is False


def test_tracers_record_their_aval_only():
  seen = []

  def f(x):
    s = S([x])
    seen.append(s)
    desc = s.describe()[0]
    assert desc[0] == "tracer"
    assert isinstance(desc[1], jax.core.ShapedArray)
    assert s.has_tracer
    return x

  jax.jit(f)(jnp.ones(2))
  jax.jvp(f, (jnp.ones(2),), (jnp.ones(2),))
  jax.vmap(f)(jnp.ones((4, 2)))
  assert not S([jnp.ones(2)]).has_tracer
  assert len(seen) == 3


@settings(max_examples=25, deadline=None)
@given(
  st.floats(allow_nan=False, allow_infinity=False, width=32),
  st.floats(allow_nan=False, allow_infinity=False, width=32),
)
def test_jvp_tracers_of_different_values_are_equal(a, b):
  """The upstream fix: a tracer's signature never holds a concrete value."""
  sigs = []

  def f(x):
    sigs.append(S([x]))
    return x

  jax.jvp(f, (jnp.float32(a),), (jnp.float32(1.0),))
  jax.jvp(f, (jnp.float32(b),), (jnp.float32(2.0),))
  assert sigs[0] == sigs[1] and hash(sigs[0]) == hash(sigs[1])


def test_fallback_leaves():
  k1, k2 = jax.random.key(0), jax.random.key(1)
  assert S([k1]) == S([k2])
  sds = jax.ShapeDtypeStruct((2, 3), jnp.float32)
  assert S([sds]) == S([jax.ShapeDtypeStruct((2, 3), jnp.float32)])
  assert S([sds]) != S([jax.ShapeDtypeStruct((2, 4), jnp.float32)])


def test_errors():
  with pytest.raises(
    TypeError, match="value of type str is not a valid JAX type"
  ):
    S(["abc"])
  with pytest.raises(
    TypeError, match="leaves must be a list or tuple, got dict"
  ):
    S({"a": 1})
  bare = ext.SignatureBuilder(
    (ji.ArrayImpl,), jax.core.Tracer, np.ndarray, np.generic, None
  )
  with pytest.raises(
    TypeError, match="leaf 1 has type object, which is not a jax Array"
  ):
    bare([1.0, object()])
  unhashable = ext.SignatureBuilder((), None, None, None, lambda x: [x])
  with pytest.raises(TypeError, match="fallback returned an unhashable key"):
    unhashable(["x"])
  with pytest.raises(TypeError, match="array_types must hold types"):
    ext.SignatureBuilder((1,), None, None, None, None)
  with pytest.raises(TypeError, match="fallback must be callable"):
    ext.SignatureBuilder((), None, None, None, 3)
  with pytest.raises(TypeError):
    ext.Signature()  # only the builder makes signatures


def test_attribute_reads_follow_the_type():
  """Slots are read at their offset, properties through their getter; both
  are looked up again when the class changes (version tag)."""

  class Base:
    __slots__ = ("aval",)

  class Sub(Base):
    __slots__ = ()

  builder = ext.SignatureBuilder((), Base, None, None, None)
  t = Sub()
  with pytest.raises(AttributeError, match="aval"):
    builder([t])  # an empty slot
  t.aval = "a1"
  assert builder([t]).describe()[0][:2] == ("tracer", "a1")
  Sub.aval = property(lambda self: "from a property")
  assert builder([t]).describe()[0][1] == "from a property"
  del Sub.aval
  assert builder([t]).describe()[0][1] == "a1"


def test_attribute_reads_run_getattr_and_getattribute_like_python():
  """A type's ``__getattr__`` runs when the descriptor raises AttributeError;
  a type that overrides ``__getattribute__`` is read through it (getattr)."""

  class Lazy:
    @property
    def aval(self):
      raise AttributeError("not computed")

    def __getattr__(self, name):
      return f"hook:{name}"

  class Custom:
    aval = property(lambda self: "property")

    def __getattribute__(self, name):
      return (
        "getattribute"
        if name == "aval"
        else object.__getattribute__(self, name)
      )

  for cls in (Lazy, Custom):
    builder = ext.SignatureBuilder((), cls, None, None, None)
    assert builder([cls()]).describe()[0][1] == getattr(cls(), "aval")
  assert getattr(Lazy(), "aval") == "hook:aval"

  class Truthy:
    def __init__(self, value):
      self.value = value

    def __bool__(self):
      if self.value is None:
        raise ValueError("no truth")
      return self.value

  class FakeArray:
    def __init__(self, committed):
      self.committed = committed

    aval = property(lambda self: "aval")
    _sharding = property(lambda self: "sharding")
    _committed = property(lambda self: self.committed)

  arrays = ext.SignatureBuilder((FakeArray,), None, None, None, None)
  assert arrays([FakeArray(1)]).describe() == [
    ("jax_array", "aval", "sharding", True)
  ]
  assert arrays([FakeArray(Truthy(False))]) == arrays([FakeArray(0)])
  with pytest.raises(ValueError, match="no truth"):
    arrays([FakeArray(Truthy(None))])
  FakeArray.aval = property(lambda self: 1 / 0)
  with pytest.raises(ZeroDivisionError):
    arrays([FakeArray(True)])


def test_fallback_that_mutates_the_list_does_not_crash():
  leaves = []

  def fallback(x):
    leaves.clear()  # shrink the list being walked
    return ("k", type(x).__name__)

  builder = ext.SignatureBuilder((), None, None, None, fallback)
  leaves.extend(["a", "b", "c"])
  s = builder(leaves)
  assert len(s) == 1


def test_eq_that_raises_propagates():
  class Bad:
    def __hash__(self):
      return 1

    def __eq__(self, other):
      raise RuntimeError("no eq")

  builder = ext.SignatureBuilder((), None, None, None, lambda x: x)
  a, b = builder([Bad()]), builder([Bad()])
  with pytest.raises(RuntimeError, match="no eq"):
    _ = a == b


def test_signatures_take_part_in_garbage_collection():
  class Holder:
    pass

  h = Holder()
  h.sig = S([1.0, jnp.ones(2)], (h,))  # a cycle through a Signature
  ref = weakref.ref(h)
  del h
  gc.collect()
  assert ref() is None


def test_context_interner():
  interner = ext.ContextInterner(2)
  t = (1, "a", None)
  k1 = interner(t)
  assert interner(tuple(list(t))) is k1  # element-wise identical: same key
  k2 = interner((2, "a", None))
  assert k2 is not k1 and k2 != k1
  k3 = interner((1, "a" * 1, None))
  assert k3 == k1 and hash(k3) == hash(k1)
  assert k1.values == t and len(interner) == 2
  with pytest.raises(TypeError, match="expected a tuple"):
    interner([1])
  ctx = interner(ji.trace_context())
  assert interner(ji.trace_context()) is ctx


@settings(max_examples=60, deadline=None)
@given(
  st.lists(
    st.sampled_from(
      [
        "f32_3",
        "f32_4",
        "i32_3",
        "np_f32_3",
        "np_f64_3",
        "int",
        "float",
        "bool",
        "complex",
        "np_f32",
        "np_i8",
        "key",
      ]
    ),
    max_size=6,
  ),
  st.lists(
    st.sampled_from(
      [
        "f32_3",
        "f32_4",
        "i32_3",
        "np_f32_3",
        "np_f64_3",
        "int",
        "float",
        "bool",
        "complex",
        "np_f32",
        "np_i8",
        "key",
      ]
    ),
    max_size=6,
  ),
)
def test_agrees_with_pure_python_twin(names_a, names_b):
  make = {
    "f32_3": lambda: jnp.ones(3),
    "f32_4": lambda: jnp.ones(4),
    "i32_3": lambda: jnp.ones(3, jnp.int32),
    "np_f32_3": lambda: np.ones(3, np.float32),
    "np_f64_3": lambda: np.ones(3),
    "int": lambda: 3,
    "float": lambda: 2.5,
    "bool": lambda: False,
    "complex": lambda: 2j,
    "np_f32": lambda: np.float32(1),
    "np_i8": lambda: np.int8(1),
    "key": lambda: jax.random.key(3),
  }
  a = [make[n]() for n in names_a]
  b = [make[n]() for n in names_b]
  assert (S(a) == S(b)) == (
    signature_twin.py_signature(a) == signature_twin.py_signature(b)
  )
  if S(a) == S(b):
    assert hash(S(a)) == hash(S(b))
  assert len(S(a)) == len(signature_twin.py_signature(a)) == len(a)


def test_leaf_properties_for_explanations():
  props = sig.leaf_properties(S([jnp.ones((2, 3))]).describe()[0])
  assert props["shape"] == (2, 3) and props["dtype"] == jnp.float32
  assert props["weak_type"] is False and props["committed"] is False
  props = sig.leaf_properties(S([np.ones(2, np.int8)]).describe()[0])
  assert props["kind"] == "ndarray" and props["dtype"] == np.int8
  props = sig.leaf_properties(S([1.0]).describe()[0])
  assert props["dtype"] == "python float" and props["weak_type"] is True
  props = sig.leaf_properties(S([jax.random.key(0)]).describe()[0])
  assert props["kind"] == "PRNGKeyArray" and props["shape"] == ()
