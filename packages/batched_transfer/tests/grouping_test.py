"""The C++ grouping pass: keys, stable order, byte counts, errors, references."""

import operator
import os
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding
import numpy as np
import pytest

# Private imports below: the C++ grouping and its wrapper are the subject.
from jaxworks.batched_transfer import _grouping
from jaxworks.batched_transfer._src import grouping
from jaxworks.batched_transfer._src import jax_internals

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import grouping_twin  # noqa: E402


def _as_tuples(groups):
  """C++ Groups or the twin's PyGroups, as comparable tuples."""
  return [
    (
      g.kind,
      g.src_devices,
      g.dst_devices,
      g.src_memory_kind,
      g.dst_memory_kind,
      list(g.indices),
      g.nbytes,
    )
    for g in groups
  ]


@pytest.fixture(scope="module")
def devices():
  return jax.devices()


def test_groups_by_source_destination_memory_kind_and_kind(devices):
  s0, s1 = SingleDeviceSharding(devices[0]), SingleDeviceSharding(devices[1])
  pinned = SingleDeviceSharding(devices[0], memory_kind="pinned_host")
  on0 = jax.device_put(np.ones(4, np.float32), devices[0])
  on1 = jax.device_put(np.ones(2, np.float32), devices[1])
  leaves = [
    np.zeros(3, np.float32),
    on0,
    np.zeros(5, np.int8),
    on1,
    1.0,
    on0,
    np.zeros(1),
    True,
  ]
  dsts = [s1, s1, s1, s1, s1, pinned, s0, None]
  groups = grouping.group_leaves(leaves, dsts, default_dst=s0)
  dl = jax_internals.device_list
  assert _as_tuples(groups) == [
    (grouping.HOST_ARRAY, None, dl(s1), None, "device", [0, 2], 12 + 5),
    (grouping.DEVICE_ARRAY, dl(s0), dl(s1), "device", "device", [1], 16),
    (grouping.DEVICE_ARRAY, dl(s1), dl(s1), "device", "device", [3], 8),
    (grouping.PY_SCALAR, None, dl(s1), None, "device", [4], 4),
    (grouping.DEVICE_ARRAY, dl(s0), dl(s0), "device", "pinned_host", [5], 16),
    (grouping.HOST_ARRAY, None, dl(s0), None, "device", [6], 8),
    (grouping.PY_SCALAR, None, dl(s0), None, "device", [7], 1),
  ]


def test_cpp_equals_python_on_a_mixed_tree(devices):
  mesh = jax.make_mesh((4, 2), ("a", "b"))
  named = NamedSharding(mesh, P("a"))
  other = NamedSharding(jax.make_mesh((2,), ("x",), devices=devices[:2]), P())
  rng = np.random.default_rng(0)
  pool = [
    np.zeros(8, np.float32),
    jnp.ones(8),
    jax.device_put(np.ones(8), named),
    3,
    2.5,
    np.float16(1),
    "text",
    None,
    object(),
    jax.device_put(np.ones(8), devices[5]),
  ]
  targets = [
    None,
    named,
    other,
    SingleDeviceSharding(devices[3]),
    SingleDeviceSharding(devices[3], memory_kind="unpinned_host"),
  ]
  leaves = [pool[k] for k in rng.integers(0, len(pool), 500)]
  dsts = [targets[k] for k in rng.integers(0, len(targets), 500)]
  default = SingleDeviceSharding(devices[0])
  cpp = grouping.group_leaves(leaves, dsts, default_dst=default)
  py = grouping_twin.group_leaves_python(leaves, dsts, default_dst=default)
  assert _as_tuples(cpp) == _as_tuples(py)
  assert sorted(i for g in cpp for i in g.indices) == list(range(500))


def test_equal_but_distinct_device_lists_share_a_group(devices):
  # Two sharding objects with equal device lists: one group, found by ==.
  a = NamedSharding(jax.make_mesh((2,), ("x",), devices=devices[:2]), P())
  b = NamedSharding(jax.make_mesh((2,), ("y",), devices=devices[:2]), P("y"))
  assert jax_internals.device_list(a) is not jax_internals.device_list(b)
  groups = grouping.group_leaves([np.zeros(2)] * 4, [a, b, a, b], default_dst=a)
  assert [list(g.indices) for g in groups] == [[0, 1, 2, 3]]


def test_python_scalar_bytes_follow_x64(devices):
  s = SingleDeviceSharding(devices[0])
  assert (
    grouping.group_leaves([1, 1.0, 1j, True], [s] * 4)[0].nbytes
    == 4 + 4 + 8 + 1
  )
  with jax.enable_x64(True):
    assert (
      grouping.group_leaves([1, 1.0, 1j, True], [s] * 4)[0].nbytes
      == 8 + 8 + 16 + 1
    )


def test_kinds_match_exact_types(devices, tmp_path):
  s = SingleDeviceSharding(devices[0])
  mapped = np.memmap(
    tmp_path / "m.bin", dtype=np.float32, mode="w+", shape=(4,)
  )
  masked = np.ma.masked_array(
    [1.0, 2.0]
  )  # an ndarray subclass jax.device_put refuses
  groups = grouping.group_leaves([mapped, masked], [s, s])
  assert [(g.kind, list(g.indices), g.nbytes) for g in groups] == [
    (grouping.HOST_ARRAY, [0], 16),
    (grouping.OTHER, [1], 0),
  ]


def test_empty_input():
  assert grouping.group_leaves([], []) == []
  assert _grouping.group_leaves((), (), {}, None, "x") == []


class _Sharding:
  def __init__(self, devs, mk="device"):
    self.devs, self.memory_kind = devs, mk


class _Leaf:
  def __init__(self, sharding, nbytes=1):
    self.sharding, self.nbytes = sharding, nbytes


class _Shaped:
  def __init__(self, shape, dtype):
    self.shape, self.dtype = shape, dtype


def test_size_rules():
  dt = np.dtype(np.int16)
  kinds = {
    _Shaped: (3, None, ""),
    _Leaf: (4, None, "inner"),
    int: (5, None, 7),
    float: (6, None, -1),
  }
  leaf = _Leaf(None)
  leaf.inner = _Shaped((2, 5), dt)
  groups = _grouping.group_leaves(
    [_Shaped((4, 3), dt), leaf, 1, 2],
    [None] * 4,
    kinds,
    _Sharding(("d",)),
    "devs",
  )
  assert [(g.kind, g.nbytes) for g in groups] == [(3, 24), (4, 20), (5, 14)]
  with pytest.raises(TypeError, match="has no readable .nbytes"):
    _grouping.group_leaves([1.0], [None], kinds, _Sharding(("d",)), "devs")
  # jax.Arrays count their abstract value's shape and dtype, as jax.Array.nbytes would.
  x = jax.device_put(np.ones((3, 5), jnp.bfloat16))
  assert grouping.group_leaves([x], [None])[0].nbytes == x.nbytes == 30


def test_works_on_any_sharding_like_object():
  kinds = {_Leaf: (7, "sharding", -1)}
  a, b = _Sharding(("d0",)), _Sharding(("d1",), "host")
  leaves = [_Leaf(a, 3), _Leaf(b, 4), _Leaf(a, 5)]
  groups = _grouping.group_leaves(leaves, [None, a, None], kinds, None, "devs")
  assert _as_tuples(groups) == [
    (7, ("d0",), ("d0",), "device", "device", [0, 2], 8),
    (7, ("d1",), ("d0",), "host", "device", [1], 4),
  ]
  assert "Group(kind=7" in repr(groups[0])


class _PropLeaf:
  """A leaf whose sharding is a property (read through its getter by the C++ pass)."""

  def __init__(self, sharding, nbytes=1):
    self._s, self.nbytes = sharding, nbytes

  @property
  def sharding(self):
    if isinstance(self._s, Exception):
      raise self._s
    return self._s


class _HookLeaf(_PropLeaf):
  """Same property, but __getattr__ makes attribute reads non-generic: read by name."""

  def __getattr__(self, name):
    if name == "sharding":
      return _Sharding(("hook",))
    raise AttributeError(name)


class _FreshLeaf:
  """Every read of .sharding builds a new sharding object (freed right after use)."""

  def __init__(self, k):
    self.k, self.nbytes = k, 1

  @property
  def sharding(self):
    return _Sharding((self.k % 3,), "dev" + "ice"[: 3 + self.k % 2])


def _reference(leaves, dsts, kinds, default=None, attr="devs"):
  cpp = _grouping.group_leaves(leaves, dsts, kinds, default, attr)
  py = grouping_twin.group_leaves_py(leaves, dsts, kinds, default, attr)
  return _as_tuples(cpp), _as_tuples(py)


def test_property_getters_are_read_like_getattr():
  a, b = _Sharding(("d0",)), _Sharding(("d1",), "host")
  kinds = {_PropLeaf: (1, "sharding", -1), _HookLeaf: (2, "sharding", -1)}
  leaves = [_PropLeaf(a, 2), _HookLeaf(b, 3), _PropLeaf(b, 4), _HookLeaf(a, 5)]
  cpp, py = _reference(leaves, [None] * 4, kinds)
  assert cpp == py
  # The property wins over __getattr__ (a data descriptor), as in Python.
  assert [(g[0], g[1], list(g[5])) for g in cpp] == [
    (1, ("d0",), [0]),
    (2, ("d1",), [1]),
    (1, ("d1",), [2]),
    (2, ("d0",), [3]),
  ]
  # A getter that raises is reported like a failing getattr, chained.
  with pytest.raises(TypeError, match=r"its \.sharding cannot be read") as info:
    _grouping.group_leaves(
      [_PropLeaf(KeyError("boom"))], [None], kinds, None, "devs"
    )
  assert isinstance(info.value.__cause__, KeyError)

  # A property without a getter raises AttributeError, as getattr does.
  class NoGetter:
    sharding = property(None)

  with pytest.raises(TypeError, match="cannot be read") as info:
    _grouping.group_leaves(
      [NoGetter()], [None], {NoGetter: (1, "sharding", 0)}, None, "devs"
    )
  assert isinstance(info.value.__cause__, AttributeError)


def test_a_property_replaced_during_the_call_is_read_anew():
  # The C++ readers cache the type's descriptor. Assigning another property to
  # the class (here from inside the getter, in the middle of the call) changes
  # the type's version tag, so the leaves after it are read through the new
  # property, as getattr reads them.
  a, b = _Sharding(("d0",)), _Sharding(("d1",))

  class Swapping:
    nbytes = 1

    @property
    def sharding(self):
      type(self).sharding = property(lambda self: b)
      return a

  kinds = {Swapping: (1, "sharding", -1)}
  groups = _grouping.group_leaves(
    [Swapping() for _ in range(3)], [None] * 3, kinds, None, "devs"
  )
  assert [(g.src_devices, list(g.indices)) for g in groups] == [
    (("d0",), [0]),
    (("d1",), [1, 2]),
  ]


def test_fresh_sharding_objects_beyond_the_identity_cache():
  # More distinct sharding objects than the C++ identity caches hold (4096),
  # each freed right after use, so their addresses get reused: the groups must
  # still be by value, equal to the Python reference. Memory kinds are equal
  # strings in distinct objects ("dev" + "ice").
  leaves = [_FreshLeaf(k) for k in range(6000)]
  cpp, py = _reference(
    leaves, [None] * len(leaves), {_FreshLeaf: (1, "sharding", -1)}
  )
  assert cpp == py
  assert [(g[1], len(g[5])) for g in cpp] == [
    ((0,), 2000),
    ((1,), 2000),
    ((2,), 2000),
  ]


class _CountingSharding:
  """A sharding whose device list is a property that counts its reads."""

  reads = 0
  memory_kind = "device"

  def __init__(self, devs):
    self._devs = devs

  @property
  def devs(self):
    type(self).reads += 1
    return self._devs


def test_recurring_shardings_are_read_once_in_a_large_cache():
  # 1000 sharding objects (more than the C++ identity cache holds before it
  # answers lookups through its filter), each the destination of 3 leaves 1000
  # apart: each is read once, and the groups equal the Python reference.
  shardings = [_CountingSharding((k % 7,)) for k in range(1000)]
  dsts = shardings * 3
  leaves = [np.zeros(k % 5, np.float32) for k in range(len(dsts))]
  kinds = grouping.kinds_table()
  _CountingSharding.reads = 0
  cpp = _grouping.group_leaves(leaves, dsts, kinds, None, "devs")
  assert _CountingSharding.reads == 1000
  py = grouping_twin.group_leaves_py(leaves, dsts, kinds, None, "devs")
  assert _as_tuples(cpp) == _as_tuples(py)
  assert [len(g.indices) for g in cpp] == [429] * 6 + [426]


def test_device_lists_whose_eq_raises():
  class Devs:
    def __hash__(self):
      return 7

    def __eq__(self, other):
      raise ValueError("cannot compare")

  leaves = [_Leaf(_Sharding(Devs())), _Leaf(_Sharding(Devs()))]
  with pytest.raises(
    TypeError, match="source sharding of leaf 1 .* could not be compared"
  ) as info:
    _grouping.group_leaves(
      leaves, [None] * 2, {_Leaf: (1, "sharding", -1)}, None, "devs"
    )
  assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.parametrize(
  "args, error, text",
  [
    ((5, [], {}, None, "devs"), TypeError, "leaves must be a sequence"),
    (([], 5, {}, None, "devs"), TypeError, "dsts must be a sequence"),
    (([1], [], {}, None, "devs"), ValueError, "1 leaves but 0 dsts"),
    (([1], [None], [], None, "devs"), TypeError, "kinds must be a dict"),
    (
      ([1], [None], {1: (0, None, 0)}, None, "devs"),
      TypeError,
      "kinds keys must be types",
    ),
    (
      ([1], [None], {int: (0, 0, 0)}, None, "devs"),
      TypeError,
      "must be a tuple (code: int",
    ),
    (
      ([1], [None], {int: (0, None)}, None, "devs"),
      TypeError,
      "must be a tuple (code: int",
    ),
    (
      ([1], [None], {}, None, "devs"),
      TypeError,
      "destination None and no default_dst",
    ),
    (
      ([1], ["cpu:0"], {}, None, "devs"),
      TypeError,
      "destination of leaf 0 must be a jax.sharding",
    ),
    (
      ([_Leaf(None)], [None], {_Leaf: (1, "sharding", -1)}, None, "devs"),
      TypeError,
      "source sharding of leaf 0",
    ),
    (
      ([_Leaf(None)], [None], {_Leaf: (True, None, -1)}, None, "devs"),
      TypeError,
      "must be a tuple (code: int",
    ),
    (
      ([_Leaf(None)], [None], {_Leaf: (1, b"sharding", -1)}, None, "devs"),
      TypeError,
      "sharding_attr: str or None",
    ),
    (
      ([_Leaf(None)], [None], {_Leaf: (1, "missing", -1)}, None, "devs"),
      TypeError,
      "its .missing cannot be read",
    ),
    (
      (
        [_Leaf(_Sharding([1]))],
        [None],
        {_Leaf: (1, "sharding", -1)},
        None,
        "devs",
      ),
      TypeError,
      "are not hashable",
    ),
    (
      (
        [_Leaf(_Sharding((1,)), "x")],
        [None],
        {_Leaf: (1, "sharding", -1)},
        None,
        "devs",
      ),
      TypeError,
      ".nbytes is not an int: 'x'",
    ),
    (
      (
        [_Leaf(_Sharding((1,)))],
        [None],
        {_Leaf: (1, "sharding", "")},
        None,
        "devs",
      ),
      TypeError,
      "size: could not read .shape and .dtype",
    ),
    (
      (
        [_Shaped([2, 3], np.float32)],
        [None],
        {_Shaped: (1, None, "")},
        _Sharding((1,)),
        "devs",
      ),
      TypeError,
      "size: .shape must be a tuple",
    ),
    (
      (
        [_Shaped((2, -3), np.float32)],
        [None],
        {_Shaped: (1, None, "")},
        _Sharding((1,)),
        "devs",
      ),
      ValueError,
      "size is -3, expected an int in [0, 2**63)",
    ),
    (
      (
        [_Shaped((2**40, 2**40), np.float32)],
        [None],
        {_Shaped: (1, None, "")},
        _Sharding((1,)),
        "devs",
      ),
      ValueError,
      "size overflows int64",
    ),
    (
      (
        [_Shaped((2,), "f4")],
        [None],
        {_Shaped: (1, None, "")},
        _Sharding((1,)),
        "devs",
      ),
      TypeError,
      "size: .dtype has no .itemsize",
    ),
    (
      ([1], [None], {int: (0, None, -2)}, None, "devs"),
      TypeError,
      "must be a tuple (code: int",
    ),
    (
      ([1], [None], {int: (0, None, 1.5)}, None, "devs"),
      TypeError,
      "must be a tuple (code: int",
    ),
    (
      (
        [_Leaf(_Sharding((1,)), -1)],
        [None],
        {_Leaf: (1, "sharding", -1)},
        None,
        "devs",
      ),
      ValueError,
      "expected an int in [0, 2**63)",
    ),
    (
      ([object()], [None], {object: (1, None, -1)}, _Sharding((1,)), "devs"),
      TypeError,
      "has no readable .nbytes",
    ),
  ],
)
def test_bad_input_raises_a_clear_error(args, error, text):
  with pytest.raises(error, match=None) as info:
    _grouping.group_leaves(*args)
  assert text in str(info.value)
  assert "jaxworks.batched_transfer._grouping.group_leaves" in str(info.value)


def test_long_non_ascii_reprs_are_cut_between_characters():
  # The repr is cut to 120 bytes; a cut inside a UTF-8 sequence would make the
  # message itself fail to decode.
  for pad in range(4):
    bad = "x" * pad + "\u00e9" * 100
    with pytest.raises(
      TypeError,
      match="must be a jax.sharding.Sharding, got 'x*\u00e9+\\.\\.\\.",
    ):
      _grouping.group_leaves([1], [bad], {}, None, "devs")


def test_errors_chain_the_original_exception():
  with pytest.raises(TypeError) as info:
    _grouping.group_leaves(
      [_Leaf(None)], [None], {_Leaf: (1, "sharding", -1)}, None, "devs"
    )
  assert isinstance(info.value.__cause__, AttributeError)


def test_no_reference_leaks(devices):
  s = SingleDeviceSharding(devices[0])
  x = jax.device_put(np.ones(3), devices[1])
  host = np.ones(3)
  dl = jax_internals.device_list(s)
  # Including what the C++ caches hold during a call: x's sharding, its device
  # list, its abstract value and dtype.
  held = (
    s,
    x,
    host,
    dl,
    x.sharding,
    jax_internals.device_list(x.sharding),
    x.aval,
    x.dtype,
  )
  before = [sys.getrefcount(o) for o in held]
  for _ in range(200):
    groups = grouping.group_leaves(
      [x, host, x, host], [s, None, None, s], default_dst=s
    )
    del groups
    try:
      _grouping.group_leaves(
        [x, host],
        [s, "bad"],
        grouping.kinds_table(),
        s,
        jax_internals.DEVICE_LIST_ATTR,
      )
    except TypeError:
      pass
  after = [sys.getrefcount(o) for o in held]
  assert after == before


def test_identity_fast_path_survives_mutation_during_the_call():
  # A __eq__ that mutates the input list must not crash the pass (it works on a snapshot).
  class Devs:
    def __init__(self, tag, victim):
      self.tag, self.victim = tag, victim

    def __hash__(self):
      return 1

    def __eq__(self, other):
      self.victim.clear()
      return False

  leaves: list = []
  shardings = [_Sharding(Devs(k, leaves)) for k in range(3)]
  leaves.extend(_Leaf(s) for s in shardings)
  groups = _grouping.group_leaves(
    leaves, [None] * 3, {_Leaf: (1, "sharding", -1)}, None, "devs"
  )
  assert [list(g.indices) for g in groups] == [[0], [1], [2]]


def test_jaxlib_fields_are_loaded_directly(devices):
  # The attributes the pass reads on jax.Arrays and SingleDeviceShardings are
  # fields of jaxlib's objects that the C++ readers learn to load (the getters
  # cost most of a leaf); a jaxlib whose getters stop returning a field fails
  # here, and the pass goes back to the getters.
  xs = [jax.device_put(np.ones(4, np.float32), d) for d in devices]
  assert _grouping._field_read_learnt(jax_internals.ArrayImpl, "_sharding", xs)
  assert _grouping._field_read_learnt(jax_internals.ArrayImpl, "aval", xs)
  shardings = [x.sharding for x in xs]
  for attr in (
    jax_internals.DEVICE_LIST_ATTR,
    jax_internals.MEMORY_KIND_ATTR,
    *jax_internals.DEVICE_KEYS.values(),
  ):
    assert _grouping._field_read_learnt(SingleDeviceSharding, attr, shardings)


class _SlotLeaf:
  """Native getters (operator.attrgetter) over __slots__: the words a FieldReader learns."""

  __slots__ = ("_a", "_b", "nbytes")
  sharding = property(operator.attrgetter("_b"))

  def __init__(self, a, b):
    self._a, self._b, self.nbytes = a, b, 1


def test_field_reads_follow_getattr():
  shardings = [_Sharding((k,)) for k in range(40)]
  leaves = [_SlotLeaf(None, s) for s in shardings]
  assert _grouping._field_read_learnt(_SlotLeaf, "sharding", leaves[:8])
  # Not learnt: too few objects, a getter written in Python, a value that two
  # words hold.
  assert not _grouping._field_read_learnt(_SlotLeaf, "sharding", leaves[:1] * 8)

  class PyGetter:
    __slots__ = ("_b",)
    sharding = property(lambda self: self._b)

    def __init__(self, b):
      self._b = b

  assert not _grouping._field_read_learnt(
    PyGetter, "sharding", [PyGetter(s) for s in shardings]
  )
  both = [_SlotLeaf(s, s) for s in shardings]
  assert not _grouping._field_read_learnt(_SlotLeaf, "sharding", both)
  # Grouping over leaves whose two slots agree for the first 8 leaves, then
  # differ, equals getattr's answer.
  mixed = both[:8] + [_SlotLeaf(shardings[0], s) for s in shardings[8:]]
  kinds = {_SlotLeaf: (1, "sharding", -1)}
  cpp, py = _reference(mixed, [None] * len(mixed), kinds)
  assert cpp == py and len(cpp) == 40
  # A slot left unset after the reads were learnt raises as getattr does.
  empty = _SlotLeaf.__new__(_SlotLeaf)
  empty.nbytes = 1
  with pytest.raises(TypeError, match="cannot be read") as info:
    _grouping.group_leaves(leaves + [empty], [None] * 41, kinds, None, "devs")
  assert isinstance(info.value.__cause__, AttributeError)


class _SwappingDevs(_CountingSharding):
  """A sharding whose device-list read, the tenth of its class, replaces _SlotLeaf.sharding."""

  @property
  def devs(self):
    devs = super().devs
    if type(self).reads == 10:
      _SlotLeaf.sharding = property(operator.attrgetter("_a"))
    return devs


def test_a_native_getter_replaced_after_its_field_was_learnt():
  # The readers have loaded the field for 9 leaves when the property is
  # replaced: the leaves after it are read through the new property.
  def run(group):
    _SwappingDevs.reads = 0
    _SlotLeaf.sharding = property(operator.attrgetter("_b"))
    leaves = [
      _SlotLeaf(_Sharding(("a",)), _SwappingDevs((k,))) for k in range(20)
    ]
    try:
      return group(
        leaves, [None] * 20, {_SlotLeaf: (1, "sharding", -1)}, None, "devs"
      )
    finally:
      _SlotLeaf.sharding = property(operator.attrgetter("_b"))

  cpp = _as_tuples(run(_grouping.group_leaves))
  py = run(grouping_twin.group_leaves_py)
  assert cpp == _as_tuples(py)
  assert [g[1] for g in cpp] == [(k,) for k in range(10)] + [("a",)]


def test_single_device_shardings_are_grouped_by_their_device(devices):
  # A new SingleDeviceSharding object per leaf (as jax.device_put makes them),
  # over 4 devices and two memory kinds: the C++ pass compares device lists by
  # the sharding's device (DEVICE_KEYS); the groups equal the Python reference,
  # which compares the device lists themselves.
  rng = np.random.default_rng(0)
  leaves, dsts = [], []
  for k in rng.integers(0, 8, 300):
    kind = "pinned_host" if k >= 4 else "device"
    leaves.append(
      jax.device_put(
        np.ones(2, np.float32),
        SingleDeviceSharding(devices[k % 4], memory_kind=kind),
      )
    )
    dsts.append(SingleDeviceSharding(devices[(k + 1) % 4]) if k % 2 else None)
  cpp = grouping.group_leaves(leaves, dsts, None)
  py = grouping_twin.group_leaves_python(leaves, dsts, None)
  assert _as_tuples(cpp) == _as_tuples(py)
  assert len({g.src_devices for g in cpp}) == 4
  assert {g.src_memory_kind for g in cpp} == {"device", "pinned_host"}


@pytest.mark.parametrize(
  "device_keys, text",
  [
    ([SingleDeviceSharding], "device_keys must be a dict"),
    ({SingleDeviceSharding: 3}, r"device_keys\[.*\] must be an attribute name"),
  ],
)
def test_bad_device_keys(devices, device_keys, text):
  x = jax.device_put(np.ones(2), devices[0])
  with pytest.raises(TypeError, match=text):
    _grouping.group_leaves(
      [x], [None], grouping.kinds_table(), None, *grouping.ATTRS, device_keys
    )


class _NbytesArray(np.ndarray):
  @property
  def nbytes(self):
    return 99


def test_numpy_byte_counts_come_from_the_array_unless_nbytes_is_overridden(
  tmp_path,
):
  plain = np.zeros((3, 5), np.float64)
  mm = np.memmap(tmp_path / "m", np.int16, "w+", shape=(7,))
  odd = np.zeros(4, np.float32).view(_NbytesArray)
  kinds = {
    np.ndarray: (0, None, -1),
    np.memmap: (1, None, -1),
    _NbytesArray: (2, None, -1),
  }
  leaves = [plain, mm, odd, plain[:, ::2], np.zeros((), np.complex64)]
  groups = _grouping.group_leaves(
    leaves, [None] * 5, kinds, _Sharding(("d",)), "devs"
  )
  assert [(g.kind, g.nbytes) for g in groups] == [
    (0, plain.nbytes + plain[:, ::2].nbytes + 8),
    (1, 14),
    (2, 99),
  ]


def test_every_kinds_entry_is_checked_even_when_no_leaf_has_its_type():
  # The readers of a kind are made when a leaf of its type is first met; the
  # entries themselves are all checked first.
  with pytest.raises(
    TypeError, match=r"kinds\[<class 'int'>\] must be a tuple"
  ):
    _grouping.group_leaves(
      [1.0],
      [None],
      {float: (0, None, 8), int: (0, None, 1.5)},
      _Sharding(("d",)),
      "devs",
    )
  groups = _grouping.group_leaves(
    [1.0, 2],
    [None, None],
    {float: (0, None, 8), int: (1, None, 3)},
    _Sharding(("d",)),
    "devs",
  )
  assert [(g.kind, g.nbytes) for g in groups] == [(0, 8), (1, 3)]
