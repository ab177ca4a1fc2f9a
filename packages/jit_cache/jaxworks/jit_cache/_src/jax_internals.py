"""Every private JAX name that jaxworks.jit_cache uses, and nothing else.

No other module of this package imports ``jax._src``. Each name below is
exercised by ``tests/jax_internals_test.py``, so a JAX upgrade that moves or
changes one fails there, in one obvious place.
"""

from __future__ import annotations

from . import deps as _deps

_deps.check_jax()  # before any private JAX name is imported

from collections.abc import Callable
from collections.abc import Sequence
import inspect as _inspect
from typing import Any

from jax._src import api as _api
from jax._src import array as _array
from jax._src import compilation_cache as _compilation_cache
from jax._src import config as _config
from jax._src import core as _core
from jax._src import distributed as _distributed
from jax._src import dtypes as _dtypes
from jax._src import effects as _effects
from jax._src import mesh as _mesh
from jax._src import named_sharding as _named_sharding
from jax._src import pjit as _pjit
from jax._src import source_info_util as _source_info_util
from jax._src import stages as _stages
from jax._src import traceback_util as _traceback_util
from jax._src import tree_util as _tree_util
from jax._src import util as _util
from jax._src import xla_bridge as _xla_bridge
from jax._src.frozen_dict import FrozenDict as _FrozenDict
from jax._src.interpreters import partial_eval as _pe
from jax._src.interpreters import pxla as _pxla
from jax._src.layout import Format as _Format
from jax._src.layout import Layout as _Layout
from jax._src.lib import _jax
from jax._src.lib import jax_jit as _jax_jit

# -- names of jax.extend, without importing jax.extend --------------------------
# ``import jax.extend`` (or any ``jax.extend.*``) imports every submodule,
# Pallas's included, which would slow a new process's first use of ``jit``.
# These are the same objects (tests/jax_internals_test.py checks each).

ClosedJaxpr = _core.ClosedJaxpr
Jaxpr = _core.Jaxpr
Literal = _core.Literal
DropVar = _core.DropVar
jit_p = _pjit.jit_p
#: jax.extend.source_info_util.register_exclusion
register_source_exclusion = _source_info_util.register_exclusion

# -- tracing context -----------------------------------------------------------

#: Tuple of every config value that changes tracing (x64, default device,
#: matmul precision, rank promotion, mesh context, the axis environment, user
#: contexts from ``jax.make_user_context``, ...). Its length and order are
#: JAX's business (a user context appends an element for the rest of the
#: process): never read an element by position. Elements are the same objects
#: from call to call while no config changes.
_stock_trace_context: Callable[[], tuple] = _config.trace_context
# What stock's jit key holds beyond the trace context (every config state made
# with include_in_jit_key but not include_in_trace_context): the concrete mesh
# of ``jax.set_mesh`` (it decides where outputs go, through ``ctx_mesh``) and
# the compiler's optimization and memory-fitting levels.
_JIT_ONLY = (
  ("concrete mesh (jax.set_mesh)", _config.device_context),
  ("jax_optimization_level", _config.optimization_level),
  ("jax_memory_fitting_level", _config.memory_fitting_level),
)
_device_context = _config.device_context
_optimization_level = _config.optimization_level
_memory_fitting_level = _config.memory_fitting_level


def trace_context() -> tuple:
  """Every config value stock's jit key holds: JAX's trace context, then the
  jit-only states (see ``_JIT_ONLY``)."""
  return (
    *_stock_trace_context(),
    _device_context.value,
    _optimization_level.value,
    _memory_fitting_level.value,
  )


def trace_context_names() -> tuple[str, ...]:
  """Names of the ``trace_context()`` elements, in order (for messages)."""
  return (*_config.trace_context_names(), *(name for name, _ in _JIT_ONLY))


def axis_env_in(values: tuple) -> Any:
  """The ``AxisEnv`` element of a recorded trace context (None if not one)."""
  envs = [v for v in values if type(v) is _core.AxisEnv]  # pylint: disable=unidiomatic-typecheck
  return envs[0] if len(envs) == 1 else None


#: Types a compiled executable takes as arguments, as they are (a dict keyed
#: by type; other values are canonicalized first).
shard_arg_handlers: dict = _pxla.shard_arg_handlers


def can_pass_to_executable(value: Any) -> bool:
  """Whether stock jit can pass ``value`` to an executable (after dtype
  canonicalization), as its own argument check decides."""
  try:
    return type(_dtypes.canonicalize_value(value)) in _pxla.shard_arg_handlers
  except _dtypes.InvalidInputException:
    return False


def is_static_eq_collision(error: ValueError) -> bool:
  """Whether ``error`` is stock tracing's failure to compare two argument
  trees whose static leaves have equal hashes and an ``__eq__`` that
  raises."""
  return str(error).startswith(
    "Exception raised while checking equality of metadata fields"
  )


def clear_in_shardings_cache() -> None:
  """Empties stock jit's process-wide cache of processed input shardings
  (keyed by argument trees, static arguments included)."""
  _pjit._process_in_axis_resources.cache_clear()  # pylint: disable=protected-access


#: Base class of JAX's tracers.
Tracer = _core.Tracer

#: The concrete jax Array class (a jaxlib type); Signature reads its C++
#: properties ``aval``, ``_sharding`` and ``_committed``.
ArrayImpl = _array.ArrayImpl


def array_samples() -> list:
  """Small jax Arrays, uncommitted and committed, of several avals, placed
  on the first device without any tracing (``Signature`` learns from them
  where an ``ArrayImpl`` keeps the fields its properties return)."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  device = _xla_bridge.devices()[0]
  sharding = _jax.SingleDeviceSharding(device)
  out = []
  for committed in (False, True, False, True):
    for value in (np.zeros(2, np.float32), np.ones((3, 1), np.int32)):
      aval = _core.ShapedArray(value.shape, value.dtype, weak_type=committed)
      out.append(
        _jax.batched_device_put(aval, sharding, [value], [device], committed)
      )
  return out


def layouts_key(leaves: Sequence[Any]) -> tuple | None:
  """The layouts of the committed jax Arrays among ``leaves`` (what stock's
  lowering reads from its arguments); None when there is none."""
  out: list[tuple[int, Any]] = []
  for i, x in enumerate(leaves):
    if type(x) is ArrayImpl and x._committed:  # pylint: disable=protected-access,unidiomatic-typecheck
      fmt = x.format
      layout = None if fmt is None else fmt.layout
      if layout is not None:
        out.append((i, layout))
  return tuple(out) if out else None


#: True at top level (no transformation or staging in progress).
trace_state_clean: Callable[[], bool] = _core.trace_state_clean

#: The current trace is ``current_trace.value``; ``eval_trace`` at top level.
#: (An attribute read and an identity test: the cheap check made before the
#: full ``trace_state_clean``.)
current_trace = _core.trace_state_strong_ref
eval_trace = _core.eval_trace


def axis_env_parts(env: Any) -> tuple[dict, frozenset, frozenset]:
  """(axis sizes, spmd axis names, explicit mesh axis names) of an AxisEnv."""
  return (
    dict(env.axis_sizes),
    frozenset(env.spmd_axis_names),
    frozenset(env.explicit_mesh_axis_names),
  )


#: Context manager binding ``(name, size)`` pairs, as jax.make_jaxpr does.
extend_axis_env = _core.extend_axis_env_nd


def disable_jit_on() -> bool:
  """``jax.disable_jit()`` is active (calls run the Python function)."""
  return bool(_config.disable_jit.value)


def debug_modes_on() -> bool:
  """Modes that jax.jit handles on its slow path; we defer to it then."""
  return bool(
    _config.debug_nans.value
    or _config.debug_infs.value
    or _config.enable_pgle.value
    or _config.debug_key_reuse.value
  )


# -- value types the executable fingerprint compares by value -----------------

FrozenDict = _FrozenDict
Mesh = _mesh.Mesh
AbstractMesh = _mesh.AbstractMesh
PyTreeDef = _tree_util.PyTreeDef
AbstractValue = _core.AbstractValue
Effect = _effects.Effect
#: Type of the default of in/out shardings and similar parameters.
UnspecifiedValue = _named_sharding.UnspecifiedValue
Layout = _Layout
Format = _Format


# -- pytrees ---------------------------------------------------------------------

#: The registry jax.jit flattens arguments with while tracing (PRNG key arrays
#: are leaves here, unlike in the dispatch registry).
tracing_registry = _tree_util.tracing_registry

#: Abstract value of a valid argument (arrays, scalars, ShapeDtypeStruct, ...);
#: TypeError for anything else.
shaped_abstractify: Callable[[Any], Any] = _core.shaped_abstractify


# -- jit's traced stage ---------------------------------------------------------------


def traced_parts(traced: Any) -> tuple[dict, list, tuple, Any, Any]:
  """(params, consts, meta types, in_tree, out_tree) of a jax ``Traced``.

  ``params`` are the ``jit_p`` parameters (``jaxpr``, shardings, donation,
  ...); ``consts`` the closed-over tracers jax turned into leading arguments.
  """
  return (
    traced._params,
    list(traced._consts),
    tuple(traced._meta_tys_flat),  # pylint: disable=protected-access
    traced._in_tree,
    traced.out_tree,
  )  # pylint: disable=protected-access


def make_traced(
  meta_tys: Sequence[Any],
  params: dict,
  in_tree: Any,
  out_tree: Any,
  consts: Sequence[Any],
) -> Any:
  """A jax ``Traced`` from cached parts (no tracing happens)."""
  return _stages.Traced(list(meta_tys), params, in_tree, out_tree, list(consts))


def is_high(closed_jaxpr: Any) -> bool:
  """True for jaxprs with mutable-state (hijax) types, which jit never caches."""
  return bool(closed_jaxpr.jaxpr.is_high)


#: Argument metadata (aval, sharding, layout, committed) jit lowers with.
meta_type: Callable[[Any], Any] = _pjit.convert_to_metaty

#: Move the first n invars of a Jaxpr to constvars (make_jaxpr's closure).
convert_invars_to_constvars: Callable[[Any, int], Any] = (
  _pe.convert_invars_to_constvars
)


# -- JAX's persistent compilation cache (persistent.py) -------------------------


#: Makes JAX decide anew, at the next compile, whether its persistent cache
#: is used and where (it decides once per process otherwise).
reset_persistent_cache: Callable[[], None] = _compilation_cache.reset_cache


def persistent_cache_enabled() -> bool:
  """Whether JAX's persistent compilation cache has a directory and is on."""
  return bool(_compilation_cache.is_persistent_cache_enabled())


def has_host_callbacks(compiled: Any) -> bool:
  """Whether a ``jax.stages.Compiled`` calls back into Python (JAX never
  writes such an executable to its persistent cache)."""
  call = getattr(compiled._executable, "unsafe_call", None)  # pylint: disable=protected-access
  return bool(getattr(call, "has_host_callbacks", False))


# -- warm-start prefetch (prefetch.py) ------------------------------------------


def initialized_backend(platform: str) -> Any:
  """The backend of ``platform`` if JAX has started it, else None (a
  prefetch never starts one: ``jax.distributed.initialize`` must come first)."""
  return _xla_bridge._backends.get(platform)  # pylint: disable=protected-access


def distributed_client() -> Any:
  """``jax.distributed``'s client, or None before (or without) it."""
  return _distributed.global_state.client


DeviceList = _jax.DeviceList
compile_options_from_bytes = _jax.CompileOptions.ParseFromString


_cache_read_wrapper: list[Callable | None] = [None]


def wrap_cache_read(wrapper: Callable) -> None:
  """Routes each read of JAX's persistent cache through
  ``wrapper(read, cache_key, compile_options, backend, devices)``, where
  ``read`` is JAX's own; replaces the wrapper set before."""
  _cache_read_wrapper[0] = wrapper
  read = _compilation_cache.get_executable_and_time
  if getattr(read, "jaxworks_wrapped", False):
    return

  def get_executable_and_time(cache_key, compile_options, backend, devices):
    wrap = _cache_read_wrapper[0]
    if wrap is None:
      return read(cache_key, compile_options, backend, devices)
    return wrap(read, cache_key, compile_options, backend, devices)

  get_executable_and_time.jaxworks_wrapped = True  # type: ignore[attr-defined]
  _compilation_cache.get_executable_and_time = get_executable_and_time


def executable_and_time(entry: bytes) -> tuple[bytes, int]:
  """(serialized executable, compile time) in the bytes of an entry file of
  JAX's persistent cache (``<key>-cache``)."""
  return _compilation_cache.extract_executable_and_time(
    _compilation_cache.decompress_executable(entry)
  )


# -- logging ---------------------------------------------------------------------

#: The logger JAX's tracing writes its ``TRACING CACHE MISS`` warnings to
#: (with ``jax_explain_cache_misses`` on).
tracing_miss_logger = _pe.logger


# -- typing ------------------------------------------------------------------------

#: Stock ``jax.jit``'s wrapper type (what its overloads return): the base of
#: ``JitFunction`` for type checkers, so ``jax.jit = jit_cache.jit`` checks.
JitWrapped = _pjit.JitWrapped


# -- traceback filtering ---------------------------------------------------------


#: ``api_boundary(fun)``: ``fun`` as an API boundary; JAX filters the
#: traceback of an exception raised below it (the outermost boundary wins).
api_boundary = _traceback_util.api_boundary

#: ``hide_frames_of(path)``: frames from files under ``path`` are hidden in
#: JAX's filtered tracebacks, as JAX hides its own.
hide_frames_of: Callable[[str], None] = _traceback_util.register_exclusion


# -- compiled executables and the C++ dispatcher -----------------------------------------


def executable_parts(compiled: Any) -> tuple[Any, list]:
  """(MeshExecutable, device-placed const args) of a jax ``Compiled``."""
  mesh_executable = compiled._executable  # pylint: disable=protected-access
  const_args = mesh_executable.shard_const_args(compiled._params.const_args)  # pylint: disable=protected-access
  return mesh_executable, list(const_args)


def fastpath_data(
  mesh_executable: Any,
  out_tree: Any,
  args_flat: Sequence[Any],
  out_flat: Sequence[Any],
  effects: Any,
  const_args: Sequence[Any],
) -> Any:
  """What the C++ dispatcher needs to call the executable itself, or None."""
  return _pjit._get_fastpath_data(  # pylint: disable=protected-access
    mesh_executable,
    out_tree,
    list(args_flat),
    list(out_flat),
    effects,
    [],
    None,
    list(const_args),
  )


def make_dispatcher(
  name: str,
  fun: Callable,
  cache_miss: Callable,
  static_argnums: Sequence[int],
  static_argnames: Sequence[str],
  capacity: int,
) -> Any:
  """jaxlib's C++ jit dispatcher over our own ``cache_miss``.

  Calling it parses the arguments in C++; when the signature was seen at top
  level it runs the stored executable with no Python at all, otherwise it calls
  ``cache_miss(*args, **kwargs)``, which returns ``(outputs, fastpath_data or
  None, False)``. ``capacity`` bounds its per-function LRU.
  """
  # A C++ cache object the user put in context (``jax_jit_cpp_cache_obj``)
  # when the function was wrapped serves it, as it serves stock's jit.
  cache = _config.jax_jit_cpp_cache_obj.value
  if cache is None:
    cache = _jax.PjitFunctionCache(capacity=capacity)
  dispatcher = _jax.pjit(
    name,
    fun,
    cache_miss,
    list(static_argnums),
    list(static_argnames),
    _pxla.JitGlobalCppCacheKeys(),
    _tree_util.dispatch_registry,
    _pxla.cc_shard_arg,
    cache,
  )
  # JAX's NaN/Inf post-hook (debug_nans, debug_infs on the C++ fast path)
  # re-runs ``dispatcher._fun`` de-optimized to raise FloatingPointError at
  # the offending operation; without it the hook re-raises its internal error.
  dispatcher._fun = fun  # pylint: disable=protected-access
  return dispatcher


def dispatcher_size(dispatcher: Any) -> int:
  return dispatcher._cache_size()  # pylint: disable=protected-access


def dispatcher_clear(dispatcher: Any) -> None:
  dispatcher._clear_cache()  # pylint: disable=protected-access


def jax_parse_arguments(args: tuple, kwargs: dict) -> tuple[Any, list]:
  """jax.jit's own C++ argument parsing (for the benchmark's comparison).

  Returns ``(ArgumentSignature, dynamic leaves)``: the static arguments and
  tree structure jax keys its inner-jit trace cache on (the avals are computed
  separately, in Python, by ``shaped_abstractify``).
  """
  return _jax_jit.parse_arguments(
    args,
    tuple(kwargs.values()),
    tuple(kwargs.keys()),
    (),
    (),
    _tree_util.tracing_registry,
  )


# -- stock JAX entry points and jit's defaults, safe under the drop-in swap ----

#: Stock ``jax.jit``, bound from JAX's own module: ``jax.jit = ...`` (the
#: drop-in swap) reassigns the attribute of the ``jax`` package, never this.
stock_jit: Callable[..., Any] = _api.jit

#: Default of ``jax.jit``'s ``fun`` parameter (the decorator-factory form),
#: the very object stock's signature holds.
JIT_FUN_DEFAULT: Any = _inspect.signature(_api.jit).parameters["fun"].default

#: Default of ``jax.jit``'s ``in_shardings``/``out_shardings``.
UNSPECIFIED: Any = _named_sharding.UNSPECIFIED


#: ``register_cache(cache, what)``: ``jax.clear_caches()`` calls
#: ``cache.cache_clear()`` (JAX holds ``cache`` weakly: keep a reference).
register_cache: Callable[[Any, str], None] = _util.register_cache


#: JAX's hook for test events (``jax._src.test_util.count_events``): the
#: name of a stock event, e.g. ``"jit_cpp_cache_miss"`` when jit runs a
#: program from Python because its C++ dispatcher missed.
test_event: Callable[..., None] = _util.test_event
