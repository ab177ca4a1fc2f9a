"""Checkpoints of arrays that span processes (jax.distributed): the save.

Save, called by every process with the same tree: process 0 takes the save
lock, cleans leftovers and makes the temporary directory, whose name the
others read from the distributed key-value store. Each process writes the
shards its devices hold (a shard several devices hold once, by the first of
them in the sharding's device order) as ``<key>.shards/<n>.npy``; process 0
also writes every array that does not span processes as ``<key>.npy``. All
fsync what they wrote, post their status and meet at a barrier of the
distributed client (``barrier_timeout_s``). Process 0 then writes the
manifest (``jaxworks_manifest.json``, which says how the shard files tile
each array) and the dtype record, fsyncs, and commits with save's atomic
rename; the others return once it posted the outcome. A process that dies
leaves the others with an error after the timeout and no committed
checkpoint. Their restore is sharded_restore.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
from typing import Any

import jax
import numpy as np

from .. import jax_internals
from . import commit
from . import files as checkpoint_files
from . import pending

MANIFEST = "jaxworks_manifest.json"
MANIFEST_FORMAT = 1
_seq = itertools.count()
_seq_lock = threading.Lock()


def spans_processes(leaves: list[Any]) -> bool:
  return any(
    isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves
  )


def bounds(idx: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
  return tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(idx, shape))


def shard_plan(x: jax.Array) -> list[tuple[tuple[tuple[int, int], ...], Any]]:
  """(bounds, writer device) of each distinct shard, in the sharding's
  device order: the same on every process."""
  seen: dict[tuple[tuple[int, int], ...], Any] = {}
  for d, idx in x.sharding.devices_indices_map(x.shape).items():
    b = bounds(idx, x.shape)
    if b not in seen:
      seen[b] = d
  return list(seen.items())


def _client(api: str) -> Any:
  client = jax_internals.distributed_client()
  if client is None:
    raise ValueError(
      f"{api}: a leaf spans devices of several processes but "
      "jax.distributed is not initialized; call jax.distributed.initialize()"
    )
  return client


def plan_save(
  api: str, keys: list[str], leaves: list[Any]
) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
  """(manifest, [(file stem, host value getter)] this process writes)."""
  pid = jax.process_index()
  arrays: dict[str, Any] = {}
  mine: list[tuple[str, Any]] = []
  for key, x in zip(keys, leaves):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      by_device = {s.device: s for s in x.addressable_shards}
      shards = []
      for n, (bounds, device) in enumerate(shard_plan(x)):
        stem = f"{key}.shards/{n}"
        shards.append(
          {
            "file": stem + ".npy",
            "start": [lo for lo, _ in bounds],
            "shape": [hi - lo for lo, hi in bounds],
          }
        )
        if device.process_index == pid:
          shard = by_device[device]
          mine.append((stem, lambda s=shard: np.asarray(s.data)))
      shape, dtype = x.shape, x.dtype
    else:
      a = np.asarray(x)
      shape, dtype = a.shape, a.dtype
      shards = [
        {"file": key + ".npy", "start": [0] * a.ndim, "shape": list(a.shape)}
      ]
      if pid == 0:
        mine.append((key, lambda a=a: a))
    arrays[key] = {
      "shape": list(shape),
      "dtype": np.dtype(dtype).name,
      "shards": shards,
    }
  manifest = {
    "format": MANIFEST_FORMAT,
    "processes": jax.process_count(),
    "arrays": arrays,
  }
  return manifest, mine


def save_across_processes(
  api: str,
  path: str,
  keys: list[str],
  leaves: list[Any],
  *,
  blocking: bool,
  threads: int,
  barrier_timeout_s: float,
  after: Any = None,
) -> pending.SaveHandle | None:
  """The collective save (see the module docstring)."""
  from .saver import _write_directory  # saver imports this module

  client = _client(api)
  pid = jax.process_index()
  with _seq_lock:
    prefix = f"jaxworks/batched_transfer/save/{next(_seq)}"
  manifest, mine = plan_save(api, keys, leaves)
  if not blocking:  # every host copy now: the caller may reuse the arrays
    values = [np.array(get(), copy=True) for _, get in mine]
    mine = [(stem, lambda v=v: v) for (stem, _), v in zip(mine, values)]
    del values
  timeout_ms = int(barrier_timeout_s * 1000)

  def work() -> None:
    with contextlib.ExitStack() as stack:
      if pid == 0:
        stack.enter_context(commit.locked(path))
        commit.clean(path)
        tmp = commit.temp_name(path, commit.NEW)
        os.mkdir(tmp)
        client.key_value_set(f"{prefix}/tmp", os.path.basename(tmp))
      else:
        name = client.blocking_key_value_get(f"{prefix}/tmp", timeout_ms)
        tmp = os.path.join(os.path.dirname(path), name)
      status = "ok"
      try:
        stems = [stem for stem, _ in mine]
        values = [get for _, get in mine]
        _write_directory(
          tmp, stems, lambda i: values[i](), lambda i: None, threads
        )
        for dirpath, _, _ in os.walk(tmp, topdown=False):
          commit.fsync_path(dirpath)
      except Exception as err:  # posted, then raised below
        status = f"process {pid}: {err!r}"
        failure: BaseException | None = err
      else:
        failure = None
      client.key_value_set(f"{prefix}/status/{pid}", status)
      try:
        client.wait_at_barrier(f"{prefix}/written", timeout_ms)
      except Exception as err:
        if pid == 0:
          commit.remove(tmp)
        raise TimeoutError(
          f"{api}: not every process finished writing {path!r} within "
          f"{barrier_timeout_s} s (barrier_timeout_s): {err}; nothing was "
          "committed"
        ) from None
      if pid == 0:  # under the lock
        outcome = _commit(api, client, prefix, tmp, path, manifest)
    if pid == 0:
      try:  # retention before the others return: they see its result
        if outcome == "ok" and after is not None:
          after()
      finally:
        client.key_value_set(f"{prefix}/done", outcome)
    else:
      outcome = client.blocking_key_value_get(f"{prefix}/done", timeout_ms)
    if failure is not None:
      raise failure
    if outcome != "ok":
      raise RuntimeError(f"{api}: the save to {path!r} failed: {outcome}")

  if blocking:
    work()
    return None
  return pending.start(path, work)


def _commit(
  api: str, client: Any, prefix: str, tmp: str, path: str, manifest: dict
) -> str:
  """Process 0: the manifest, fsync, the atomic rename; the outcome."""
  statuses = dict(client.key_value_dir_get(f"{prefix}/status/"))
  failed = [v for v in statuses.values() if v != "ok"]
  if failed or len(statuses) != manifest["processes"]:
    commit.remove(tmp)
    return "; ".join(failed) or f"statuses: {statuses}"
  try:
    dtypes = {k: a["dtype"] for k, a in manifest["arrays"].items()}
    record = json.dumps(
      {"format": checkpoint_files.RECORD_FORMAT, "dtypes": dtypes},
      indent=0,
      sort_keys=True,
    ).encode()
    for name, data in (
      (MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode()),
      (checkpoint_files.DTYPE_RECORD, record),
    ):
      with open(os.path.join(tmp, name), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    commit.fsync_path(tmp)
    commit.publish(tmp, path)
  except Exception as err:  # posted to every process
    commit.remove(tmp)
    return f"process 0: {err!r}"
  return "ok"
