"""Fuzzing the C++ grouping with arbitrary Python objects: no crash, clear errors."""

import os
import sys

from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
from jax.sharding import SingleDeviceSharding
import numpy as np

# Private imports below: the C++ grouping and its wrapper are the subject.
from jaxworks.batched_transfer import _grouping
from jaxworks.batched_transfer._src import grouping
from jaxworks.batched_transfer._src import jax_internals

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grouping_twin  # noqa: E402

API = "jaxworks.batched_transfer._grouping.group_leaves"


class Raises:
  """Every attribute, hash, == and repr raises."""

  def __getattr__(self, name):
    raise RuntimeError(f"no {name}")

  def __hash__(self):
    raise RuntimeError("no hash")

  def __eq__(self, other):
    raise RuntimeError("no eq")

  def __repr__(self):
    raise RuntimeError("no repr")


class Shardingish:
  def __init__(self, devs, mk):
    self.devs, self.memory_kind = devs, mk


class Leaf:
  def __init__(self, sharding, nbytes):
    self.sharding, self.nbytes = sharding, nbytes


class PropLeaf:
  """Its sharding and nbytes are properties (the C++ pass calls their getters directly)."""

  def __init__(self, sharding, nbytes):
    self._sharding, self._nbytes = sharding, nbytes

  @property
  def sharding(self):
    if isinstance(self._sharding, Raises):
      raise RuntimeError("no sharding")
    return self._sharding

  @property
  def nbytes(self):
    return self._nbytes


class BadEq:
  def __init__(self, h):
    self.h = h

  def __hash__(self):
    return self.h

  def __eq__(self, other):
    raise ValueError("cannot compare")


scalars = st.one_of(
  st.none(),
  st.booleans(),
  st.integers(),
  st.floats(allow_nan=True),
  st.text(max_size=5),
  st.binary(max_size=5),
  st.complex_numbers(),
)
objects = st.recursive(
  st.one_of(
    scalars,
    st.builds(Raises),
    st.builds(BadEq, st.integers(0, 3)),
    st.just(np.zeros(2)),
    st.just(np.float32(1)),
  ),
  lambda children: st.one_of(
    st.lists(children, max_size=3),
    st.tuples(children),
    st.dictionaries(st.text(max_size=3), children, max_size=3),
  ),
  max_leaves=8,
)
sharding_like = st.one_of(
  st.none(),
  objects,
  st.builds(Shardingish, objects, objects),
  st.builds(
    Shardingish,
    st.tuples(st.integers(0, 2)),
    st.sampled_from(["device", "host", None]),
  ),
)
leaves_st = st.one_of(
  objects,
  st.builds(Leaf, sharding_like, st.one_of(st.integers(), objects)),
  st.builds(PropLeaf, sharding_like, st.one_of(st.integers(), objects)),
)


class Shaped:
  def __init__(self, shape, dtype):
    self.shape, self.dtype = shape, dtype


size_rules = st.one_of(
  st.integers(-3, 64), st.sampled_from(["", "inner", "shape", "nbytes"])
)
kind_values = st.one_of(
  st.tuples(
    st.integers(-2, 5),
    st.sampled_from([None, "sharding", "nbytes", "x"]),
    size_rules,
  ),
  objects,
  st.tuples(objects, objects, objects),
)
kinds_st = st.one_of(
  st.dictionaries(
    st.sampled_from(
      [
        Leaf,
        PropLeaf,
        Shaped,
        int,
        float,
        str,
        tuple,
        list,
        type(None),
        np.ndarray,
      ]
    ),
    kind_values,
    max_size=4,
  ),
  objects,
)
shapes = st.one_of(
  st.tuples(st.integers(-2, 2**40)),
  st.lists(st.integers(0, 3), max_size=2),
  objects,
)
dtypes = st.one_of(
  st.sampled_from([np.dtype(np.float32), np.dtype(np.int8)]), objects
)
shaped_leaves = st.builds(Shaped, shapes, dtypes)


def _check(result, n):
  assert isinstance(result, list)
  seen = sorted(i for g in result for i in g.indices)
  assert seen == list(range(n))
  for g in result:
    assert g.nbytes >= 0
    assert list(g.indices) == sorted(g.indices)
    repr(g)


@settings(
  max_examples=400,
  deadline=None,
  derandomize=True,
  database=None,
  suppress_health_check=[HealthCheck.too_slow],
)
@given(
  leaves=st.lists(st.one_of(leaves_st, shaped_leaves), max_size=6),
  dsts=st.lists(sharding_like, max_size=6),
  kinds=kinds_st,
  default=sharding_like,
  attr=st.sampled_from(["devs", "memory_kind", "x"]),
)
def test_arbitrary_objects_never_crash(leaves, dsts, kinds, default, attr):
  try:
    result = _grouping.group_leaves(leaves, dsts, kinds, default, attr)
  except (TypeError, ValueError) as err:
    assert API in str(err)
    return
  _check(result, len(leaves))
  # Where the C++ pass succeeds, its pure-Python twin computes the same groups.
  py = grouping_twin.group_leaves_py(leaves, dsts, kinds, default, attr)
  assert _summary(result) == _summary(py)


def _summary(groups):
  return [
    (
      g.kind,
      _ident(g.src_devices),
      _ident(g.dst_devices),
      _ident(g.src_memory_kind),
      _ident(g.dst_memory_kind),
      list(g.indices),
      g.nbytes,
    )
    for g in groups
  ]


def _ident(x):
  """Comparable without calling __eq__ (the fuzzed objects may raise there)."""
  return (
    x
    if isinstance(x, (type(None), bool, int, str, tuple)) and _plain(x)
    else id(x)
  )


def _plain(x):
  return not isinstance(x, tuple) or all(
    isinstance(e, (type(None), bool, int, str)) for e in x
  )


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(leaves=objects, dsts=objects)
def test_arbitrary_containers_never_crash(leaves, dsts):
  try:
    result = _grouping.group_leaves(leaves, dsts, {}, None, "devs")
  except (TypeError, ValueError) as err:
    assert API in str(err)
    return
  _check(result, len(leaves))


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(
  picks=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), max_size=40)
)
def test_cpp_matches_python_on_real_leaves(picks):
  devices = jax.devices()
  pool = [
    np.zeros(3, np.float32),
    np.ones((2, 2)),
    jax.device_put(np.ones(2), devices[1]),
    jax.numpy.ones(5),
    7,
    np.int8(1),
  ]
  dsts_pool = [
    None,
    SingleDeviceSharding(devices[0]),
    SingleDeviceSharding(devices[1]),
    SingleDeviceSharding(devices[2], memory_kind="pinned_host"),
  ]
  leaves = [pool[a] for a, _ in picks]
  dsts = [dsts_pool[b] for _, b in picks]
  default = dsts_pool[1]
  cpp = grouping.group_leaves(leaves, dsts, default)
  py = grouping_twin.group_leaves_py(
    leaves,
    dsts,
    grouping.kinds_table(),
    default,
    jax_internals.DEVICE_LIST_ATTR,
    jax_internals.MEMORY_KIND_ATTR,
  )
  assert [
    (
      g.kind,
      g.src_devices,
      g.dst_devices,
      g.src_memory_kind,
      g.dst_memory_kind,
      list(g.indices),
      g.nbytes,
    )
    for g in cpp
  ] == [
    (
      g.kind,
      g.src_devices,
      g.dst_devices,
      g.src_memory_kind,
      g.dst_memory_kind,
      g.indices,
      g.nbytes,
    )
    for g in py
  ]
