"""The stage family: ``trace`` -> ``Traced`` -> ``Lowered`` -> ``Compiled``.

Each class subclasses its ``jax.stages`` counterpart and shares the stock
object's state (``jax_internals.stage_as``), so every stock attribute and
method is there with the stock signature and result, and ``isinstance(x,
jax.stages.Lowered)`` holds. The additions:

* ``Traced.lower(lowering_platforms=...)`` lowers for any of cpu, cuda, rocm
  and tpu from any host, with ``jax.export``'s lowering parameters, and
  returns a ``Lowered`` that keeps ``fun_name``, ``jaxpr`` and ``platforms``;
* ``Lowered.compile(compiler_options=None, *, platform=None)`` compiles a
  multi-platform lowering for one present platform;
* ``Lowered.export()`` exports the lowering as this package's
  :class:`~jaxworks.stages_aot.Exported` (a lowering made without
  ``lowering_platforms`` is stock's own, for this host's compile path, and is
  lowered once more with export parameters).

:func:`trace` is the first stage. Every entry point (``stages_aot.trace``,
``jaxworks.jit_cache.jit(f).trace/lower``, ``pmap_chunked.pmap(f).trace/lower``)
returns these classes; jaxworks.jit_cache re-exports them.
"""

from __future__ import annotations

from collections.abc import Sequence
import os
from typing import TYPE_CHECKING
from typing import Any

import jax

from . import jax_internals as ji
from . import lowering as _lowering
from . import platforms as _platforms

if TYPE_CHECKING:
  from .exported import Exported

_StockTraced = jax.stages.Traced
_StockLowered = jax.stages.Lowered
_StockCompiled = jax.stages.Compiled
_DisabledSafetyCheck = jax.export.DisabledSafetyCheck
_tree_leaves = jax.tree_util.tree_leaves
_tree_flatten_with_path = jax.tree_util.tree_flatten_with_path
_keystr = jax.tree_util.keystr
_is_symbolic_dim = jax.export.is_symbolic_dim
_stock_jit = ji.stock_jit  # used even after jax.jit is swapped

# Keep this package's frames out of the source locations of lowered modules,
# as JAX does for its own frames.
ji.register_source_exclusion(os.path.dirname(os.path.dirname(__file__)))
# and out of JAX's filtered tracebacks: an error about the user's input ends
# at the user's call.
ji.hide_frames_of(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _avals_text(avals: Any) -> str:
  """``f32[2,3], i32[]`` for a pytree of abstract values."""
  return ", ".join(
    a.str_short(short_dtypes=True) if hasattr(a, "str_short") else str(a)
    for a in _tree_leaves(avals)
  )


@ji.api_boundary
def trace(fun, *args, **kwargs) -> Traced:
  """Traces ``fun`` for the given arguments; the first stage.

  A ``fun`` with a ``trace`` method (``jax.jit(f, static_argnums=...)``,
  ``jaxworks.jit_cache.jit(f, ...)``, ``jaxworks.pmap_chunked.pmap(f)``) is
  traced by it, so its options are kept; a plain function is jitted with
  stock ``jax.jit`` (bound when this package is imported, so a swapped
  ``jax.jit`` is not looked up).

  Args:
    fun: the function, or a jitted function.
    *args: arrays, ``jax.ShapeDtypeStruct`` s (with shardings, or with
      symbolic dimensions from :func:`arg_spec`), or static values for static
      arguments of a jitted ``fun``.
    **kwargs: keyword arguments, likewise.

  Returns:
    A :class:`Traced` (a ``jax.stages.Traced``).

  >>> import jax.numpy as jnp
  >>> traced = trace(jnp.sin, jax.ShapeDtypeStruct((4,), jnp.float32))
  >>> traced.fun_name, traced.jaxpr.eqns[0].primitive.name
  ('sin', 'sin')
  """
  if not callable(fun):
    raise TypeError(
      f"jaxworks.stages_aot.trace: expected a function to trace, got "
      f"{type(fun).__name__} {fun!r}"
    )
  _check_symbolic_scopes(args, kwargs)
  trace_method = getattr(fun, "trace", None)
  jitted = fun if callable(trace_method) else _stock_jit(fun)
  return Traced.from_traced(jitted.trace(*args, **kwargs))


def _check_symbolic_scopes(args, kwargs) -> None:
  """Symbolic dimensions of all arguments must come from one SymbolicScope."""
  first = None
  leaves = _tree_flatten_with_path((args, kwargs))[0]
  for path, leaf in leaves:
    shape = getattr(leaf, "shape", None)
    if not isinstance(shape, tuple):
      continue
    for d in shape:
      if not _is_symbolic_dim(d):
        continue
      name = ("args" if path[0].idx == 0 else "kwargs") + _keystr(path[1:])
      if first is None:
        first = (d.scope, name)
      elif d.scope is not first[0]:
        raise ValueError(
          f"jaxworks.stages_aot.trace: the symbolic dimensions of {first[1]} and "
          f"{name} come from different scopes, so equal names would not denote "
          "equal sizes; create the specs together, e.g. arg_specs('f32[b,128]', "
          "'f32[b]'), or pass one jax.export.SymbolicScope to symbolic_shape"
        )


class Traced(_StockTraced):
  """A function traced for specific argument types (``f.trace(...)``).

  A ``jax.stages.Traced`` (every stock attribute: ``jaxpr``, ``fun_name``,
  ``in_avals``, ``out_info``, ``args_info``, ...), whose :meth:`lower` takes
  any lowering platforms and returns a jaxworks :class:`Lowered`. Tracers
  the function closes over (when traced under another transformation) are
  leading inputs of ``jaxpr``, as in stock JAX.
  """

  @classmethod
  def from_traced(cls, traced: Any) -> Traced:
    """Enters the family from a stock ``jax.jit(f).trace(...)`` (a jaxworks
    ``Traced`` is returned as is).

    >>> import jax, jax.numpy as jnp
    >>> from jaxworks import stages_aot
    >>> t = stages_aot.Traced.from_traced(jax.jit(jnp.cos).trace(jnp.zeros(3)))
    >>> t.lower(lowering_platforms=("tpu",)).platforms
    ('tpu',)
    """
    if isinstance(traced, Traced):
      return traced
    if isinstance(traced, _StockTraced):
      return ji.stage_as(cls, traced)
    raise TypeError(
      "jaxworks.stages_aot.Traced.from_traced: expected the result of "
      "jax.jit(f).trace(*args) or jaxworks.jit_cache.jit(f).trace(*args), "
      f"got {type(traced).__name__}; trace the function first"
    )

  # Stock's signature, JAX's private ``_private_parameters`` included: JAX's
  # own modules (``jax.export``, ``jax.experimental``) pass it to any
  # ``jax.stages.Traced`` and expect it honoured. It is not documented here.
  @ji.api_boundary
  def lower(
    self,
    *,
    lowering_platforms: tuple[str, ...] | None = None,
    _private_parameters: Any = None,
  ) -> Lowered:
    """Lowers for the given platforms; this host need not have them.

    Args:
      lowering_platforms: a tuple with any of ``'cpu'``, ``'cuda'``,
        ``'rocm'`` and ``'tpu'``; None for the platform of the arguments
        (as stock). With more than one platform, the module takes a platform
        index as its first argument (the ``jax.export`` calling convention).

    Returns:
      A :class:`Lowered` (a ``jax.stages.Lowered``).

    Raises:
      TypeError, ValueError: bad ``lowering_platforms``.
    """
    api = "jaxworks.stages_aot.Traced.lower"
    traced: Traced | None = self
    if lowering_platforms is not None and _private_parameters is None:
      platforms = _platforms.canonical_platforms(lowering_platforms, api=api)
      stock = ji.lower_for_export(self, platforms)
      traced = None
    else:
      # Stock's own lowering, with exactly the given arguments: for JAX's own
      # callers (platform names unchecked: jax.export passes names of its
      # own), and for this host, so that compile() and serialize_executable
      # behave as jax.jit's (export() lowers once more).
      stock = super().lower(
        lowering_platforms=lowering_platforms,
        _private_parameters=_private_parameters,
      )
      platforms = ji.lowering_platforms(stock) or tuple(
        lowering_platforms or (_lowering.default_platform(),)
      )
    out = Lowered.from_lowered(
      stock, fun_name=self.fun_name, jaxpr=self.jaxpr, platforms=platforms
    )
    out.__dict__["_jw_traced"] = traced
    return out

  def __repr__(self) -> str:
    return (
      f"Traced({self.fun_name}({_avals_text(self.jaxpr.in_avals)}) -> "
      f"({_avals_text(self.jaxpr.out_avals)}))"
    )


class Lowered(_StockLowered):
  """A lowering for one or more platforms, carrying its program.

  A ``jax.stages.Lowered`` plus:

  Attributes:
    fun_name: the name of the lowered function.
    jaxpr: the ``ClosedJaxpr`` it was lowered from.
    platforms: the platforms it was lowered for.
  """

  _jw_fun_name: str
  _jw_jaxpr: Any
  _jw_platforms: tuple[str, ...]
  _jw_exported: tuple[tuple, jax.export.Exported] | None
  _jw_traced: Traced | None  # set when lowered with stock's parameters

  @classmethod
  def from_lowered(
    cls,
    lowered: jax.stages.Lowered,
    *,
    fun_name: str,
    jaxpr: Any,
    platforms: Sequence[str],
  ) -> Lowered:
    """A jaxworks ``Lowered`` sharing the state of stock ``lowered``.

    Args:
      lowered: a ``jax.stages.Lowered`` (or a jaxworks one).
      fun_name: the function's name.
      jaxpr: the ``ClosedJaxpr`` it was lowered from.
      platforms: the platforms it was lowered for.
    """
    if not isinstance(lowered, _StockLowered):
      raise TypeError(
        "jaxworks.stages_aot.Lowered.from_lowered: expected a "
        f"jax.stages.Lowered, got {type(lowered).__name__}"
      )
    out = ji.stage_as(cls, lowered)
    out.__dict__.update(
      _jw_fun_name=fun_name,
      _jw_jaxpr=jaxpr,
      _jw_platforms=tuple(platforms),
      _jw_exported=None,
      _jw_traced=None,
    )
    return out

  fun_name = property(lambda self: self._jw_fun_name)
  jaxpr = property(lambda self: self._jw_jaxpr)
  platforms = property(lambda self: self._jw_platforms)

  @ji.api_boundary
  def compile(
    self,
    compiler_options: dict[str, Any] | None = None,
    *,
    device_assignment: tuple[Any, ...] | None = None,
    platform: str | None = None,
  ) -> Compiled:
    """Compiles for a platform that is both lowered for and present here.

    A lowering for the default backend alone compiles as
    ``jax.stages.Lowered.compile`` does. Otherwise (several platforms, or a
    present platform that is not the default backend) the exported module
    is compiled with its platform index fixed to ``platform``: the program
    that runs is the multi-platform module itself (argument donation is not
    kept then).

    Args:
      compiler_options: XLA compiler options, as stock.
      device_assignment: as stock (single-platform lowerings only).
      platform: the platform to compile for; None picks the default
        backend if lowered for, else the first present lowered platform.

    Returns:
      A :class:`Compiled` (a ``jax.stages.Compiled``).

    Raises:
      ValueError: the platform is not lowered for or not present (the
        message lists the platforms present), or the inputs have symbolic
        dimensions.
    """
    api = "jaxworks.stages_aot.Lowered.compile"
    if device_assignment is not None and len(self.platforms) == 1:
      # As stock: the given devices decide where the program runs (a
      # lowering over an abstract mesh for another platform included).
      stock = super().compile(
        compiler_options, device_assignment=device_assignment
      )
      return Compiled.from_compiled(
        stock,
        fun_name=self.fun_name,
        platform=_lowering.platform_name(device_assignment[0]),
        lowered_for=self.platforms,
      )
    if (
      platform is None
      and len(self.platforms) == 1
      and self.platforms[0] not in _platforms.present_platforms()
    ):
      # Where stock refuses (a lowering over an abstract mesh needs a
      # device_assignment), its exception, as it raises it; where stock
      # would compile for another backend, jaxworks refuses (below).
      super().compile(compiler_options)
    target = _platforms.choose_platform(
      self.platforms, platform, api=api, fun_name=self.fun_name
    )
    symbolic = _lowering.symbolic_inputs(self.jaxpr.in_avals)
    if symbolic:
      raise ValueError(
        f"{api}: {self.fun_name!r} was lowered with symbolic dimensions "
        f"({', '.join(symbolic)}), which XLA cannot compile; trace with "
        "concrete shapes to compile, or export() and call the exported "
        "function with concrete arrays"
      )
    if self.platforms == (target,) and target == _lowering.default_platform():
      stock = super().compile(
        compiler_options, device_assignment=device_assignment
      )
    else:
      if device_assignment is not None:
        raise ValueError(
          f"{api}: device_assignment applies to a lowering for the default "
          f"backend alone; {self.fun_name!r} was lowered for "
          f"{self.platforms}: lower for ({target!r},) to pass one"
        )
      stock = _lowering.compile_exported(
        self._stock_export(()),
        target,
        self.in_avals,
        api,
        compiler_options,
        committed=ji.lowering_committed(self),  # as stock's compile
        placed_on=ji.lowering_devices(self),  # where the arguments are
        one_device=ji.one_device_shardings(self),  # stock's shardings there
      )
    return Compiled.from_compiled(
      stock, fun_name=self.fun_name, platform=target, lowered_for=self.platforms
    )

  def _stock_export(self, disabled_checks: tuple) -> jax.export.Exported:
    cached = self._jw_exported
    if cached is not None and cached[0] == disabled_checks:
      return cached[1]
    source: Any = self
    if self._jw_traced is not None:  # lowered as jax.jit lowers: again
      source = ji.lower_for_export(self._jw_traced, self.platforms)
    exp = ji.export_lowered(
      source, self.jaxpr, self.fun_name, disabled_checks=disabled_checks
    )
    self._jw_exported = (disabled_checks, exp)
    return exp

  @ji.api_boundary
  def export(
    self,
    *,
    vjp_order: int = 0,
    disabled_checks: Sequence[jax.export.DisabledSafetyCheck] = (),
  ) -> Exported:
    """Exports this lowering as a serializable program.

    Args:
      vjp_order: how many orders of VJP the serialized form includes.
      disabled_checks: ``jax.export.DisabledSafetyCheck`` objects.

    Returns:
      A :class:`~jaxworks.stages_aot.Exported`.

    Raises:
      ValueError: ``vjp_order`` is not an int >= 0.
      TypeError: ``disabled_checks`` holds something else.
    """
    api = "jaxworks.stages_aot.Lowered.export"
    if (
      isinstance(vjp_order, bool)
      or not isinstance(vjp_order, int)
      or vjp_order < 0
    ):
      raise ValueError(
        f"{api}: vjp_order must be an int >= 0, got {vjp_order!r}; use 0 "
        "(no derivatives) or 1 (one order of jax.grad)"
      )
    # Imported here: the exported program's module (and its module reader,
    # which imports jax.extend) is not on the path of trace, lower, compile.
    from . import exported  # pylint: disable=g-import-not-at-top

    limit = exported.validate.MAX_VJP_LEVELS
    if vjp_order > limit:  # what is written must read back
      raise ValueError(
        f"{api}: vjp_order={vjp_order} is more than the {limit} VJP orders "
        f"that deserialize and load_artifact read back; use vjp_order <= "
        f"{limit}"
      )
    checks = tuple(disabled_checks)
    for c in checks:
      if not isinstance(c, _DisabledSafetyCheck):
        raise TypeError(
          f"{api}: disabled_checks must hold jax.export.DisabledSafetyCheck "
          f"objects, got {c!r}; e.g. "
          "jax.export.DisabledSafetyCheck.custom_call('my_target')"
        )
    return exported.Exported(self._stock_export(checks), vjp_order=vjp_order)

  def __repr__(self) -> str:
    return (
      f"Lowered({self.fun_name}({_avals_text(self.jaxpr.in_avals)}), "
      f"platforms={self.platforms})"
    )


class Compiled(_StockCompiled):
  """An executable for one present platform; call it like the function.

  A ``jax.stages.Compiled`` plus:

  Attributes:
    fun_name: the function name.
    platform: the platform it was compiled for.
    lowered_for: the platforms of the lowering it came from.
  """

  fun_name: str
  platform: str
  lowered_for: tuple[str, ...]

  @classmethod
  def from_compiled(
    cls,
    compiled: jax.stages.Compiled,
    *,
    fun_name: str,
    platform: str,
    lowered_for: Sequence[str],
  ) -> Compiled:
    """A jaxworks ``Compiled`` sharing the state of stock ``compiled``."""
    if not isinstance(compiled, _StockCompiled):
      raise TypeError(
        "jaxworks.stages_aot.Compiled.from_compiled: expected a "
        f"jax.stages.Compiled, got {type(compiled).__name__}"
      )
    out = ji.stage_as(cls, compiled)
    out.__dict__.update(
      fun_name=fun_name, platform=platform, lowered_for=tuple(lowered_for)
    )
    return out

  def __repr__(self) -> str:
    return (
      f"Compiled({self.fun_name}, platform={self.platform!r}, "
      f"lowered_for={self.lowered_for})"
    )


__all__ = ["Compiled", "Lowered", "Traced", "trace"]


# Imported from jaxworks.stages_aot (a lazy package): the module tracebacks and repr name;
# doctest finds their examples through __test__.
__test__ = {"Traced": Traced, "Lowered": Lowered, "Compiled": Compiled}
Traced.__module__ = "jaxworks.stages_aot"
Lowered.__module__ = "jaxworks.stages_aot"
Compiled.__module__ = "jaxworks.stages_aot"
