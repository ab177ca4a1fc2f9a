"""A persistent executable cache on disk, keyed by program fingerprints.

Off by default. ``set_cache_dir(path)`` (or the environment variable
``JAXWORKS_JIT_CACHE_DIR``) turns it on: an executable compiled for a program
whose structural fingerprint is fully content-based is serialized to the
directory, and a new process tracing the same program loads it instead of
lowering and compiling.

On a hit the first call of a new process costs: tracing, the fingerprint,
the key (``disk_key.py``: one pass over the fingerprint), reading one file
and checking it (``disk_store.py``: exact key comparison, payload checksum),
and deserializing the executable. Nothing is lowered, hashed as HLO or
compiled. On a miss the program is compiled as usual; serializing and
writing the new entry happen on a background thread (``config.flush()``
waits for them; writes are flushed at exit), so a miss costs about what
``jax.jit``'s first call costs plus the key. A write that fails leaves no entry (the
rename is the last step) and warns; it never changes a result.

Any mismatch (truncated file, flipped byte, another version, another
machine) rejects the entry with a reason, which ``explain_miss`` reports;
the program is compiled and the entry rewritten. Entries are pickles: load
them only from a directory you trust, as with
``jax.experimental.serialize_executable``.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from collections.abc import Sequence
import os
import pickle
import threading
import time
from typing import Any
import warnings
import weakref

import jax
from jax.experimental import serialize_executable as _serialize

from . import disk_key as _key
from . import disk_store as _store

# Stock JAX callables bound at import (safe under ``jax.* = ...`` swaps).
_jax_devices = jax.devices

#: Environment variable naming the cache directory (read on every lookup
#: while ``set_cache_dir`` has not been called).
ENV_VAR = "JAXWORKS_JIT_CACHE_DIR"
#: Default bound on the directory's entry bytes.
DEFAULT_MAX_BYTES = 1 << 30

# The parts other modules and tests use, in one place.
NotPersistable = _key.NotPersistable
make_key = _key.make_key
FORMAT_VERSION = _store.FORMAT_VERSION
MAGIC = _store.MAGIC
HEADER = _store.HEADER
SUFFIX = _store.SUFFIX
read_entry = _store.read_entry
write_entry = _store.write_entry
evict = _store.evict

_UNSET: Any = object()


class _Config:
  """Settings of the disk cache (``jit_cache.config``).

  Attributes:
    cache_dir: the directory in use, or None (off); see ``set_cache_dir``.
    max_bytes: bound on the directory's entry bytes.
    background_writes: serialize and write new entries on a background
      thread (default True); False writes them before the call returns.
  """

  def __init__(self):
    self._dir: Any = _UNSET
    self.max_bytes = DEFAULT_MAX_BYTES
    self.background_writes = True

  @property
  def cache_dir(self) -> str | None:
    """The directory in use, or None (off)."""
    if self._dir is not _UNSET:
      return self._dir
    return os.environ.get(ENV_VAR) or None

  def flush(self, timeout: float | None = None) -> bool:
    """Waits until entries being written in the background are on disk.

    Returns:
      True when none is pending any more (False: ``timeout`` seconds passed).
    """
    return WRITER.flush(timeout)

  def __repr__(self) -> str:
    return (
      f"jit_cache.config(cache_dir={self.cache_dir!r}, "
      f"max_bytes={self.max_bytes}, "
      f"background_writes={self.background_writes})"
    )


config = _Config()


def set_cache_dir(
  path: str | os.PathLike | None, max_bytes: int | None = None
) -> None:
  """Turns the persistent executable cache on (a directory) or off (None).

  Args:
    path: directory for entries (created if missing), or None to turn the
      cache off (also when ``JAXWORKS_JIT_CACHE_DIR`` is set).
    max_bytes: bound on the directory's entry bytes (default 1 GiB); least
      recently used entries are deleted beyond it.

  Raises:
    TypeError: ``path`` is not a path or None, or ``max_bytes`` not an int.
    ValueError: ``max_bytes`` is not positive.
  """
  if path is not None and not isinstance(path, (str, os.PathLike)):
    raise TypeError(
      "jaxworks.jit_cache.set_cache_dir: path must be a str, an "
      f"os.PathLike or None, got {type(path).__name__} {path!r:.80}"
    )
  if max_bytes is not None:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
      raise TypeError(
        "jaxworks.jit_cache.set_cache_dir: max_bytes must be an int, got "
        f"{type(max_bytes).__name__} {max_bytes!r:.80}"
      )
    if max_bytes <= 0:
      raise ValueError(
        "jaxworks.jit_cache.set_cache_dir: max_bytes must be positive, got "
        f"{max_bytes}; pass None to turn the cache off"
      )
    config.max_bytes = max_bytes
  config._dir = None if path is None else os.fspath(path)


def enabled() -> bool:
  return config.cache_dir is not None


# ----------------------------------------------------------------- counters


class DiskCounters:
  __slots__ = (
    "hits",
    "misses",
    "rejected",
    "writes",
    "bytes_read",
    "bytes_written",
    "load_s",
    "evictions",
    "unpersistable",
  )

  def __init__(self):
    self.reset()

  def reset(self) -> None:
    for name in self.__slots__:
      setattr(self, name, 0)
    self.load_s = 0.0


COUNTERS = DiskCounters()
_COUNT_LOCK = threading.Lock()


def _count(counters: Sequence[Any], field: str, n: Any = 1) -> None:
  """Adds ``n`` to ``field`` of COUNTERS and ``disk_<field>`` of each of
  ``counters`` (the caller's and the global cache counters)."""
  with _COUNT_LOCK:
    setattr(COUNTERS, field, getattr(COUNTERS, field) + n)
    attr = "disk_" + field
    for c in counters:
      if hasattr(c, attr):
        setattr(c, attr, getattr(c, attr) + n)


#: Per trace entry: what the disk cache did for it last (for explain_miss):
#: text, or a function computing it (work only explain_miss needs).
_NOTES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_NOTES_LOCK = threading.Lock()


def _note(owner: Any, note: Any) -> None:
  if owner is None:
    return
  with _NOTES_LOCK:
    try:
      _NOTES[owner] = note
    except TypeError:
      pass


def note_for(owner: Any) -> str | None:
  """What the disk cache last did for ``owner`` (a trace entry), or None."""
  if owner is None:
    return None
  with _NOTES_LOCK:
    note = _NOTES.get(owner)
  return note() if callable(note) else note


# ----------------------------------------------------------------- writes


class _Writer:
  """Runs entry writes in order on one daemon thread; flushed at exit."""

  def __init__(self):
    self._reset()

  def _reset(self) -> None:
    self.cv = threading.Condition()
    self.jobs: list[Callable[[], None]] = []
    self.pending = 0
    self.thread: threading.Thread | None = None

  def submit(self, job: Callable[[], None]) -> None:
    with self.cv:
      self.jobs.append(job)
      self.pending += 1
      if self.thread is None or not self.thread.is_alive():
        self.thread = threading.Thread(
          target=self._run, name="jaxworks-jit-cache-writer", daemon=True
        )
        self.thread.start()
      self.cv.notify_all()

  def _run(self) -> None:
    while True:
      with self.cv:
        while not self.jobs:
          if not self.cv.wait(timeout=30.0) and not self.jobs:
            self.thread = None  # idle: a later submit starts a new one
            return
        job = self.jobs.pop(0)
      try:
        job()
      except Exception as e:  # pylint: disable=broad-except
        warnings.warn(
          f"jaxworks.jit_cache: a disk cache write failed: "
          f"{type(e).__name__}: {e}",
          RuntimeWarning,
        )
      finally:
        with self.cv:
          self.pending -= 1
          self.cv.notify_all()

  def flush(self, timeout: float | None = None) -> bool:
    with self.cv:
      return self.cv.wait_for(lambda: self.pending == 0, timeout)


WRITER = _Writer()
atexit.register(WRITER.flush)  # runs before jax's own exit handler (LIFO)
if hasattr(os, "register_at_fork"):  # the child has no writer thread
  os.register_at_fork(after_in_child=WRITER._reset)  # pylint: disable=protected-access


# ------------------------------------------ JAX's persistent cache hits

# An executable that XLA:CPU loaded from JAX's persistent compilation cache
# serializes into bytes whose executable fails when loaded and run ("Function
# ... fusion not found"), so such an executable is never written here. JAX
# records a monitoring event for each hit, on the thread that compiles.
_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_PROBE = "/jaxworks/jit_cache/listener_probe"


class _ThreadEvents(threading.local):
  count = 0


_events = _ThreadEvents()


def _on_event(event: str, **_: Any) -> None:
  if event in (_JAX_CACHE_HIT, _PROBE):
    _events.count += 1


def _jax_cache_events() -> int:
  """This thread's count of JAX cache hits (and probes) so far.

  Records a probe event first: when it does not arrive, the listener was
  never registered or ``jax.monitoring.clear_event_listeners()`` removed it,
  and it is registered (again).
  """
  before = _events.count
  jax.monitoring.record_event(_PROBE)
  if _events.count == before:
    jax.monitoring.register_event_listener(_on_event)
  return _events.count


# ----------------------------------------------------------------- build


def wrap_build(
  build: Callable[[], Any],
  make: Callable[[Any, float, tuple], Any],
  owner: Any,
  in_tree: Any,
  out_tree: Any,
  leaves: Sequence[Any],
  program: Any,
  params: Any,
  context: tuple,
  counters: Sequence[Any] = (),
) -> Callable[[], Any]:
  """``build`` going through the disk cache.

  Args:
    build: compiles (lowering included); returns an executable record with
      ``compiled``, ``compile_seconds``, ``warnings`` and ``const_args``.
    make: ``make(compiled, compile_seconds, warnings)`` builds that record
      from a loaded ``jax.stages.Compiled``.
    owner: the trace entry (for ``explain_miss``).
    in_tree, out_tree: the trace's argument and output trees.
    leaves: the call's flat arguments.
    program, params: the program's and its parameters' fingerprints.
    context: the trace context values.
    counters: cache counters given ``disk_*`` increments as well.
  """
  directory = config.cache_dir
  if directory is None:
    return build

  def through_disk() -> Any:
    try:
      key = make_key(program, params, leaves, context)
    except NotPersistable as e:
      _count(counters, "unpersistable")
      _note(owner, f"disk cache: not persisted ({e})")
      return build()
    name = _key.file_name(key, SUFFIX)
    path = os.path.join(directory, name)
    t0 = time.perf_counter()
    payload, reason = read_entry(path, key)
    if payload is not None:
      exe, reason = _load(payload, in_tree, out_tree, make)
      if exe is not None:
        _count(counters, "hits")
        _count(counters, "bytes_read", len(payload))
        _count(counters, "load_s", time.perf_counter() - t0)
        _store.touch(path)  # least recently used: touched on every hit
        _note(owner, f"disk cache: loaded {name}")
        for w in exe.warnings:  # what lowering anew would have said
          warnings.warn(w, stacklevel=6)
        return exe
    _count(counters, "misses")
    if reason == "absent":
      note: Any = _absent_note(directory, key, name)
    else:
      _count(counters, "rejected")
      note = f"disk cache: entry {name} rejected: {reason}; rewritten"
    hits = _jax_cache_events()
    exe = build()
    if _events.count != hits:
      _count(counters, "unpersistable")
      _note(
        owner,
        _amend(
          note,
          " (not written: the executable came from JAX's persistent "
          "compilation cache, and XLA cannot serialize such an executable "
          "again; it is written by a process that compiles it)",
        ),
      )
      return exe
    _note(owner, note)
    _write(directory, name, key, exe, counters, owner, note)
    return exe

  return through_disk


def _load(
  payload: bytes, in_tree: Any, out_tree: Any, make: Callable
) -> tuple[Any, str]:
  """(executable record, "") from a checked payload, or (None, reason)."""
  try:
    record = pickle.loads(payload)
    by_id = {d.id: d for d in _jax_devices(record["platform"])}
    compiled = _serialize.deserialize_and_load(
      record["executable"],
      in_tree,
      out_tree,
      backend=record["platform"],
      execution_devices=[by_id[i] for i in record["devices"]],
    )
    exe = make(
      compiled,
      record["compile_seconds"],
      tuple(UserWarning(m) for m in record["warnings"]),
    )
  except Exception as e:  # pylint: disable=broad-except
    return None, f"corrupt: could not load ({type(e).__name__}: {e})"
  return exe, ""


def _absent_note(directory: str, key: dict, name: str) -> Callable[[], str]:
  """The note of a lookup that found no entry; whether an entry of the same
  program for another environment exists is looked up only when asked."""
  text: list[str] = []

  def note() -> str:
    if not text:
      reason = _store.rejected_sibling(directory, key, name)
      text.append(
        f"disk cache: no entry {name}"
        + (
          f"; an entry for another environment was rejected: {reason}"
          if reason
          else ""
        )
      )
    return text[0]

  return note


def _write(
  directory: str,
  name: str,
  key: dict,
  exe: Any,
  counters: Sequence[Any],
  owner: Any,
  note: Any,
) -> None:
  """Writes the entry of ``exe`` (serialized, pickled, written and evicted
  on the writer thread unless configured otherwise); the note of ``owner``
  says when it could not be written.

  Serializing reads the compiled executable and may run while a call runs
  it (tested with many programs, each loaded by a new process and compared
  with ``jax.jit``). What XLA:CPU cannot serialize again are executables
  loaded from JAX's persistent cache, which are never written (see above).
  """
  if exe.const_args:
    _note(owner, _amend(note, " (not written: it has constant arguments)"))
    return
  owner_ref = weakref.ref(owner) if owner is not None else None
  max_bytes = config.max_bytes

  def job() -> None:
    target = owner_ref() if owner_ref is not None else None
    try:
      serialized, _, _ = _serialize.serialize(exe.compiled)
      devices = exe.compiled.runtime_executable().local_devices()
      record = {
        "executable": serialized,
        "platform": devices[0].platform,
        "devices": [d.id for d in devices],
        "compile_seconds": exe.compile_seconds,
        "warnings": [str(w) for w in exe.warnings],
      }
    except Exception as e:  # pylint: disable=broad-except
      problem = f" (not written: not serializable: {type(e).__name__}: {e})"
      _note(target, _amend(note, problem))
      return
    problem = _write_record(directory, name, key, record, counters, max_bytes)
    if problem:
      _note(target, _amend(note, problem))

  if config.background_writes:
    WRITER.submit(job)
  else:
    job()


def _amend(note: Any, text: str) -> Any:
  if callable(note):
    return lambda: note() + text
  return note + text


def _write_record(
  directory: str,
  name: str,
  key: dict,
  record: dict,
  counters: Sequence[Any],
  max_bytes: int,
) -> str:
  """Writes one entry; returns "" or why it was not written."""
  payload = pickle.dumps(record, protocol=4)
  try:
    os.makedirs(directory, exist_ok=True)
    written = write_entry(directory, name, key, payload)
    _count(counters, "writes")
    _count(counters, "bytes_written", written)
    _count(counters, "evictions", evict(directory, max_bytes, keep=name))
  except OSError as e:
    warnings.warn(
      f"jaxworks.jit_cache: could not write the disk cache entry "
      f"{name} in {directory}: {e}",
      RuntimeWarning,
    )
    return f" (not written: {e})"
  return ""
