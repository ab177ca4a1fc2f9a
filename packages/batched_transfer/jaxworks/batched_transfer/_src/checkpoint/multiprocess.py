"""Checkpoints of arrays that span processes (jax.distributed): the save
(the README, "Checkpoints written by several processes", tells its steps).
Shards are written as ``<key>.shards/<n>.npy``, an array that spans no
processes as ``<key>.npy`` by process 0, which commits.

Every key of one save lies under a prefix with the save's sequence number,
which every process takes first thing in the call (``ticket``), before any
check that can fail: an error after it is posted under that number, so a
failed save never puts the processes' numbers out of step. Every process
posts the save's identity (``id/<process>``: the call, the path, a digest
of the tree's keys, shapes, dtypes, shardings and non-array leaves);
process 0 checks that every process posted the same one before it posts
the temporary directory (``tmp``), which the others wait for before they
write, so processes whose calls got out of step anyway (a call one of them
never made) fail, naming both calls, instead of writing into each other's
save. The outcome is one key that the first writer sets (the store refuses
to overwrite it): "ok" by process 0 after the commit, or the error of
whichever process failed first, anywhere in the save, or gave up waiting.
Every process waits by polling the store for the
keys it needs and that outcome, so all of them raise as soon as one failed;
a process that died leaves the others with a TimeoutError after
``barrier_timeout_s`` and no committed checkpoint. Once a process is done
with a save's keys (returned or raised), it counts itself in
``<prefix>/released``; the last of them deletes the prefix, so a job that
saves for days keeps no keys of finished saves in the coordinator (a save a
process never joined keeps its few keys). Their restore is restore_shards.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
import contextlib
import dataclasses
import itertools
import json
import threading
import time
from typing import Any

import jax
import numpy as np

from .. import jax_internals
from . import checksum
from . import format
from . import hostvalue
from . import pending
from . import writer
from .destination import Destination
from .destination import Save
from .job import SaveJob
from .keys import check_files
from .storage import LOG

_PREFIX = "jaxworks/batched_transfer/save"
_seq = itertools.count()
#: Collective restores are numbered apart from saves (``restore_board``).
_RESTORE_PREFIX = "jaxworks/batched_transfer/restore"
_restore_seq = itertools.count()
_seq_lock = threading.Lock()
#: Seconds between two polls of the key-value store: the first, the most.
POLL_S = (0.001, 0.005)
#: Seconds between two looks for a failed process while this one writes.
WRITE_CHECK_S = 0.05
_NOTHING = "; nothing was committed"


def multi_process() -> bool:
  """Whether this is one of several processes of a jax.distributed job."""
  return (
    jax_internals.distributed_client() is not None and jax.process_count() > 1
  )


def spans_processes(leaves: list[Any]) -> bool:
  return any(
    isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves
  )


def shard_plan(x: jax.Array) -> list[tuple[tuple[tuple[int, int], ...], Any]]:
  """(bounds, writer device) of each distinct shard, in the sharding's
  device order: the same on every process."""
  seen: dict[tuple[tuple[int, int], ...], Any] = {}
  for d, idx in x.sharding.devices_indices_map(x.shape).items():
    b = format.bounds(idx, x.shape)
    if b not in seen:
      seen[b] = d
  return list(seen.items())


class Ticket:
  """A collective call's sequence number, taken first thing in the call;
  ``board`` once the save's protocol took it over (it then posts its own
  failures)."""

  def __init__(self, seq: int) -> None:
    self.seq = seq
    self.board: _Board | None = None


@contextlib.contextmanager
def ticket(api: str, path: Any, collective: Any = None) -> Iterator[Any]:
  """The ``Ticket`` of a collective save (None if the call saves alone:
  ``collective`` false, or one process): taken before anything in the call
  can fail. An error raised in the block before the save's protocol began
  is posted as that save's outcome, so the other processes raise it too
  (in step) instead of waiting for this one, or meeting its next save."""
  if (collective is not None and not collective) or not multi_process():
    yield None
    return
  with _seq_lock:
    t = Ticket(next(_seq))
  try:
    yield t
  except BaseException as err:
    if t.board is None:
      where = path if isinstance(path, str) else repr(path)
      board = _Board(api, where, _client(api), t.seq, 0.0)
      board.fail(err, _NOTHING)
      board.release()
    raise


def _client(api: str) -> Any:
  client = jax_internals.distributed_client()
  if client is None:
    raise ValueError(
      f"{api}: a leaf spans devices of several processes but "
      "jax.distributed is not initialized; call jax.distributed.initialize()"
    )
  return client


def plan_save(
  api: str, keys: list[str], paths: list[str], leaves: list[Any]
) -> tuple[dict[str, Any], list[tuple[str, Any]], list[tuple[str, Any]]]:
  """(manifest, [(file stem, numpy array or jax.Array)] this process writes,
  [(key, value)] of the leaves that span no processes, which process 0
  writes and every process checks): a shard's one-device array, or a whole
  leaf that spans no processes."""
  pid = jax.process_index()
  arrays: dict[str, Any] = {}
  mine: list[tuple[str, Any]] = []
  whole: list[tuple[str, Any]] = []
  named: list[tuple[str, str]] = []
  for key, where, x in zip(keys, paths, leaves):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      by_device = {s.device: s for s in x.addressable_shards}
      plan = [
        (format.shard_stem(key, n), b, d)
        for n, (b, d) in enumerate(shard_plan(x))
      ]
    else:  # one file of the whole leaf, process 0's to write
      plan = [(key, tuple((0, n) for n in x.shape), None)]
      whole.append((key, x))
      if pid == 0:
        mine.append((key, x))
    shards = []
    for stem, b, device in plan:
      start, shape = [lo for lo, _ in b], [hi - lo for lo, hi in b]
      shards.append({"file": stem + ".npy", "start": start, "shape": shape})
      named.append((stem + ".npy", where))
      if device is not None and device.process_index == pid:
        mine.append((stem, by_device[device].data))
    arrays[key] = {
      "shape": list(x.shape),
      "dtype": np.dtype(x.dtype).name,
      "shards": shards,
    }
  check_files(api, named)
  manifest = {
    "format": format.MANIFEST_FORMAT,
    "processes": jax.process_count(),
    "arrays": arrays,
  }
  return manifest, mine, whole


class _Board:
  """One save's keys in jax.distributed's key-value store (module docstring):
  ``<prefix>/tmp``, ``<prefix>/status/<process>``, ``<prefix>/outcome``.
  ``subject`` names the call in the errors of a failed outcome."""

  def __init__(
    self,
    api: str,
    path: str,
    client: Any,
    seq: int,
    timeout_s: float,
    subject: str = "the save to",
    prefix: str = _PREFIX,
    stages: tuple[tuple[str, str], ...] = (
      ("id", "start the save"),
      ("status", "finish writing"),
    ),
  ) -> None:
    self.api, self.path, self.client = api, path, client
    # What every process posts before process 0's outcome: (key, doing).
    self.stages = stages
    self.subject = f"{subject} {path!r}"
    self.prefix = f"{prefix}/{seq}"
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
        f"{self.api}: posted to every process of {self.subject}, which all "
        "raise"
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
      f"{self.api}: {self.subject} failed on process "
      f"{outcome['process']}: {outcome['error']}"
    )

  def look(self) -> None:
    """Raises if another process failed (at most every WRITE_CHECK_S)."""
    now = time.monotonic()
    if now - self.looked >= WRITE_CHECK_S:
      self.looked = now
      self.check(self.entries())

  def late(
    self, entries: dict[str, str], names: list[str], what: str
  ) -> tuple[list[int], str]:
    """(the processes that this one, waiting for ``names`` to ``what``,
    waits for, what they did not do): while process 0's keys are awaited,
    the processes that never started the save or finished writing, which
    process 0 itself waits for (e.g. a process that died)."""
    rules = self.stages if "outcome" in names else ()
    if "tmp" in names:
      rules = self.stages[:1]
    for kind, doing in rules:
      missing = [p for p in range(self.count) if f"{kind}/{p}" not in entries]
      if missing:
        return missing, doing
    late = sorted(  # "tmp" and "outcome" are process 0's to post
      int(n.rsplit("/", 1)[1]) if "/" in n else 0
      for n in names
      if n not in entries
    )
    return late, what

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
        late, what = self.late(entries, names, what)
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

  def agree(self, name: str, value: str) -> list[str]:
    """Posts this process's ``value`` as ``name`` and returns every
    process's, in process order, once all are posted (raises a failed
    outcome, or TimeoutError after ``timeout_s``)."""
    self.post(f"{name}/{self.pid}", value)
    names = [f"{name}/{p}" for p in range(self.count)]
    entries = self.wait(names, f"reach {name!r}", "")
    return [entries[n] for n in names]


@contextlib.contextmanager
def restore_board(
  api: str, path: str, timeout_s: float, collective: bool
) -> Iterator[_Board | None]:
  """The board of a restore that every process of a jax.distributed job
  makes together (``collective``, with several processes; else None): its
  number taken first, in call order; an error raised in the block is
  posted, so every other process raises it too instead of waiting."""
  if not collective or not multi_process():
    yield None
    return
  with _seq_lock:
    seq = next(_restore_seq)
  board = _Board(
    api, path, _client(api), seq, timeout_s, "the restore of", _RESTORE_PREFIX
  )
  try:
    yield board
  except BaseException as err:
    board.fail(err, "")
    raise
  finally:
    board.release()


def run(job: SaveJob, ticket: Ticket | None) -> pending.SaveHandle | None:
  """Runs ``job`` by this process alone (``job.run_alone``) or by every
  process (``save_across_processes``): collectively where the job's
  ``collective`` option says (None: when jax.distributed runs several
  processes) and the tree has arrays spanning processes or several
  processes run. ``ticket``: the collective call's (``ticket``)."""
  api, dest = job.api, job.destination
  collective = job.options.collective
  if collective is None:
    collective = multi_process()
  spans = spans_processes(job.leaves)
  if spans and not collective:
    raise ValueError(
      f"{api}: {dest.path!r}: with collective=False this process saves "
      "alone, but the tree has arrays spanning devices of several "
      "processes; let every process call save (collective=None)"
    )
  if not (collective and (spans or multi_process())):
    return job.run_alone()
  if job.record.codecs:
    raise ValueError(
      f"{api}: {dest.path!r}: compression={job.options.compression!r} is for "
      "checkpoints one process saves; a checkpoint several processes save "
      "together stores raw shards (restore reads the byte ranges it needs): "
      "pass compression=None"
    )
  if dest.npz:
    raise ValueError(
      f"{api}: {dest.path!r}: a checkpoint several processes save together "
      "is a directory (one file per shard); drop the .npz suffix"
    )
  return save_across_processes(job, ticket)


@dataclasses.dataclass
class _Share:
  """What one process writes of a collective save (``plan_save``), staged:
  ``stems[i]`` from ``take(i)`` (released by ``done(i)``); then the
  leaves that span no processes, ``take(len(stems) + j)`` for ``same[j]``,
  whose checksums process 0 compares with its own files'."""

  manifest: dict[str, Any]
  stems: list[str]
  sizes: list[int]
  same: list[str]
  take: Callable[[int], Any]
  done: Callable[[int], None]
  identity: dict[str, Any]


def save_across_processes(
  job: SaveJob, ticket: Ticket | None = None
) -> pending.SaveHandle | None:
  """The collective save of ``job`` (see the module docstring).
  ``job.prepare()`` runs first, on every process: the checks of the call
  (an error there is every process's), and the leaves to write, staged by
  ``job.stage``; ``job.turn()`` before anything is written;
  ``job.release()`` once this process is done with the save. The leaves of
  the job's ``primary_keys`` are process 0's: they are not checked
  against the other processes'. ``ticket``: the call's, taken when it
  began (a new one if None). The files go through ``job.destination``."""
  api, path, o = job.api, job.path, job.options
  if ticket is None:
    with _seq_lock:
      ticket = Ticket(next(_seq))
  client = _client(api)
  board = ticket.board = _Board(
    api, path, client, ticket.seq, o.barrier_timeout_s
  )

  def done() -> None:
    board.release()
    job.release()

  try:
    job.prepare()
    share = _share(job, board.pid)
    board.post(f"id/{board.pid}", json.dumps(share.identity, sort_keys=True))
  except BaseException as err:
    board.fail(err, _NOTHING)
    done()
    raise
  job.leaves = []

  def work() -> None:
    try:
      job.turn()
      _Collective(board, job, share).run()
    except BaseException as err:
      board.fail(err, "")  # the notes were set where it was known
      raise
    finally:
      done()

  if o.blocking:
    work()
    return None
  try:
    return pending.start(path, work)
  except BaseException as err:  # no thread: work() never runs
    board.fail(err, _NOTHING)
    done()
    raise


def _share(job: SaveJob, pid: int) -> _Share:
  """This process's ``_Share`` of ``job``, staged, with the save's
  identity, which every process must share: the path, the manifest (keys,
  shapes, dtypes, shardings) and the leaves that are not arrays."""
  manifest, mine, whole = plan_save(job.api, job.keys, job.paths, job.leaves)
  record, primary = job.record, job.options.primary_keys
  agreed = dataclasses.replace(
    record,
    values={k: v for k, v in record.values.items() if k not in primary},
  )
  arrays = {k: v for k, v in manifest["arrays"].items() if k not in primary}
  plan = checksum.crc(
    json.dumps(arrays, sort_keys=True).encode() + format.encode_record(agreed)
  )
  identity = {"call": "save", "path": job.destination.key, "plan": plan}
  # Process 0 writes them (in C order, as every file): the checksums of its
  # files are the reference.
  whole = [] if pid == 0 else [(k, x) for k, x in whole if k not in primary]
  values = [x for _, x in mine] + [x for _, x in whole]
  names = [stem for stem, _ in mine] + [key for key, _ in whole]
  take, done = job.stage(values, names)
  return _Share(
    manifest, [stem for stem, _ in mine], writer.sizes_of(values[: len(mine)]),
    [key for key, _ in whole], take, done, identity,
  )  # fmt: skip


class _Collective:
  """The protocol of one collective save on this process, once its turn
  came (the module docstring): process 0 begins, every process writes its
  share, process 0 checks the statuses and commits, then runs the job's
  ``committed``; the others wait for its outcome."""

  def __init__(self, board: _Board, job: SaveJob, share: _Share) -> None:
    self.board, self.job, self.share = board, job, share
    self.dest: Destination = job.destination
    self.save: Save | None = None  # begun (process 0) or attached to
    self.where = dict(zip(job.keys, job.paths))
    self.note = _NOTHING
    self.began = False  # process 0: begun and not committed

  def run(self) -> None:
    board, dest = self.board, self.dest
    with contextlib.ExitStack() as stack:
      try:
        if board.pid == 0:
          self.save = save = dest.begin()
          stack.callback(save.end)  # the lock or lease, held to the end
          self.began = True
          ids = [f"id/{p}" for p in range(board.count)]
          entries = board.wait(ids, "start the save too", _NOTHING)
          agree(board, entries, self.share.identity)  # before any shard
          board.post("tmp", save.name)  # the others may write
        else:
          entries = board.wait(
            ["tmp"], "make the temporary directory", _NOTHING
          )
          self.save = dest.attach(entries["tmp"])
        sums = self._write()
        if board.pid == 0:
          self._commit(sums)
      except BaseException as err:
        if self.began and self.save is not None:  # process 0, locked
          with contextlib.suppress(Exception):
            self.save.abort()
        board.fail(err, self.note)
        raise
    self._outcome()

  def _write(self) -> dict[str, list[int]]:
    """This process's files, then its status posted: their checksums, and
    those of the leaves that span no processes (``same``)."""
    board, share = self.board, self.share

    def take(i: int) -> Any:
      board.look()
      return share.take(i)

    bar = writer.Bar("save", share.sizes, self.job.options.progress)

    def done(i: int) -> None:
      share.done(i)
      bar.done(i)

    try:
      assert self.save is not None
      sums = self.save.write(
        share.stems, take, done, self.job.options.threads, {}
      )
    finally:
      bar.close()
    n = len(share.stems)
    same = {}
    for j, key in enumerate(share.same):
      same[key] = hostvalue.digest(share.take(n + j))
      share.done(n + j)
    status = {"crc32c": sums, "same": same}
    board.post(f"status/{board.pid}", json.dumps(status))
    return sums

  def _commit(self, sums: dict[str, list[int]]) -> None:
    """Process 0, every status posted: the agreement checked, the manifest
    and the record committed."""
    board, save = self.board, self.save
    assert save is not None
    statuses = [
      json.loads(v)
      for v in self._all("status", "finish writing", _NOTHING).values()
    ]
    _check_agreement(board, statuses, sums, self.where)
    manifest, record = _final(self.share.manifest, self.job.record, statuses)
    try:
      save.commit(record, manifest)
    except BaseException as err:  # its notes say whether it committed
      notes = getattr(err, "__notes__", ())
      self.note = "".join(f"; {n}" for n in notes) or _NOTHING
      raise
    self.began = False  # committed: nothing to remove
    LOG.info("saved %s (written by every process)", self.job.path)

  def _all(self, kind: str, what: str, note: str) -> dict[str, str]:
    """Waits for ``<kind>/<p>`` of every process ``p``; their values."""
    names = [f"{kind}/{p}" for p in range(self.board.count)]
    entries = self.board.wait(names, what, note)
    return {n: entries[n] for n in names}

  def _outcome(self) -> None:
    """Process 0: the job's ``committed`` (a manager's retention, before
    the others return: they see its result), then "ok" posted; the others
    wait for the outcome."""
    board, path = self.board, self.job.path
    if board.pid == 0:
      try:
        self.job.committed()
      except BaseException as err:
        board.fail(err, f"; {path!r} was committed, then this failed")
        raise
      board.check({"outcome": json.dumps(board.settle({"ok": True}))})
    else:
      note = f"; {path!r} is complete if it was committed"
      board.wait(["outcome"], "commit", note)


def _call(identity: dict[str, Any]) -> str:
  what = (
    "saves" if identity["call"] == "save" else f"calls {identity['call']} of"
  )
  return f"{what} {identity['path']!r}"


def agree(board: _Board, entries: dict[str, str], identity: dict) -> None:
  """Process 0, before anything is written: raises ValueError unless every
  process posted ``identity`` (process 0's) as the identity of this
  collective call: the same call, path and (for a save) tree."""
  for p in range(board.count):
    theirs = json.loads(entries[f"id/{p}"])
    if theirs == identity:
      continue
    if {**theirs, "plan": None} == {**identity, "plan": None}:
      raise ValueError(
        f"{board.api}: processes {board.pid} and {p} save different trees "
        f"to {board.path!r} (keys, shapes, dtypes, shardings or the str/"
        "None/scalar leaves differ); every process must pass the same tree"
      )
    raise ValueError(
      f"{board.api}: the processes are not making the same collective call: "
      f"process {board.pid} {_call(identity)}, process {p} {_call(theirs)}; "
      "every process must make the same collective calls (save, and the "
      "manager's save and delete) in the same order, with the same path"
    )


def _check_agreement(
  board: _Board,
  statuses: list[dict],
  sums: dict[str, list[int]],
  where: dict[str, str],
) -> None:
  """Process 0: raises ValueError unless every process saved the same
  values of the leaves that span no processes, which process 0 alone
  wrote (``sums``: their C-order checksums)."""
  for p, status in enumerate(statuses):
    for key, digest in status["same"].items():
      if digest != sums[key]:
        raise ValueError(
          f"{board.api}: the leaf at {where[key]} (key {key!r}) spans no "
          f"processes and differs between process 0 and process {p}; such a "
          "leaf is written once, by process 0, so it must be equal on every "
          "process (as jax.device_put requires of host values): make it "
          "equal, or save it with collective=False to a path of each process"
        )


def _final(
  manifest: dict, record: format.Record, statuses: list[dict]
) -> tuple[bytes, bytes]:
  """Process 0: the manifest (with every shard file's checksums) and the
  record, encoded."""
  sums = {}
  for status in statuses:
    sums.update(status["crc32c"])
  for entry in manifest["arrays"].values():
    for shard in entry["shards"]:
      shard["crc32c"] = sums[shard["file"][: -len(".npy")]]
  record.dtypes = {k: a["dtype"] for k, a in manifest["arrays"].items()}
  record.save_id = format.new_save_id()
  return format.encode_manifest(manifest), format.encode_record(record)


def run_collective(
  api: str, what: str, path: str, fn: Callable[[], None], timeout_s: float
) -> None:
  """Runs ``fn`` once for every process of the job: a collective call that
  every process makes in the same order as its collective saves (it takes
  the next sequence number of theirs). Each process posts the call's
  identity (``what`` and ``path``, a destination's ``key``, as the
  processes compare it); process 0 waits for all of them (so no
  process is still before the call, e.g. reading what ``fn`` deletes),
  checks that they are the same (``agree``), runs ``fn()`` and posts its
  outcome;
  the others wait for it (at most ``timeout_s``) and raise RuntimeError
  naming process 0's error if it failed (TimeoutError, posted, if it never
  came); process 0 raises its own error."""
  client = _client(api)
  with _seq_lock:  # as save_across_processes: numbers stay in step
    seq = next(_seq)
  board = _Board(
    api, path, client, seq, timeout_s, f"{what} of",
    stages=(("id", f"call {what} too"),),
  )  # fmt: skip
  try:
    identity = {"call": what, "path": path, "plan": None}
    board.post(f"id/{board.pid}", json.dumps(identity, sort_keys=True))
    if board.pid != 0:
      board.wait(["outcome"], what, "")  # raises a failed one
      return
    try:
      entries = board.wait(
        [f"id/{p}" for p in range(board.count)],
        f"call {what} too",
        "; nothing was done",
      )
      agree(board, entries, identity)
      fn()
    except BaseException as err:
      board.fail(err, "")
      raise
    board.check({"outcome": json.dumps(board.settle({"ok": True}))})
  finally:
    board.release()
