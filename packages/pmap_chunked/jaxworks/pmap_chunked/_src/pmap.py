"""pmap built as jit(shard_map(body)) over a mesh of the devices.

A :class:`Pmapped` has ``arguments.Arguments`` read a call's arguments (flat
leaves, mapped axes, size, static values) and ``programs.Programs`` build the
program of each argument structure, size and static values (an ``Entry``: a
Mesh with Auto axes, one rank-keeping NamedSharding per leaf, and
``jaxworks.jit_cache.jit(shard_map(body))``); it keeps the table of entries
itself, puts misplaced inputs in place (``placement``) and counts.
"""

from __future__ import annotations

from collections.abc import Callable
import copy
import dataclasses
import functools
import inspect
import threading
import types
from typing import Any
import weakref

import jax

from jaxworks import jit_cache

from . import axes as axes_lib
from . import deps
from . import jax_internals
from . import lru
from . import mesh as mesh_lib
from . import placement
from . import programs as programs_lib
from .arguments import API
from .arguments import Arguments
from .arguments import describe
from .arguments import static_key
from .programs import Entry
from .programs import Programs

# Default bound on one pmapped function's program table (LRU).
DEFAULT_MAXSIZE = 256

#: The cache-info type of jit_cache, one for both packages.
CacheInfo = jit_cache.CacheInfo
#: CacheInfo fields a pmapped function sums over its programs' jit caches
#: (the rest describe its own program table).
_PROGRAM_FIELDS = tuple(
  f.name
  for f in dataclasses.fields(CacheInfo)
  if f.name not in ("hits", "misses", "evictions", "entries", "maxsize")
)

#: Every live pmapped function (for :func:`stats`).
_REGISTRY: weakref.WeakSet[Pmapped] = weakref.WeakSet()
_REGISTRY_LOCK = threading.Lock()
#: CacheInfo fields that count events (the rest are sizes of live caches).
_SIZES = ("entries", "maxsize", "dispatch_entries", "executables")
_EVENTS = tuple(
  f.name for f in dataclasses.fields(CacheInfo) if f.name not in _SIZES
)
#: The events of pmapped functions that died, so :func:`stats` never goes
#: back when a function is collected.
_RETIRED: dict[str, float] = dict.fromkeys(_EVENTS, 0)
# Reentrant: a finalizer may run (garbage collection) while this thread
# holds it.
_RETIRED_LOCK = threading.RLock()


class _Counts:
  """A pmapped function's own counters (kept apart from it, so they can be
  retired into :func:`stats` when it dies)."""

  __slots__ = ("hits", "misses", "evictions")

  def __init__(self):
    self.hits = self.misses = self.evictions = 0


def _info(counts: _Counts, entries: Any, maxsize: int) -> jit_cache.CacheInfo:
  programs = [p.cache_info() for e in entries.values() for p in e.programs()]
  return CacheInfo(
    hits=counts.hits,
    misses=counts.misses,
    evictions=counts.evictions,
    entries=len(entries),
    maxsize=maxsize,
    **{f: sum(getattr(p, f) for p in programs) for f in _PROGRAM_FIELDS},
  )


def _retire(counts: _Counts, entries: Any) -> None:
  """Adds a dead pmapped function's events to the process-wide totals."""
  info = _info(counts, entries, 0)
  with _RETIRED_LOCK:
    for name in _EVENTS:
      _RETIRED[name] += getattr(info, name)


_Tracer = jax.core.Tracer
_config = jax.config


class _PmapTraced(jit_cache.Traced):
  """``Pmapped.trace``'s result: a ``jaxworks.stages_aot.Traced`` that JAX's
  own exporters refuse, as they refuse ``jax.pmap``."""

  def lower(
    self,
    *,
    lowering_platforms: tuple[str, ...] | None = None,
    _private_parameters: Any = None,
  ) -> jit_cache.Lowered:
    if _private_parameters is not None:
      # Only JAX itself passes private parameters (jax.export.export does):
      # stock raises ValueError for a pmap there (it is no jit result).
      raise ValueError(
        "Function to be exported must be the result of `jit` but is: "
        f"{API} of {self.fun_name}; jax.export.export takes a jit result, "
        "and jax.pmap raises this ValueError too. Export the pmap's program "
        "with pmapped.lower(*args).export() (jaxworks.stages_aot), or export "
        "jax.jit(jax.shard_map(...)) of the function."
      )
    return super().lower(lowering_platforms=lowering_platforms)


def _fun_name(fun: Any) -> str:
  """``fun``'s ``__name__`` as jax.pmap's wrapper takes it (a partial's is
  its function's)."""
  name = getattr(fun, "__name__", None)
  if isinstance(name, str):
    return name
  if isinstance(fun, functools.partial):
    return _fun_name(fun.func)
  return "<unnamed function>"


def _any_arguments(*args, **kwargs):
  """The code object of ``Pmapped``'s signature (see there); never called."""
  del args, kwargs


@dataclasses.dataclass(frozen=True)
class PmapOptions:
  """:func:`jaxworks.pmap_chunked.pmap`'s keyword arguments, as passed (a
  :class:`Pmapped` checks them)."""

  in_axes: Any = 0
  out_axes: Any = 0
  static_broadcasted_argnums: Any = ()
  devices: Any = None
  backend: str | None = None
  axis_size: int | None = None
  donate_argnums: Any = ()
  chunked: bool = False
  maxsize: int = DEFAULT_MAXSIZE


class Pmapped:
  """A function mapped over devices by :func:`jaxworks.pmap_chunked.pmap`.

  Calling it runs the mapped function (also as a method: ``@pmap`` on a
  ``def`` in a class binds ``self``); ``lower`` and ``trace`` give the
  ``jaxworks.stages_aot`` stages of the program a call would run, with the
  arguments' weak types kept, and ``cache_info()`` reports this function's
  cache counters. As for ``jax.pmap``'s wrapper, ``inspect.signature`` gives
  ``fun``'s signature, ``(*args, **kwargs)`` with ``follow_wrapped=False``,
  and ``jax.export.export`` raises ``ValueError``: export the program with
  ``lower(*args).export()``.
  """

  # inspect.signature(p, follow_wrapped=False) reads these (and __name__ and
  # __annotations__, copied from fun) as for the plain ``(*args, **kwargs)``
  # function jax.pmap returns; without them it takes an object with __get__
  # for a builtin and raises ValueError. follow_wrapped=True follows
  # __wrapped__ to fun's own signature, as for jax.pmap.
  __code__ = _any_arguments.__code__
  __defaults__ = None
  __kwdefaults__ = None

  def __init__(self, fun: Callable, axis_name: Any, options: PmapOptions):
    _check_fun(fun)
    maxsize = options.maxsize
    _check_options(axis_name, options.chunked, maxsize, options.backend)
    in_axes = axes_lib.check_axes_spec(API, "in_axes", options.in_axes)
    out_axes = axes_lib.check_axes_spec(API, "out_axes", options.out_axes)
    self._args = Arguments(
      fun,
      in_axes,
      static_broadcasted_argnums=options.static_broadcasted_argnums,
      donate_argnums=options.donate_argnums,
      devices=options.devices,
      axis_size=options.axis_size,
      maxsize=maxsize,
    )
    self._programs = Programs(
      fun,
      axis_name,
      out_axes=out_axes,
      arguments=self._args,
      backend=options.backend,
      chunked=options.chunked,
    )
    # Program table: key -> Entry, least recently used dropped first.
    self._maxsize = maxsize
    self._entries: lru.LRU[Any, Entry] = lru.LRU(maxsize)
    self._lock = threading.Lock()
    self._counts = _Counts()
    functools.update_wrapper(self, fun, updated=())
    # As jax.pmap's wrapper: a name and annotations (fun's, or none) even
    # when fun has none of its own (a functools.partial, a callable object).
    if not isinstance(getattr(self, "__name__", None), str):
      self.__name__ = _fun_name(fun)
    if not isinstance(vars(self).get("__annotations__"), dict):
      self.__annotations__ = {}
    with _REGISTRY_LOCK:
      _REGISTRY.add(self)
    weakref.finalize(self, _retire, self._counts, self._entries)

  # ----------------------------------------------------------------- calling

  @jax_internals.api_boundary
  def __call__(self, *args, **kwargs):
    return self._run("call", args, kwargs)

  def __get__(self, instance, owner=None):
    """As a method (``@pmap`` on a ``def`` in a class), binds ``self``."""
    if instance is None:
      return self
    return types.MethodType(self, instance)

  @jax_internals.api_boundary
  def lower(self, *args, **kwargs) -> jit_cache.Lowered:
    """Lowers the program a call with these arguments would run.

    Returns a ``jaxworks.stages_aot.Lowered`` (a ``jax.stages.Lowered`` with
    ``fun_name``, ``jaxpr``, ``platforms``, ``compile(platform=...)`` and
    ``export()``) whose ``args_info`` is the ``(args, kwargs)`` structure as
    passed without the static arguments, as for ``jax.pmap``, so its
    ``compile()`` takes the arguments as a call does.
    """
    return self._run("lower", args, kwargs)

  @jax_internals.api_boundary
  def trace(self, *args, **kwargs) -> jit_cache.Traced:
    """Traces the program a call with these arguments would run (a
    ``jaxworks.stages_aot.Traced`` of the program over the flat argument
    leaves)."""
    return self._run("trace", args, kwargs)

  def cache_info(self) -> jit_cache.CacheInfo:
    """This function's cache counters, as ``jaxworks.jit_cache.CacheInfo``.

    ``hits``, ``misses``, ``entries``, ``evictions`` and ``maxsize`` describe
    its program table (one program per argument structure, mapped size and
    static values); the other fields (``traces``, ``compiles``,
    ``executable_reuses``, ...) are summed over those programs' jit caches.
    """
    with self._lock:
      return _info(self._counts, self._entries, self._maxsize)

  def clear_cache(self) -> None:
    """Drops every program this function holds (the next call rebuilds)."""
    with self._lock:
      self._entries.clear()
    self._args.clear()

  def _run(self, how: str, args: tuple, kwargs: dict):
    static_vals, leaves, treedef, in_axes, size = self._args.parse(args, kwargs)
    nested = bool(mesh_lib.frames())
    tracing = nested or any(isinstance(x, _Tracer) for x in leaves)
    # As jax.pmap, no donation while jax.debug_nans is on; read as a
    # jax.config attribute, which sees `with jax.debug_nans(...)` too.
    donating = bool(self._args.donate) and not getattr(
      _config, "jax_debug_nans"
    )
    context = programs_lib.context_key() if nested else None
    nargs = len(args)
    key = (
      treedef,
      in_axes,
      size,
      static_key(static_vals),
      nargs,
      context,
      donating,
    )
    with self._lock:
      entry = self._entries.get(key)
    built = entry is None
    if entry is None:
      entry = self._programs.build(
        static_vals, treedef, in_axes, size, nargs,
        extra_axes=(), nested=nested, donating=donating,
      )  # fmt: skip
    demanded: dict = {}
    while True:
      try:
        if how != "call":
          out = _stage(how, entry, leaves, treedef)
        elif tracing:
          out = (entry.traced or entry.jitted)(*leaves)
        else:
          try:
            placed = placement.place_inputs(leaves, entry)
          except placement.DeletedInput as deleted:
            self._args.raise_deleted(deleted.index, leaves, treedef)
          out = self._programs.place_negative(entry, entry.jitted(*placed))
      except mesh_lib.NeedsAxis as need:
        if nested:
          raise
        # Nested pmaps asked for an axis this mesh lacks: add it, run again.
        more = self._programs.more_axes(entry, need, demanded)
        entry = self._programs.build(
          static_vals, treedef, in_axes, size, nargs,
          extra_axes=more, nested=False, donating=donating,
        )  # fmt: skip
        built = True
        continue
      except NameError as err:  # AxisNameError is one
        if isinstance(err, deps.AxisNameError) and str(err).startswith(API):
          raise  # already pmap's own diagnostic (jit_cache's is re-reported)
        self._programs.diagnose(err, static_vals, treedef, nargs, leaves, entry)
      # Only a call that succeeded changes the cache: a failed one leaves
      # nothing half-built behind.
      if built:
        self._counts.misses += 1
        with self._lock:
          self._counts.evictions += len(self._entries.put(key, entry))
      else:
        self._counts.hits += 1
      return out

  def __repr__(self):
    programs = self._programs
    return (
      f"<jaxworks.pmap_chunked.pmap of {describe(programs.fun)} over axis "
      f"{programs.axis_name!r}, chunked={programs.chunked}>"
    )


def _stage(how: str, entry: Entry, leaves: list, treedef) -> Any:
  """The ``lower``/``trace`` stage of ``entry`` for these argument leaves."""
  stage = getattr(entry.jitted, how)(
    *[programs_lib.abstract(x, s) for x, s in zip(leaves, entry.in_shardings)]
  )
  if how == "trace":
    stage = copy.copy(stage)
    stage.__class__ = _PmapTraced
    return stage
  # The program takes flat leaves; describe its arguments as the user passed
  # them ((positional, keyword) without the static ones, as jax.pmap's lower
  # does), so .compile() takes the user's arguments.
  donated = [a.donated for a in jax.tree_util.tree_leaves(stage.args_info)]
  stage = copy.copy(stage)  # the same lowering, described anew
  stage.args_info = jax.tree_util.tree_unflatten(
    treedef, [jax_internals.arg_info(x, d) for x, d in zip(leaves, donated)]
  )
  return stage


def _check_fun(fun: Any) -> None:
  if isinstance(fun, staticmethod):
    raise TypeError(
      f"{API}: got the staticmethod object {fun!r}; as "
      "jax.pmap, pmap takes the function itself: apply "
      "@staticmethod outside (above) @pmap."
    )
  if not callable(fun):
    raise TypeError(
      f"{API}: fun must be callable, got {fun!r} of type "
      f"{type(fun).__name__}; pass the function to map."
    )
  if inspect.isgeneratorfunction(fun):
    raise TypeError(
      f"{API}: fun must return its outputs, but {fun!r} is a "
      "generator function (it yields); return a value or a "
      "tuple of values instead."
    )


def _check_options(axis_name, chunked, maxsize, backend) -> None:
  """pmap's options that are one value each (the axes specs and argument
  positions are checked by ``Arguments`` and ``axes``)."""
  try:
    hash(axis_name)
  except TypeError:
    raise TypeError(
      f"{API}: axis_name must be hashable, got {axis_name!r}; "
      "use a string such as axis_name='i'."
    ) from None
  if not isinstance(chunked, bool):
    raise TypeError(f"{API}: chunked must be True or False, got {chunked!r}.")
  if type(maxsize) is not int or maxsize < 1:
    raise TypeError(
      f"{API}: maxsize must be an int >= 1, got {maxsize!r}; "
      f"pass e.g. maxsize={DEFAULT_MAXSIZE}."
    )
  if backend is not None and not isinstance(backend, str):
    # jax.pmap raises AttributeError when it reads such a backend.
    raise mesh_lib.OptionTypeError(
      f"{API}: backend must be a platform name such as "
      f"'cpu' or None, got {backend!r}."
    )


def stats() -> jit_cache.CacheInfo:
  """Process-wide counters: events (hits, misses, traces, compiles, ...) of
  every pmapped function since import, those that died included; sizes
  (``entries``, ``executables``, ...) of the live ones (``maxsize`` is the
  largest bound)."""
  with _REGISTRY_LOCK:
    live = list(_REGISTRY)
  with _RETIRED_LOCK:
    retired = dict(_RETIRED)
  infos = [f.cache_info() for f in live]
  fields = [f.name for f in dataclasses.fields(CacheInfo)]
  totals = {n: sum(getattr(i, n) for i in infos) for n in fields}
  for name, value in retired.items():
    totals[name] += value
  totals["maxsize"] = max((i.maxsize for i in infos), default=0)
  return CacheInfo(**totals)
