"""Warm starts: entries of JAX's persistent cache deserialized before JAX
asks for them.

JAX finds a program in its persistent cache only after tracing, lowering and
hashing it; only then does it read and deserialize the executable, which for
a training step can take as long as the trace, and adds up over the eager
operations and library jits of a process's start (BENCHMARKS.md has warm-start
figures). jit_cache records which entries were read (``hints.py``)
and, in the next process, deserializes them on a background thread
(``deserialize_executable`` releases the GIL) while this one traces:

* **A call site's first call.** A ``jit_cache.jit`` function's first
  top-level call prefetches the entry its call site read last time, and
  waits for that prefetch before it returns.
* **A process's start.** ``set_cache_dir`` prefetches, in order, the entries
  the last run of the same command line read (eager operations, library
  jits, jit_cache's and ``jax.jit``'s programs). What the process passes by
  without asking for is dropped; what is left is dropped ``LINGER_S``
  seconds after the list is done, when the cache is switched, and at exit.

JAX's own read takes a prefetched executable only when it asks for the same
key with the same compile options and devices, which is what it would have
deserialized itself. Anything else (no hint, a stale or planted one, a
failure in the background) is dropped, and JAX reads its entry as always.
XLA aborts the process on compile options that contradict an executable:
hints are read only from files the user owns that nobody else may write
(``hints.py``), and options that contradict themselves are refused before
XLA sees them. Bounded caches (``max_bytes``) and
``jax_compilation_cache_check_contents`` are left to JAX's own reads (its
bookkeeping is in them).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from typing import Any

import jax

from . import cache_dir as _cache_dir
from . import hints as _hints
from . import jax_internals as ji
from . import monitoring as _monitoring

#: Seconds a process prefetch keeps what nobody asked for after its list.
LINGER_S = 30.0
_NULL = contextlib.nullcontext()
#: Call sites compiled in this process: later misses of the same site (a
#: re-created closure) reuse in-process and need no prefetch.
_SEEN: set[str] = set()
_SEEN_MAX = 4096
#: (id of the code, hash of the call signature) of calls whose site is in
#: ``_SEEN``: a re-created closure's miss skips the site digest. A collision
#: (a code object freed and its id reused) only skips a prefetch.
_SEEN_CALLS: set[tuple[int, int]] = set()
_LOCK = threading.Lock()
#: JAX cache key -> the item that answers JAX's read of it.
_PENDING: dict[str, _Item] = {}
_local = threading.local()
_config = jax.config
_process_index = jax.process_index
_record_duration = jax.monitoring.record_event_duration_secs
#: ``jax.monitoring`` duration event: one entry read and deserialized by a
#: prefetch, off the main thread (seconds).
DESERIALIZE_EVENT = "/jaxworks/jit_cache/prefetch_deserialize_sec"


def hints_dir() -> str | None:
  """The hint directory of JAX's persistent cache, or None where there is
  nothing to prefetch from: no cache, one not on a local file system, or one
  that checks or bounds its entries on each read."""
  directory = getattr(_config, "jax_compilation_cache_dir")
  if not directory or "://" in directory:
    return None
  if getattr(_config, "jax_compilation_cache_max_size") != -1:
    return None
  if getattr(_config, "jax_compilation_cache_check_contents"):
    return None
  return os.path.join(directory, _hints.HINTS)


# ------------------------------------------------------------ prefetching


class _Item:
  """One entry to deserialize, and its result once done."""

  __slots__ = ("read", "position", "loader", "state", "result", "done")

  def __init__(self, read: _hints.Read, position: int, loader: _Loader):
    self.read, self.position, self.loader = read, position, loader
    self.state = "queued"  # -> running -> done, or dropped
    self.result: tuple | None = None  # (backend, executable, compile time)
    self.done = threading.Event()

  def take(self, options: Any, backend: Any, devices: Any) -> tuple | None:
    """(executable, compile time) if this is what JAX asks for, else None;
    waits for a deserialization under way."""
    r = self.read
    if (
      tuple(d.id for d in devices) != r.devices
      or r.platform != backend.platform
      or options.SerializeAsString() != r.options
    ):
      with _LOCK:
        self.drop()  # a result still under way is discarded by its loader
      return None
    self.done.wait()
    with _LOCK:
      result, self.result = self.result, None
      self.state = "dropped"
    if result is None or result[0] is not backend:
      return None
    return result[1:]

  def drop(self) -> None:
    """Under ``_LOCK``."""
    if _PENDING.get(self.read.key) is self:
      del _PENDING[self.read.key]
    self.state, self.result = "dropped", None
    self.done.set()


class _Loader:
  """A background thread deserializing ``reads`` in order, keeping what
  it made for ``linger`` seconds (None: until ``stop``)."""

  def __init__(
    self, reads: list[_hints.Read], entries: str, linger: float | None
  ):
    self.entries, self.linger = entries, linger
    self.items = [_Item(r, i, self) for i, r in enumerate(reads)]
    self._stop = threading.Event()
    self.thread = threading.Thread(
      target=self._run, name="jaxworks-prefetch", daemon=True
    )

  def start(self) -> bool:
    """Registers its items (in place of another loader's that has not
    started on the same key) and starts."""
    with _LOCK:
      mine = []
      for item in self.items:
        other = _PENDING.get(item.read.key)
        if other is not None and other.state != "queued":
          continue  # under way or done: that one answers JAX
        if other is not None:
          other.drop()
        _PENDING[item.read.key] = item
        mine.append(item)
      self.items = mine
    if not self.items:
      return False
    try:
      self.thread.start()
    except RuntimeError:  # no thread to be had: JAX reads as always
      self.stop()
      return False
    return True

  def _run(self) -> None:
    try:
      self._load()
    finally:  # whatever happens, nobody waits on an item forever
      self._drop_all()
      with _LOCK:
        for item in self.items:
          item.done.set()

  def _load(self) -> None:
    for item in self.items:
      if self._stop.is_set():
        break
      with _LOCK:
        if item.state != "queued":
          continue
        item.state = "running"
      result = _deserialize(item.read, self.entries)
      with _LOCK:
        if item.state == "running":
          item.state, item.result = "done", result
          if result is None:
            item.drop()
      item.done.set()
    self._stop.wait(self.linger)
    self._drop_all()

  def passed(self, position: int) -> None:
    """JAX asked for the item at ``position``: those before it that it did
    not ask for are not coming."""
    with _LOCK:
      for item in self.items:
        if item.position < position and item.state in ("queued", "done"):
          item.drop()

  def _drop_all(self) -> None:
    with _LOCK:
      for item in self.items:
        if item.state != "running":
          item.drop()

  def stop(self) -> None:
    """Drops everything and waits for the thread (nothing outlives it)."""
    self._stop.set()
    self._drop_all()
    if self.thread.is_alive() and self.thread is not threading.current_thread():
      self.thread.join()
    self._drop_all()


def _deserialize(read: _hints.Read, entries: str) -> tuple | None:
  """(backend, executable, compile time) of ``read``'s entry, or None."""
  try:
    backend = ji.initialized_backend(read.platform)
    if backend is None or ji.distributed_client() is not None:
      return None  # never start a backend; one process at a time
    by_id = {d.id: d for d in backend.devices()}
    devices = ji.DeviceList(tuple(by_id[i] for i in read.devices))
    options = ji.compile_options_from_bytes(read.options)
    # XLA aborts the process on options that contradict themselves.
    if options.num_replicas != 1 or options.num_partitions != len(devices):
      return None
    t0 = time.perf_counter()
    entry = _hints.read_regular(
      os.path.join(entries, read.key + "-cache"), _hints.MAX_ENTRY_BYTES
    )
    if entry is None:
      return None
    serialized, compile_time = ji.executable_and_time(entry)
    exe = backend.deserialize_executable(serialized, devices, options)
    _record_duration(DESERIALIZE_EVENT, time.perf_counter() - t0)
    return backend, exe, compile_time
  except Exception:  # pylint: disable=broad-except
    return None  # JAX reads the entry itself and reports what is wrong


def _cache_read(read, cache_key, compile_options, backend, devices):
  """JAX's persistent-cache read: recorded, and answered by a matching
  prefetch."""
  if getattr(_local, "building", False):
    _local.read = (cache_key, compile_options, backend, devices)
  _PROCESS.record(cache_key, compile_options, backend, devices)
  if _PROCESS.waiting:
    _PROCESS.begin()
  with _LOCK:
    item = _PENDING.pop(cache_key, None)
    if item is not None and item.state == "queued" and item.position:
      item.drop()  # others first: JAX is as quick to read it itself
      item = None
  if item is not None:
    got = item.take(compile_options, backend, devices)
    item.loader.passed(item.position)
    if got is not None:
      _monitoring.count_prefetched()
      return got
  return read(cache_key, compile_options, backend, devices)


# ---------------------------------------------------------- call sites


def first_compile(
  fun: Any, leaves: list, treedef: Any, statics: tuple, sig: Any
) -> Any:
  """A context for a top-level call that may compile: prefetches while it
  runs when a hint exists, and writes or refreshes the hint afterwards.
  ``sig`` is the call's dispatch signature (equal signatures of one code
  give one site)."""
  if (
    not _cache_dir.config.prefetch
    or getattr(_local, "session", None) is not None
  ):
    return _NULL
  code = _hints.code_of(fun)
  call = (id(code), hash(sig))
  if call in _SEEN_CALLS:
    return _NULL
  directory = hints_dir()
  if directory is None or not ji.persistent_cache_enabled():
    return _NULL
  abstractify = ji.shaped_abstractify
  try:
    short = lambda x: abstractify(x).str_short()  # noqa: E731
    name = _hints.site_digest(fun, leaves, treedef, statics, short)
  except Exception:  # pylint: disable=broad-except
    return _NULL  # an abstract value without a short form: no prefetch
  if name is None:
    return _NULL
  with _LOCK:
    if len(_SEEN) >= _SEEN_MAX:
      _SEEN.clear()
      _SEEN_CALLS.clear()
    _SEEN_CALLS.add(call)
    if name in _SEEN:
      return _NULL
    _SEEN.add(name)
  return _Session(directory, name)


def forget_sites() -> None:
  """Forgets which call sites compiled in this process (their next first
  call prefetches and writes its hint again)."""
  with _LOCK:
    _SEEN.clear()
    _SEEN_CALLS.clear()


class _Session:
  """One call's prefetch, and the hint of what JAX read for it."""

  def __init__(self, directory: str, name: str):
    self.path = os.path.join(directory, name + ".json")
    self.entries = os.path.dirname(directory)
    self.hint: _hints.Read | None = None
    self.loader: _Loader | None = None

  def __enter__(self) -> _Session:
    _local.session, _local.read = self, None
    ji.wrap_cache_read(_cache_read)
    self.hint = _hints.read_site(self.path)
    if self.hint is not None:
      loader = _Loader([self.hint], self.entries, None)  # until __exit__
      self.loader = loader if loader.start() else None
    return self

  def __exit__(self, *exc: Any) -> None:
    _local.session = None
    if self.loader is not None:
      self.loader.stop()
    seen, _local.read = _local.read, None
    if seen is None or exc[0] is not None or _process_index() != 0:
      return
    read = _hints.of_call(*seen)
    if read != self.hint:
      _hints.write_site(self.path, read)


@contextlib.contextmanager
def building():
  """Marks the compile of a call site: the cache read it makes is the one
  its hint names."""
  _local.building = True
  try:
    yield
  finally:
    _local.building = False


# ------------------------------------------------------------- processes


class _Process:
  """This process's reads of the cache, and its prefetch at start."""

  def __init__(self):
    self.loader: _Loader | None = None
    self.loaded: list[_hints.Read] = []
    self.reads: list[tuple] = []
    self.path: str | None = None
    self.waiting = False  # for the first read to start the prefetch

  def start(self) -> None:
    """At ``set_cache_dir``: reads the hint of this command line. The
    prefetch starts at the first read of the cache (the backend is up then,
    and ``jax.distributed`` initialized or not: a prefetch never starts a
    backend)."""
    self.stop()
    directory, name = hints_dir(), _hints.process_digest()
    if directory is None or name is None or not _cache_dir.config.prefetch:
      return
    self.path = os.path.join(directory, name + ".json")
    ji.wrap_cache_read(_cache_read)
    self.loaded = _hints.read_process(self.path)
    self.waiting = bool(self.loaded)

  def begin(self) -> None:
    with _LOCK:
      if not self.waiting:
        return
      self.waiting = False
    directory = os.path.dirname(self.path or "")
    loader = _Loader(self.loaded, os.path.dirname(directory), LINGER_S)
    self.loader = loader if loader.start() else None

  def record(self, key, options, backend, devices) -> None:
    if self.path is not None and len(self.reads) < _hints.MAX_READS:
      self.reads.append((key, options, backend, devices))

  def stop(self) -> None:
    """Drops the prefetch and writes the hint of the reads so far."""
    self.waiting = False
    loader, self.loader = self.loader, None
    if loader is not None:
      loader.stop()
    path, self.path = self.path, None
    reads, self.reads = self.reads, []
    if path is None or not reads or _process_index() != 0:
      return
    try:
      now = [_hints.of_call(*r) for r in reads]
    except Exception:  # pylint: disable=broad-except
      return  # a backend gone at exit: no hint this time
    if now != self.loaded:
      _hints.write_process(path, now)


_PROCESS = _Process()
atexit.register(_PROCESS.stop)


def _after_fork_in_child() -> None:
  """A forked child has none of the parent's threads: nothing it could
  wait on is left pending, and the lock starts free."""
  global _LOCK
  _LOCK = threading.Lock()
  for item in list(_PENDING.values()):
    item.state, item.result = "dropped", None
    item.done.set()
  _PENDING.clear()
  _PROCESS.loader, _PROCESS.waiting, _PROCESS.path = None, False, None
  _PROCESS.reads = []


if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=_after_fork_in_child)


def start_process() -> None:
  """Called by ``persistent.set_cache_dir``: the process prefetch of the
  directory now in use (or none)."""
  _PROCESS.start()
