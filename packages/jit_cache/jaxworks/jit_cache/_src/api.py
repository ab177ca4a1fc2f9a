"""``jit`` with its own trace cache, executable reuse and observable caches.

How a call flows (the whole mechanism):

1. ``f(*args)`` at top level enters jaxlib's C++ dispatcher, built once per
   function over our ``_cache_miss``. A signature it has seen runs the stored
   executable without any Python (fast re-dispatch). Under a trace we go to
   ``_cache_miss`` directly.
2. Otherwise ``_cache_miss`` splits static arguments, flattens the rest and
   asks the C++ extension for a ``Signature`` (kind, aval, sharding, committed
   per leaf + tree structure, statics and JAX's trace context).
3. Trace cache: ``Signature`` -> entry. On a miss the abstract values decide
   (an entry traced for other placements or leaf kinds with the same avals is
   reused), then entries traced under another axis environment whose jaxpr uses
   the same axis sizes (found with ``jaxworks.axis_names``), and only then JAX
   traces the Python function, once even with many threads asking.
4. Under an outer trace, a hit re-emits the cached jaxpr with
   ``jit_p.bind(*args, **cached_params)``: neither the Python function nor
   JAX's parameter inference runs again.
5. At top level the entry's executable is looked up by placement, then in the
   process-wide executable cache by structural fingerprint (jaxpr structure,
   literals, constants, parameters, placement, context): a re-created closure
   reuses what an earlier one compiled. With a cache directory set
   (``set_cache_dir``, opt-in), a program keyed by content alone is then
   looked up on disk (``disk_cache.py``) before it is lowered and compiled,
   and written there after. The result goes back to the C++ dispatcher as its
   fast path.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Iterable
from collections.abc import Sequence
import functools
import inspect
import os
import threading
import time
import types
from typing import Any
import warnings
import weakref

import jax
from jax.extend import core as jex_core
from jax.extend import source_info_util as jex_source_info
from jax.extend.core import primitives as jex_primitives

from .. import _signature as _ext
from . import cache as _cache
from . import deps as _deps
from . import disk_cache as _disk
from . import fingerprint as _fingerprint
from . import jax_internals as ji
from . import signature as _sig

_axis_names = _deps.load_axis_names()

#: This package's directory (jaxworks/jit_cache/). Its frames are not user
#: code: source locations in jaxprs and lowered modules skip them, as they skip
#: jax's own, and name the user's call instead of our dispatch code.
PACKAGE_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep
jex_source_info.register_exclusion(PACKAGE_DIR)

_jit_p = jex_primitives.jit_p
# Hot-path names bound once.
_flatten = ji.tracing_registry.flatten
_trace_context = ji.trace_context
_trace_state_clean = ji.trace_state_clean
_debug_modes_on = ji.debug_modes_on
_disable_jit_on = ji.disable_jit_on
_current_trace = ji.current_trace
_eval_trace = ji.eval_trace
_signature = _sig.signature
_CONTEXT = _ext.ContextInterner(16)
# Stock JAX callables bound at import, never looked up on ``jax`` at call time:
# after ``jax.jit = jit_cache.jit`` (the drop-in swap) they are still stock's.
_stock_jit = ji.stock_jit
_tree_unflatten = jax.tree_util.tree_unflatten
_tree_flatten_with_path = jax.tree_util.tree_flatten_with_path
_keystr = jax.tree_util.keystr
_jax_config = jax.config
_StockLowered = jax.stages.Lowered
_tree_leaves = jax.tree_util.tree_leaves
_Tracer = jax.core.Tracer
_test_event = ji.test_event

#: Default of in_shardings/out_shardings: stock jax.jit's own default object.
_UNSET: Any = ji.UNSPECIFIED

#: Default per-function bound on trace entries.
DEFAULT_MAXSIZE = 256
#: Executables kept per trace entry (one per argument placement).
_EXECUTABLES_PER_ENTRY = 16
#: Signatures that may point at one trace entry.
_ALIASES_PER_ENTRY = 16

#: Config values named in explain_miss when the trace context differs.
_EXPLAINED_CONFIG = (
  "jax_enable_x64",
  "jax_default_matmul_precision",
  "jax_numpy_rank_promotion",
  "jax_numpy_dtype_promotion",
  "jax_default_device",
  "jax_default_prng_impl",
  "jax_threefry_partitionable",
)

_REGISTRY: weakref.WeakSet[_JitCore] = weakref.WeakSet()
_REGISTRY_LOCK = threading.Lock()


# --------------------------------------------------------------- entries


class _Entry:
  """One traced program: the cached jaxpr and jit parameters."""

  __slots__ = (
    "params",
    "jaxpr",
    "in_tree",
    "out_tree",
    "trace_seconds",
    "key",
    "base_key",
    "sigs",
    "executables",
    "axis_sizes",
    "portable",
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
    base_key: Hashable | None,
    axis_sizes: dict,
    config: dict,
  ):
    self.params = params
    self.jaxpr = params["jaxpr"]
    self.in_tree = in_tree
    self.out_tree = out_tree
    self.trace_seconds = trace_seconds
    self.key = key
    self.base_key = base_key
    self.sigs: list[Any] = []
    self.executables: collections.OrderedDict[Any, _Executable] = (
      collections.OrderedDict()
    )
    self.axis_sizes = axis_sizes
    self.portable: bool | None = None
    self.lock = threading.Lock()
    self.config = config


class _Uncacheable:
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


class _Executable:
  __slots__ = (
    "compiled",
    "mesh_executable",
    "const_args",
    "compile_seconds",
    "tokens",
    "warnings",
    "__weakref__",
  )

  def __init__(self, compiled: Any, compile_seconds: float):
    self.compiled = compiled
    self.mesh_executable, self.const_args = ji.executable_parts(compiled)
    self.compile_seconds = compile_seconds
    # Token arguments: MeshExecutable.call's argument check cannot take them
    # (it reads .shape), jax.jit calls the executable unchecked; so do we.
    self.tokens = any(
      a is ji.abstract_token for a in _tree_leaves(compiled.in_avals)
    )
    #: Warnings lowering issued that jax.jit would issue again when it lowers
    #: the program anew (unusable donated buffers): replayed on reuse.
    self.warnings: tuple = ()


def _loaded_executable(
  compiled: Any, compile_seconds: float, replay: tuple
) -> _Executable:
  """An executable record for a ``Compiled`` loaded from the disk cache."""
  exe = _Executable(compiled, compile_seconds)
  exe.warnings = replay
  return exe


class _FunctionCache:
  """Trace entries of one function: LRU by abstract key, indexed by Signature."""

  def __init__(self, maxsize: int, counters: _cache.Counters):
    self.maxsize = maxsize
    self.counters = counters
    self.by_sig: dict[Any, _Entry] = {}
    self.by_key: collections.OrderedDict[Hashable, _Entry] = (
      collections.OrderedDict()
    )
    self.shared: dict[Hashable, list[_Entry]] = {}
    self.lock = threading.RLock()
    self.flight = _cache.SingleFlight()

  def __len__(self) -> int:
    return len(self.by_key)

  def touch(self, entry: _Entry) -> None:
    try:
      self.by_key.move_to_end(entry.key)
    except KeyError:
      pass
    _cache.GLOBAL_ENTRIES.touch(entry)

  def insert(self, entry: _Entry) -> None:
    victims = []
    with self.lock:
      self.by_key[entry.key] = entry
      if entry.base_key is not None:
        self.shared.setdefault(entry.base_key, []).append(entry)
      while len(self.by_key) > self.maxsize:
        victims.append(next(iter(self.by_key.values())))
        self._remove(victims[-1])
    for victim in victims:
      _cache.GLOBAL_ENTRIES.discard(victim)
      self._count_eviction()
    _cache.GLOBAL_ENTRIES.add(entry, self)

  def alias(self, sig: Any, entry: _Entry) -> None:
    with self.lock:
      if self.by_key.get(entry.key) is not entry:
        return  # evicted meanwhile
      self.by_sig[sig] = entry
      entry.sigs.append(sig)
      if len(entry.sigs) > _ALIASES_PER_ENTRY:
        self.by_sig.pop(entry.sigs.pop(0), None)

  def _remove(self, entry: _Entry) -> None:
    if self.by_key.get(entry.key) is entry:
      del self.by_key[entry.key]
    for sig in entry.sigs:
      if self.by_sig.get(sig) is entry:
        del self.by_sig[sig]
    if entry.base_key is not None:
      peers = self.shared.get(entry.base_key, [])
      if entry in peers:
        peers.remove(entry)
      if not peers:
        self.shared.pop(entry.base_key, None)

  def _count_eviction(self) -> None:
    self.counters.evictions += 1
    _cache.GLOBAL_COUNTERS.evictions += 1

  def evict(self, entry: _Entry, from_global: bool = False) -> None:
    with self.lock:
      present = self.by_key.get(entry.key) is entry
      self._remove(entry)
    if present:
      self._count_eviction()
    if not from_global:
      _cache.GLOBAL_ENTRIES.discard(entry)

  def clear(self) -> None:
    with self.lock:
      entries = list(self.by_key.values())
      self.by_sig.clear()
      self.by_key.clear()
      self.shared.clear()
    for entry in entries:
      _cache.GLOBAL_ENTRIES.discard(entry)

  def executables(self) -> int:
    return sum(len(e.executables) for e in list(self.by_key.values()))


# ------------------------------------------------------------ argument specs


def _index_tuple(value: Any, what: str) -> tuple[int, ...]:
  if value is None:
    return ()
  items = (value,) if isinstance(value, int) else value
  try:
    out = tuple(items)
  except TypeError:
    raise TypeError(
      f"jaxworks.jit_cache.jit: {what} must be an int or a sequence of "
      f"ints, got {value!r}"
    ) from None
  for i in out:
    if not isinstance(i, int) or isinstance(i, bool):
      raise TypeError(
        f"jaxworks.jit_cache.jit: {what} must be an int or a sequence of "
        f"ints, got {value!r}"
      )
  return out


def _name_tuple(value: Any, what: str) -> tuple[str, ...]:
  if value is None:
    return ()
  items = (value,) if isinstance(value, str) else value
  try:
    out = tuple(items)
  except TypeError:
    raise TypeError(
      f"jaxworks.jit_cache.jit: {what} must be a str or a sequence of "
      f"str, got {value!r}"
    ) from None
  for n in out:
    if not isinstance(n, str):
      raise TypeError(
        f"jaxworks.jit_cache.jit: {what} must be a str or a sequence of "
        f"str, got {value!r}"
      )
  return out


def _resolve_argnums(
  fun: Callable,
  name: str,
  sig: inspect.Signature | None,
  argnums: Any,
  argnames: Any,
  what: str,
) -> tuple[tuple[int, ...], tuple[str, ...]]:
  """Completes argnums from argnames or the reverse, as jax.jit documents."""
  if argnums is None and argnames is None:
    return (), ()
  nums = _index_tuple(argnums, f"{what}_argnums")
  names = _name_tuple(argnames, f"{what}_argnames")
  if sig is None:
    return nums, names
  params = list(sig.parameters.values())
  kinds = inspect.Parameter
  positional = [
    p
    for p in params
    if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
  ]
  if not any(p.kind is kinds.VAR_POSITIONAL for p in params):
    n = len(positional)
    for i in nums:
      if not -n <= i < n:
        raise ValueError(
          f"jaxworks.jit_cache.jit: {what}_argnums {i} out of range for "
          f"{name} with {n} positional args; use an index in [{-n}, {n}) "
          f"or {what}_argnames"
        )
  positional_only = {p.name for p in params if p.kind is kinds.POSITIONAL_ONLY}
  if bad := sorted(set(names) & positional_only):
    raise ValueError(
      f"jaxworks.jit_cache.jit: {what}_argnames {bad} of {name} are "
      f"positional-only parameters; use {what}_argnums instead"
    )
  if not any(p.kind is kinds.VAR_KEYWORD for p in params):
    valid = {
      p.name
      for p in params
      if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
    }
    if bad := sorted(set(names) - valid):
      raise ValueError(
        f"jaxworks.jit_cache.jit: {what}_argnames {bad} are not parameters "
        f"of {name} (it takes {sorted(valid)}); fix the names"
      )
  if argnums is not None and argnames is None:
    names = tuple(
      p.name
      for i, p in enumerate(params)
      if p.kind is kinds.POSITIONAL_OR_KEYWORD and i in nums
    )
  elif argnames is not None and argnums is None:
    nums = tuple(
      i
      for i, p in enumerate(params)
      if p.kind is kinds.POSITIONAL_OR_KEYWORD and p.name in names
    )
  return nums, names


def _fun_name(fun: Callable) -> str:
  name = getattr(fun, "__name__", None)
  if name is None and isinstance(fun, functools.partial):
    return _fun_name(fun.func)
  return name if isinstance(name, str) else type(fun).__name__


def _signature_of(fun: Callable) -> inspect.Signature | None:
  try:
    return inspect.signature(fun)
  except (TypeError, ValueError):
    return None


def _config_snapshot() -> dict[str, Any]:
  out = {}
  for name in _EXPLAINED_CONFIG:
    try:
      out[name] = getattr(_jax_config, name)
    except AttributeError:
      pass
  return out


def _counting(fun: Callable, counters: _cache.Counters) -> Callable:
  """``fun``, counting its executions (= traces) in ``counters``."""

  @functools.wraps(fun)
  def traced_fun(*args, **kwargs):
    counters.traces += 1
    _cache.GLOBAL_COUNTERS.traces += 1
    return fun(*args, **kwargs)

  # functools.wraps skips what `fun` lacks (a partial has no __name__): keep
  # the name jax.jit would report for `fun` itself.
  traced_fun.__name__ = _fun_name(fun)
  traced_fun.__qualname__ = getattr(fun, "__qualname__", traced_fun.__name__)
  return traced_fun


def _lower_keeping_donation_warnings(traced: Any) -> tuple[Any, tuple]:
  """``traced.lower()`` and the "donated buffers were not usable" warnings it
  issued (as they were issued: every warning is shown as usual).

  Only programs that donate come here. ``catch_warnings`` is process-wide:
  a warning another thread issues meanwhile is recorded and shown from here.
  """
  with warnings.catch_warnings(record=True) as caught:
    lowered = traced.lower()
  keep = []
  for w in caught:
    warnings.warn_explicit(
      w.message, w.category, w.filename, w.lineno, source=w.source
    )
    if issubclass(w.category, UserWarning) and "donated buffers" in str(
      w.message
    ):
      keep.append(w.message)
  return lowered, tuple(keep)


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

  def __init__(self, fun: Callable, ref: Any = None):
    self._ref = weakref.ref(fun) if ref is None else ref
    self.__name__ = _fun_name(fun)
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


# -------------------------------------------------------------------- stages


class Traced:
  """A traced function specialised to argument types (``f.trace(...)``).

  Attributes:
    jaxpr: the ``ClosedJaxpr``. Tracers the function closes over (when traced
      under another transformation) are leading inputs, not constants.
    fun_name: name of the traced function.
    in_avals: abstract values of the dynamic arguments, as the pytree
      ``(args, kwargs)`` (static arguments left out).
    out_info: output ``jax.ShapeDtypeStruct`` pytree.
    args_info: jax's ``ArgInfo`` pytree (aval and donation per argument).
  """

  __slots__ = ("_traced",)

  def __init__(self, traced: Any):
    self._traced = traced

  @property
  def jaxpr(self) -> jex_core.ClosedJaxpr:
    return self._traced.jaxpr

  @property
  def fun_name(self) -> str:
    return self._traced.fun_name

  @property
  def in_avals(self) -> Any:
    params, consts, _, in_tree, _ = ji.traced_parts(self._traced)
    avals = params["jaxpr"].in_avals[len(consts) :]
    return _tree_unflatten(in_tree, avals)

  @property
  def out_info(self) -> Any:
    return self._traced.out_info

  @property
  def args_info(self) -> Any:
    return self._traced.args_info

  @property
  def _consts(self) -> list:
    return ji.traced_parts(self._traced)[1]

  def lower(
    self,
    *,
    lowering_platforms: tuple[str, ...] | None = None,
    _private_parameters: Any = None,
  ) -> jax.stages.Lowered:
    """Lowers to a stock ``jax.stages.Lowered``.

    Args:
      lowering_platforms: platforms to lower for, e.g. ``("tpu",)`` or
        ``("cpu", "cuda")``; default: those of the arguments.
      _private_parameters: a ``jax.interpreters.mlir.LoweringParameters``,
        passed through to ``jax.stages.Traced.lower`` as is (private in jax
        too; ``jaxworks.stages_aot`` lowers with ``jax.export``'s parameters
        through it). Default: jax's default lowering.
    """
    if _private_parameters is None:
      return self._traced.lower(lowering_platforms=lowering_platforms)
    return self._traced.lower(
      lowering_platforms=lowering_platforms,
      _private_parameters=_private_parameters,
    )

  def __repr__(self) -> str:
    return (
      f"Traced({self.fun_name}: {self.jaxpr.in_avals} -> "
      f"{self.jaxpr.out_avals})"
    )


# -------------------------------------------------------------- JitFunction


class _JitCore:
  """The machinery of one (function, jit options): trace cache, C++
  dispatcher, stock jit for tracing. Shared by every :class:`JitFunction`
  wrapping that function with those options (see :func:`jit`)."""

  def __init__(
    self,
    fun: Callable,
    name: str,
    fun_state: tuple,
    *,
    static_argnums: Any,
    static_argnames: Any,
    donate_argnums: Any,
    donate_argnames: Any,
    in_shardings: Any,
    out_shardings: Any,
    keep_unused: bool,
    device: Any,
    backend: Any,
    inline: bool,
    compiler_options: dict[str, Any] | None,
    maxsize: int,
  ):
    # `fun` is the user's function, or a _WeakCallable of it for shared cores.
    specs = (static_argnums, static_argnames, donate_argnums, donate_argnames)
    signature = (
      None
      if all(v is None for v in specs)  # the common case
      else _signature_of(fun)
    )
    s_nums, s_names = _resolve_argnums(
      fun, name, signature, static_argnums, static_argnames, "static"
    )
    _resolve_argnums(
      fun, name, signature, donate_argnums, donate_argnames, "donate"
    )
    self.fun_state = fun_state
    self._fun = fun
    self._name = name
    self._static_argnums = s_nums
    self._static_argnames = frozenset(s_names)
    self._has_statics = bool(s_nums or s_names)
    self._maxsize = maxsize
    jax_kwargs: dict[str, Any] = dict(
      static_argnums=s_nums,
      static_argnames=s_names,
      donate_argnums=donate_argnums,
      donate_argnames=donate_argnames,
      keep_unused=keep_unused,
      inline=inline,
      compiler_options=compiler_options,
    )
    if in_shardings is not _UNSET:
      jax_kwargs["in_shardings"] = in_shardings
    if out_shardings is not _UNSET:
      jax_kwargs["out_shardings"] = out_shardings
    if device is not None:
      jax_kwargs["device"] = device
    if backend is not None:
      jax_kwargs["backend"] = backend
    self._counters = _cache.Counters()
    # jax.jit does the rest of the per-function preprocessing once, here; we
    # ask it to trace on misses (through a wrapper that counts the Python
    # executions) and defer to it in its debug modes.
    self._jax = _stock_jit(_counting(fun, self._counters), **jax_kwargs)
    self._cache = _FunctionCache(maxsize, self._counters)
    self_ref = weakref.ref(self)

    def cache_miss(*args, **kwargs):
      return self_ref()._cache_miss(args, kwargs)  # pylint: disable=protected-access

    self._dispatcher = ji.make_dispatcher(
      name, fun, cache_miss, s_nums, s_names, maxsize
    )
    with _REGISTRY_LOCK:
      _REGISTRY.add(self)

  # -- calling ---------------------------------------------------------------

  @functools.cached_property
  def _param_names(self) -> list[str] | None:
    """Positional parameter names (for messages only; computed on demand)."""
    signature = _signature_of(self._fun)
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

  def _cache_miss(self, args: tuple, kwargs: dict):
    """Everything the C++ dispatcher does not serve (steps 2-5 above)."""
    if _debug_modes_on():
      return self._jax(*args, **kwargs), None, False
    leaves, treedef, statics, ctx, sig = self._key(args, kwargs)
    entry = self._cache.by_sig.get(sig)
    if entry is not None:  # the hot path of inner calls, inlined
      self._hit(entry)
      self._cache.touch(entry)
    else:
      entry = self._entry_slow(leaves, treedef, statics, ctx, sig, args, kwargs)
    top_level = _trace_state_clean()
    if type(entry) is _Uncacheable:  # pylint: disable=unidiomatic-typecheck
      if entry.high or top_level:
        return self._jax(*args, **kwargs), None, False
      out_flat = _jit_p.bind(*entry.consts, *leaves, **entry.params)
      return entry.out_tree.unflatten(out_flat), None, False
    if not top_level:
      out_flat = _jit_p.bind(*leaves, **entry.params)
      return entry.out_tree.unflatten(out_flat), None, False
    for leaf in leaves:
      if isinstance(leaf, _Tracer):
        # A tracer at top level escaped its trace: jax.jit's error says where
        # it was created.
        return self._jax(*args, **kwargs), None, False
    _test_event("jit_cpp_cache_miss")  # as jax.jit's Python call path does
    exe = self._executable(entry, leaves, ctx)
    if exe.tokens:
      out_flat = exe.mesh_executable.unsafe_call(*exe.const_args, *leaves)
    else:
      out_flat = exe.mesh_executable.call(*exe.const_args, *leaves)
    fast = ji.fastpath_data(
      exe.mesh_executable,
      entry.out_tree,
      leaves,
      out_flat,
      entry.jaxpr.effects,
      exe.const_args,
    )
    return entry.out_tree.unflatten(out_flat), fast, False

  # -- keys ----------------------------------------------------------------------

  def _split(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple]:
    """(dynamic args, dynamic kwargs, hashable statics key)."""
    statics: list[Any] = []
    if self._static_argnums:
      n = len(args)
      idx = {i + n if i < 0 else i for i in self._static_argnums}
      idx = {i for i in idx if 0 <= i < n}
      statics.extend((i, args[i]) for i in sorted(idx))
      dyn_args = tuple(a for i, a in enumerate(args) if i not in idx)
    else:
      dyn_args = args
    if kwargs and self._static_argnames:
      statics.extend(
        (k, kwargs[k]) for k in sorted(kwargs) if k in self._static_argnames
      )
      dyn_kwargs = {
        k: v for k, v in kwargs.items() if k not in self._static_argnames
      }
    else:
      dyn_kwargs = kwargs
    key = tuple((where, type(v), v) for where, v in statics)
    try:
      hash(key)
    except TypeError:
      for where, v in statics:
        try:
          hash(v)
        except TypeError as e:
          label = (
            f"argument {where}"
            if isinstance(where, int)
            else f"argument {where!r}"
          )
          raise ValueError(
            "jaxworks.jit_cache.jit: Non-hashable static arguments are "
            f"not supported: static {label} of {self._name} is "
            f"not hashable: {type(v).__name__} {v!r:.80} ({e}); pass a "
            "hashable value (for example a tuple instead of a list) or "
            "make the argument dynamic"
          ) from None
      raise
    return dyn_args, dyn_kwargs, key

  def _key(self, args: tuple, kwargs: dict):
    if self._has_statics:
      dyn_args, dyn_kwargs, statics = self._split(args, kwargs)
    else:
      dyn_args, dyn_kwargs, statics = args, kwargs, ()
    leaves, treedef = _flatten((dyn_args, dyn_kwargs))
    ctx = _CONTEXT(_trace_context())
    try:
      sig = _signature(leaves, (treedef, statics, ctx))
    except TypeError as e:
      raise self._bad_argument(args, kwargs, leaves, e) from None
    return leaves, treedef, statics, ctx, sig

  def _leaf_paths(self, args: tuple, kwargs: dict) -> list[str]:
    """Readable path of each dynamic leaf, e.g. ``x['w']`` or ``args[2][0]``."""
    n = len(args)
    static_idx = {i + n if i < 0 else i for i in self._static_argnums}
    dyn_positions = [i for i in range(n) if i not in static_idx]
    dyn_args = tuple(args[i] for i in dyn_positions)
    dyn_kwargs = {
      k: v for k, v in kwargs.items() if k not in self._static_argnames
    }
    flat, _ = _tree_flatten_with_path((dyn_args, dyn_kwargs))
    out = []
    for path, _ in flat:
      if not path:
        out.append("?")
        continue
      head = path[0].idx if hasattr(path[0], "idx") else 0
      if head == 0 and len(path) > 1 and hasattr(path[1], "idx"):
        pos = dyn_positions[path[1].idx]
        names = self._param_names or []
        base = names[pos] if pos < len(names) else f"args[{pos}]"
      elif head == 1 and len(path) > 1 and hasattr(path[1], "key"):
        base = str(path[1].key)
      else:
        out.append(_keystr(path))
        continue
      out.append(base + _keystr(tuple(path[2:])))
    return out

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
          f"jaxworks.jit_cache.jit: argument {where} of {self._name} has "
          f"type {type(leaf).__name__}, which is not a valid JAX type; mark "
          "it static (static_argnums/static_argnames) or pass an array"
        )
    return TypeError(f"jaxworks.jit_cache.jit: {error}")

  # -- the trace cache -----------------------------------------------------------

  def _hit(self, entry: _Entry) -> None:
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
    avals = tuple(ji.shaped_abstractify(x) for x in leaves)
    key = (avals, treedef, statics, ctx)
    # The axis environment is read where JAX keeps it, never by its position
    # in the trace context (user contexts append to that tuple).
    env = ji.current_axis_env()
    sizes, spmd, explicit = ji.axis_env_parts(env)
    base_key = None
    if sizes:
      rest = ji.without_axis_env(ctx.values, env)
      if rest is not None:
        base_key = (avals, treedef, statics, _CONTEXT(rest), spmd, explicit)
    cache = self._cache
    computed = []

    def lookup():
      entry = cache.by_key.get(key)
      if entry is None and base_key is not None:
        entry = self._shared_entry(
          base_key, sizes, spmd, explicit, args, kwargs
        )
      return entry

    def compute():
      computed.append(True)
      return self._trace_new(key, base_key, sizes, args, kwargs)

    entry = cache.flight.run(key, lookup, compute)
    if type(entry) is _Entry:  # pylint: disable=unidiomatic-typecheck
      if not computed:
        self._hit(entry)
        cache.touch(entry)
      cache.alias(sig, entry)
    return entry

  def _trace_new(self, key, base_key, sizes, args, kwargs) -> Any:
    t0 = time.perf_counter()
    traced = self._jax.trace(*args, **kwargs)
    seconds = time.perf_counter() - t0
    self._counters.misses += 1
    _cache.GLOBAL_COUNTERS.misses += 1
    params, consts, _, in_tree, out_tree = ji.traced_parts(traced)
    high = ji.is_high(params["jaxpr"])
    if consts or high:
      return _Uncacheable(traced, params, consts, out_tree, high)
    axis_sizes = {}
    if sizes:
      used = _axis_names.used_axis_names(params["jaxpr"])
      axis_sizes = {n: sizes[n] for n in used if n in sizes}
    entry = _Entry(
      params,
      in_tree,
      out_tree,
      seconds,
      key,
      base_key,
      axis_sizes,
      _config_snapshot(),
    )
    self._cache.insert(entry)
    return entry

  def _shared_entry(self, base_key, sizes, spmd, explicit, args, kwargs):
    """An entry traced under another axis environment, if it applies here.

    An entry applies when the axis names its jaxpr uses have the same sizes
    here. A jaxpr can also depend on names it does not mention (for example
    ``lax.axis_size('i')`` folds to a literal), so before the first sharing
    the function is traced once more under an environment holding only the
    used names: the entry is shared only when that trace succeeds and gives a
    structurally identical jaxpr.
    """
    for cand in list(self._cache.shared.get(base_key, ())):
      if any(sizes.get(n) != s for n, s in cand.axis_sizes.items()):
        continue
      if cand.portable is None:
        cand.portable = self._check_portable(cand, spmd, explicit, args, kwargs)
      if cand.portable:
        return cand
    return None

  def _check_portable(self, cand, spmd, explicit, args, kwargs) -> bool:
    names = frozenset(cand.axis_sizes)
    restricted = ji.make_axis_env(
      cand.axis_sizes, spmd & names, explicit & names
    )
    try:
      with ji.axis_env_set(restricted):
        traced = self._jax.trace(*args, **kwargs)
    except Exception:  # pylint: disable=broad-except
      return False  # needs more of the environment than the names it uses
    params, consts, _, _, _ = ji.traced_parts(traced)
    if consts:
      return False
    mine = _fingerprint.fingerprint(cand.jaxpr)
    return mine is not None and mine == _fingerprint.fingerprint(
      params["jaxpr"]
    )

  # -- executables -------------------------------------------------------------------

  def _executable(self, entry: _Entry, leaves: list, ctx: Any) -> _Executable:
    placement = _sig.signature(leaves, ctx)
    exe = entry.executables.get(placement)
    if exe is not None:
      return exe
    with entry.lock:
      exe = entry.executables.get(placement)
      if exe is None:
        exe = self._build_executable(entry, leaves, placement)
        entry.executables[placement] = exe
        if len(entry.executables) > _EXECUTABLES_PER_ENTRY:
          entry.executables.popitem(last=False)
    return exe

  def _build_executable(
    self, entry: _Entry, leaves: list, placement: Any
  ) -> _Executable:
    traced = ji.make_traced(
      [ji.meta_type(x) for x in leaves],
      entry.params,
      entry.in_tree,
      entry.out_tree,
      [],
    )
    counters = self._counters

    donates = any(entry.params["donated_invars"])

    def build() -> _Executable:
      t0 = time.perf_counter()
      if donates:
        lowered, replay = _lower_keeping_donation_warnings(traced)
      else:
        lowered, replay = traced.lower(), ()
      compiled = lowered.compile()
      exe = _Executable(compiled, time.perf_counter() - t0)
      exe.warnings = replay
      counters.compiles += 1
      _cache.GLOBAL_COUNTERS.compiles += 1
      return exe

    program = _fingerprint.fingerprint(entry.jaxpr)
    params = _fingerprint.params_key(entry.params)
    if program is None or params is None:
      return build()
    # Programs holding no user object (callback, array kept by identity) and
    # little constant data outlive their functions in the shared cache.
    keep = (
      not program.pins
      and not params.pins
      and program.nbytes <= _fingerprint.CONTENT_HASH_MAX_BYTES
      and _fingerprint.plain(placement.extra.values)
    )
    if keep and _disk.enabled():  # a new process may load it (opt-in)
      build = _disk.wrap_build(
        build,
        _loaded_executable,
        entry,
        entry.in_tree,
        entry.out_tree,
        leaves,
        program,
        params,
        placement.extra.values,
        (counters, _cache.GLOBAL_COUNTERS),
      )
    exe, reused = _cache.EXECUTABLES.get_or_build(
      (program, params, placement), build, keep
    )
    if reused:
      for warning in exe.warnings:  # what lowering anew would have said
        warnings.warn(warning, stacklevel=4)
      counters.executable_reuses += 1
      counters.time_saved_s += exe.compile_seconds
      _cache.GLOBAL_COUNTERS.executable_reuses += 1
      _cache.GLOBAL_COUNTERS.time_saved_s += exe.compile_seconds
    return exe

  # -- stages ------------------------------------------------------------------------

  def trace(self, *args, **kwargs) -> Traced:
    """Traces for these arguments (cached), without compiling.

    Shares the trace cache with calls: ``f.trace(x)`` then ``f(x)`` traces
    the Python function once. Tracers the function closes over become leading
    inputs of ``Traced.jaxpr`` (``make_jaxpr`` keeps them as constants).
    """
    leaves, treedef, statics, ctx, sig = self._key(args, kwargs)
    entry = self._entry(leaves, treedef, statics, ctx, sig, args, kwargs)
    if type(entry) is _Uncacheable:  # pylint: disable=unidiomatic-typecheck
      return Traced(entry.traced)
    return Traced(
      ji.make_traced(
        [ji.meta_type(x) for x in leaves],
        entry.params,
        entry.in_tree,
        entry.out_tree,
        [],
      )
    )

  def lower(self, *args, **kwargs) -> jax.stages.Lowered:
    """``self.trace(*args, **kwargs).lower()``: a stock ``jax.stages.Lowered``."""
    return self.trace(*args, **kwargs).lower()

  def eval_shape(self, *args, **kwargs) -> Any:
    """Output ``jax.ShapeDtypeStruct`` pytree, from the shared trace cache."""
    return self.trace(*args, **kwargs).out_info

  # -- observability -----------------------------------------------------------------

  def cache_info(self) -> _cache.CacheInfo:
    """Counters and sizes of this function's caches."""
    return self._counters.snapshot(
      entries=len(self._cache),
      maxsize=self._maxsize,
      dispatch_entries=ji.dispatcher_size(self._dispatcher),
      executables=self._cache.executables(),
    )

  def clear_cache(self) -> None:
    """Drops this function's trace entries, C++ dispatch entries, and what
    JAX's own tracing caches hold for it (so the next call runs Python).

    Its compiled executables go too, from the shared executable cache as
    well, unless another live function holds them.
    """
    executables = [
      exe
      for entry in list(self._cache.by_key.values())
      for exe in list(entry.executables.values())
    ]
    self._cache.clear()
    ji.dispatcher_clear(self._dispatcher)
    self._jax.clear_cache()
    _cache.EXECUTABLES.discard(executables)

  def dispatch_size(self) -> int:
    return ji.dispatcher_size(self._dispatcher)

  def clear_dispatch(self) -> None:
    ji.dispatcher_clear(self._dispatcher)

  def explain_miss(self, *args, **kwargs) -> str:
    """Why a call with these arguments would (not) hit the trace cache.

    Returns:
      ``"<name>: hit ..."``, or ``"<name>: miss ..."`` followed by one line per
      difference from the nearest cached entry, such as
      ``x['w']: dtype float32 -> float64``.
    """
    from . import explain  # pylint: disable=g-import-not-at-top

    leaves, treedef, statics, ctx, sig = self._key(args, kwargs)
    text = explain.explain(
      self, leaves, treedef, statics, ctx, sig, args, kwargs
    )
    disk = _disk.note_for(self._cache.by_sig.get(sig))
    return text if disk is None else f"{text}\n  {disk}"


class _Unusable:
  """Stands in for the core of a function jit cannot reference weakly: as
  with ``jax.jit``, building the wrapper works and using it raises."""

  def __init__(self, message: str):
    self._message = message

  def _fail(self, *args, **kwargs) -> Any:
    raise TypeError(self._message)

  _dispatcher = _cache_miss = _split = trace = lower = eval_shape = _fail
  explain_miss = cache_info = _fail

  def dispatch_size(self) -> int:
    return 0

  def clear_cache(self) -> None:
    pass

  clear_dispatch = clear_cache


class JitFunction:
  """A function wrapped by :func:`jit`. Call it like the function.

  Methods: ``trace``, ``lower``, ``eval_shape`` (sharing one trace cache with
  calls), ``cache_info``, ``explain_miss``, ``clear_cache``; and, as on
  ``jax.jit``'s wrappers, ``_cache_size()`` (signatures served without Python)
  and ``_clear_cache()``.

  Wrappers of the same function object with the same options share one cache,
  as ``jax.jit``'s do: ``jit(f)(x)`` written inline traces ``f`` once, not at
  every call. ``cache_info()`` and ``clear_cache()`` are per (function,
  options).
  """

  __wrapped__: Callable  # set by functools.update_wrapper in __init__

  def __init__(self, fun: Callable, core: Any, options: dict):
    functools.update_wrapper(self, fun)
    self._fun = fun
    self._core = core
    self._options = options

  def __call__(self, *args, **kwargs):
    core = self._core
    if _current_trace.value is not _eval_trace and not _disable_jit_on():
      # Under a trace the C++ dispatcher can only hand over to _cache_miss:
      # go there directly.
      return core._cache_miss(args, kwargs)[0]  # pylint: disable=protected-access
    try:
      return core._dispatcher(*args, **kwargs)  # pylint: disable=protected-access
    except ValueError as e:
      if str(e).startswith("Non-hashable static arguments"):
        core._split(args, kwargs)  # raises our own, clearer error  # pylint: disable=protected-access
      raise

  def __get__(self, obj: Any, objtype: Any = None) -> Any:
    if obj is None:
      return self
    return types.MethodType(self, obj)

  def __repr__(self) -> str:
    try:
      return f"<JitFunction of {self.__wrapped__!r}>"
    except Exception:  # pylint: disable=broad-except
      return "<JitFunction>"  # a broken repr of the function, or no function

  def __getstate__(self) -> dict:
    """Pickles as the function and the options (caches are not pickled)."""
    return {
      "function_name": _fun_name(self._fun),
      "fun": self._fun,
      "options": self._options,
    }

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(_make(state["fun"], state["options"]).__dict__)

  def trace(self, *args, **kwargs) -> Traced:
    """Traces for these arguments (cached), without compiling.

    Shares the trace cache with calls: ``f.trace(x)`` then ``f(x)`` traces
    the Python function once. Tracers the function closes over become leading
    inputs of ``Traced.jaxpr`` (``make_jaxpr`` keeps them as constants).
    """
    return self._core.trace(*args, **kwargs)

  def lower(self, *args, **kwargs) -> jax.stages.Lowered:
    """``self.trace(*args, **kwargs).lower()``: a stock ``jax.stages.Lowered``.

    Its ``compile()`` prunes unused arguments unless ``keep_unused=True``, as
    ``jax.jit``'s does.
    """
    return self._core.lower(*args, **kwargs)

  def eval_shape(self, *args, **kwargs) -> Any:
    """Output ``jax.ShapeDtypeStruct`` pytree, from the shared trace cache."""
    return self._core.eval_shape(*args, **kwargs)

  def cache_info(self) -> _cache.CacheInfo:
    """Counters and sizes of this function's caches."""
    return self._core.cache_info()

  def clear_cache(self) -> None:
    """Drops this function's trace entries, C++ dispatch entries, and what
    JAX's own tracing caches hold for it (so the next call runs Python)."""
    self._core.clear_cache()

  def explain_miss(self, *args, **kwargs) -> str:
    """Why a call with these arguments would (not) hit the trace cache.

    Returns:
      ``"<name>: hit ..."``, or ``"<name>: miss ..."`` followed by one line per
      difference from the nearest cached entry, such as
      ``x['w']: dtype float32 -> float64``.
    """
    return self._core.explain_miss(*args, **kwargs)

  def _cache_size(self) -> int:
    """Signatures the C++ dispatcher serves with no Python (``jax.jit``'s
    ``_cache_size()``): one per distinct top-level call signature."""
    return self._core.dispatch_size()

  def _clear_cache(self) -> None:
    """Empties the C++ dispatcher only (``jax.jit``'s ``_clear_cache()``)."""
    self._core.clear_dispatch()


# ---------------------------------------------- shared cores per function

#: id(function) -> (weak reference to it, {options key: _JitCore}). A core
#: holds its function only weakly (through _WeakCallable), so a function's
#: cores live exactly as long as the function.
_CORES: dict[int, tuple[Any, dict]] = {}
_CORES_LOCK = threading.Lock()
#: Option sets kept per function (oldest dropped first).
_CORES_PER_FUNCTION = 32


def _forget_cores(fun_id: int, ref: Any) -> None:
  # A weakref callback: runs when the function dies, possibly inside a
  # garbage collection, so it takes no lock (dict operations are atomic).
  item = _CORES.get(fun_id)
  if item is not None and item[0] is ref:
    _CORES.pop(fun_id, None)


def _freeze(value: Any) -> Any:
  """Hashable, type-exact key of a jit option (TypeError if unhashable)."""
  t = type(value)
  if t is list or t is tuple:
    return (t, tuple(_freeze(v) for v in value))
  if t is dict:
    return (t, tuple((k, _freeze(v)) for k, v in value.items()))
  if t is float:
    return (t, value.hex())  # -0.0 and 0.0 differ
  hash(value)
  return (t, value)


def _options_key(options: dict) -> Any:
  """Key of every jit option, or None when one is unhashable (no sharing)."""
  if all(options[k] is v for k, v in _DEFAULT_OPTIONS.items()):
    return ()
  try:
    return tuple(_freeze(options[k]) for k in _DEFAULT_OPTIONS)
  except TypeError:
    return None


def _fun_state(fun: Callable) -> tuple:
  """What of a function can change while it stays the same object, and
  changes what tracing it does: its code and defaults (compared by identity)."""
  return (
    getattr(fun, "__code__", None),
    getattr(fun, "__defaults__", None),
    getattr(fun, "__kwdefaults__", None),
  )


def _same_state(a: tuple, b: tuple) -> bool:
  return a[0] is b[0] and a[1] is b[1] and a[2] is b[2]


def _weakref_message(fun: Callable, error: Exception) -> str:
  return (
    f"jaxworks.jit_cache.jit: {error} ({type(fun).__name__} "
    f"{_safe_repr(fun)}); jit keys its caches by the function weakly, as "
    "jax.jit does: give the class a '__weakref__' slot, or jit a function "
    "that calls it, e.g. jit(lambda *a, **k: obj(*a, **k))"
  )


def _safe_repr(obj: Any) -> str:
  try:
    return f"{obj!r:.80}"
  except Exception:  # pylint: disable=broad-except
    return f"<{type(obj).__name__} object>"


def _make(fun: Callable, options: dict) -> JitFunction:
  """The JitFunction for ``fun``: a shared core when one matches."""
  key = _options_key(options)
  state = _fun_state(fun)
  fun_id = id(fun)
  if key is not None:
    item = _CORES.get(fun_id)
    if item is not None and item[0]() is fun:
      core = item[1].get(key)
      if core is not None and _same_state(core.fun_state, state):
        return JitFunction(fun, core, options)
  name = _fun_name(fun)
  try:
    ref = weakref.ref(fun, functools.partial(_forget_cores, fun_id))
  except TypeError as e:
    # Validate the options now (as jax.jit does), fail when used.
    _JitCore(fun, name, state, **options)
    return JitFunction(fun, _Unusable(_weakref_message(fun, e)), options)
  core = _JitCore(_WeakCallable(fun, ref), name, state, **options)
  if key is not None:
    with _CORES_LOCK:
      item = _CORES.get(fun_id)
      if item is None or item[0]() is not fun:
        item = (ref, {})
        _CORES[fun_id] = item
      cores = item[1]
      cores.pop(key, None)
      cores[key] = core
      while len(cores) > _CORES_PER_FUNCTION:
        del cores[next(iter(cores))]
  return JitFunction(fun, core, options)


# ------------------------------------------------------------------ public API

_FUN_DEFAULT = ji.JIT_FUN_DEFAULT


def jit(
  fun: Callable = _FUN_DEFAULT,
  /,
  *,
  in_shardings: Any = _UNSET,
  out_shardings: Any = _UNSET,
  static_argnums: int | Sequence[int] | None = None,
  static_argnames: str | Iterable[str] | None = None,
  donate_argnums: int | Sequence[int] | None = None,
  donate_argnames: str | Iterable[str] | None = None,
  keep_unused: bool = False,
  device: Any = None,
  backend: str | None = None,
  inline: bool = False,
  compiler_options: dict[str, Any] | None = None,
  maxsize: int = DEFAULT_MAXSIZE,
) -> Any:
  """``jax.jit`` with its own trace cache, executable reuse and cache stats.

  The parameters are ``jax.jit``'s: the same names, kinds (``fun``
  positional-only, the rest keyword-only), order and defaults, plus
  ``maxsize``, which bounds this function's trace entries (least recently used
  go first). Where ``jax.jit`` raises, this raises the same exception class.
  Use it as ``jit(f, ...)``, ``@jit``, ``@jit(static_argnums=...)`` or with
  ``functools.partial(jit, ...)``; it also works on methods.

  Wrapping the same function object again with the same options gives a new
  :class:`JitFunction` over the same caches (keyed by the function's identity,
  held weakly, its code and defaults, and every option), so ``jit(f)(x)``
  written inline runs from the cache after the first call, as with
  ``jax.jit``.

  Args:
    fun: the function to compile; omitted to get a decorator.
    in_shardings: as ``jax.jit``.
    out_shardings: as ``jax.jit``.
    static_argnums: positional arguments treated as static (hashable).
    static_argnames: keyword arguments treated as static.
    donate_argnums: positional arguments whose buffers may be reused.
    donate_argnames: keyword arguments whose buffers may be reused.
    keep_unused: keep unused arguments in the compiled program.
    device: deprecated in jax.jit, passed through.
    backend: deprecated in jax.jit, passed through.
    inline: inline into an enclosing jaxpr instead of a ``jit`` equation.
    compiler_options: XLA compiler options (top-level calls only).
    maxsize: per-function LRU bound on trace entries (>= 1).

  Returns:
    A :class:`JitFunction` (a decorator when ``fun`` is omitted).

  Raises:
    TypeError: ``fun`` is not callable, is a generator function or a
      ``staticmethod``/``classmethod`` object; bad argnums types.
    ValueError: static/donate argnums or argnames that ``fun`` does not
      have, or a bad ``maxsize``.

  >>> import jax.numpy as jnp
  >>> from jaxworks.jit_cache import jit
  >>> @jit
  ... def f(x, y):
  ...   return x * 2 + y
  >>> f(jnp.arange(3.0), 1.0)
  Array([1., 3., 5.], dtype=float32)
  >>> f(jnp.arange(3.0), 5.0).tolist()   # same signature: no new trace
  [5.0, 7.0, 9.0]
  >>> f.cache_info().traces
  1
  """
  options = dict(
    in_shardings=in_shardings,
    out_shardings=out_shardings,
    static_argnums=static_argnums,
    static_argnames=static_argnames,
    donate_argnums=donate_argnums,
    donate_argnames=donate_argnames,
    keep_unused=keep_unused,
    device=device,
    backend=backend,
    inline=inline,
    compiler_options=compiler_options,
    maxsize=maxsize,
  )
  if fun is _FUN_DEFAULT:
    return functools.partial(jit, **options)
  _check_function(fun, "jit")
  if not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize < 1:
    raise ValueError(
      f"jaxworks.jit_cache.jit: maxsize must be an int >= 1, got {maxsize!r}"
    )
  return _make(fun, options)


#: jit's options at their defaults (the common ``jit(f)``).
_DEFAULT_OPTIONS = {
  name: p.default
  for name, p in inspect.signature(jit).parameters.items()
  if p.kind is inspect.Parameter.KEYWORD_ONLY
}


def _check_function(fun: Any, api: str) -> None:
  """The checks jax.jit makes on its function, with the same classes."""
  if isinstance(fun, (staticmethod, classmethod)):
    kind = type(fun).__name__
    raise TypeError(
      f"jaxworks.jit_cache.{api}: {kind} arguments are not supported, got "
      f"{_safe_repr(fun)}: Expected a callable value; apply {api} to the "
      f"function first, then {kind}: {kind}({api}(f))"
    )
  if not callable(fun):
    raise TypeError(
      f"jaxworks.jit_cache.{api}: Expected a callable value, got "
      f"{type(fun).__name__} {_safe_repr(fun)}; pass a function, as in "
      f"{api}(f, ...)"
    )
  if inspect.isgeneratorfunction(fun):
    raise TypeError(
      f"jaxworks.jit_cache.{api}: Expected a function, got a generator "
      f"function: {_fun_name(fun)}; JAX traces a function once, so return "
      "the values (e.g. stacked) instead of yielding them"
    )


def _implicit_jit(
  fun: Callable, api: str, static_argnums: Any = None
) -> JitFunction:
  """The shared wrapper make_jaxpr uses for a plain function (a private one
  for functions that are not weakly referenceable, which jax.make_jaxpr
  accepts)."""
  _check_function(fun, api)
  wrapped = jit(fun, static_argnums=static_argnums)
  if isinstance(wrapped._core, _Unusable):  # pylint: disable=protected-access
    # Not weakly referenceable: a private core holding it (no sharing).
    options = dict(_DEFAULT_OPTIONS, static_argnums=static_argnums)
    core = _JitCore(fun, _fun_name(fun), _fun_state(fun), **options)
    wrapped = JitFunction(fun, core, options)
  return wrapped


def eval_shape(fun: Callable, *args, **kwargs) -> Any:
  """``jax.eval_shape`` through the trace cache of :func:`jit`.

  A :class:`JitFunction` uses its own cache, so a later call with the same
  signature does not trace again; a plain function uses the cache that every
  ``jit(f)`` of it shares, so repeated ``eval_shape(f, ...)`` calls trace
  once.

  >>> import jax, jax.numpy as jnp
  >>> from jaxworks.jit_cache import eval_shape
  >>> eval_shape(lambda x: x.sum(0), jax.ShapeDtypeStruct((4, 3), jnp.float32))
  ShapeDtypeStruct(shape=(3,), dtype=float32)
  """
  if isinstance(fun, JitFunction):
    return fun.eval_shape(*args, **kwargs)
  _check_function(fun, "eval_shape")
  # As jax.eval_shape, this needs a weakly referenceable function.
  return jit(fun).eval_shape(*args, **kwargs)


def make_jaxpr(
  fun: Callable,
  static_argnums: int | Sequence[int] | None = None,
  axis_env: Sequence[tuple[Any, int]] | None = None,
  return_shape: bool = False,
) -> Callable[..., Any]:
  """``jax.make_jaxpr`` through the trace cache of :func:`jit`.

  Like ``jax.make_jaxpr`` (and unlike ``f.trace``), tracers the function closes
  over stay constants of the returned ``ClosedJaxpr`` (upstream
  jax-ml/jax#21116).

  >>> import jax.numpy as jnp
  >>> from jaxworks.jit_cache import make_jaxpr
  >>> make_jaxpr(lambda x: jnp.sin(x) * 2.0)(1.0)
  { lambda ; a:f32[]. let b:f32[] = sin a; c:f32[] = mul b 2.0:f32[] in (c,) }
  """
  wrapped = _implicit_jit(fun, "make_jaxpr", static_argnums)

  @functools.wraps(fun)
  def make_jaxpr_f(*args, **kwargs):
    with ji.extend_axis_env(list(axis_env or [])):
      traced = wrapped.trace(*args, **kwargs)
    consts = traced._consts  # pylint: disable=protected-access
    if consts:
      jaxpr = jex_core.ClosedJaxpr(
        ji.convert_invars_to_constvars(traced.jaxpr.jaxpr, len(consts)), consts
      )
    else:
      jaxpr = traced.jaxpr
    return (jaxpr, traced.out_info) if return_shape else jaxpr

  make_jaxpr_f.__name__ = f"make_jaxpr({_fun_name(fun)})"
  return make_jaxpr_f


def _live_functions() -> list[_JitCore]:
  with _REGISTRY_LOCK:
    return list(_REGISTRY)


def stats() -> _cache.CacheInfo:
  """Process-wide counters (since import or ``reset_stats()``) and sizes.

  ``entries``/``maxsize`` are trace entries across all live functions and the
  global bound; ``executables`` the compiled executables held (by live
  functions' entries or by the shared cache), each counted once;
  ``evictions`` counts trace entries dropped by either bound.
  """
  live = _live_functions()
  executables = {id(e): e for e in _cache.EXECUTABLES.live()}
  for f in live:
    for entry in list(f._cache.by_key.values()):  # pylint: disable=protected-access
      executables.update((id(e), e) for e in list(entry.executables.values()))
  return _cache.GLOBAL_COUNTERS.snapshot(
    entries=sum(len(f._cache) for f in live),  # pylint: disable=protected-access
    maxsize=_cache.GLOBAL_ENTRIES.maxsize,
    dispatch_entries=sum(ji.dispatcher_size(f._dispatcher) for f in live),  # pylint: disable=protected-access
    executables=len(executables),
  )


def reset_stats() -> None:
  """Zeroes the process-wide and every function's counters."""
  _cache.GLOBAL_COUNTERS.reset()
  for f in _live_functions():
    f._counters.reset()  # pylint: disable=protected-access


def clear_caches() -> None:
  """Drops every trace entry, dispatch entry and shared executable.

  Clears every cache of the package: each live function's trace entries, C++
  dispatch entries and JAX tracing caches, the process-wide entry order, the
  shared executable cache and the fingerprint memo.
  """
  for f in _live_functions():
    f.clear_cache()
  _cache.GLOBAL_ENTRIES.clear()
  _cache.EXECUTABLES.clear()
  _fingerprint.clear_memo()


class _ClearedWithJax:
  """Registered with JAX, so ``jax.clear_caches()`` clears jit_cache too (as
  it clears every cache of stock jit)."""

  def cache_clear(self) -> None:
    clear_caches()


_CLEARED_WITH_JAX = _ClearedWithJax()
ji.register_cache(_CLEARED_WITH_JAX, "jaxworks.jit_cache")


def set_global_maxsize(
  entries: int | None = None, executables: int | None = None
) -> None:
  """Sets the process-wide LRU bounds.

  Args:
    entries: trace entries across all functions (default 4096).
    executables: shared compiled executables (default 1024).
  """
  for value, what in ((entries, "entries"), (executables, "executables")):
    if value is not None and (
      not isinstance(value, int) or isinstance(value, bool) or value < 1
    ):
      raise ValueError(
        f"jaxworks.jit_cache.set_global_maxsize: {what} must be an int >= "
        f"1, got {value!r}"
      )
  if entries is not None:
    _cache.GLOBAL_ENTRIES.resize(entries)
  if executables is not None:
    _cache.EXECUTABLES.resize(executables)
