"""Across processes: JAX's persistent compilation cache, switched on and read.

jit_cache keeps no files of its own. ``set_cache_dir(path)`` (or the
environment variable ``JAXWORKS_JIT_CACHE_DIR``) turns on JAX's persistent
compilation cache for the whole process: ``jax_compilation_cache_dir``, with
``jax_persistent_cache_min_compile_time_secs`` and
``jax_persistent_cache_min_entry_size_bytes`` at 0 so that small programs are
cached too (each overridable through ``config``). Every compile of the
process goes through it: ``jit_cache.jit``'s, ``jax.jit``'s, eager
operations' and library jits'. Its entries are XLA executables, never pickles.

JAX decides once per process, at its first compile, whether the cache is
used; ``set_cache_dir`` resets that decision, so it takes effect when called
after a compile too.

What JAX reports through ``jax.monitoring`` is counted here: process-wide for
``stats()``, and per compile of a jit_cache function, for its
``cache_info()`` and ``explain_miss``.
"""

from __future__ import annotations

from collections.abc import Callable
import os
import stat
import threading
from typing import Any
import warnings
import weakref

import jax

from . import closures as _closures

_config_update = jax.config.update
_monitoring = jax.monitoring
_process_index = jax.process_index


def _ji():
  """``jax_internals``, imported when first needed: importing
  ``jaxworks.jit_cache`` (this module with it) stays cheap."""
  from . import jax_internals  # pylint: disable=g-import-not-at-top

  return jax_internals


#: Environment variable naming the cache directory (read at import).
ENV_VAR = "JAXWORKS_JIT_CACHE_DIR"

HITS = "/jax/compilation_cache/cache_hits"
MISSES = "/jax/compilation_cache/cache_misses"
REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
TIME_SAVED = "/jax/compilation_cache/compile_time_saved_sec"
RETRIEVAL = "/jax/compilation_cache/cache_retrieval_time_sec"
_PROBE = "/jaxworks/jit_cache/listener_probe"

_UNSET: Any = object()


class _Config:
  """Settings of the persistent cache (``jit_cache.config``).

  Attributes:
    cache_dir: the directory in use, or None (off); see ``set_cache_dir``.
    min_compile_time_secs: ``jax_persistent_cache_min_compile_time_secs``
      while the cache is on (default 0: every program is written).
    min_entry_size_bytes: ``jax_persistent_cache_min_entry_size_bytes``
      while the cache is on (default 0).
    max_bytes: ``jax_compilation_cache_max_size`` (default -1: no bound; a
      bound needs the ``filelock`` package, which JAX's eviction uses).
    prefetch: whether a function's first call in a process deserializes its
      executable from the cache while it traces (default True; see
      ``prefetch.py``).
  """

  _JAX_NAMES = {
    "min_compile_time_secs": "jax_persistent_cache_min_compile_time_secs",
    "min_entry_size_bytes": "jax_persistent_cache_min_entry_size_bytes",
    "max_bytes": "jax_compilation_cache_max_size",
  }

  def __init__(self):
    self._dir: str | None = None
    self._values: dict[str, Any] = {
      "min_compile_time_secs": 0.0,
      "min_entry_size_bytes": 0,
      "max_bytes": -1,
    }
    self._prefetch = True

  @property
  def cache_dir(self) -> str | None:
    """The directory in use, or None (off)."""
    return self._dir

  def _get(self, name: str) -> Any:
    return self._values[name]

  def _set(self, name: str, value: Any) -> None:
    _check_setting(name, value)
    self._values[name] = value
    if self._dir is not None:
      _config_update(self._JAX_NAMES[name], value)
      _ji().reset_persistent_cache()

  @property
  def prefetch(self) -> bool:
    return self._prefetch

  @prefetch.setter
  def prefetch(self, value: bool) -> None:
    if not isinstance(value, bool):
      raise TypeError(
        "jaxworks.jit_cache.config.prefetch must be True or False, got "
        f"{type(value).__name__} {value!r:.80}"
      )
    self._prefetch = value

  min_compile_time_secs = property(
    lambda self: self._get("min_compile_time_secs"),
    lambda self, v: self._set("min_compile_time_secs", v),
  )
  min_entry_size_bytes = property(
    lambda self: self._get("min_entry_size_bytes"),
    lambda self, v: self._set("min_entry_size_bytes", v),
  )
  max_bytes = property(
    lambda self: self._get("max_bytes"),
    lambda self, v: self._set("max_bytes", v),
  )

  def __repr__(self) -> str:
    return (
      f"jit_cache.config(cache_dir={self.cache_dir!r}, "
      + ", ".join(f"{k}={v!r}" for k, v in self._values.items())
      + f", prefetch={self.prefetch!r})"
    )


def _check_setting(name: str, value: Any) -> None:
  where = f"jaxworks.jit_cache.config.{name}"
  if name == "min_compile_time_secs":
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise TypeError(
        f"{where} must be a number of seconds, got "
        f"{type(value).__name__} {value!r:.80}"
      )
    if value < 0:
      raise ValueError(f"{where} must be >= 0, got {value}")
    return
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(
      f"{where} must be an int, got {type(value).__name__} {value!r:.80}"
    )
  if name == "min_entry_size_bytes" and value < 0:
    raise ValueError(f"{where} must be >= 0, got {value}")
  if name == "max_bytes":
    if value == 0 or value < -1:
      raise ValueError(
        f"{where} must be positive, or -1 for no bound, got {value}; "
        "jit_cache.set_cache_dir(None) turns the cache off"
      )
    if value != -1:
      try:
        import filelock  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
      except ImportError as e:
        raise ImportError(
          f"{where}={value}: JAX bounds its persistent cache only with the "
          "'filelock' package installed (its eviction locks the directory); "
          "install filelock, or keep the default -1 (no bound)"
        ) from e


config = _Config()


def set_cache_dir(
  path: str | os.PathLike | None, max_bytes: int | None = None
) -> None:
  """Turns JAX's persistent compilation cache on (a directory) or off (None).

  For the whole process: every compile (``jit_cache.jit``, ``jax.jit``,
  eager operations) looks up and writes entries there. Takes effect at the
  next compile, also when the process compiled before. In the background it
  deserializes the entries that the last run of the same command line read
  first, until JAX asks for them (``prefetch.py``; ``config.prefetch``).

  A missing directory is created with mode 0700 (its missing parents too).
  An existing one that another user owns, or that group or others may write
  to, gets a warning: whoever can write there can make this process run
  their code (entries are executables).

  Args:
    path: the directory, or None to turn the cache off.
    max_bytes: sets ``config.max_bytes`` (JAX's bound on the directory).

  Raises:
    TypeError: ``path`` is not a path or None, or ``max_bytes`` not an int.
    ValueError: ``max_bytes`` is 0 or below -1.
    NotADirectoryError: ``path`` exists and is not a directory.
  """
  if path is not None and not isinstance(path, (str, os.PathLike)):
    raise TypeError(
      "jaxworks.jit_cache.set_cache_dir: path must be a str, an "
      f"os.PathLike or None, got {type(path).__name__} {path!r:.80}"
    )
  if max_bytes is not None:
    _check_setting("max_bytes", max_bytes)
    config._values["max_bytes"] = max_bytes  # pylint: disable=protected-access
  if path is None:
    config._dir = None  # pylint: disable=protected-access
    _config_update("jax_compilation_cache_dir", None)
    _ji().reset_persistent_cache()
    _start_prefetch()
    return
  directory = os.path.abspath(os.fspath(path))
  _prepare(directory)
  config._dir = directory  # pylint: disable=protected-access
  for name, jax_name in _Config._JAX_NAMES.items():  # pylint: disable=protected-access
    _config_update(jax_name, config._values[name])  # pylint: disable=protected-access
  _config_update("jax_compilation_cache_dir", directory)
  _ji().reset_persistent_cache()
  _start_prefetch()


def _start_prefetch() -> None:
  """The process prefetch of the directory now in use (prefetch.py)."""
  from . import prefetch  # pylint: disable=g-import-not-at-top

  prefetch.start_process()


def _prepare(directory: str) -> None:
  """Creates ``directory`` (0700) or warns when others may write to it."""
  missing = []
  head = directory
  while not os.path.lexists(head):
    missing.append(head)
    head = os.path.dirname(head)
  for d in reversed(missing):
    try:
      os.mkdir(d, 0o700)
    except FileExistsError:
      pass  # made meanwhile by someone else: checked below
  if not os.path.isdir(directory):
    raise NotADirectoryError(
      f"jaxworks.jit_cache.set_cache_dir: {directory!r} exists and is not "
      "a directory; pass a directory (it is created when missing)"
    )
  problem = unsafe_reason(directory)
  if problem:
    warnings.warn(
      f"jaxworks.jit_cache.set_cache_dir: {directory!r} {problem}; its "
      "entries are executables that this process runs, so whoever can "
      "write there can run code as you. Use a directory of your own with "
      f"mode 0700 (chmod 700 {directory}), e.g. under your home directory",
      UserWarning,
      stacklevel=3,
    )


def unsafe_reason(directory: str) -> str:
  """Why users other than the caller may write to ``directory`` ("" if
  none of them may)."""
  st = os.stat(directory)
  reasons = []
  getuid = getattr(os, "getuid", None)
  if getuid is not None and st.st_uid != getuid():
    reasons.append(f"is owned by uid {st.st_uid}, not by you (uid {getuid()})")
  writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
  if writable:
    who = " and ".join(
      w
      for bit, w in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "others"))
      if writable & bit
    )
    reasons.append(
      f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    )
  return " and ".join(reasons)


def _apply_environment() -> None:
  """Applies ``JAXWORKS_JIT_CACHE_DIR`` (at import)."""
  path = os.environ.get(ENV_VAR)
  if path:
    set_cache_dir(path)


_apply_environment()


# ----------------------------------------------------------------- events


class _Totals:
  """JAX's persistent-cache events since import or ``reset()``."""

  __slots__ = (
    "requests",
    "hits",
    "misses",
    "prefetched",
    "time_saved_s",
    "retrieval_s",
  )

  def __init__(self):
    self.reset()

  def reset(self) -> None:
    self.requests = self.hits = self.misses = self.prefetched = 0
    self.time_saved_s = self.retrieval_s = 0.0


TOTALS = _Totals()


class _ThreadEvents(threading.local):
  """This thread's event counts (a compile reports on its own thread)."""

  def __init__(self):
    self.counts = [0, 0, 0, 0]  # probes, requests, hits, misses
    self.retrieval_s = 0.0


_events = _ThreadEvents()
_INDEX = {_PROBE: 0, REQUESTS: 1, HITS: 2, MISSES: 3}


def _on_event(event: str, **_: Any) -> None:
  i = _INDEX.get(event)
  if i is None:
    return
  _events.counts[i] += 1
  if i == 1:
    TOTALS.requests += 1
  elif i == 2:
    TOTALS.hits += 1
  elif i == 3:
    TOTALS.misses += 1


def _on_duration(event: str, duration_secs: float, **_: str | int) -> None:
  if event == TIME_SAVED:
    TOTALS.time_saved_s += duration_secs
  elif event == RETRIEVAL:
    TOTALS.retrieval_s += duration_secs
    _events.retrieval_s += duration_secs


def ensure_listening() -> None:
  """Registers the listeners, again if ``jax.monitoring`` dropped them."""
  before = _events.counts[0]
  _monitoring.record_event(_PROBE)
  if _events.counts[0] == before:
    _monitoring.register_event_listener(_on_event)
    _monitoring.register_event_duration_secs_listener(_on_duration)


ensure_listening()


def totals() -> dict[str, Any]:
  """The process-wide figures ``stats()`` reports."""
  return {
    "persistent_hits": TOTALS.hits,
    "persistent_misses": TOTALS.misses,
    "persistent_prefetched": TOTALS.prefetched,
    "persistent_time_saved_s": TOTALS.time_saved_s,
    "persistent_load_s": TOTALS.retrieval_s,
  }


# ------------------------------------------------- per compile: what happened

#: Per trace entry or function counters: the outcome of their last compile.
_NOTES: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_NOTES_LOCK = threading.Lock()


def _note(owners: tuple, text: str) -> None:
  with _NOTES_LOCK:
    for owner in owners:
      try:
        _NOTES[owner] = text
      except TypeError:
        pass


def note_for(*owners: Any) -> str | None:
  """What the last compile of the first of ``owners`` that has one did
  with the persistent cache, or None."""
  with _NOTES_LOCK:
    for owner in owners:
      if owner is None:
        continue
      try:
        text = _NOTES.get(owner)
      except TypeError:
        continue
      if text is not None:
        return text
  return None


def observed(build: Callable[[], Any], entry: Any, counters: Any) -> Callable:
  """``build`` (a compile) with its persistent-cache outcome recorded: in
  ``counters`` (``persistent_hits``/``persistent_misses``/
  ``persistent_load_s``) and as the note ``explain_miss`` shows."""

  def build_observed() -> Any:
    ensure_listening()
    before = list(_events.counts)
    retrieval = _events.retrieval_s
    exe = build()
    requests, hits, misses = (_events.counts[i] - before[i] for i in (1, 2, 3))
    if hits:
      counters.persistent_hits += hits
      counters.persistent_load_s += _events.retrieval_s - retrieval
      text = "persistent cache: loaded from JAX's persistent compilation cache"
      from . import prefetch  # pylint: disable=g-import-not-at-top

      if prefetch.took():
        text += " (deserialized while the function traced and lowered)"
    elif misses:
      counters.persistent_misses += misses
      text = (
        "persistent cache: compiled, and written to JAX's persistent "
        "compilation cache"
      )
    else:
      text = "persistent cache: compiled, not cacheable: " + _why_not(
        requests, exe
      )
    _note((entry, counters), text)
    _closures.remember(counters)  # for explain_miss of re-created functions
    return exe

  return build_observed


def note_reused(entry: Any, counters: Any) -> None:
  """Records that ``entry`` reused an executable compiled in this process."""
  _note(
    (entry, counters),
    "persistent cache: not consulted: reused an executable compiled in this "
    "process for a structurally identical program",
  )
  _closures.remember(counters)
  from . import explain  # pylint: disable=g-import-not-at-top

  explain.log_reuse(counters)


def _why_not(requests: int, exe: Any) -> str:
  """Why a compile neither read nor wrote an entry (JAX logs the reason
  only at DEBUG level; this derives it from the settings)."""
  if not _ji().persistent_cache_enabled():
    return (
      "JAX's persistent compilation cache is off "
      "(jit_cache.set_cache_dir(path) or JAXWORKS_JIT_CACHE_DIR turns it on)"
    )
  if not requests:
    return (
      "JAX did not use its persistent cache for this compile (a backend "
      "that cannot serialize executables, or the cache disabled by "
      "jax_enable_compilation_cache=False)"
    )
  if _process_index() != 0:
    return (
      "only process 0 writes entries (this is process "
      + str(_process_index())
      + ")"
    )
  if _ji().has_host_callbacks(exe.compiled):
    return (
      "it uses host callbacks (jax.debug.print, jax.pure_callback, "
      "io_callback), which JAX never writes to its cache"
    )
  minimum = getattr(jax.config, "jax_persistent_cache_min_compile_time_secs")
  if exe.compile_seconds < minimum:
    return (
      f"it compiled in {exe.compile_seconds:.3f} s, under "
      f"jax_persistent_cache_min_compile_time_secs={minimum} "
      "(jit_cache.config.min_compile_time_secs)"
    )
  return (
    "its entry is smaller than jax_persistent_cache_min_entry_size_bytes="
    f"{getattr(jax.config, 'jax_persistent_cache_min_entry_size_bytes')} "
    "(jit_cache.config.min_entry_size_bytes), or writing it failed"
  )
