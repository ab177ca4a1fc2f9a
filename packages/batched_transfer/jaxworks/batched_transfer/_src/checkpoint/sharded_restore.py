"""Restore of a checkpoint that several processes wrote (it has a manifest).

Each array is built with ``jax.make_array_from_callback``: each process
reads, for each of its devices, only the parts of the shard files that
overlap that device's slice (through a read-only memory map of each file).
"""

from __future__ import annotations

from collections.abc import Callable
import json
import os
from typing import Any

import jax
import numpy as np

from .. import targets
from .sharded import MANIFEST
from .sharded import MANIFEST_FORMAT
from .sharded import bounds

# Stock JAX callables bound at import (the drop-in contract: never looked up
# on ``jax`` at call time).
_devices = jax.devices
_make_array_from_callback = jax.make_array_from_callback


def read_manifest(api: str, path: str) -> dict | None:
  file = os.path.join(path, MANIFEST)
  if not os.path.isfile(file):
    return None
  try:
    with open(file, "rb") as f:
      manifest = json.loads(f.read().decode())
    if manifest.get("format") != MANIFEST_FORMAT:
      raise ValueError(f"unknown format {manifest.get('format')!r}")
    for a in manifest["arrays"].values():
      a["dtype"] = np.dtype(a["dtype"])
  except (ValueError, KeyError, TypeError, AttributeError) as err:
    raise ValueError(
      f"{api}: the manifest {file!r} is damaged ({err}); write the checkpoint "
      "again"
    ) from None
  return manifest


def _read_region(
  api: str, path: str, key: str, entry: dict, idx: tuple
) -> np.ndarray:
  shape = tuple(entry["shape"])
  want = bounds(idx, shape)
  out = np.empty([hi - lo for lo, hi in want], entry["dtype"])
  for shard in entry["shards"]:
    lo = shard["start"]
    hi = [a + n for a, n in zip(lo, shard["shape"])]
    inter = [(max(a, w0), min(b, w1)) for a, b, (w0, w1) in zip(lo, hi, want)]
    if any(a >= b for a, b in inter):
      continue
    file = os.path.join(path, shard["file"])
    try:
      data = np.load(file, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
      raise ValueError(
        f"{api}: the shard file {file!r} of {key!r} is not readable: {err}"
      ) from None
    if data.shape != tuple(shard["shape"]):
      raise ValueError(
        f"{api}: the shard file {file!r} of {key!r} holds {list(data.shape)}, "
        f"the manifest says {shard['shape']}; the checkpoint is damaged"
      )
    src = tuple(slice(a - s, b - s) for (a, b), s in zip(inter, lo))
    dst = tuple(slice(a - w0, b - w0) for (a, b), (w0, _) in zip(inter, want))
    part = np.asarray(data[src])
    if part.dtype.kind == "V":
      part = part.view(entry["dtype"])
    out[dst] = part
  return out


def restore_tree(
  api: str,
  path: str,
  manifest: dict,
  target: Any,
  treedef: Any,
  leaves: list[Any],
  keys: list[str],
  paths: list[str],
  specs: list[tuple[tuple[int, ...], np.dtype, bool]],
  placement: Any,
  placement_of: Any,
  weak: Any,
) -> Any:
  """restore's path for a checkpoint with a manifest (several processes wrote it)."""
  places = targets.resolve_placement(
    api, placement, target, treedef, leaves, placement_of
  )
  out = restore(api, path, manifest, keys, paths, specs, places)
  return treedef.unflatten(
    [weak(y) if spec[2] else y for y, spec in zip(out, specs)]
  )


def restore(
  api: str,
  path: str,
  manifest: dict,
  keys: list[str],
  paths: list[str],
  specs: list[tuple[tuple[int, ...], np.dtype, bool]],
  places: list[Any],
) -> list[jax.Array]:
  """The arrays of a manifest checkpoint onto ``places`` (validated first)."""
  arrays = manifest["arrays"]
  missing = [k for k in keys if k not in arrays]
  extra = sorted(set(arrays) - set(keys))
  if missing or extra:
    raise ValueError(
      f"{api}: the target and {path!r} disagree: missing from the "
      f"checkpoint {missing[:5]}, not in the target {extra[:5]}"
    )
  shardings = []
  for key, where, (shape, dtype, _), p in zip(keys, paths, specs, places):
    entry = arrays[key]
    stored = entry["dtype"]
    same = (
      stored == dtype
      or np.dtype(jax.dtypes.canonicalize_dtype(stored)) == dtype
    )
    if tuple(entry["shape"]) != shape or not same:
      raise ValueError(
        f"{api}: the leaf at {where} (key {key!r}) is stored as "
        f"{stored.name}{entry['shape']} but the target expects "
        f"{dtype.name}{list(shape)}"
      )
    sharding, layout, _ = targets.normalize_target(api, p)
    if sharding is None:
      sharding = targets.single_device_sharding(_devices()[0])
    if layout is not None:
      raise ValueError(
        f"{api}: the leaf at {where}: restoring a checkpoint written by "
        "several processes onto a layout is not supported; pass a Sharding"
      )
    shardings.append(sharding)
  out: list[jax.Array] = []
  for key, (shape, dtype, _), sharding in zip(keys, specs, shardings):
    region = _region_reader(api, path, key, arrays[key], dtype)
    out.append(_make_array_from_callback(shape, sharding, region, dtype=dtype))
  return out


def _region_reader(
  api: str, path: str, key: str, entry: dict, dtype: np.dtype
) -> Callable[[Any], np.ndarray]:
  """The callback giving the slice ``idx`` of one array, as ``dtype``."""

  def region(idx: Any) -> np.ndarray:
    a = _read_region(api, path, key, entry, idx)
    return a if a.dtype == dtype else a.astype(dtype)

  return region
