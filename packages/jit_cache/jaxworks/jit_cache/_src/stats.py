"""``stats()`` and ``reset_stats()``: jit_cache's process-wide counters, and
JAX's persistent-cache events beside them."""

from __future__ import annotations

from . import cache as _cache
from . import monitoring as _monitoring
from .core import REGISTRY
from .core import REGISTRY_LOCK


def live_functions() -> list[_cache.CoreView]:
  with REGISTRY_LOCK:
    return list(REGISTRY)


def stats() -> _cache.CacheInfo:
  """Process-wide counters (since import or ``reset_stats()``) and sizes.

  ``entries``/``maxsize`` are trace entries across all live functions and the
  global bound; ``executables`` the compiled executables held (by live
  functions' entries or by the shared cache), each counted once;
  ``evictions`` counts trace entries dropped by either bound.

  The ``persistent_*`` fields are JAX's persistent compilation cache's
  events (``jax.monitoring``) for every compile of the process since import
  or ``reset_stats()``: hits, misses (entries written), the time retrieving entries and the compile time saved.
  """
  live = live_functions()
  executables = {id(e): e for e in _cache.EXECUTABLES.live()}
  for f in live:
    for entry in f.cache.by_key.values():
      executables.update((id(e), e) for e in entry.executables.values())
  return _cache.GLOBAL_COUNTERS.snapshot(
    entries=sum(len(f.cache) for f in live),
    maxsize=_cache.GLOBAL_ENTRIES.maxsize,
    dispatch_entries=sum(f.dispatch_size() for f in live),
    executables=len(executables),
    **_monitoring.totals(),
  )


def reset_stats() -> None:
  """Zeroes the process-wide and every function's counters."""
  _cache.GLOBAL_COUNTERS.reset()
  _monitoring.TOTALS.reset()
  for f in live_functions():
    f.counters.reset()
