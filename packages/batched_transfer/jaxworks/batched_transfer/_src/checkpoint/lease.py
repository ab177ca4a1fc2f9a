"""The writer lease of a CheckpointManager directory: one writer at a time.

A manager that writes (``save``, ``delete``, retention) first holds the
directory's lease: the object ``.jaxworks-writer/<generation>`` in it,
created with ``Storage.create`` (a no-replace link on disk, a conditional
put in a bucket), naming the host, the process, a random writer id and a
heartbeat time that a daemon thread renews every ``HEARTBEAT_S`` seconds.
The holder is the highest generation listed. Another process that wants to
write meets it and raises ``WriterConflictError``, unless the holder is
gone: on the same host (and pid namespace) its process no longer runs, or,
elsewhere, its heartbeat did not move for ``EXPIRY_S`` seconds; then it
takes the lease over by creating the next generation (of two takers one
wins), with a warning. A holder that finds a higher generation lost its
lease and its next write raises. Reading needs no lease.

Managers of one process share its lease on a directory (counted; the last
``release`` deletes it), however each spells the directory (a symbolic
link, a relative path, ``..``: the lease is filed under the directory's
device and inode), and never take over one another's; a jax.distributed
job's writer is process 0 alone.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
import json
import os
import secrets
import socket
import threading
import time
from typing import Any

from .storage import LOG
from .storage import Storage

#: The prefix of the lease objects in a manager directory.
PREFIX = ".jaxworks-writer"
#: How often the holder renews its heartbeat, in seconds.
HEARTBEAT_S = 10.0
#: A lease of another host whose heartbeat is older than this is stale.
EXPIRY_S = 60.0


class WriterConflictError(RuntimeError):
  """Another live process writes the CheckpointManager directory.

  Raised by ``save`` and ``delete`` (never by reads). The message names the
  directory, the other writer (host, pid, since when) and the fix: one
  writer per directory (a job of several processes calls
  ``jax.distributed.initialize`` so that process 0 writes for all), another
  directory, or ``read_only=True`` for a process that only reads.
  """


def _pid_start(pid: int) -> int | None:
  """The start time of process ``pid`` (clock ticks since boot), or None."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
      return int(f.read().rpartition(")")[2].split()[19])
  except (OSError, ValueError, IndexError):
    return None


def _machine() -> str:
  """This host and pid namespace: processes with the same one see each
  other's pids."""
  parts = [socket.gethostname()]
  for path in ("/proc/sys/kernel/random/boot_id",):
    try:
      with open(path, encoding="ascii") as f:
        parts.append(f.read().strip())
    except OSError:
      pass
  try:
    parts.append(os.readlink("/proc/self/ns/pid"))
  except OSError:
    pass
  return "/".join(parts)


def _running(pid: int, start: int | None) -> bool:
  """Whether process ``pid`` (started at ``start``, if known) runs here."""
  if pid <= 0:
    return False
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    pass  # another user's: it exists
  now = _pid_start(pid)
  return start is None or now is None or now == start


def _key(gen: int) -> str:
  return f"{PREFIX}/{gen:020d}"


def describe(record: dict[str, Any]) -> str:
  """The writer of ``record`` in words."""
  since = time.strftime(
    "%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(record.get("started", 0)))
  )
  return (
    f"process {record.get('pid')} on host {record.get('host')!r} (writer "
    f"{record.get('writer')}, since {since})"
  )


class Lease:
  """This process's lease on one directory (``acquire`` makes it)."""

  def __init__(self, st: Storage, directory: str, gen: int) -> None:
    self.storage = st
    self.directory = directory
    self.gen = gen
    self.pid = os.getpid()
    self.writer = secrets.token_hex(8)
    self.started = time.time()
    self.refs = 0
    self.key: Any = st.url  # what ``_held`` files it under (identity)
    self.lost: dict[str, Any] | None = None  # the record that took it over
    self._stop = threading.Event()
    self._io = threading.Lock()  # a renewal and the release, one at a time
    self._thread: threading.Thread | None = None

  def record(self) -> dict[str, Any]:
    return {
      "format": 1,
      "writer": self.writer,
      "host": socket.gethostname(),
      "machine": _machine(),
      "pid": self.pid,
      "pid_start": _pid_start(self.pid),
      "started": self.started,
      "beat": time.time(),
      "directory": self.directory,
    }

  def data(self) -> bytes:
    return json.dumps(self.record(), sort_keys=True).encode()

  def start(self) -> None:
    self._thread = threading.Thread(
      target=self._beat, name=f"jaxworks-lease-{self.directory}", daemon=True
    )
    self._thread.start()

  def _beat(self) -> None:
    while not self._stop.wait(HEARTBEAT_S):
      try:
        if self.renew():
          return
      except Exception as err:  # noqa: BLE001  (kept trying; logged)
        LOG.warning(
          "could not renew the writer lease of %r (%s); another process "
          "may take it over after %g s without one",
          self.directory,
          err,
          EXPIRY_S,
        )

  def renew(self) -> bool:
    """Writes a new heartbeat; True (and ``lost`` set) if a higher
    generation took the lease over, or the lease was released."""
    with self._io:
      if self._stop.is_set():
        return True  # released: never written again
      return self._renew()

  def _renew(self) -> bool:
    gens = _generations(self.storage)
    higher = [g for g in gens if g > self.gen]
    if higher:
      self.lost = _read(self.storage, max(higher)) or {"writer": "?"}
      LOG.warning(
        "the writer lease of %r was taken over by %s; this process no "
        "longer writes there",
        self.directory,
        describe(self.lost),
      )
      return True
    self.storage.write(_key(self.gen), self.data())
    LOG.debug("renewed the writer lease %s", self.storage.where(_key(self.gen)))
    return False

  def check(self, api: str) -> None:
    """Raises WriterConflictError if another writer took the lease over."""
    if self.lost is not None:
      raise WriterConflictError(
        f"{api}: {self.directory!r} is now written by {describe(self.lost)}, "
        "which took over this process's writer lease (its heartbeat had "
        f"stopped for {EXPIRY_S:g} s: was this process suspended?); this "
        "manager no longer writes there: stop one of the two writers, and "
        "create a new CheckpointManager to write again"
      )

  def drop(self) -> None:
    """Stops the heartbeat and deletes this generation (also when lost: a
    lower generation is never the holder)."""
    self._stop.set()
    try:
      with self._io:  # after a renewal under way: none writes it again
        self.storage.delete([_key(self.gen)])
    except OSError as err:
      LOG.warning(
        "could not delete the writer lease of %r: %s", self.directory, err
      )
      return
    root = getattr(self.storage, "root", None)  # a local directory: rmdir
    if root is not None:
      try:
        os.rmdir(os.path.join(root, PREFIX))
      except OSError:
        pass  # not empty (another generation), or gone
    LOG.debug("released the writer lease of %r", self.directory)


_lock = threading.Lock()  # guards _held
_acquiring = threading.Lock()  # one acquire at a time in this process
_held: dict[Any, Lease] = {}  # by ``identity`` of the directory


def _generations(st: Storage) -> list[int]:
  out = []
  for key in st.list(PREFIX):
    name = key.rpartition("/")[2]
    if name.isdigit():
      out.append(int(name))
  return sorted(out)


def _read(st: Storage, gen: int) -> dict[str, Any] | None:
  """The record of generation ``gen`` (None if gone or unreadable)."""
  try:
    data = bytes(st.read(_key(gen)))
  except FileNotFoundError:
    return None
  try:
    record = json.loads(data)
  except ValueError:
    return {}
  return record if isinstance(record, dict) else {}


def _conflict(api: str, directory: str, record: dict[str, Any]) -> Exception:
  return WriterConflictError(
    f"{api}: {directory!r} is being written by another CheckpointManager: "
    f"{describe(record)}; two writers of one directory skip or delete each "
    "other's steps. Run one writer per directory: in a job of several "
    "processes call jax.distributed.initialize() before creating the "
    "manager (process 0 then writes for all), give each job its own "
    "directory, or pass read_only=True where a process only reads. If that "
    f"process is gone, its lease expires {EXPIRY_S:g} s after its last "
    f"heartbeat (or delete {directory}/{PREFIX})"
  )


def _stale(
  api: str,
  st: Storage,
  directory: str,
  gen: int,
  conflict: Callable[[str, str, dict[str, Any]], Exception] = _conflict,
) -> dict[str, Any] | None:
  """Returns the record of generation ``gen`` once its writer is known to
  be gone, None if it was released meanwhile (list again: another process
  may have created a lower generation since); raises ``conflict(api,
  directory, record)`` while it lives; waits at most ``EXPIRY_S`` for a
  writer on another host."""
  record = _read(st, gen)
  if record is None:
    return None  # released meanwhile
  same = record.get("machine") == _machine()
  pid = int(record.get("pid") or 0)
  if same:
    if pid == os.getpid() and record.get("pid_start") == _pid_start(pid):
      return record  # this process's own, no longer held (a fork, a reload)
    if _running(pid, record.get("pid_start")):
      raise conflict(api, directory, record)
    return record
  # Another host: alive while its heartbeat moves. An unreadable record
  # (damaged, or a format this version does not know) is alive while it
  # changes: its age counts from now, never taken over at once.
  beat = record.get("beat")
  since = float(beat or 0) if record else time.time()
  while True:
    age = time.time() - since
    if age > EXPIRY_S:
      return record or {"writer": "unreadable"}
    time.sleep(min(HEARTBEAT_S / 4, EXPIRY_S - age + 0.01))
    now = _read(st, gen)
    if now is None:
      return None  # released meanwhile
    if now.get("beat") != beat:
      raise conflict(api, directory, now)


def acquire(
  api: str,
  st: Storage,
  directory: str,
  conflict: Callable[[str, str, dict[str, Any]], Exception] = _conflict,
) -> Lease:
  """This process's lease on ``directory`` (``st`` its storage), one more
  reference to it; raises WriterConflictError (or what ``conflict(api,
  directory, record)`` returns) while another live process holds it."""
  with _acquiring:
    return _acquire(api, st, directory, conflict)


def identity(st: Storage) -> Any:
  """What names ``st``'s directory however its path is spelled: a local
  directory's (device, inode), else its real path (symbolic links, ``..``
  and relative spellings resolved); a bucket prefix's URL."""
  root = getattr(st, "root", None)
  if root is None:
    return st.url
  try:
    info = os.stat(root)
  except OSError:
    return ("path", os.path.realpath(root))
  return ("inode", info.st_dev, info.st_ino)


def _shared(key: Any) -> Lease | None:
  """This process's live lease on ``key``, one more reference to it."""
  with _lock:
    held = _held.get(key)
    if held is not None and held.pid == os.getpid() and held.lost is None:
      held.refs += 1
      return held
  return None


def _acquire(
  api: str,
  st: Storage,
  directory: str,
  conflict: Callable[[str, str, dict[str, Any]], Exception],
) -> Lease:
  key = identity(st)
  held = _shared(key)
  if held is not None:
    return held
  for _ in range(20):
    gens = _generations(st)
    taken = None
    if gens:
      record = _read(st, gens[-1]) or {}
      with _lock:  # this process's own lease, under another key: shared
        mine = [
          x
          for x in _held.values()
          if x.writer == record.get("writer") and x.pid == os.getpid()
        ]
      if mine:
        held = _shared(mine[0].key)
        if held is not None:
          return held
      taken = _stale(api, st, directory, gens[-1], conflict)
      if taken is None:
        continue  # released meanwhile: judge what is there now
    gen = gens[-1] + 1 if gens else 0
    lease = Lease(st, directory, gen)
    try:
      st.create(_key(gen), lease.data())
    except FileExistsError:
      continue  # another process created it first: judge that one
    if gens:
      try:
        st.delete([_key(g) for g in gens])
      except OSError:
        pass  # left: lower generations are never the holder
    if taken:
      LOG.warning(
        "%s: took over the writer lease of %r from %s, which is gone (its "
        "process no longer runs, or its heartbeat stopped)",
        api,
        directory,
        describe(taken),
      )
    LOG.debug("holding the writer lease %s", st.where(_key(gen)))
    lease.refs = 1
    lease.key = key
    lease.start()
    with _lock:
      _held[key] = lease
    _register_exit()
    return lease
  raise WriterConflictError(
    f"{api}: could not take the writer lease of {directory!r}: other "
    "processes keep creating it; run one writer per directory"
  )


def release(lease: Lease) -> None:
  """Drops one reference to ``lease``; the last deletes it."""
  with _lock:
    lease.refs -= 1
    if lease.refs > 0:
      return
    if _held.get(lease.key) is lease:
      del _held[lease.key]
  if lease.pid == os.getpid():
    lease.drop()


_registered = False


def _register_exit() -> None:
  global _registered
  with _lock:
    if _registered:
      return
    _registered = True
  atexit.register(_release_all)


def _release_all() -> None:
  """At exit (after the save threads finished): delete this process's
  leases."""
  with _lock:
    leases = [x for x in _held.values() if x.pid == os.getpid()]
    _held.clear()
  for lease in leases:
    lease.drop()


def _after_fork() -> None:
  global _lock, _acquiring
  _lock, _acquiring = threading.Lock(), threading.Lock()
  _held.clear()


if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=_after_fork)
