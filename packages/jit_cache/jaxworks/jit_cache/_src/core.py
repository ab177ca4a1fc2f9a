"""The machinery of one jitted function: ``_JitCore``, in three layers:
``_Arguments`` (arguments to keys), ``_TraceCache`` (entries and their
executables) and ``_JitCore`` (the C++ dispatcher and the calls it hands
over).

How a call flows (the whole mechanism):

1. ``f(*args)`` enters jaxlib's C++ dispatcher (``JitFunction``'s C base
   type forwards the call to it), built once per function over our
   ``_cache_miss``. A signature it has seen at top level runs the stored
   executable without any Python (fast re-dispatch); under a trace it hands
   over to ``_cache_miss`` (a call whose first argument is a tracer goes
   there directly).
2. Otherwise ``_cache_miss`` splits static arguments, flattens the rest and
   asks the C++ extension for a ``Signature`` (kind, aval, sharding, committed
   per leaf + tree structure, statics and JAX's trace context).
3. Trace cache: ``Signature`` -> entry. On a miss the abstract values decide:
   an entry traced for other placements or leaf kinds with the same avals,
   tree, statics and trace context (the axis environment included: a function
   may read any bound axis name, so entries are never shared across axis
   environments) is reused; only then JAX traces the Python function, once
   even with many threads asking.
4. Under an outer trace, a hit re-emits the cached jaxpr with
   ``jit_p.bind(*args, **cached_params)``: neither the Python function nor
   JAX's parameter inference runs again.
5. At top level the entry's executable is looked up by placement, then in the
   process-wide executable cache by structural fingerprint (jaxpr structure,
   literals, constants, parameters, placement, context): a re-created closure
   reuses what an earlier one compiled. A compile goes through JAX's
   persistent compilation cache when ``set_cache_dir`` turned it on
   (``persistent.py``); a call site's first top-level call deserializes the
   entry it read last time while it traces (``prefetch.py``). The result
   goes back to the C++ dispatcher as its fast path.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import inspect
import os
import threading
import time
from typing import Any
import weakref

import jax

from jaxworks import stages_aot as _stages

from .. import _signature as _ext
from . import argnums as _argnums
from . import boundary as _boundary
from . import cache as _cache
from . import executables as _executables
from . import explain
from . import jax_internals as ji
from . import monitoring as _monitoring
from . import persistent  # noqa: F401  (applies JAXWORKS_JIT_CACHE_DIR)
from . import prefetch as _prefetch
from . import signature as _sig

#: This package's directory (jaxworks/jit_cache/). Its frames are not user
#: code: source locations in jaxprs and lowered modules skip them, as they skip
#: jax's own, and name the user's call instead of our dispatch code.
PACKAGE_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep
ji.register_source_exclusion(PACKAGE_DIR)

_jit_p = ji.jit_p
# Hot-path names bound once.
_flatten = ji.tracing_registry.flatten
_trace_context = ji.trace_context
_trace_state_clean = ji.trace_state_clean
_debug_modes_on = ji.debug_modes_on
_arg_key = _sig.key
_CONTEXT = _ext.ContextInterner(16)
# Stock JAX callables bound at import, never looked up on ``jax`` at call time:
# after ``jax.jit = jit_cache.jit`` (the drop-in swap) they are still stock's.
_stock_jit = ji.stock_jit
_Tracer = jax.core.Tracer
_test_event = ji.test_event
_disable_jit_on = ji.disable_jit_on
_shard_arg_handlers = ji.shard_arg_handlers

#: Default of in_shardings/out_shardings: stock jax.jit's own default object.
UNSET: Any = ji.UNSPECIFIED

#: Every live core (for ``stats()``, ``reset_stats()``, ``clear_caches()``).
REGISTRY: weakref.WeakSet[_JitCore] = weakref.WeakSet()
REGISTRY_LOCK = threading.Lock()


def _counting(fun: Callable, name: str, counters: _cache.Counters) -> Callable:
  """``fun`` (named ``name``), counting its executions (= traces) in
  ``counters``."""

  @functools.wraps(fun)
  def traced_fun(*args, **kwargs):
    counters.traces += 1
    _cache.GLOBAL_COUNTERS.traces += 1
    return fun(*args, **kwargs)

  # functools.wraps skips what `fun` lacks (a partial has no __name__): keep
  # the name jax.jit would report for `fun` itself (computed once, by jit).
  traced_fun.__name__ = name
  traced_fun.__qualname__ = getattr(fun, "__qualname__", traced_fun.__name__)
  return traced_fun


class _WeakCallable:
  """Calls a weakly held function.

  A function's shared :class:`_JitCore` (its trace cache, dispatcher and stock
  jit) lives as long as the function and must not keep it alive itself: it
  calls the function through this proxy. ``__wrapped__`` leads to the function
  while it lives, so JAX's debug info (name, source location, signature) is
  the function's own.

  Raises:
    TypeError: ``fun`` is not weakly referenceable.
  """

  def __init__(self, fun: Callable, name: str, ref: Any = None):
    self._ref = weakref.ref(fun) if ref is None else ref
    self.__name__ = name
    self.__qualname__ = getattr(fun, "__qualname__", self.__name__)
    # None when fun has no module (typeshed types __module__ as str only).
    self.__module__ = getattr(fun, "__module__", None)  # type: ignore[assignment]

  @property
  def __wrapped__(self) -> Callable:
    fun = self._ref()
    if fun is None:
      raise AttributeError("__wrapped__")
    return fun

  def __call__(self, *args, **kwargs):
    fun = self._ref()
    if fun is None:
      raise RuntimeError(
        f"jaxworks.jit_cache: function {self.__qualname__} was garbage "
        "collected; keep a reference to it while you use it"
      )
    return fun(*args, **kwargs)


class _Arguments:
  """A function's arguments as cache keys: static arguments split off, the
  rest flattened, and the C++ ``Signature`` of the leaves with the tree,
  statics and trace context (step 2 above); and the errors that name an
  argument by its path (``x['w']``, ``args[2][0]``)."""

  def __init__(
    self, fun: Callable, name: str, s_nums: tuple, s_names: tuple
  ) -> None:
    # `fun` is the user's function, or a _WeakCallable of it for shared cores.
    self._fun = fun
    self._name = name
    self._static_argnums = s_nums
    self._static_argnames = frozenset(s_names)
    self._has_statics = bool(s_nums or s_names)

  @functools.cached_property
  def _param_names(self) -> list[str] | None:
    """Positional parameter names (for messages only; computed on demand)."""
    signature = _argnums.signature_of(self._fun)
    if signature is None:
      return None
    return [
      p.name
      for p in signature.parameters.values()
      if p.kind
      in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
      )
    ]

  # -- the CoreView interface (cache.CoreView): what explain, stats and
  # closures read --------------------------------------------------------------

  @property
  def name(self) -> str:
    return self._name

  @property
  def user_function(self) -> Callable | None:
    fun = self._fun
    if hasattr(fun, "__code__"):
      return fun
    return getattr(fun, "__wrapped__", None)  # a weak proxy: None when dead

  def raw_function(self) -> Callable | None:
    """The user's function as given to jit (None once collected)."""
    fun = self._fun
    return fun._ref() if type(fun) is _WeakCallable else fun  # pylint: disable=protected-access,unidiomatic-typecheck

  @property
  def param_names(self) -> list[str] | None:
    return self._param_names

  def key(self, args: tuple, kwargs: dict) -> tuple:
    return self._key(args, kwargs)

  def leaf_paths(self, args: tuple, kwargs: dict) -> list[str]:
    return self._leaf_paths(args, kwargs)

  def _split(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple]:
    """(dynamic args, dynamic kwargs, hashable statics key)."""
    return _argnums.split_statics(
      args, kwargs, self._static_argnums, self._static_argnames, self._name
    )

  def _key(self, args: tuple, kwargs: dict):
    if self._has_statics:
      dyn_args, dyn_kwargs, statics = self._split(args, kwargs)
    else:
      dyn_args, dyn_kwargs, statics = args, kwargs, ()
    ctx = _CONTEXT(_trace_context())
    try:
      leaves, treedef, sig = _arg_key((dyn_args, dyn_kwargs), statics, ctx)
    except TypeError as e:
      leaves, _ = _flatten((dyn_args, dyn_kwargs))
      raise self._bad_argument(args, kwargs, leaves, e) from None
    return leaves, treedef, statics, ctx, sig

  def _leaf_paths(self, args: tuple, kwargs: dict) -> list[str]:
    """Readable path of each dynamic leaf, e.g. ``x['w']`` or ``args[2][0]``."""
    return _argnums.leaf_paths(
      args,
      kwargs,
      self._static_argnums,
      self._static_argnames,
      self._param_names,
    )

  def _bad_argument(
    self, args: tuple, kwargs: dict, leaves: list, error: Exception
  ) -> Exception:
    paths = self._leaf_paths(args, kwargs)
    for i, leaf in enumerate(leaves):
      try:
        _sig.signature([leaf])
      except TypeError:
        where = paths[i] if i < len(paths) else f"leaf {i}"
        return TypeError(
          f"jaxworks.jit_cache.jit: Error interpreting argument to "
          f"{self._name} as an abstract array. The problematic value is of "
          f"type {type(leaf)} and was passed to the function at path "
          f"{where}. It is not a valid JAX type; mark the argument static "
          "(static_argnums/static_argnames) or pass an array."
        )
    return TypeError(f"jaxworks.jit_cache.jit: {error}")

  def _not_a_jax_type(self, args, kwargs, i, leaf) -> TypeError:
    """Stock's TypeError for an argument that has an abstract value but is
    no value (``jax.ShapeDtypeStruct``), raised before any compile."""
    paths = self._leaf_paths(args, kwargs)
    where = paths[i] if i < len(paths) else f"leaf {i}"
    aval = ji.shaped_abstractify(leaf)
    return TypeError(
      f"jaxworks.jit_cache.jit: Argument '{where}' of shape "
      f"{aval.str_short()} of type {type(leaf)} is not a valid JAX type. "
      f"{self._name} was called with it; pass an array of that shape and "
      "dtype (a jax.ShapeDtypeStruct describes an argument for .trace(), "
      ".lower() and .eval_shape(), not for a call)."
    )


class _TraceCache(_Arguments):
  """A function's trace entries (step 3 above) and their executables per
  placement (step 5), over stock jit, which traces on a miss; and what is
  built from them without calling: ``trace``, ``lower``, ``eval_shape``,
  ``explain_miss``."""

  def __init__(
    self,
    fun: Callable,
    name: str,
    s_nums: tuple,
    s_names: tuple,
    jax_kwargs: dict[str, Any],
    maxsize: int,
  ) -> None:
    super().__init__(fun, name, s_nums, s_names)
    self._maxsize = maxsize
    self._counters = _cache.Counters()
    # jax.jit does the rest of the per-function preprocessing once, here; we
    # ask it to trace on misses (through a wrapper that counts the Python
    # executions) and defer to it in its debug modes.
    self._jax = _stock_jit(_counting(fun, name, self._counters), **jax_kwargs)
    self._cache = _cache.FunctionCache(maxsize, self._counters)

  @property
  def cache(self) -> _cache.FunctionCache:
    return self._cache

  @property
  def counters(self) -> _cache.Counters:
    return self._counters

  def _hit(self, entry: _cache.Entry) -> None:
    counters = self._counters
    counters.hits += 1
    counters.time_saved_s += entry.trace_seconds
    _cache.GLOBAL_COUNTERS.hits += 1
    _cache.GLOBAL_COUNTERS.time_saved_s += entry.trace_seconds

  def _entry(
    self,
    leaves: list,
    treedef: Any,
    statics: tuple,
    ctx: Any,
    sig: Any,
    args: tuple,
    kwargs: dict,
  ) -> Any:
    entry = self._cache.by_sig.get(sig)
    if entry is not None:
      self._hit(entry)
      self._cache.touch(entry)
      return entry
    return self._entry_slow(leaves, treedef, statics, ctx, sig, args, kwargs)

  def _entry_slow(self, leaves, treedef, statics, ctx, sig, args, kwargs):
    # The key holds the whole context, the axis environment included (step 3).
    avals = tuple(ji.shaped_abstractify(x) for x in leaves)
    key = (avals, treedef, statics, ctx)
    cache = self._cache
    computed = []

    def compute():
      computed.append(True)
      return self._trace_new(key, args, kwargs)

    entry = cache.flight.run(key, lambda: cache.by_key.peek(key), compute)
    if type(entry) is _cache.Entry:  # pylint: disable=unidiomatic-typecheck
      if not computed:
        self._hit(entry)
        cache.touch(entry)
      cache.alias(sig, entry)
    return entry

  def _trace_new(self, key, args, kwargs) -> Any:
    # With jax_explain_cache_misses on: the explanation joins JAX's warning.
    explained = explain.log_miss(self, args, kwargs)
    t0 = time.perf_counter()
    try:
      try:
        traced = self._jax.trace(*args, **kwargs)
      finally:
        if explained is not None:
          explained()
    except ValueError as e:
      if not (self._has_statics and ji.is_static_eq_collision(e)):
        raise
      # A process-wide cache inside stock's tracing compared our static
      # argument with another function's one of equal hash, and the static's
      # __eq__ raised. Stock's own first call never meets that entry; ours
      # should not either.
      ji.clear_in_shardings_cache()
      traced = self._jax.trace(*args, **kwargs)
    seconds = time.perf_counter() - t0
    self._counters.misses += 1
    _cache.GLOBAL_COUNTERS.misses += 1
    params, consts, _, in_tree, out_tree = ji.traced_parts(traced)
    high = ji.is_high(params["jaxpr"])
    if consts or high:
      return _cache.Uncacheable(traced, params, consts, out_tree, high)
    entry = _cache.Entry(
      params, in_tree, out_tree, seconds, key, _cache.config_snapshot()
    )
    self._cache.insert(entry)
    return entry

  def _executable(
    self, entry: _cache.Entry, leaves: list, ctx: Any
  ) -> _executables.Executable:
    # Placement: shardings, committedness and context (the signature), and
    # the layouts of committed arrays, which stock's lowering reads too.
    placement = _sig.signature(leaves, ctx)
    key = (placement, ji.layouts_key(leaves))
    exe = entry.executables.peek(key)
    if exe is not None:
      return exe
    with entry.lock:
      exe = entry.executables.peek(key)
      if exe is None:
        exe = _executables.build(entry, leaves, key, self._counters)
        # Beyond the bound, the oldest executable built goes.
        entry.executables.put(key, exe)
    return exe

  # -- stages ------------------------------------------------------------------

  def trace(self, *args, **kwargs) -> _stages.Traced:
    """``JitFunction.trace``: a ``Traced`` built from the cached entry."""
    leaves, treedef, statics, ctx, sig = self._key(args, kwargs)
    entry = self._entry(leaves, treedef, statics, ctx, sig, args, kwargs)
    if type(entry) is _cache.Uncacheable:  # pylint: disable=unidiomatic-typecheck
      return _stages.Traced.from_traced(entry.traced)
    return _stages.Traced.from_traced(
      ji.make_traced(
        [ji.meta_type(x) for x in leaves],
        entry.params,
        entry.in_tree,
        entry.out_tree,
        [],
      )
    )

  def lower(self, *args, **kwargs) -> _stages.Lowered:
    return self.trace(*args, **kwargs).lower()

  def eval_shape(self, *args, **kwargs) -> Any:
    return self.trace(*args, **kwargs).out_info

  def explain_miss(self, *args, **kwargs) -> str:
    """``JitFunction.explain_miss``, with the note of the last compile."""
    leaves, treedef, statics, ctx, sig = self._key(args, kwargs)
    text = explain.explain(
      self, leaves, treedef, statics, ctx, sig, args, kwargs
    )
    note = _monitoring.note_for(self._cache.by_sig.get(sig), self._counters)
    return text if note is None else f"{text}\n  {note}"


class _JitCore(_TraceCache):
  """The machinery of one (function, jit options): the C++ dispatcher over
  the trace cache, and the calls it does not serve (steps 1, 4 and 5 above).
  Shared by every :class:`JitFunction` wrapping that function with those
  options (see :func:`jit`)."""

  def __init__(
    self, fun: Callable, name: str, fun_state: tuple, options: dict[str, Any]
  ):
    """``options``: :func:`jit`'s keyword arguments, all of them."""
    static_argnums = options["static_argnums"]
    static_argnames = options["static_argnames"]
    donate_argnums = options["donate_argnums"]
    donate_argnames = options["donate_argnames"]
    specs = (static_argnums, static_argnames, donate_argnums, donate_argnames)
    signature = (
      None
      if all(v is None for v in specs)  # the common case
      else _argnums.signature_of(fun)
    )
    parsed = _argnums.parse_argnums(
      specs,
      (
        "static_argnums",
        "static_argnames",
        "donate_argnums",
        "donate_argnames",
      ),
    )
    s_nums, s_names = _argnums.resolve_argnums(
      fun, name, signature, parsed[0], parsed[1], "static"
    )
    _argnums.resolve_argnums(
      fun, name, signature, parsed[2], parsed[3], "donate"
    )
    self.fun_state = fun_state
    jax_kwargs: dict[str, Any] = dict(
      static_argnums=s_nums,
      static_argnames=s_names,
      donate_argnums=parsed[2],
      donate_argnames=parsed[3],
      keep_unused=options["keep_unused"],
      inline=options["inline"],
      compiler_options=options["compiler_options"],
    )
    for key, unset in (
      ("in_shardings", UNSET),
      ("out_shardings", UNSET),
      ("device", None),
      ("backend", None),
    ):
      if options[key] is not unset:
        jax_kwargs[key] = options[key]
    super().__init__(fun, name, s_nums, s_names, jax_kwargs, options["maxsize"])
    self_ref = weakref.ref(self)
    self._counters.owner = self_ref

    # An API boundary, as stock's: JAX filters the traceback of an error
    # raised while tracing (a call enters no Python frame before this one).
    # An unbound axis name in a top-level call raises axis_names' diagnostic,
    # read from JAX's error before its traceback is filtered.
    @ji.api_boundary
    def cache_miss(*args, **kwargs):
      core = self_ref()
      try:
        return core._cache_miss(args, kwargs)  # pylint: disable=protected-access
      except (NameError, AssertionError) as e:
        found = _boundary.axis_name_error(core.raw_function(), e, args, kwargs)
        if found is None:
          raise
        raise found from e

    self._dispatcher = ji.make_dispatcher(
      name, fun, cache_miss, s_nums, s_names, options["maxsize"]
    )
    dispatcher = self._dispatcher

    # A call whose first argument is a tracer (JitFunction's C slot checks)
    # comes here directly: under a trace the dispatcher could only hand it
    # to cache_miss after parsing the arguments itself.
    @ji.api_boundary
    def traced_call(*args, **kwargs):
      if _disable_jit_on():  # the dispatcher runs the function un-jitted
        return dispatcher(*args, **kwargs)
      return self_ref()._cache_miss(args, kwargs)[0]  # pylint: disable=protected-access

    self.traced_call = traced_call
    with REGISTRY_LOCK:
      REGISTRY.add(self)

  # -- calling -----------------------------------------------------------------

  def _cache_miss(self, args: tuple, kwargs: dict):
    """Everything the C++ dispatcher does not serve (steps 2-5 above)."""
    if _debug_modes_on():
      return self._jax(*args, **kwargs), None, False
    leaves, treedef, statics, ctx, sig = self._key(args, kwargs)
    entry = self._cache.by_sig.get(sig)
    if entry is not None:
      self._hit(entry)
      self._cache.touch(entry)
      if not _trace_state_clean():  # the hot path of inner calls, inlined
        out_flat = _jit_p.bind(*leaves, **entry.params)
        return entry.out_tree.unflatten(out_flat), None, False
      return self._run(entry, leaves, ctx, args, kwargs)
    if not _trace_state_clean():
      entry = self._entry_slow(leaves, treedef, statics, ctx, sig, args, kwargs)
      return self._run(entry, leaves, ctx, args, kwargs)
    # A top-level miss may compile: in a warm process its executable is read
    # from JAX's persistent cache while it traces (prefetch.py).
    with _prefetch.first_compile(self._fun, leaves, treedef, statics, sig):
      entry = self._entry_slow(leaves, treedef, statics, ctx, sig, args, kwargs)
      return self._run(entry, leaves, ctx, args, kwargs)

  def _run(self, entry: Any, leaves: list, ctx: Any, args: tuple, kwargs):
    """Runs ``entry`` on ``leaves`` (binds it under a trace)."""
    top_level = _trace_state_clean()
    if type(entry) is _cache.Uncacheable:  # pylint: disable=unidiomatic-typecheck
      if entry.high or top_level:
        return self._jax(*args, **kwargs), None, False
      out_flat = _jit_p.bind(*entry.consts, *leaves, **entry.params)
      return entry.out_tree.unflatten(out_flat), None, False
    if not top_level:
      out_flat = _jit_p.bind(*leaves, **entry.params)
      return entry.out_tree.unflatten(out_flat), None, False
    for i, leaf in enumerate(leaves):
      if type(leaf) in _shard_arg_handlers:
        continue
      if isinstance(leaf, _Tracer):
        # A tracer at top level escaped its trace: jax.jit's error says where
        # it was created.
        return self._jax(*args, **kwargs), None, False
      if not ji.can_pass_to_executable(leaf):
        raise self._not_a_jax_type(args, kwargs, i, leaf)
    _test_event("jit_cpp_cache_miss")  # as jax.jit's Python call path does
    exe = self._executable(entry, leaves, ctx)
    # Unchecked, as jax.jit calls it: MeshExecutable.call's argument check
    # cannot take token arguments (it reads .shape).
    out_flat = exe.mesh_executable.unsafe_call(*exe.const_args, *leaves)
    fast = ji.fastpath_data(
      exe.mesh_executable,
      entry.out_tree,
      leaves,
      out_flat,
      entry.jaxpr.effects,
      exe.const_args,
    )
    return entry.out_tree.unflatten(out_flat), fast, False

  # -- observability -----------------------------------------------------------

  def cache_info(self) -> _cache.CacheInfo:
    return self._counters.snapshot(
      entries=len(self._cache),
      maxsize=self._maxsize,
      dispatch_entries=ji.dispatcher_size(self._dispatcher),
      executables=self._cache.executables(),
    )

  def clear_cache(self) -> None:
    """``JitFunction.clear_cache``; its compiled executables go too, from the
    shared executable cache as well, unless another live function holds
    them."""
    executables = [
      exe
      for entry in self._cache.by_key.values()
      for exe in entry.executables.values()
    ]
    self._cache.clear()
    ji.dispatcher_clear(self._dispatcher)
    self._jax.clear_cache()
    _cache.EXECUTABLES.discard(executables)

  def dispatch_size(self) -> int:
    return ji.dispatcher_size(self._dispatcher)

  def clear_dispatch(self) -> None:
    ji.dispatcher_clear(self._dispatcher)


class _Unusable:
  """Stands in for the core of a function jit cannot reference weakly: as
  with ``jax.jit``, building the wrapper works and using it raises."""

  def __init__(self, message: str):
    self._message = message

  def _fail(self, *args, **kwargs) -> Any:
    raise TypeError(self._message)

  _dispatcher = _cache_miss = _split = trace = lower = eval_shape = _fail
  traced_call = _fail
  explain_miss = cache_info = _fail

  def dispatch_size(self) -> int:
    return 0

  def clear_cache(self) -> None:
    pass

  clear_dispatch = clear_cache
