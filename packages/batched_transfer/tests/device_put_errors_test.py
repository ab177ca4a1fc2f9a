"""device_put raises the exception classes stock jax.device_put raises.

A differential list of bad inputs: leaves of types JAX does not hold, shapes
a sharding cannot split (over Explicit, Auto and mixed mesh axes), specs of
the wrong rank, targets, prefixes and flags stock rejects.
"""

import functools

import jax
from jax.experimental.layout import Format
from jax.experimental.layout import Layout
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding
import jaxworks_testing as jwt
import numpy as np
import pytest

from jaxworks import batched_transfer as bt

stock = jax.device_put  # bound at import: stock JAX's, never swapped here


# Meshes over the devices present (8 host devices on the CPU target, where
# 7 rows do not split; one chip on a TPU machine, where each case is still
# compared with what stock does there), made when a case asks.
def _dev(i):
  devices = jax.devices()
  return devices[i % len(devices)]


@functools.cache
def _explicit():
  n = len(jax.devices())
  return jax.make_mesh((n,), ("x",), axis_types=(AxisType.Explicit,))


@functools.cache
def _auto():
  return Mesh(np.array(jax.devices()), ("x",))  # Auto axes


@functools.cache
def _mixed():
  n = len(jax.devices())
  return jax.make_mesh(
    (min(2, n), n // min(2, n)),
    ("a", "b"),
    axis_types=(AxisType.Explicit, AxisType.Auto),
  )


@functools.cache
def _one():
  # A mesh (1, 1) of the first device: what a machine with one chip has,
  # on every device count.
  return jax.make_mesh(
    (1, 1),
    ("a", "b"),
    axis_types=(AxisType.Explicit, AxisType.Auto),
    devices=jax.devices()[:1],
  )


@functools.cache
def _half():
  devices = jax.devices()
  return Mesh(np.array(devices[len(devices) // 2 :]), ("x",))


def f32(*shape):
  return np.ones(shape, np.float32)


def on(mesh, *spec):
  return NamedSharding(mesh, P(*spec))


def deleted():
  x = jax.numpy.ones(3)
  x.delete()
  return x


# name -> () -> (value, target, keyword arguments)
CASES = {
  # Leaves of types JAX does not hold.
  "longdouble": lambda: (np.ones(3, np.longdouble), None, {}),
  "longdouble->device": lambda: (np.ones(3, np.longdouble), _dev(1), {}),
  "longdouble->sharding": lambda: (
    np.ones(8, np.longdouble),
    on(_explicit(), "x"),
    {},
  ),
  "complex256": lambda: (np.ones(3, np.clongdouble), None, {}),
  "timedelta64": lambda: (np.ones(3, "timedelta64[s]"), _dev(2), {}),
  "datetime64": lambda: (np.zeros(3, "datetime64[D]"), None, {}),
  "object": lambda: (np.array([object()] * 3), None, {}),
  "object->device": lambda: (np.array([1, 2], dtype=object), _dev(1), {}),
  "str": lambda: (np.array(["a", "b"]), None, {}),
  "bytes": lambda: (np.array([b"a", b"b"]), _dev(0), {}),
  "void": lambda: (np.zeros(3, "V4"), None, {}),
  "structured": lambda: (np.zeros(3, [("a", "i4")]), None, {}),
  "big-endian": lambda: (np.ones(3, ">f4"), _dev(1), {}),
  "python str": lambda: ("abc", None, {}),
  "python object": lambda: (object(), None, {}),
  "python int too big": lambda: (2**70, None, {}),
  "one bad leaf among good": lambda: (
    [f32(3), np.ones(3, np.longdouble), f32(2)],
    _dev(1),
    {},
  ),
  "bad leaf and bad sharding": lambda: (
    [f32(7), np.ones(3, np.longdouble)],
    on(_explicit(), "x"),
    {},
  ),
  # Shapes a sharding cannot split.
  "indivisible, explicit": lambda: (f32(7), on(_explicit(), "x"), {}),
  "indivisible, auto": lambda: (f32(7), on(_auto(), "x"), {}),
  "indivisible, auto, device array": lambda: (
    jax.numpy.ones(7),
    on(_auto(), "x"),
    {},
  ),
  "indivisible, auto, committed elsewhere": lambda: (
    jax.device_put(f32(7), _dev(3)),
    on(_auto(), "x"),
    {},
  ),
  "indivisible, explicit, device array": lambda: (
    jax.numpy.ones(7),
    on(_explicit(), "x"),
    {},
  ),
  "indivisible, mixed, explicit axis": lambda: (
    f32(3, 4),
    on(_mixed(), "a", "b"),
    {},
  ),
  "indivisible, mixed, auto axis": lambda: (
    f32(2, 6),
    on(_mixed(), "a", "b"),
    {},
  ),
  "indivisible, mixed, tuple": lambda: (f32(4), on(_mixed(), ("a", "b")), {}),
  "indivisible, fewer devices": lambda: (f32(6), on(_half(), "x"), {}),
  "indivisible, second leaf": lambda: (
    {"a": f32(8), "b": f32(9)},
    on(_auto(), "x"),
    {},
  ),
  "indivisible, int4": lambda: (
    np.ones(7, jax.numpy.int4),
    on(_auto(), "x"),
    {},
  ),
  # Specs of the wrong rank.
  "rank, explicit": lambda: (f32(8), on(_mixed(), "a", "b"), {}),
  "rank, auto": lambda: (f32(8), on(_auto(), None, "x"), {}),
  "rank 0": lambda: (np.float32(1), on(_explicit(), "x"), {}),
  "rank, device array": lambda: (jax.numpy.ones(8), on(_mixed(), "a", "b"), {}),
  # From one device to a sharding over it alone (which jaxworks copied
  # there without checking the spec).
  "rank, device array to one device": lambda: (
    jax.numpy.ones(8),
    on(_one(), "a", "b"),
    {},
  ),
  "rank, committed array to one device": lambda: (
    jax.device_put(f32(8), _dev(0)),
    on(_one(), None, "b"),
    {},
  ),
  "rank, donated array to one device": lambda: (
    jax.device_put(f32(8), _dev(0)),
    on(_one(), "a", "b"),
    {"donate": True},
  ),
  "rank 0, device array to one device": lambda: (
    jax.numpy.float32(1),
    on(_one(), "a"),
    {},
  ),
  # Targets, prefixes and flags.
  "target str": lambda: (f32(3), "cpu", {}),
  "target int": lambda: (f32(3), 3, {}),
  "target prefix": lambda: ({"a": f32(3)}, [_dev(0)], {}),
  "abstract mesh": lambda: (
    f32(8),
    NamedSharding(_explicit().abstract_mesh, P("x")),
    {},
  ),
  "layout of another rank": lambda: (
    f32(2, 3),
    Format(Layout((0,)), SingleDeviceSharding(_dev(0))),
    {},
  ),
  "donate and may_alias": lambda: (
    f32(3),
    _dev(0),
    {"donate": True, "may_alias": True},
  ),
  "deleted array": lambda: (deleted(), _dev(1), {}),
  # Not errors: both must succeed.
  "divisible, auto": lambda: (f32(8, 2), on(_auto(), "x"), {}),
  "fewer devices": lambda: (f32(8), on(_half(), "x"), {}),
  "int4 divisible": lambda: (np.ones(8, jax.numpy.int4), on(_auto(), "x"), {}),
}

# Where this package raises a subclass of stock's class, on purpose: the
# message names the API, the leaf and the fix (the public PlacementError is a
# ValueError; the public SpecRankError is a PlacementError and an
# AssertionError).
SUBCLASSES_OK = {"PlacementError", "SpecRankError"}


def outcome(fn, value, target, kwargs):
  try:
    return jax.block_until_ready(fn(value, target, **kwargs))
  except Exception as err:  # compared with stock's below
    return err


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_exception_class_as_stock(name):
  want = outcome(stock, *CASES[name]())
  got = outcome(bt.device_put, *CASES[name]())
  if not isinstance(want, Exception):
    assert not isinstance(got, Exception), got
    for y, x in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      assert y.sharding == x.sharding
      np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    return
  assert isinstance(got, Exception), f"stock raised {want!r}; got {got!r}"
  assert isinstance(got, type(want)), (want, got)
  if type(got).__name__ not in SUBCLASSES_OK:
    assert type(got) is type(want), (want, got)
  # A class the user can import: a builtin, stock's own, or a public one.
  cls = type(got)
  assert (
    cls.__module__ == "builtins"
    or cls is type(want)
    or getattr(bt, cls.__name__, None) is cls
  ), cls


def test_longdouble_and_indivisible_raise_stock_classes():
  bad = np.ones(3, np.longdouble)
  with pytest.raises(TypeError) as info:
    bt.device_put(bad)
  assert type(info.value) is TypeError
  assert str(info.value).startswith(
    "jaxworks.batched_transfer.device_put: the leaf at <root>"
  )
  jwt.require_devices(2)  # 7 rows split over one device
  indivisible = type(outcome(stock, f32(7), on(_auto(), "x"), {}))
  assert indivisible is not ValueError and issubclass(indivisible, ValueError)
  with pytest.raises(indivisible, match=r"device_put: cannot place the leaf"):
    bt.device_put(f32(7), on(_auto(), "x"))
  with pytest.raises(ValueError) as info:
    bt.device_put(f32(7), on(_explicit(), "x"))
  assert type(info.value) is ValueError
