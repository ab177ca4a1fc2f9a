"""Grouping of leaves into batches: the C++ pass and its pure-Python twin.

A leaf's group is the tuple (source devices, destination devices, source memory
kind, destination memory kind, kind of leaf). ``group_leaves`` computes all
groups in one C++ pass (see cc/grouping.h); ``group_leaves_py`` is the same
algorithm in Python, kept as the reference the tests compare against and the
baseline of the benchmark.

>>> import numpy as np, jax
>>> from jax.sharding import SingleDeviceSharding
>>> s0, s1 = (SingleDeviceSharding(d) for d in jax.devices()[:2])
>>> leaves = [np.zeros(4, np.float32), np.zeros(2, np.float32), 1.0]
>>> groups = group_leaves(leaves, [s0, s1, s0], default_dst=s0)
>>> [(KIND_NAMES[g.kind], list(g.indices), g.nbytes) for g in groups]
[('numpy', [0], 16), ('numpy', [1], 8), ('scalar', [2], 4)]
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from .. import _grouping
from . import jax_internals

# Kinds of leaves (the last component of a group key).
HOST_ARRAY = 0  # numpy.ndarray / numpy.memmap
DEVICE_ARRAY = 1  # jax.Array
PY_SCALAR = 2  # bool, int, float, complex
NP_SCALAR = 3  # numpy scalar (numpy.float32(1.0), ...)
OTHER = _grouping.OTHER_KIND  # anything else: handed to jax.device_put as is

KIND_NAMES = {
  HOST_ARRAY: "numpy",
  DEVICE_ARRAY: "jax.Array",
  PY_SCALAR: "scalar",
  NP_SCALAR: "numpy scalar",
  OTHER: "other",
}

# How a kind counts bytes: an int >= 0 (fixed), -1 (leaf.nbytes), or an
# attribute name whose value has .shape and .dtype ("" for the leaf itself).
SizeRule = int | str
# type -> (kind, attribute holding the source sharding or None for host kinds, size rule)
KindsTable = dict[type, tuple[int, str | None, SizeRule]]
_KINDS_CACHE: dict[bool, KindsTable] = {}
# The attributes of a Sharding the grouping reads: device list, memory kind.
_ATTRS = (jax_internals.DEVICE_LIST_ATTR, jax_internals.MEMORY_KIND_ATTR)


def kinds_table(x64: bool | None = None) -> KindsTable:
  """The exact-type table given to the C++ pass.

  numpy arrays count ``.nbytes``; jax.Arrays have their source sharding read and
  count prod(shape) * itemsize of their abstract value (cheaper than
  jax.Array.nbytes); Python scalars take the size of the dtype JAX gives them
  (which depends on jax_enable_x64).
  """
  if x64 is None:
    x64 = jax_internals.enable_x64()
  table = _KINDS_CACHE.get(x64)
  if table is None:
    wide = 8 if x64 else 4
    table = {
      np.ndarray: (HOST_ARRAY, None, -1),
      np.memmap: (HOST_ARRAY, None, -1),
      jax_internals.ArrayImpl: (
        DEVICE_ARRAY,
        jax_internals.SHARDING_ATTR,
        jax_internals.ABSTRACT_VALUE_ATTR,
      ),
      bool: (PY_SCALAR, None, 1),
      int: (PY_SCALAR, None, wide),
      float: (PY_SCALAR, None, wide),
      complex: (PY_SCALAR, None, 2 * wide),
    }
    scalar_types = set(np.sctypeDict.values()) | {jnp.bfloat16.dtype.type}
    for t in scalar_types:
      if isinstance(t, type) and issubclass(t, np.generic):
        table[t] = (NP_SCALAR, None, -1)
    _KINDS_CACHE[x64] = table
  return table


def group_leaves(
  leaves: Sequence[Any], dsts: Sequence[Any], default_dst: Any = None
) -> list[Any]:
  """Groups leaf indices in C++; see the module docstring.

  Args:
    leaves: the flat leaves of a pytree.
    dsts: one destination Sharding (or None) per leaf.
    default_dst: the Sharding for host leaves whose destination is None.

  Returns:
    A list of ``_grouping.Group`` (kind, src_devices, dst_devices,
    src_memory_kind, dst_memory_kind, indices, nbytes), by first appearance.
  """
  return _grouping.group_leaves(
    leaves, dsts, kinds_table(), default_dst, *_ATTRS
  )


@dataclasses.dataclass
class PyGroup:
  """The pure-Python counterpart of ``_grouping.Group``."""

  kind: int
  src_devices: Any
  dst_devices: Any
  src_memory_kind: Any
  dst_memory_kind: Any
  indices: list[int]
  nbytes: int


def group_leaves_py(
  leaves: Sequence[Any],
  dsts: Sequence[Any],
  kinds: KindsTable,
  default_dst: Any,
  devices_attr: str,
  memory_kind_attr: str = "memory_kind",
) -> list[PyGroup]:
  """The reference implementation of ``_grouping.group_leaves``: the straightforward Python loop."""
  if len(leaves) != len(dsts):
    raise ValueError(f"got {len(leaves)} leaves but {len(dsts)} dsts")

  def placement(sharding):
    mk = getattr(sharding, memory_kind_attr, None)
    if mk is None and not hasattr(sharding, memory_kind_attr):
      mk = sharding.memory_kind
    return getattr(sharding, devices_attr), mk

  groups: dict[tuple[Any, ...], PyGroup] = {}
  for i, (leaf, dst) in enumerate(zip(leaves, dsts)):
    kind, sharding_attr, size = kinds.get(type(leaf), (OTHER, None, 0))
    if sharding_attr is not None:
      src_devices, src_mk = placement(getattr(leaf, sharding_attr))
    else:
      src_devices = src_mk = None
    if dst is None:
      if sharding_attr is not None:
        dst_devices, dst_mk = src_devices, src_mk
      else:
        if default_dst is None:
          raise TypeError(
            f"leaf {i} is a host value with destination None and no default_dst"
          )
        dst_devices, dst_mk = placement(default_dst)
    else:
      dst_devices, dst_mk = placement(dst)
    key = (src_devices, dst_devices, src_mk, dst_mk, kind)
    group = groups.get(key)
    if group is None:
      group = groups[key] = PyGroup(
        kind, src_devices, dst_devices, src_mk, dst_mk, [], 0
      )
    group.indices.append(i)
    group.nbytes += _size(leaf, size)
  return list(groups.values())


def _size(leaf: Any, rule: SizeRule) -> int:
  if isinstance(rule, str):
    holder = getattr(leaf, rule) if rule else leaf
    return math.prod(holder.shape) * holder.dtype.itemsize
  return rule if rule >= 0 else int(leaf.nbytes)


def group_leaves_python(
  leaves: Sequence[Any], dsts: Sequence[Any], default_dst: Any = None
) -> list[PyGroup]:
  """``group_leaves`` with the pure-Python implementation (for tests and benchmarks)."""
  return group_leaves_py(leaves, dsts, kinds_table(), default_dst, *_ATTRS)
