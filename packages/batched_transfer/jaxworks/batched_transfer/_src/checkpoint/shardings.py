"""The shardings of saved arrays, in the record: what ``metadata`` reports.

A ``NamedSharding`` is recorded as its mesh (axis names, shape, axis types,
device ids in mesh order), its PartitionSpec and memory kind; a
``SingleDeviceSharding`` as its device id and memory kind. Other shardings
are not recorded. ``rebuild`` makes the sharding again where every device
it names is one of this process's job (``jax.devices()``), else None.

>>> import jax
>>> from jax.sharding import NamedSharding, PartitionSpec as P
>>> s = NamedSharding(jax.make_mesh((4, 2), ("a", "b")), P("a", None))
>>> rebuild(describe(s)) == s
True
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from jax.sharding import SingleDeviceSharding
import numpy as np


def _spec_entry(e: Any) -> Any:
  if e is None or isinstance(e, str):
    return e
  if isinstance(e, tuple) and all(isinstance(x, str) for x in e):
    return list(e)
  raise TypeError(e)


def describe(sharding: Any) -> dict[str, Any] | None:
  """The JSON record of ``sharding``, or None for a kind not recorded."""
  try:
    if isinstance(sharding, SingleDeviceSharding):
      device: Any = next(iter(sharding.device_set))
      return {"device": int(device.id), "memory_kind": sharding.memory_kind}
    if isinstance(sharding, NamedSharding):
      mesh, spec = sharding.mesh, sharding.spec
      if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
        return None
      return {
        "mesh": {
          "axis_names": list(mesh.axis_names),
          "shape": [int(n) for n in mesh.devices.shape],
          "axis_types": [t.name for t in mesh.axis_types],
          "devices": [int(d.id) for d in mesh.devices.flat],
        },
        "spec": [_spec_entry(e) for e in spec],
        "memory_kind": sharding.memory_kind,
      }
  except (TypeError, AttributeError, ValueError):
    return None
  return None


def rebuild(desc: Any) -> Any:
  """The sharding ``desc`` records, on this job's devices; None where a
  device is missing or the record is not one ``describe`` writes."""
  try:
    by_id = {d.id: d for d in jax.devices()}
    if "device" in desc:
      return SingleDeviceSharding(
        by_id[desc["device"]], memory_kind=desc.get("memory_kind")
      )
    m = desc["mesh"]
    devices = np.array([by_id[i] for i in m["devices"]], dtype=object)
    mesh = jax.sharding.Mesh(
      devices.reshape(m["shape"]),
      tuple(m["axis_names"]),
      axis_types=tuple(jax.sharding.AxisType[t] for t in m["axis_types"]),
    )
    spec = PartitionSpec(
      *(tuple(e) if isinstance(e, list) else e for e in desc["spec"])
    )
    return NamedSharding(mesh, spec, memory_kind=desc.get("memory_kind"))
  except (KeyError, TypeError, ValueError, AttributeError):
    return None
