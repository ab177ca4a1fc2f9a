"""TransferPlan: what a device_put would do, computed without moving anything."""

from __future__ import annotations

import dataclasses
from typing import Any

from . import grouping
from . import jax_internals
from . import transfer
from .targets import Request

_ROUTE_TEXT = {
  transfer.ALIAS: "already in place",
  transfer.HOST: "host->device",
  transfer.COPY: "batched copy",
  transfer.JAX: "jax.device_put",
}


def format_bytes(n: int) -> str:
  """A byte count for people.

  >>> format_bytes(512), format_bytes(1536), format_bytes(3 * 2**30)
  ('512 B', '1.5 KiB', '3.0 GiB')
  """
  size = float(n)
  for unit in ("B", "KiB", "MiB"):
    if size < 1024:
      return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
    size /= 1024
  return f"{size:.1f} GiB"


def _device_ids(devices: Any) -> tuple[int, ...] | None:
  return None if devices is None else tuple(d.id for d in devices)


def _ids_text(ids: tuple[int, ...] | None, memory_kind: str | None) -> str:
  """Device ids as runs.

  >>> _ids_text((0, 1, 2, 3, 6), "device"), _ids_text(None, None)
  ('[0-3,6] device', 'host')
  """
  if ids is None:
    return "host"
  runs, start = [], 0
  for k in range(1, len(ids) + 1):
    if k == len(ids) or ids[k] != ids[k - 1] + 1:
      runs.append(
        str(ids[start]) if k - start == 1 else f"{ids[start]}-{ids[k - 1]}"
      )
      start = k
  return f"[{','.join(runs)}]" + (f" {memory_kind}" if memory_kind else "")


@dataclasses.dataclass(frozen=True)
class PlannedGroup:
  """Leaves that move together in one batched call.

  Attributes:
    kind: the kind of leaf ("numpy", "jax.Array", "scalar", "numpy scalar", "other").
    route: "host->device", "batched copy", "already in place" or "jax.device_put".
    src_devices: ids of the source devices in device-list order, None for host values.
    dst_devices: ids of the destination devices in device-list order.
    src_memory_kind: memory kind of the sources (None for host values).
    dst_memory_kind: memory kind of the destinations.
    paths: tree paths of the leaves (keystr form), in leaf order.
    nbytes: bytes of the leaves, as they are now.
    zero_copy: leaves whose result reuses the input's buffers.
    relayouts: leaves that get a layout change after placement.
  """

  kind: str
  route: str
  src_devices: tuple[int, ...] | None
  dst_devices: tuple[int, ...] | None
  src_memory_kind: str | None
  dst_memory_kind: str | None
  paths: tuple[str, ...]
  nbytes: int
  zero_copy: int
  relayouts: int

  @property
  def num_leaves(self) -> int:
    return len(self.paths)

  @property
  def copies(self) -> int:
    return self.num_leaves - self.zero_copy


@dataclasses.dataclass(frozen=True)
class TransferPlan:
  """The groups a device_put would make, in order, and what each costs.

  str() gives a table, one row per group.
  """

  groups: tuple[PlannedGroup, ...]

  @property
  def num_leaves(self) -> int:
    return sum(g.num_leaves for g in self.groups)

  @property
  def nbytes(self) -> int:
    return sum(g.nbytes for g in self.groups)

  @property
  def zero_copy(self) -> int:
    return sum(g.zero_copy for g in self.groups)

  @property
  def copies(self) -> int:
    return sum(g.copies for g in self.groups)

  def __str__(self) -> str:
    head = (
      f"TransferPlan: {self.num_leaves} leaves in {len(self.groups)} groups, "
      f"{format_bytes(self.nbytes)}; {self.copies} copied, {self.zero_copy} zero-copy"
    )
    rows = [
      "# kind route leaves bytes zero-copy relayout".split() + ["from -> to"]
    ]
    for k, g in enumerate(self.groups):
      rows.append([
        str(k), g.kind, g.route, str(g.num_leaves), format_bytes(g.nbytes),
        str(g.zero_copy), str(g.relayouts),
        f"{_ids_text(g.src_devices, g.src_memory_kind)} -> "
        f"{_ids_text(g.dst_devices, g.dst_memory_kind)}",
      ])  # fmt: skip
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = [head]
    for r in rows:
      cells = (
        cell.rjust(w) if c in (0, 3, 4, 5, 6) else cell.ljust(w)
        for c, (cell, w) in enumerate(zip(r, widths))
      )
      lines.append(("  " + "  ".join(cells)).rstrip())
    return "\n".join(lines)


def build_plan(req: Request, batches: list[transfer.Batch]) -> TransferPlan:
  planned = []
  for b in batches:
    g = b.group
    nbytes = _batch_bytes(req, b)
    if b.route == transfer.ALIAS:
      zero = len(b.indices)
    elif (
      b.route == transfer.COPY
      and g.src_devices == g.dst_devices
      and (g.src_memory_kind == g.dst_memory_kind)
    ):
      relayout = set(b.relayout)
      zero = sum(
        1
        for i in b.indices
        if req.semantics[i] != jax_internals.ArrayCopySemantics.ALWAYS_COPY
        and i not in relayout
      )
    else:
      zero = 0
    planned.append(
      PlannedGroup(
        kind=grouping.KIND_NAMES.get(g.kind, "other"),
        route=_ROUTE_TEXT[b.route],
        src_devices=_device_ids(g.src_devices),
        dst_devices=_device_ids(g.dst_devices),
        src_memory_kind=g.src_memory_kind,
        dst_memory_kind=g.dst_memory_kind,
        paths=tuple(req.path(i) for i in b.indices),
        nbytes=nbytes,
        zero_copy=zero,
        relayouts=len(b.relayout),
      )
    )
  return TransferPlan(tuple(planned))


def _batch_bytes(req: Request, b: transfer.Batch) -> int:
  if len(b.indices) == len(b.group.indices):
    return int(b.group.nbytes)
  groups = grouping.group_leaves(
    [req.leaves[i] for i in b.indices],
    [req.dsts[i] for i in b.indices],
    req.default_dst,
  )
  return sum(g.nbytes for g in groups)
