"""What JAX's persistent compilation cache did: counters and per-compile notes.

JAX reports its persistent-cache events through ``jax.monitoring``; they are
counted here process-wide (``TOTALS``, for ``stats()``) and per thread, so
that ``observed`` can attribute a compile's events to the jit_cache function
compiling (its ``cache_info()``) and keep a note of the outcome for its
``explain_miss``.
"""

from __future__ import annotations

from collections.abc import Callable
import threading
from typing import Any
import weakref

import jax

from . import closures as _closures
from . import jax_internals as ji

_monitoring = jax.monitoring
_process_index = jax.process_index

HITS = "/jax/compilation_cache/cache_hits"
MISSES = "/jax/compilation_cache/cache_misses"
REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
TIME_SAVED = "/jax/compilation_cache/compile_time_saved_sec"
RETRIEVAL = "/jax/compilation_cache/cache_retrieval_time_sec"
_PROBE = "/jaxworks/jit_cache/listener_probe"

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
    self.prefetched = 0  # reads answered by a prefetch (prefetch.py)


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


def count_prefetched() -> None:
  """Counts a read of the cache that a prefetch answered (``prefetch.py``)."""
  TOTALS.prefetched += 1
  _events.prefetched += 1


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
    retrieval, prefetched = _events.retrieval_s, _events.prefetched
    exe = build()
    requests, hits, misses = (_events.counts[i] - before[i] for i in (1, 2, 3))
    if hits:
      counters.persistent_hits += hits
      counters.persistent_load_s += _events.retrieval_s - retrieval
      text = "persistent cache: loaded from JAX's persistent compilation cache"
      if _events.prefetched != prefetched:
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


def _why_not(requests: int, exe: Any) -> str:
  """Why a compile neither read nor wrote an entry (JAX logs the reason
  only at DEBUG level; this derives it from the settings)."""
  if not ji.persistent_cache_enabled():
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
    return f"only process 0 writes entries (this is process {_process_index()})"
  if ji.has_host_callbacks(exe.compiled):
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
