"""Restore of a checkpoint that several processes wrote (it has a manifest).

Everything is validated before anything is placed: the manifest, every key,
shape and dtype against the target, each placement, and the .npy header of
every shard file this process needs (manifest.py opens them relative to the
checkpoint directory's descriptor). Then, as restore's other path, batches are
read on a background thread ahead of the batch being placed: for each array,
the region each of this process's devices holds is read with ``preadv`` from
the overlapping shard files (through the descriptors validated, by
``read_threads`` threads) straight into a new aligned host buffer, and the
regions are placed with one batched transfer per array (on CPU a device takes
its buffer over: no copy). A target with a layout (a ``Format``) is relaid out
on its devices afterwards, as device_put does.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
from typing import Any

import jax
from jax.experimental.layout import Format
import numpy as np

from .. import jax_internals
from .. import prefetch
from .. import targets
from ..api import place
from ..progress import Progress
from ..transfer import placement_error
from . import files
from .keys import astype
from .keys import cast_to
from .manifest import Bounds
from .manifest import Entry
from .manifest import Manifest
from .manifest import read_tasks
from .manifest import verify_tasks
from .sharded import MANIFEST
from .sharded import bounds


@dataclasses.dataclass
class _Leaf:
  key: str
  entry: Entry
  sharding: Any
  layout: Any
  aval: Any
  committed: bool
  devices: list[Any]
  regions: list[Bounds]  # per device
  pieces: dict[Bounds, list]  # per distinct region: (Stored, Shard)
  cast: np.dtype | None = None  # the target's dtype, where it differs

  @property
  def nbytes(self) -> int:
    size = self.entry.dtype.itemsize
    return sum(math.prod(b - a for a, b in r) * size for r in self.pieces)


def restore_arrays(
  api: str,
  opened: Manifest,
  keys: list[str],
  paths: list[str],
  specs: list[tuple[tuple[int, ...], np.dtype, bool]],
  places: list[Any],
  weak: Any,
  max_inflight_bytes: int,
  read_threads: int,
  progress: bool | None,
  batch_cap: int,
  verify: bool,
) -> list[Any]:
  """restore's path for a checkpoint with a manifest (several processes
  wrote it): the arrays of ``keys``, placed (restore sorted the target)."""
  plan = _plan(api, opened, keys, paths, specs, places)
  limit = min(max(1, max_inflight_bytes // 2), batch_cap)
  out = _stream(
    api, opened, plan, limit, max_inflight_bytes, read_threads, progress,
    verify,
  )  # fmt: skip
  return [weak(y) if spec[2] else y for y, spec in zip(out, specs)]


def _plan(
  api: str,
  opened: Manifest,
  keys: list[str],
  paths: list[str],
  specs: list[tuple[tuple[int, ...], np.dtype, bool]],
  places: list[Any],
) -> list[_Leaf]:
  """Checks shapes, placements and shard files; what to read."""
  path, arrays = opened.path, opened.arrays
  normalized: dict[int, Any] = {}
  plan = []
  for key, where, (shape, dtype, _), p in zip(keys, paths, specs, places):
    entry = arrays[key]
    stored = entry.dtype
    if entry.shape != shape:
      raise ValueError(
        f"{api}: the leaf at {where} (key {key!r}) is stored in the "
        f"checkpoint {path!r} (its manifest {MANIFEST!r}) as "
        f"{stored.name}{list(entry.shape)} but the target expects shape "
        f"{list(shape)}; restore into a target of the stored shape "
        "(bt.metadata(path) lists them)"
      )
    cast = cast_to(stored, dtype)
    if id(p) not in normalized:
      normalized[id(p)] = targets.restore_target(api, p, where)
    sharding, layout, committed = normalized[id(p)]
    if sharding is None:
      sharding = targets.single_device_sharding(jax_internals.default_device())
    try:
      sharding.shard_shape(shape)
      index_map = sharding.addressable_devices_indices_map(shape)
    except Exception as err:  # the sharding's own message says why
      raise placement_error(
        err,
        sharding,
        shape,
        f"{api}: the leaf at {where} with shape {shape} cannot be placed on "
        f"{sharding}: {err}",
      ) from None
    aval = jax_internals.ShapedArray(
      shape, jax.dtypes.canonicalize_dtype(stored if cast is None else cast)
    )
    if committed:
      aval = jax_internals.device_put_aval(aval, sharding)
    regions = [bounds(idx, shape) for idx in index_map.values()]
    pieces = {r: opened.pieces(key, entry, r) for r in dict.fromkeys(regions)}
    plan.append(
      _Leaf(
        key,
        entry,
        sharding,
        layout,
        aval,
        committed,
        list(index_map),
        regions,
        pieces,
        cast,
      )  # fmt: skip
    )
  return plan


def _stream(
  api: str,
  opened: Manifest,
  plan: list[_Leaf],
  limit: int,
  max_inflight_bytes: int,
  read_threads: int,
  progress: bool | None,
  verify: bool = True,
) -> list[Any]:
  """Reads (ahead, on a background thread) and places; the arrays in order."""
  jax_internals.release_dropped_host_buffers()
  sizes = [leaf.nbytes for leaf in plan]
  batches = prefetch.split_batches(sizes, limit)
  pool = concurrent.futures.ThreadPoolExecutor(
    read_threads, thread_name_prefix=files.READ_THREAD_PREFIX
  )
  bar = Progress("restore", sum(sizes), enabled=progress)
  memory = files.HostMemory()

  def read_batch(k: int) -> list[dict[Bounds, np.ndarray]]:
    return _read(
      api, opened, [plan[i] for i in batches[k]], memory, pool, verify
    )

  reader = prefetch.BatchReader(
    read_batch, [sum(sizes[i] for i in b) for b in batches], max_inflight_bytes
  )
  out: list[Any] = [None] * len(plan)

  def place_batch(batch: list[int], regions: Any) -> None:
    for i, bufs in zip(batch, regions):
      out[i] = _put(api, plan[i], bufs)  # from here on deleted on failure

  try:
    prefetch.place_batches(
      reader,
      batches,
      place_batch,
      out,
      lambda batch: bar.update(sum(sizes[i] for i in batch)),
    )
  finally:
    pool.shutdown(wait=True)
    bar.close()
  return out


def _read(
  api: str,
  opened: Manifest,
  leaves: list[_Leaf],
  memory: files.HostMemory,
  pool: concurrent.futures.ThreadPoolExecutor,
  verify: bool = True,
) -> list[dict[Bounds, np.ndarray]]:
  """The distinct regions of ``leaves``, each in a new aligned buffer."""
  used = {
    s.name: s for leaf in leaves for p in leaf.pieces.values() for s, _ in p
  }
  fds: dict[str, int] = {}
  try:
    for name, s in used.items():
      fd = s.fd
      if fd < 0:  # closed after validation: the same file must be there
        fd = _reopen(api, s)
      fds[name] = fd
    out, tasks = [], []
    verified: set[tuple[str, int]] | None = set() if verify else None
    for leaf in leaves:
      bufs = _buffers(memory, leaf)
      for want, pieces in leaf.pieces.items():
        tasks += read_tasks(
          pieces, want, bufs[want], fds, files.CHUNK, verified
        )
      out.append(bufs)
    if verified is not None:  # chunks that no read covered whole
      tasks += verify_tasks(used, fds, verified)
    futures = [pool.submit(t) for t in tasks]
    concurrent.futures.wait(futures)  # every read ends before fds close
    try:
      for f in futures:
        f.result()
    except (OSError, ValueError, EOFError) as err:
      raise ValueError(
        f"{api}: reading {err}; the file changed or is damaged since restore "
        "validated it"
      ) from None
    for name, s in used.items():
      if files.stamp(os.fstat(fds[name])) != s.stamp:
        raise ValueError(
          f"{api}: {s.where} was modified while restore read it; restore again"
        )
  finally:
    for name, fd in fds.items():
      if fd != used[name].fd:
        os.close(fd)
  return out


def _buffers(memory: files.HostMemory, leaf: _Leaf) -> dict[Bounds, Any]:
  """A new aligned buffer per distinct region of ``leaf``: parts of one map
  of their own for an array of ``OWN_MAP`` bytes or more (huge pages for the
  whole array, however small its regions), else from ``memory``'s slabs."""
  dtype = leaf.entry.dtype
  shapes = {r: tuple(b - a for a, b in r) for r in leaf.pieces}
  sizes = {r: math.prod(x) * dtype.itemsize for r, x in shapes.items()}
  total = sum(n + (-n % files.ALIGN) for n in sizes.values())
  if len(shapes) == 1 or total < files.OWN_MAP:
    return {r: memory.empty(x, dtype)[0] for r, x in shapes.items()}
  buf, offset, out = files._anonymous_map(total), 0, {}
  for r, x in shapes.items():
    out[r] = np.ndarray(x, dtype, buffer=buf, offset=offset)
    offset += sizes[r] + (-sizes[r] % files.ALIGN)
  return out


def _reopen(api: str, s: files.Stored) -> int:
  try:
    fd, st = files._open_file(s.name, s.dir_fd)
  except (OSError, ValueError) as err:
    raise ValueError(f"{api}: {s.where} cannot be read: {err}") from None
  if files.stamp(st) != s.stamp:
    os.close(fd)
    raise ValueError(
      f"{api}: {s.where} was replaced after restore validated it; restore again"
    )
  return fd


def _put(api: str, leaf: _Leaf, bufs: dict[Bounds, np.ndarray]) -> Any:
  """One array from its regions (a device may take its buffer over)."""
  put = jax_internals.batched_device_put
  if leaf.cast is not None:
    bufs = {r: astype(b, leaf.cast) for r, b in bufs.items()}
  shards = [bufs[r] for r in leaf.regions]
  devices = leaf.devices
  with jax_internals.explicit_device_put_scope():
    if len(bufs) < len(shards) or 0 in leaf.aval.shape:
      # A region several devices hold: each gets a copy of its own (a buffer
      # backing two shards would let a donation on one change the other).
      memory_kind = leaf.sharding.memory_kind
      shards = [
        put(
          jax_internals.ShapedArray(x.shape, leaf.aval.dtype),
          jax.sharding.SingleDeviceSharding(d, memory_kind=memory_kind),
          [x], [d], True, True,
        )
        for x, d in zip(shards, devices)
      ]  # fmt: skip
    y = put(leaf.aval, leaf.sharding, shards, devices, leaf.committed, False)
  if leaf.layout is not None:
    y = place(y, Format(leaf.layout, leaf.sharding), donate=True, api=api)
  return y
