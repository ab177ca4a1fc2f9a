"""The pure-Python twin of the C++ grouping pass (``_grouping.group_leaves``):
the straightforward loop, the reference the grouping tests compare against
and the baseline of batched_transfer_bench's grouping rows. It lives here,
not in the package: it ships in no wheel.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import math
from typing import Any

from jaxworks.batched_transfer._src import grouping
from jaxworks.batched_transfer._src.grouping import OTHER
from jaxworks.batched_transfer._src.grouping import KindsTable
from jaxworks.batched_transfer._src.grouping import SizeRule


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
  return group_leaves_py(
    leaves, dsts, grouping.kinds_table(), default_dst, *grouping.ATTRS
  )
