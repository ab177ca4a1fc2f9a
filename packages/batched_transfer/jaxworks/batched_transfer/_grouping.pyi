"""Typed stub of the C++ extension jaxworks.batched_transfer._grouping (cc/grouping.h)."""

from collections.abc import Sequence
from typing import Any

OTHER_KIND: int

class Group:
  """Leaves that move in one batched call."""

  @property
  def kind(self) -> int: ...
  @property
  def src_devices(self) -> Any: ...
  @property
  def dst_devices(self) -> Any: ...
  @property
  def src_memory_kind(self) -> Any: ...
  @property
  def dst_memory_kind(self) -> Any: ...
  @property
  def indices(self) -> list[int]: ...
  @property
  def nbytes(self) -> int: ...

def group_leaves(
  leaves: Sequence[Any],
  dsts: Sequence[Any],
  kinds: dict[type, tuple[int, str | None, int | str]],
  default_dst: Any,
  devices_attr: str,
  memory_kind_attr: str = "memory_kind",
  device_keys: dict[type, str] | None = None,
) -> list[Group]:
  """Groups leaf indices by (source devices, destination devices, source memory kind,
  destination memory kind, leaf kind), in stable order, with byte counts."""

def _field_read_learnt(type: type, name: str, objects: list[Any]) -> bool:
  """For tests: whether one C++ field reader, after reading `name` of each object (each
  read checked against getattr), loads the attribute's word directly."""
