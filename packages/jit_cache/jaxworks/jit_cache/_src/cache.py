"""Bounded caches, counters and single-flight computation.

Three structures, all thread-safe:

* ``Counters`` and ``CacheInfo``: what ``f.cache_info()`` and ``stats()``
  report (hits, misses, evictions, entries, traces, compiles, executable
  reuses, time saved).
* ``EntryLRU``: one process-wide LRU order over every function's trace entries,
  so the total stays under a global bound while each function keeps its own
  ``maxsize``. It holds entries and their owners weakly: entries die with
  their function.
* ``ExecutableCache``: compiled executables keyed by structural fingerprint,
  shared by every function (re-created closures find each other here); only
  executables that hold no user object outlive their functions, in a bounded
  LRU.

``SingleFlight`` makes concurrent callers with the same key wait for the one
computing it, instead of tracing or compiling the same thing several times.

Per function: ``FunctionCache`` holds its trace entries (``Entry``: a cached
jaxpr with its jit parameters and executables per placement), LRU by abstract
key and indexed by argument ``Signature``; ``Uncacheable`` is a trace used
once and never stored.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
import dataclasses
import threading
from typing import Any
from typing import Protocol
import weakref

import jax

from .lru import LRU
from .reaper import REAPER

_jax_config = jax.config


@dataclasses.dataclass(frozen=True)
class CacheInfo:
  """Snapshot of cache counters (per function or process-wide).

  Attributes:
    hits: calls answered from the trace cache in Python (no tracing). A
      call the C++ dispatcher serves (a signature seen before at top level,
      ``dispatch_entries``) runs no Python and is not counted: after the
      first calls of a signature, ``hits`` stays put while calls go on.
    misses: calls that had to trace.
    evictions: trace entries dropped by an LRU bound (or executables, for the
      process-wide executable cache in ``stats()``).
    entries: trace entries held now.
    maxsize: the LRU bound on ``entries``.
    traces: executions of the Python function while tracing (a miss after
      an eviction may be served by JAX's own tracing cache without one).
    compiles: lowerings + XLA compilations.
    executable_reuses: compilations avoided because a structurally identical
      program was already compiled (re-created closures).
    dispatch_entries: signatures the C++ dispatcher serves without Python.
    executables: compiled executables held (per function: by its entries;
      in ``stats()``: the shared executable cache).
    time_saved_s: tracing and compile time avoided by hits and reuses, in
      seconds (measured when the entry was first built).
    persistent_hits: compiles served by JAX's persistent compilation cache
      (``jax.monitoring`` event ``/jax/compilation_cache/cache_hits``; in
      ``stats()``: every compile of the process, eager and library jits too).
    persistent_misses: compiles written to it (``.../cache_misses``).
    persistent_load_s: seconds spent retrieving its entries
      (``.../cache_retrieval_time_sec``).
    persistent_prefetched: (``stats()`` only) hits whose executable
      ``jit_cache.jit`` had deserialized while the function traced (a
      function's first call in a warm process; ``prefetch.py``).
    persistent_time_saved_s: (``stats()`` only) compile time its hits saved,
      as JAX estimates it (``.../compile_time_saved_sec``).
  """

  hits: int = 0
  misses: int = 0
  evictions: int = 0
  entries: int = 0
  maxsize: int = 0
  traces: int = 0
  compiles: int = 0
  executable_reuses: int = 0
  dispatch_entries: int = 0
  executables: int = 0
  time_saved_s: float = 0.0
  persistent_hits: int = 0
  persistent_misses: int = 0
  persistent_load_s: float = 0.0
  persistent_time_saved_s: float = 0.0
  persistent_prefetched: int = 0


class CoreView(Protocol):
  """What ``explain``, ``stats`` and ``closures`` read of one function's
  core (``core._JitCore``): its only interface to them."""

  @property
  def name(self) -> str:
    """The function's name, as messages use it."""
    ...

  @property
  def user_function(self) -> Callable | None:
    """The user's function (None once it died)."""
    ...

  @property
  def param_names(self) -> list[str] | None:
    """Positional parameter names (None: no signature)."""
    ...

  @property
  def cache(self) -> FunctionCache:
    """The function's trace entries."""
    ...

  @property
  def counters(self) -> Counters:
    """The function's counters."""
    ...

  def key(self, args: tuple, kwargs: dict) -> tuple:
    """``(leaves, treedef, statics, ctx, signature)`` of a call."""
    ...

  def leaf_paths(self, args: tuple, kwargs: dict) -> list[str]:
    """Readable path of each dynamic leaf of a call."""
    ...

  def dispatch_size(self) -> int:
    """Signatures the C++ dispatcher serves without Python."""
    ...

  def clear_cache(self) -> None:
    """Drops the function's entries and their executables."""
    ...


class Counters:
  """Mutable counters; increments are plain attribute updates (GIL-atomic
  enough for statistics)."""

  __slots__ = (
    "hits",
    "misses",
    "evictions",
    "traces",
    "compiles",
    "executable_reuses",
    "time_saved_s",
    "persistent_hits",
    "persistent_misses",
    "persistent_load_s",
    "owner",
  )

  def __init__(self):
    self.reset()
    #: Weak reference to the function core counting here (None: none).
    self.owner: Callable[[], CoreView | None] | None = None

  def reset(self) -> None:
    self.hits = self.misses = self.evictions = self.traces = 0
    self.compiles = self.executable_reuses = 0
    self.persistent_hits = self.persistent_misses = 0
    self.time_saved_s = self.persistent_load_s = 0.0

  def snapshot(self, **extra: Any) -> CacheInfo:
    """A ``CacheInfo`` of these counters, ``extra`` fields overriding them."""
    counted = {n: getattr(self, n) for n in self.__slots__ if n != "owner"}
    return CacheInfo(**(counted | extra))


#: Process-wide totals (every function adds to these too).
GLOBAL_COUNTERS = Counters()


class SingleFlight:
  """Run ``compute`` once per key at a time; other threads wait for it.

  A thread that asks again for a key it is itself computing (recursion while
  tracing) computes it again instead of waiting on itself.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._flights: dict[Hashable, tuple[int, threading.Event]] = {}

  def run(
    self, key: Hashable, lookup: Callable[[], Any], compute: Callable[[], Any]
  ) -> Any:
    """Returns ``lookup()`` if not None, else the result of ``compute()``.

    ``compute`` is expected to store its result where ``lookup`` finds it;
    waiters re-run ``lookup`` when the computing thread finishes (and compute
    themselves if it failed).
    """
    me = threading.get_ident()
    while True:
      found = lookup()
      if found is not None:
        return found
      with self._lock:
        flight = self._flights.get(key)
        if flight is None:
          event = threading.Event()
          self._flights[key] = (me, event)
          leader = True
        elif flight[0] == me:
          leader = None  # re-entrant: do not wait for ourselves
        else:
          leader = False
          event = flight[1]
      if leader is None:
        return compute()
      if not leader:
        event.wait()
        continue
      try:
        found = lookup()  # stored between our lookup and taking the key?
        return found if found is not None else compute()
      finally:
        with self._lock:
          del self._flights[key]
        event.set()


class EntryLRU:
  """Process-wide LRU order over trace entries of all functions.

  Holds entries and their owners weakly: an entry leaves the order when its
  function (the only strong holder) is collected.
  """

  def __init__(self, maxsize: int):
    self._order: LRU[weakref.ref, weakref.ref] = LRU(maxsize)
    # Re-entrant: a weak reference's callback may run (from the garbage
    # collector) while this thread holds the lock.
    self._lock = threading.RLock()

  def _forget(self, ref: weakref.ref) -> None:
    with self._lock:
      self._order.pop(ref, None)

  @property
  def maxsize(self) -> int:
    return self._order.maxsize  # type: ignore[return-value]

  def touch(self, entry: Any) -> None:
    # Without the lock (a trace-cache hit's path): one ordered-dict step.
    # The stored key stays the reference whose callback forgets the entry.
    try:
      self._order.refresh(weakref.ref(entry))
    except KeyError:
      pass  # evicted concurrently

  def add(self, entry: Any, owner: Any) -> None:
    refs = (weakref.ref(entry, self._forget), weakref.ref(owner))
    with self._lock:
      victims = self._order.put(refs[0], refs[1])
    self._evict(victims)

  def discard(self, entry: Any) -> None:
    with self._lock:
      self._order.pop(weakref.ref(entry), None)

  def resize(self, maxsize: int) -> None:
    with self._lock:
      victims = self._order.resize(maxsize)
    self._evict(victims)

  def clear(self) -> None:
    with self._lock:
      self._order.clear()

  @staticmethod
  def _evict(victims: list[tuple[weakref.ref, weakref.ref]]) -> None:
    """Tells the owners of the least recently used entries the bound
    evicted (outside the lock)."""
    for entry_ref, owner_ref in victims:
      entry, cache = entry_ref(), owner_ref()
      if entry is not None and cache is not None:
        cache.evict(entry)

  def __len__(self) -> int:
    return len(self._order)


#: Default global bound on trace entries across all functions.
DEFAULT_GLOBAL_MAXSIZE = 4096
GLOBAL_ENTRIES = EntryLRU(DEFAULT_GLOBAL_MAXSIZE)


class ExecutableCache:
  """Compiled executables shared across functions, by structural key.

  Two tiers:

  * every executable built through the cache is found while it is alive,
    that is while a trace entry of a live function holds it (weak tier);
  * executables marked ``keep`` (programs that hold no user object: no host
    callback, no array by identity, little constant data) also stay in a
    small LRU after their functions are gone, so a closure re-created after
    the previous one died still reuses them (strong tier). It is bounded by
    count (``maxsize``) and by estimated bytes (``maxbytes``): a process that
    makes thousands of distinct short-lived programs keeps only the most
    recent few, as stock JAX keeps none.
  """

  def __init__(self, maxsize: int, maxbytes: int):
    self.maxbytes = maxbytes
    self.evictions = 0
    self.nbytes = 0  # estimated bytes held by the strong tier
    self._strong: LRU[Hashable, Any] = LRU(maxsize)
    self._sizes: dict[Hashable, int] = {}
    self._weak: dict[Hashable, weakref.ref] = {}
    self._lock = threading.RLock()  # re-entrant: see EntryLRU
    self._flight = SingleFlight()

  @property
  def maxsize(self) -> int:
    return self._strong.maxsize  # type: ignore[return-value]

  def get(self, key: Hashable) -> Any:
    with self._lock:
      value = self._strong.get(key)
      if value is not None:
        return value
      ref = self._weak.get(key)
      return None if ref is None else ref()

  def put(
    self, key: Hashable, value: Any, keep: bool = True, nbytes: int = 0
  ) -> None:
    def forget(ref, key=key):
      with self._lock:
        if self._weak.get(key) is ref:
          del self._weak[key]

    ref = weakref.ref(value, forget)
    with self._lock:
      self._weak[key] = ref
      if keep:
        self.nbytes += nbytes - self._sizes.get(key, 0)
        self._sizes[key] = nbytes
        evicted = self._evicted_locked(self._strong.put(key, value))
    if keep:
      REAPER.drop(evicted)

  def _evicted_locked(self, over_count: list[tuple[Hashable, Any]]) -> list:
    """Counts what the count bound evicted (``over_count``) and evicts the
    oldest entries down to the byte bound; returns every evicted value (the
    caller frees them after the lock)."""
    evicted = []
    for key, value in over_count:
      self.nbytes -= self._sizes.pop(key, 0)
      evicted.append(value)
    while self._strong and self.nbytes > self.maxbytes:
      key, value = self._strong.popitem()
      self.nbytes -= self._sizes.pop(key, 0)
      evicted.append(value)
    self.evictions += len(evicted)
    return evicted

  def get_or_build(
    self,
    key: Hashable,
    build: Callable[[], Any],
    keep: bool = True,
    size: Callable[[Any], int] = lambda value: 0,
  ) -> tuple[Any, bool]:
    """(value, reused): ``reused`` is True when another caller built it.
    ``size(value)`` estimates the bytes a built value holds."""
    built = []

    def compute():
      value = build()
      self.put(key, value, keep, size(value) if keep else 0)
      built.append(True)
      return value

    value = self._flight.run(key, lambda: self.get(key), compute)
    return value, not built

  def clear(self) -> None:
    with self._lock:
      self._strong.clear()
      self._sizes.clear()
      self.nbytes = 0
      self._weak.clear()

  def discard(self, values: list[Any]) -> None:
    """Drops the strong tier's hold on these executables (a function's
    ``clear_cache()``); they stay findable while something else holds them."""
    ids = {id(v) for v in values}
    with self._lock:
      keys = [k for k, v in self._strong.items() if id(v) in ids]
      for key in keys:
        self.nbytes -= self._sizes.pop(key, 0)
        self._strong.pop(key)

  def resize(
    self, maxsize: int | None = None, maxbytes: int | None = None
  ) -> None:
    with self._lock:
      if maxbytes is not None:
        self.maxbytes = maxbytes
      over_count = [] if maxsize is None else self._strong.resize(maxsize)
      evicted = self._evicted_locked(over_count)
    del evicted  # freed here, after the lock

  def live(self) -> list[Any]:
    """Every executable the cache can hand out now."""
    with self._lock:
      refs = list(self._weak.values())
      strong = list(self._strong.values())
    seen = {id(v): v for v in strong}
    for ref in refs:
      v = ref()
      if v is not None:
        seen[id(v)] = v
    return list(seen.values())

  def __len__(self) -> int:
    return len(self.live())


#: Defaults of the strong tier: executables of dead functions kept for
#: re-created closures (a sweep needs the last few, not thousands).
DEFAULT_EXECUTABLE_MAXSIZE = 16
DEFAULT_EXECUTABLE_MAXBYTES = 32 << 20
EXECUTABLES = ExecutableCache(
  DEFAULT_EXECUTABLE_MAXSIZE, DEFAULT_EXECUTABLE_MAXBYTES
)

# ------------------------------------------------ per-function trace entries

#: Signatures that may point at one trace entry.
ALIASES_PER_ENTRY = 16
#: Executables (placements) one trace entry keeps.
EXECUTABLES_PER_ENTRY = 16

#: Config values named in explain_miss when the trace context differs.
EXPLAINED_CONFIG = (
  "jax_enable_x64",
  "jax_default_matmul_precision",
  "jax_numpy_rank_promotion",
  "jax_numpy_dtype_promotion",
  "jax_default_device",
  "jax_default_prng_impl",
  "jax_threefry_partitionable",
)


def config_snapshot() -> dict[str, Any]:
  """The ``EXPLAINED_CONFIG`` values now (kept per entry for explain_miss)."""
  out = {}
  for name in EXPLAINED_CONFIG:
    try:
      out[name] = getattr(_jax_config, name)
    except AttributeError:
      pass
  return out


class Entry:
  """One traced program: the cached jaxpr and jit parameters."""

  __slots__ = (
    "params",
    "jaxpr",
    "in_tree",
    "out_tree",
    "trace_seconds",
    "key",
    "sigs",
    "executables",
    "lock",
    "config",
    "__weakref__",
  )

  def __init__(
    self,
    params: dict,
    in_tree: Any,
    out_tree: Any,
    trace_seconds: float,
    key: Hashable,
    config: dict,
  ):
    self.params = params
    self.jaxpr = params["jaxpr"]
    self.in_tree = in_tree
    self.out_tree = out_tree
    self.trace_seconds = trace_seconds
    self.key = key
    self.sigs: list[Any] = []
    #: Placement key -> executable, the newest ``EXECUTABLES_PER_ENTRY``
    #: built (looked up with ``peek``: the oldest built goes first).
    self.executables: LRU[Any, Any] = LRU(EXECUTABLES_PER_ENTRY)
    self.lock = threading.Lock()
    self.config = config


class Uncacheable:
  """A trace that must not be cached (closes over outer tracers, or uses
  mutable refs): used once, never stored."""

  __slots__ = ("traced", "params", "consts", "out_tree", "high")

  def __init__(
    self, traced: Any, params: dict, consts: list, out_tree: Any, high: bool
  ):
    self.traced = traced
    self.params = params
    self.consts = consts
    self.out_tree = out_tree
    self.high = high


class FunctionCache:
  """Trace entries of one function: LRU by abstract key, indexed by Signature."""

  def __init__(self, maxsize: int, counters: Counters):
    self.counters = counters
    self.by_sig: dict[Any, Entry] = {}
    #: Abstract key -> entry (looked up with ``peek``, refreshed on a hit).
    self.by_key: LRU[Hashable, Entry] = LRU(maxsize)
    self.lock = threading.RLock()
    self.flight = SingleFlight()

  def __len__(self) -> int:
    return len(self.by_key)

  def touch(self, entry: Entry) -> None:
    try:
      self.by_key.refresh(entry.key)
    except KeyError:
      pass  # evicted concurrently
    GLOBAL_ENTRIES.touch(entry)

  def insert(self, entry: Entry) -> None:
    with self.lock:
      victims = [victim for _, victim in self.by_key.put(entry.key, entry)]
      for victim in victims:
        self._remove_sigs(victim)
    for victim in victims:
      GLOBAL_ENTRIES.discard(victim)
      self._count_eviction()
    GLOBAL_ENTRIES.add(entry, self)

  def alias(self, sig: Any, entry: Entry) -> None:
    with self.lock:
      if self.by_key.peek(entry.key) is not entry:
        return  # evicted meanwhile
      self.by_sig[sig] = entry
      entry.sigs.append(sig)
      if len(entry.sigs) > ALIASES_PER_ENTRY:
        self.by_sig.pop(entry.sigs.pop(0), None)

  def _remove_sigs(self, entry: Entry) -> None:
    for sig in entry.sigs:
      if self.by_sig.get(sig) is entry:
        del self.by_sig[sig]

  def _count_eviction(self) -> None:
    self.counters.evictions += 1
    GLOBAL_COUNTERS.evictions += 1

  def evict(self, entry: Entry) -> None:
    """Drops ``entry``, which the process-wide bound evicted."""
    with self.lock:
      present = self.by_key.peek(entry.key) is entry
      if present:
        self.by_key.pop(entry.key)
      self._remove_sigs(entry)
    if present:
      self._count_eviction()

  def clear(self) -> None:
    with self.lock:
      entries = [entry for _, entry in self.by_key.clear()]
      self.by_sig.clear()
    for entry in entries:
      GLOBAL_ENTRIES.discard(entry)

  def executables(self) -> int:
    return sum(len(e.executables) for e in self.by_key.values())


# Imported from jaxworks.jit_cache (a lazy package): the module tracebacks and repr name;
# doctest finds their examples through __test__.
__test__ = {"CacheInfo": CacheInfo}
CacheInfo.__module__ = "jaxworks.jit_cache"
