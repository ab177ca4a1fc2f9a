"""``jit``, ``JitFunction`` and the module functions of jaxworks.jit_cache.

How a call flows is described in ``core.py`` (``_JitCore``, the machinery of
one function); the trace entries and shared caches are in ``cache.py``,
executables in ``executables.py``, argument numbers in ``argnums.py``. The
stage family (``Traced``, ``Lowered``, ``Compiled``) and the platform names
are jaxworks.stages_aot's, re-exported here for ``jaxworks.jit_cache``.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
import functools
import inspect
import threading
import types
from typing import TYPE_CHECKING
from typing import Any
from typing import overload
import weakref

from jaxworks.stages_aot import KNOWN_PLATFORMS as KNOWN_PLATFORMS
from jaxworks.stages_aot import Compiled as Compiled
from jaxworks.stages_aot import Lowered as Lowered
from jaxworks.stages_aot import Traced as Traced
from jaxworks.stages_aot import canonical_platforms as canonical_platforms
from jaxworks.stages_aot import present_platforms as present_platforms

from .. import _signature as _ext
from . import argnums as _argnums
from . import boundary as _boundary
from . import cache as _cache
from . import fingerprint as _fingerprint
from . import jax_internals as ji
from . import reaper as _reaper
from . import stats as _stats
from .core import UNSET as _UNSET
from .core import _JitCore
from .core import _Unusable
from .core import _WeakCallable
from .lru import LRU
from .stats import reset_stats as reset_stats
from .stats import stats as stats

_current_trace = ji.current_trace
_eval_trace = ji.eval_trace
_disable_jit_on = ji.disable_jit_on

#: Default per-function bound on trace entries.
DEFAULT_MAXSIZE = 256


if TYPE_CHECKING:
  # For type checkers a JitFunction is what stock's jit returns (its methods
  # are overridden compatibly), so `jax.jit = jit_cache.jit` type-checks.
  _JitBase = ji.JitWrapped
else:
  # Calls are forwarded in C to the function's C++ dispatcher.
  _JitBase = _ext.Forwarder


class JitFunction(_JitBase):
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
    _forward(self, core)

  # The hot path has no Python frame of jit_cache: the base type
  # (``_signature.Forwarder``, C) forwards each call with its argument vector
  # to the core's C++ dispatcher, as calling stock's wrapper enters its
  # dispatcher. What the dispatcher does not serve (a new signature, a call
  # under a trace) it hands to the core's cache-miss function, an API
  # boundary as stock's, which also raises axis_names' diagnostic. The
  # dispatcher's own errors go through ``_call_failed``.

  if TYPE_CHECKING:  # at run time, the base type's C slot and method

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...
    def _forward_to(
      self,
      target: Callable,
      on_error: Any,
      traced: Callable | None = None,
      tracer_type: type | None = None,
    ) -> None: ...

  def _call_failed(self, error: Exception, args: tuple, kwargs: dict) -> Any:
    """The exception to raise instead of ``error`` (chained), or None."""
    if type(error) is ValueError and str(error).startswith(  # pylint: disable=unidiomatic-typecheck
      "Non-hashable static arguments"
    ):
      try:
        _raise_split_error(self._core, error, args, kwargs)  # pylint: disable=protected-access
      except Exception as clearer:  # pylint: disable=broad-except
        # Our own, clearer error; its traceback as JAX filtered it, without
        # this frame.
        tb = clearer.__traceback__
        return clearer.with_traceback(None if tb is None else tb.tb_next)
    return None

  def __get__(self, obj: Any, objtype: Any = None) -> Any:
    if obj is None:
      return self
    return types.MethodType(self, obj)

  @property
  def __signature__(self) -> inspect.Signature | None:
    """The function's signature, as stock's jit object reports it (so
    ``inspect.signature(f, follow_wrapped=False)`` works; None when the
    function has none)."""
    return _argnums.signature_of(self._fun)

  def __repr__(self) -> str:
    try:
      return f"<JitFunction of {self.__wrapped__!r}>"
    except Exception:  # pylint: disable=broad-except
      return "<JitFunction>"  # a broken repr of the function, or no function

  def __getstate__(self) -> dict:
    """Pickles as the function and the options (caches are not pickled)."""
    return {
      "function_name": _argnums.fun_name(self._fun),
      "fun": self._fun,
      "options": self._options,
    }

  def __setstate__(self, state: dict) -> None:
    made = _make(state["fun"], state["options"])
    self.__dict__.update(made.__dict__)
    _forward(self, made._core)  # pylint: disable=protected-access

  @_boundary.entry_point
  def trace(self, *args, **kwargs) -> Traced:
    """Traces for these arguments (cached), without compiling.

    Shares the trace cache with calls: ``f.trace(x)`` then ``f(x)`` traces
    the Python function once. Tracers the function closes over become leading
    inputs of ``Traced.jaxpr`` (``make_jaxpr`` keeps them as constants).
    """
    return self._core.trace(*args, **kwargs)

  @_boundary.entry_point
  def lower(self, *args, **kwargs) -> Lowered:
    """``self.trace(*args, **kwargs).lower()``: a jaxworks ``Lowered`` (a
    ``jax.stages.Lowered`` with ``fun_name``, ``jaxpr``, ``platforms`` and
    ``export()``).

    Its ``compile()`` prunes unused arguments unless ``keep_unused=True``, as
    ``jax.jit``'s does.
    """
    return self._core.lower(*args, **kwargs)

  @_boundary.entry_point
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


if not TYPE_CHECKING:
  # Calls enter the base type's C entry point with the caller's arguments
  # (no argument tuple to pack).
  _ext.enable_vectorcall(JitFunction)


@ji.api_boundary
def _raise_split_error(core: Any, error: Exception, args: tuple, kwargs):
  """Raises the error of splitting off the static arguments, from ``error``
  (an API boundary: JAX filters its traceback as stock's errors')."""
  try:
    core._split(args, kwargs)  # pylint: disable=protected-access
  except Exception as clearer:
    raise clearer from error


def _forward(f: JitFunction, core: Any) -> None:
  """Where ``f``'s calls go: the core's dispatcher, or with a tracer first
  (a call under a trace), straight to its cache-miss path."""
  f._forward_to(  # pylint: disable=protected-access
    core._dispatcher,  # pylint: disable=protected-access
    JitFunction._call_failed,  # pylint: disable=protected-access
    core.traced_call,
    ji.Tracer,
  )


# ---------------------------------------------- shared cores per function


#: holds its function only weakly (through _WeakCallable), so a function's
#: cores live exactly as long as the function.
_CORES: dict[int, tuple[Any, LRU]] = {}
_CORES_LOCK = threading.Lock()
#: Option sets kept per function (oldest dropped first).
_CORES_PER_FUNCTION = 32


def _forget_cores(fun_id: int, ref: Any, cores: dict = _CORES) -> None:
  # A weakref callback: runs when the function dies, possibly inside a
  # garbage collection, so it takes no lock (dict operations are atomic).
  # ``cores`` is bound at definition: at interpreter exit the module's
  # globals may already be gone when the last functions die.
  item = cores.get(fun_id)
  if item is not None and item[0] is ref:
    cores.pop(fun_id, None)


def _freeze(value: Any) -> Any:
  """Hashable, type-exact key of a jit option (TypeError if unhashable)."""
  t = type(value)
  if t is list or t is tuple:
    return (t, tuple(_freeze(v) for v in value))
  if t is dict:
    return (t, tuple((k, _freeze(v)) for k, v in value.items()))
  if t is float:  # by bits: -0.0, NaN signs and payloads differ
    return (t, _fingerprint.float_bits(value))
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
      core = item[1].peek(key)
      if core is not None and _same_state(core.fun_state, state):
        return JitFunction(fun, core, options)
  name = _argnums.fun_name(fun)
  try:
    ref = weakref.ref(fun, functools.partial(_forget_cores, fun_id))
  except TypeError as e:
    # Validate the options now (as jax.jit does), fail when used.
    _JitCore(fun, name, state, options)
    return JitFunction(fun, _Unusable(_weakref_message(fun, e)), options)
  core = _JitCore(_WeakCallable(fun, name, ref), name, state, options)
  if key is not None:
    with _CORES_LOCK:
      item = _CORES.get(fun_id)
      if item is None or item[0]() is not fun:
        item = (ref, LRU(_CORES_PER_FUNCTION))
        _CORES[fun_id] = item
      item[1].put(key, core)
  return JitFunction(fun, core, options)


_FUN_DEFAULT = ji.JIT_FUN_DEFAULT


# Typed as stock's: a function gives a JitFunction (whose ``trace``,
# ``lower``, ``eval_shape`` and ``cache_info`` type checkers see), no
# function a decorator.
@overload
def jit(
  fun: Callable,
  /,
  *,
  in_shardings: Any = ...,
  out_shardings: Any = ...,
  static_argnums: int | Sequence[int] | None = ...,
  static_argnames: str | Iterable[str] | None = ...,
  donate_argnums: int | Sequence[int] | None = ...,
  donate_argnames: str | Iterable[str] | None = ...,
  keep_unused: bool = ...,
  device: Any = ...,
  backend: str | None = ...,
  inline: bool = ...,
  compiler_options: dict[str, Any] | None = ...,
  maxsize: int = ...,
) -> JitFunction: ...


@overload
def jit(
  *,
  in_shardings: Any = ...,
  out_shardings: Any = ...,
  static_argnums: int | Sequence[int] | None = ...,
  static_argnames: str | Iterable[str] | None = ...,
  donate_argnums: int | Sequence[int] | None = ...,
  donate_argnames: str | Iterable[str] | None = ...,
  keep_unused: bool = ...,
  device: Any = ...,
  backend: str | None = ...,
  inline: bool = ...,
  compiler_options: dict[str, Any] | None = ...,
  maxsize: int = ...,
) -> Callable[[Callable], JitFunction]: ...


@ji.api_boundary
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
) -> JitFunction | Callable[[Callable], JitFunction]:
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
      f"function: {_argnums.fun_name(fun)}; JAX traces a function once, so return "
      "the values (e.g. stacked) instead of yielding them"
    )


@ji.api_boundary
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


@ji.api_boundary
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
  _check_function(fun, "make_jaxpr")
  wrapped = jit(fun, static_argnums=static_argnums)
  if isinstance(wrapped._core, _Unusable):  # pylint: disable=protected-access
    # Not weakly referenceable (jax.make_jaxpr accepts it): a private core
    # holding it (no sharing).
    options = dict(_DEFAULT_OPTIONS, static_argnums=static_argnums)
    core = _JitCore(fun, _argnums.fun_name(fun), _fun_state(fun), options)
    wrapped = JitFunction(fun, core, options)

  @functools.wraps(fun)
  @ji.api_boundary
  def make_jaxpr_f(*args, **kwargs):
    with ji.extend_axis_env(list(axis_env or [])):
      traced = wrapped.trace(*args, **kwargs)
    consts = traced._consts  # pylint: disable=protected-access
    if consts:
      jaxpr = ji.ClosedJaxpr(
        ji.convert_invars_to_constvars(traced.jaxpr.jaxpr, len(consts)), consts
      )
    else:
      jaxpr = traced.jaxpr
    return (jaxpr, traced.out_info) if return_shape else jaxpr

  make_jaxpr_f.__name__ = f"make_jaxpr({_argnums.fun_name(fun)})"
  return make_jaxpr_f


def clear_caches() -> None:
  """Drops every trace entry, dispatch entry and shared executable.

  Clears every cache of the package: each live function's trace entries, C++
  dispatch entries and JAX tracing caches, the process-wide entry order, the
  shared executable cache and the fingerprint memo.
  """
  for f in _stats.live_functions():
    f.clear_cache()
  _cache.GLOBAL_ENTRIES.clear()
  _cache.EXECUTABLES.clear()
  _reaper.REAPER.flush()  # what evictions handed over is freed too
  _fingerprint.clear_memo()


class _ClearedWithJax:
  """Registered with JAX, so ``jax.clear_caches()`` clears jit_cache too (as
  it clears every cache of stock jit)."""

  def cache_clear(self) -> None:
    clear_caches()


_CLEARED_WITH_JAX = _ClearedWithJax()
ji.register_cache(_CLEARED_WITH_JAX, "jaxworks.jit_cache")


def set_global_maxsize(
  entries: int | None = None,
  executables: int | None = None,
  executable_bytes: int | None = None,
) -> None:
  """Sets the process-wide bounds.

  Args:
    entries: trace entries across all functions (default 4096).
    executables: compiled executables kept after every function that used
      them is gone, for re-created closures (default 16). Executables of live
      functions are not counted: they go with their functions.
    executable_bytes: the estimated memory those kept executables may hold
      (default 32 MiB).
  """
  api = "jaxworks.jit_cache.set_global_maxsize"
  for value, what in (
    (entries, "entries"),
    (executables, "executables"),
    (executable_bytes, "executable_bytes"),
  ):
    if value is not None and (
      not isinstance(value, int) or isinstance(value, bool) or value < 1
    ):
      raise ValueError(f"{api}: {what} must be an int >= 1, got {value!r}")
  if entries is not None:
    _cache.GLOBAL_ENTRIES.resize(entries)
  if executables is not None or executable_bytes is not None:
    _cache.EXECUTABLES.resize(executables, executable_bytes)


# Imported from jaxworks.jit_cache (a lazy package): the module tracebacks and repr name;
# doctest finds their examples through __test__.
__test__ = {"JitFunction": JitFunction}
JitFunction.__module__ = "jaxworks.jit_cache"
