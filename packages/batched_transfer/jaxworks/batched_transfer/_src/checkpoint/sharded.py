"""Checkpoints of arrays that span processes (jax.distributed): the save.

Save, called by every process with the same tree: process 0 takes the save
lock, cleans leftovers and makes the temporary directory, whose name the
others read from the distributed key-value store. Each process writes the
shards its devices hold (a shard several devices hold once, by the first of
them in the sharding's device order) as ``<key>.shards/<n>.npy``; process 0
also writes every array that does not span processes as ``<key>.npy``. All
fsync what they wrote and post their status. Process 0 then writes the
manifest (``jaxworks_manifest.json``, which says how the shard files tile
each array) and the dtype record, fsyncs, commits with save's atomic
rename, and posts the outcome the others return or raise with.

Every key of one save lies under a prefix with the save's sequence number,
which every process takes first thing, so a failed save never puts the
processes' numbers out of step. The outcome is one key that the first
writer sets (the store refuses to overwrite it): "ok" by process 0 after
the commit, or the error of whichever process failed first, anywhere in the
save, or gave up waiting. Every process waits by polling the store for the
keys it needs and that outcome, so all of them raise as soon as one failed;
a process that died leaves the others with a TimeoutError after
``barrier_timeout_s`` and no committed checkpoint. Once a process is done
with a save's keys (returned or raised), it counts itself in
``<prefix>/released``; the last of them deletes the prefix, so a job that
saves for days keeps no keys of finished saves in the coordinator (a save a
process never joined keeps its few keys). Their restore is sharded_restore.
"""

from __future__ import annotations

from collections.abc import Callable
import contextlib
import itertools
import json
import os
import threading
import time
from typing import Any

import jax
import numpy as np

from .. import jax_internals
from . import commit
from . import files as checkpoint_files
from . import hostvalue
from . import pending

MANIFEST = "jaxworks_manifest.json"
MANIFEST_FORMAT = 1
_PREFIX = "jaxworks/batched_transfer/save"
_seq = itertools.count()
_seq_lock = threading.Lock()
#: Seconds between two polls of the key-value store: the first, the most.
POLL_S = (0.001, 0.005)
#: Seconds between two looks for a failed process while this one writes.
WRITE_CHECK_S = 0.05
_NOTHING = "; nothing was committed"


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
  """(manifest, [(file stem, numpy array or jax.Array)] this process writes):
  a shard's one-device array, or a whole leaf that spans no processes."""
  pid = jax.process_index()
  arrays: dict[str, Any] = {}
  mine: list[tuple[str, Any]] = []
  for key, x in zip(keys, leaves):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      by_device = {s.device: s for s in x.addressable_shards}
      shards = []
      for n, (b, device) in enumerate(shard_plan(x)):
        stem = f"{key}.shards/{n}"
        shards.append(
          {
            "file": stem + ".npy",
            "start": [lo for lo, _ in b],
            "shape": [hi - lo for lo, hi in b],
          }
        )
        if device.process_index == pid:
          mine.append((stem, by_device[device].data))
    else:
      shards = [
        {"file": key + ".npy", "start": [0] * x.ndim, "shape": list(x.shape)}
      ]
      if pid == 0:
        mine.append((key, x))
    arrays[key] = {
      "shape": list(x.shape),
      "dtype": np.dtype(x.dtype).name,
      "shards": shards,
    }
  manifest = {
    "format": MANIFEST_FORMAT,
    "processes": jax.process_count(),
    "arrays": arrays,
  }
  return manifest, mine


def _host(x: Any) -> np.ndarray | hostvalue.Shards:
  return hostvalue.of(x) if isinstance(x, jax.Array) else x


class _Board:
  """One save's keys in jax.distributed's key-value store (module docstring):
  ``<prefix>/tmp``, ``<prefix>/status/<process>``, ``<prefix>/outcome``."""

  def __init__(
    self, api: str, path: str, client: Any, seq: int, timeout_s: float
  ) -> None:
    self.api, self.path, self.client = api, path, client
    self.prefix = f"{_PREFIX}/{seq}"
    self.timeout_s = timeout_s
    self.pid = jax.process_index()
    self.count = jax.process_count()
    self.settled = False  # this process posted or met a failed outcome
    self.looked = time.monotonic()

  def post(self, name: str, value: str) -> None:
    self.client.key_value_set(f"{self.prefix}/{name}", value)

  def entries(self) -> dict[str, str]:
    """Every key of this save (relative to the prefix) and its value."""
    try:
      got = self.client.key_value_dir_get(self.prefix + "/")
    except Exception as err:  # JaxRuntimeError: the coordinator is gone
      self.settled = True
      raise RuntimeError(
        f"{self.api}: the save to {self.path!r} failed on process "
        f"{self.pid}: jax.distributed's key-value store failed ({err}); "
        "process 0, which runs it, may have died"
      ) from None
    n = len(self.prefix) + 1
    return {k[n:]: v for k, v in got}

  def settle(self, outcome: dict[str, Any]) -> dict[str, Any]:
    """Posts ``outcome`` unless one is posted; returns the one that holds."""
    try:
      self.client.key_value_set(f"{self.prefix}/outcome", json.dumps(outcome))
      return outcome
    except Exception:  # ALREADY_EXISTS: another process's came first
      value = self.entries().get("outcome")
      if value is None:
        raise
      return json.loads(value)

  def fail(self, err: BaseException, note: str) -> None:
    """Posts this process's error as the outcome (if none is posted)."""
    if self.settled:
      return
    self.settled = True
    with contextlib.suppress(Exception):  # a dead store: nothing to tell
      self.settle({"process": self.pid, "error": f"{err!r}{note}"})
      err.add_note(
        f"{self.api}: posted to every process saving {self.path!r}, which "
        "all raise"
      )

  def release(self) -> None:
    """This process no longer reads the save's keys; the last process to
    release them deletes them (each read its outcome before)."""
    with contextlib.suppress(Exception):  # a dead store keeps nothing
      key = f"{self.prefix}/released"
      if self.client.key_value_increment(key, 1) >= self.count:
        self.client.key_value_delete(self.prefix)

  def check(self, entries: dict[str, str]) -> None:
    """Raises the error of a failed outcome in ``entries``."""
    value = entries.get("outcome")
    if value is None:
      return
    outcome = json.loads(value)
    if outcome.get("ok"):
      return
    self.settled = True
    cls = TimeoutError if outcome.get("timeout") else RuntimeError
    raise cls(
      f"{self.api}: the save to {self.path!r} failed on process "
      f"{outcome['process']}: {outcome['error']}"
    )

  def look(self) -> None:
    """Raises if another process failed (at most every WRITE_CHECK_S)."""
    now = time.monotonic()
    if now - self.looked >= WRITE_CHECK_S:
      self.looked = now
      self.check(self.entries())

  def wait(self, names: list[str], what: str, note: str) -> dict[str, str]:
    """Polls until every key in ``names`` or the outcome is posted; raises a
    failed outcome, or TimeoutError (posted) after ``timeout_s``."""
    deadline = time.monotonic() + self.timeout_s
    pause = POLL_S[0]
    while True:
      entries = self.entries()
      if "outcome" in entries or all(n in entries for n in names):
        self.check(entries)
        return entries
      if time.monotonic() >= deadline:
        late = sorted(  # "tmp" and "outcome" are process 0's to post
          int(n[len("status/") :]) if n.startswith("status/") else 0
          for n in names
          if n not in entries
        )
        who = "process" + ("es " if len(late) > 1 else " ")
        outcome = self.settle(
          {
            "process": self.pid,
            "timeout": True,
            "error": f"it waited {self.timeout_s} s (barrier_timeout_s) for "
            f"{who}{', '.join(map(str, late))} to {what}{note}",
          }
        )
        self.check({"outcome": json.dumps(outcome)})
        return entries  # another process's outcome was "ok" after all
      time.sleep(pause)
      pause = min(2 * pause, POLL_S[1])


def save_across_processes(
  api: str,
  path: str,
  keys: list[str],
  leaves: list[Any],
  *,
  prepare: Callable[[list[Any]], list[Any]],
  blocking: bool,
  threads: int,
  barrier_timeout_s: float,
  after: Callable[[], None] | None = None,
) -> pending.SaveHandle | None:
  """The collective save (see the module docstring). ``prepare(leaves)``
  runs first, on every process: the checks of the call (an error there is
  every process's), and the leaves to write."""
  client = _client(api)
  with _seq_lock:  # before anything that can fail (module docstring)
    seq = next(_seq)
  board = _Board(api, path, client, seq, barrier_timeout_s)
  try:
    leaves = prepare(leaves)
    manifest, mine = plan_save(api, keys, leaves)
    if not blocking:  # every host value now: the caller may reuse the arrays
      for _, x in mine:
        hostvalue.start_copy(x)
      mine = [(stem, _host(x)) for stem, x in mine]
  except BaseException as err:
    board.fail(err, _NOTHING)
    board.release()
    raise
  del leaves

  def work() -> None:
    try:
      _collective(board, path, manifest, mine, threads, after)
    except BaseException as err:
      board.fail(err, "")  # the notes were set where it was known
      raise
    finally:
      board.release()

  if blocking:
    work()
    return None
  return pending.start(path, work)


def _collective(
  board: _Board,
  path: str,
  manifest: dict,
  mine: list[tuple[str, Any]],
  threads: int,
  after: Callable[[], None] | None,
) -> None:
  from .saver import _write_directory  # saver imports this module

  pid = board.pid
  with contextlib.ExitStack() as stack:
    tmp = None
    try:
      if pid == 0:
        stack.enter_context(commit.locked(path))
        commit.clean(path)
        tmp = commit.temp_name(path, commit.NEW)
        os.mkdir(tmp)
        board.post("tmp", os.path.basename(tmp))
      else:
        entries = board.wait(["tmp"], "make the temporary directory", _NOTHING)
        tmp = os.path.join(os.path.dirname(path), entries["tmp"])
      stems = [stem for stem, _ in mine]
      values = [x for _, x in mine]

      def take(i: int) -> Any:
        board.look()
        return _host(values[i])

      _write_directory(tmp, stems, take, lambda i: None, threads)
      for dirpath, _, _ in os.walk(tmp, topdown=False):
        commit.fsync_path(dirpath)
      values.clear()  # the host values held for a non-blocking save
      mine.clear()
      board.post(f"status/{pid}", "ok")
      if pid == 0:
        board.wait(
          [f"status/{p}" for p in range(board.count)],
          "finish writing",
          _NOTHING,
        )
        _commit(tmp, path, manifest)
        tmp = None
    except BaseException as err:
      if tmp is not None and pid == 0:  # under the lock
        commit.remove(tmp)
      board.fail(err, _NOTHING)
      raise
  if pid == 0:
    try:  # retention before the others return: they see its result
      if after is not None:
        after()
    except BaseException as err:
      board.fail(err, f"; {path!r} was committed, then this failed")
      raise
    board.check({"outcome": json.dumps(board.settle({"ok": True}))})
  else:
    note = f"; {path!r} is complete if it was committed"
    board.wait(["outcome"], "commit", note)


def _commit(tmp: str, path: str, manifest: dict) -> None:
  """Process 0: the manifest, the dtype record, fsync, the atomic rename."""
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
