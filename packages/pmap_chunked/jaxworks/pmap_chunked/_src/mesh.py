"""Devices and meshes for pmap, and the stack of pmaps being traced.

A top-level pmap runs on a mesh whose first axis is its own axis name. A pmap
called while another one is tracing its body (a nested pmap) does not make a
mesh of its own: it runs over one more axis of the outer pmap's mesh. When that
axis is missing, the nested pmap raises ``NeedsAxis``; the top-level pmap catches
it, adds the axis to its mesh (a 2-D mesh for two levels) and traces again.
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import functools
import threading
from typing import Any

import jax
from jax.sharding import AxisType
from jax.sharding import Mesh
import numpy as np

API = "jaxworks.pmap_chunked.pmap"

# Bound at import (see pmap.py): later reassignments of jax.* do not reach us.
_devices = jax.devices


@functools.lru_cache(maxsize=256)
def make_mesh(devices: tuple, shape: tuple[int, ...], names: tuple) -> Mesh:
  """A Mesh with Auto axis types (cached: equal meshes are the same object)."""
  array = np.empty(len(devices), dtype=object)
  array[:] = devices
  return Mesh(
    array.reshape(shape), names, axis_types=(AxisType.Auto,) * len(names)
  )


def select_devices(
  devices: tuple | None, total: int, backend: str | None = None
) -> tuple:
  """The ``total`` devices a (possibly nested) pmap of that global size uses."""
  if devices is not None:
    if len(devices) != total:
      raise ValueError(
        f"{API}: the mapped axis size is {total} but devices= lists "
        f"{len(devices)} devices; the mapped size (times the sizes of nested "
        f"pmaps) must equal len(devices). Pass {total} devices or resize the "
        "mapped axis."
      )
    return devices
  try:
    available = _devices(backend)
  except RuntimeError as e:
    raise RuntimeError(
      f"{API}: backend={backend!r} has no devices here ({e}); pass "
      "backend=None for the default backend, or one of the available "
      "ones."
    ) from None
  # Those of process 0 first, then 1, ...: a stable sort keeps each
  # process's devices in their order.
  available = sorted(available, key=lambda d: d.process_index)
  if total > len(available):
    raise ValueError(
      f"{API}: the mapped axis needs {total} devices but only "
      f"{len(available)} are available (jax.device_count()); use a mapped "
      f"size of at most {len(available)}, or split the data into chunks."
    )
  return tuple(available[:total])


class OptionTypeError(TypeError, AttributeError):
  """A pmap option of a type it cannot use (a device list holding other
  objects, a backend that is not a name).

  A ``TypeError``, and an ``AttributeError`` as ``jax.pmap`` raises when it
  reads such a value (``'int' object has no attribute 'process_index'``).
  """


def pmap_devices(api: str, devices: Any) -> tuple:
  """pmap's ``devices=`` read as ``jax.pmap`` reads it (its truth value,
  then ``tuple(devices)``: any iterable), as a tuple of distinct devices."""
  try:
    empty = not devices
  except ValueError as e:  # a numpy array: no truth value (as in jax.pmap)
    raise ValueError(
      f"{api}: devices={devices!r} has no truth value ({e}); jax.pmap "
      "raises this ValueError too. Pass a list of devices, e.g. "
      "list(devices.flat) for a numpy array of them."
    ) from None
  if empty:
    raise ValueError(
      f"{api}: 'devices' argument to {api.rpartition('.')[2]} must be "
      f"non-empty, or None. Got {devices!r}; pass a non-empty sequence of "
      "devices, e.g. jax.devices()[:4]."
    )
  try:
    devices = tuple(devices)
  except TypeError:
    raise TypeError(
      f"{api}: devices must be an iterable of jax devices, got "
      f"{devices!r}; pass e.g. jax.devices()[:4]."
    ) from None
  bad = [d for d in devices if not isinstance(d, jax.Device)]
  if bad:
    raise OptionTypeError(
      f"{api}: devices must hold jax.Device objects, got "
      f"{bad[0]!r}; pass e.g. jax.devices()[:4]."
    )
  return _distinct(api, devices)


def _distinct(api: str, devices: tuple) -> tuple:
  if len(set(devices)) != len(devices):
    raise ValueError(
      f"{api}: devices lists a device more than once "
      f"({list(devices)}); each device may appear only once."
    )
  return devices


def check_devices(api: str, devices: Any) -> tuple:
  """A tuple of distinct jax devices, or an error saying what to pass."""
  if isinstance(devices, jax.Device) or not isinstance(devices, Sequence):
    raise TypeError(
      f"{api}: devices must be a sequence of jax devices, got "
      f"{devices!r}; pass e.g. jax.devices()[:4]."
    )
  devices = tuple(devices)
  if not devices:
    raise ValueError(
      f"{api}: 'devices' argument to {api.rpartition('.')[2]} must be "
      f"non-empty, or None. Got {devices!r}; pass a non-empty sequence of "
      "devices, e.g. jax.devices()[:4]."
    )
  bad = [d for d in devices if not isinstance(d, jax.Device)]
  if bad:
    raise TypeError(
      f"{api}: devices must hold jax.Device objects, got "
      f"{bad[0]!r}; pass e.g. jax.devices()[:4]."
    )
  return _distinct(api, devices)


@dataclasses.dataclass(frozen=True)
class Frame:
  """One pmap whose body is being traced."""

  axis_name: Any
  size: int
  mesh: Mesh


class NeedsAxis(Exception):
  """Raised by a nested pmap whose axis the enclosing mesh does not have yet."""

  def __init__(self, axis_name: Any, size: int):
    super().__init__(
      f"{API}: nested pmap over axis {axis_name!r} (size {size}) needs the "
      "outer pmap to add that axis to its mesh"
    )
    self.axis_name = axis_name
    self.size = size


_state = threading.local()


def frames() -> list[Frame]:
  """The pmaps whose bodies are being traced on this thread, outermost first."""
  stack = getattr(_state, "frames", None)
  if stack is None:
    stack = _state.frames = []
  return stack
