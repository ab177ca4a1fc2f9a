"""The stages Traced -> Lowered -> Compiled / Exported.

``Traced`` wraps the result of ``jit(f).trace(...)``. ``Traced.lower`` lowers
once for any of cpu, cuda, rocm and tpu (several at once give one module that
takes a platform index argument and selects the platform at run time), with the
lowering parameters of ``jax.export`` when the traced object's ``lower`` takes
them (see ``entry.lower_traced``). The resulting ``Lowered`` keeps the function
name, the jaxpr and the platforms, so that ``export()`` reuses that lowering,
and ``compile()`` compiles it for a platform present on this host.
"""

from __future__ import annotations

from collections.abc import Sequence
import os
from typing import Any
from typing import cast

import jax
import jax.extend.source_info_util
import numpy as np

from . import entry
from . import jax_internals
from .exported import Exported
from .platforms import canonical_platforms
from .platforms import choose_platform
from .specs import format_aval
from .specs import is_concrete

# Keep this package's frames out of the source locations of lowered modules
# (and out of filtered tracebacks), as JAX does for its own frames.
jax.extend.source_info_util.register_exclusion(
  os.path.dirname(os.path.dirname(__file__))
)


def trace(fun, *args, **kwargs) -> Traced:
  """Traces ``fun`` for the given arguments; the first stage.

  ``fun`` is jitted with ``jaxworks.jit_cache.jit`` unless it is already a
  jitted function (anything with a ``trace`` method, e.g. ``jax.jit(f,
  static_argnums=...)`` or ``jaxworks.jit_cache.jit(f, ...)``), whose options
  are then kept.

  Args:
    fun: the function, or a jitted function.
    *args: arrays, ``jax.ShapeDtypeStruct`` s (with shardings, or with
      symbolic dimensions from :func:`arg_spec`), or static values for static
      arguments of a jitted ``fun``.
    **kwargs: keyword arguments, likewise.

  Returns:
    A :class:`Traced`.

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
  jitted = fun if callable(trace_method) else entry.default_jit()(fun)
  return Traced.from_traced(jitted.trace(*args, **kwargs))


def _check_symbolic_scopes(args, kwargs) -> None:
  """Symbolic dimensions of all arguments must come from one SymbolicScope."""
  first = None
  leaves = jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
  for path, leaf in leaves:
    shape = getattr(leaf, "shape", None)
    if not isinstance(shape, tuple):
      continue
    for d in shape:
      if not jax.export.is_symbolic_dim(d):
        continue
      name = ("args" if path[0].idx == 0 else "kwargs") + jax.tree_util.keystr(
        path[1:]
      )
      if first is None:
        first = (d.scope, name)
      elif d.scope is not first[0]:
        raise ValueError(
          f"jaxworks.stages_aot.trace: the symbolic dimensions of {first[1]} and "
          f"{name} come from different scopes, so equal names would not denote "
          "equal sizes; create the specs together, e.g. arg_specs('f32[b,128]', "
          "'f32[b]'), or pass one jax.export.SymbolicScope to symbolic_shape"
        )


class Traced:
  """A function traced for specific argument types, ready to lower.

  Create one with :func:`trace` or from an existing traced object with
  :meth:`from_traced`.

  Attributes:
    fun_name: the name of the traced function.
    jaxpr: its ``ClosedJaxpr``.
    in_avals: pytree ``(args, kwargs)`` of input abstract values.
    args_info: pytree ``(args, kwargs)`` of ``jax.stages.ArgInfo``.
    out_info: pytree of ``jax.ShapeDtypeStruct`` for the outputs.
  """

  __slots__ = ("_traced",)

  def __init__(self, traced: Any):
    self._traced = traced

  @classmethod
  def from_traced(cls, traced: Any) -> Traced:
    """Enters the stages from ``jaxworks.jit_cache.jit(f).trace(...)``.

    Also accepts a stock ``jax.stages.Traced`` (``jax.jit(f).trace(...)``),
    or anything else with ``jaxpr``, ``fun_name``, ``in_avals``,
    ``args_info``, ``out_info`` and ``lower(lowering_platforms=...)``.

    >>> import jax.numpy as jnp
    >>> t = Traced.from_traced(jax.jit(jnp.cos).trace(jnp.zeros(3)))
    >>> t.lower(lowering_platforms=("tpu",)).platforms
    ('tpu',)
    """
    if isinstance(traced, Traced):
      return traced
    missing = entry.missing_attributes(traced)
    if missing:
      raise TypeError(
        "jaxworks.stages_aot.Traced.from_traced: expected the result of "
        "jaxworks.jit_cache.jit(f).trace(*args) or jax.jit(f).trace(*args), got "
        f"{type(traced).__name__} (missing {', '.join(missing)})"
      )
    return cls(traced)

  fun_name = property(lambda self: self._traced.fun_name)
  jaxpr = property(lambda self: self._traced.jaxpr)
  in_avals = property(lambda self: self._traced.in_avals)
  args_info = property(lambda self: self._traced.args_info)
  out_info = property(lambda self: self._traced.out_info)

  @property
  def traced(self) -> Any:
    """The wrapped traced object (jit_cache or stock)."""
    return self._traced

  def lower(
    self, *, lowering_platforms: Sequence[str] | None = None
  ) -> Lowered:
    """Lowers for the given platforms; this host need not have them.

    Args:
      lowering_platforms: a tuple with any of ``'cpu'``, ``'cuda'``,
        ``'rocm'`` and ``'tpu'``; None for the default backend. With more
        than one platform, the module takes a platform index as its first
        argument (the jax.export calling convention).

    Returns:
      A :class:`Lowered`.

    Raises:
      TypeError, ValueError: bad ``lowering_platforms``.
    """
    platforms = canonical_platforms(
      lowering_platforms, api="jaxworks.stages_aot.Traced.lower"
    )
    lowered, for_export = entry.lower_traced(self._traced, platforms)
    # Without the export parameters, this flag moves constants out of the
    # module into extra arguments, which jax.export cannot serialize.
    hoisted = not for_export and bool(
      # jax.config's options are dynamic attributes, absent from its stubs.
      jax.config.jax_use_simplified_jaxpr_constants  # type: ignore[attr-defined]
    )
    return Lowered(lowered, self, platforms, constants_hoisted=hoisted)

  def __repr__(self) -> str:
    args = ", ".join(
      format_aval(a) for a in jax.tree_util.tree_leaves(self.in_avals)
    )
    return f"Traced({self.fun_name}({args}))"


class Lowered:
  """A lowering for one or more platforms, carrying its program.

  Attributes:
    fun_name: the name of the lowered function.
    jaxpr: the ``ClosedJaxpr`` it was lowered from.
    platforms: the tuple of platforms it was lowered for.
    in_avals: pytree ``(args, kwargs)`` of input abstract values.
    args_info: pytree ``(args, kwargs)`` of ``jax.stages.ArgInfo``.
    out_info: pytree of ``jax.ShapeDtypeStruct`` for the outputs.
  """

  __slots__ = (
    "_lowered",
    "_traced",
    "_platforms",
    "_constants_hoisted",
    "_exported",
  )

  def __init__(
    self,
    lowered: Any,
    traced: Traced,
    platforms: tuple[str, ...],
    *,
    constants_hoisted: bool,
  ):
    self._lowered = lowered
    self._traced = traced
    self._platforms = platforms
    self._constants_hoisted = constants_hoisted
    # (disabled_checks, the stock export with them), once exported.
    self._exported: tuple[tuple, jax.export.Exported] | None = None

  fun_name = property(lambda self: self._traced.fun_name)
  jaxpr = property(lambda self: self._traced.jaxpr)
  platforms = property(lambda self: self._platforms)
  in_avals = property(lambda self: self._lowered.in_avals)
  args_info = property(lambda self: self._lowered.args_info)
  out_info = property(lambda self: self._lowered.out_info)
  in_tree = property(lambda self: self._lowered.in_tree)
  out_tree = property(lambda self: self._lowered.out_tree)

  @property
  def jax_lowered(self) -> jax.stages.Lowered:
    """The stock ``jax.stages.Lowered`` this wraps."""
    return self._lowered

  def as_text(
    self, dialect: str | None = None, *, debug_info: bool = False
  ) -> str:
    """The module as text: StableHLO by default, or ``dialect="hlo"``.

    >>> import jax.numpy as jnp
    >>> low = trace(jnp.sin, jnp.zeros(2)).lower(lowering_platforms=("cpu", "tpu"))
    >>> 'jax.global_constant = "_platform_index"' in low.as_text()
    True
    """
    return self._lowered.as_text(dialect, debug_info=debug_info)

  def compiler_ir(self, dialect: str | None = None) -> Any:
    """The module as an MLIR object (see ``jax.stages.Lowered.compiler_ir``)."""
    return self._lowered.compiler_ir(dialect)

  def cost_analysis(self) -> dict[str, float] | None:
    """XLA's cost estimate of the module (flops, bytes accessed, ...).

    The estimate is platform-neutral HLO analysis; custom calls (e.g.
    LAPACK on cpu) count as zero.
    """
    return self._lowered.cost_analysis()

  def _symbolic_inputs(self) -> list[str]:
    return [
      format_aval(a)
      for a in jax.tree_util.tree_leaves(self.in_avals)
      if not is_concrete(a.shape)
    ]

  def compile(self, platform: str | None = None) -> Compiled:
    """Compiles for a platform that is both lowered for and present here.

    A lowering for the default backend alone compiles as
    ``jax.stages.Lowered.compile`` does. Otherwise (several platforms, or a
    present platform that is not the default backend) the exported module
    is compiled, with its platform index argument fixed to ``platform``:
    the program that runs is the multi-platform module itself (argument
    donation is not kept then).

    Args:
      platform: the platform to compile for; None picks the default
        backend if lowered for, else the first present lowered platform.

    Returns:
      A :class:`Compiled`.

    Raises:
      ValueError: the platform is not lowered for or not present (the
        message lists the platforms present), or the inputs have symbolic
        dimensions.
    """
    api = "jaxworks.stages_aot.Lowered.compile"
    target = choose_platform(
      self._platforms, platform, api=api, fun_name=self.fun_name
    )
    symbolic = self._symbolic_inputs()
    if symbolic:
      raise ValueError(
        f"{api}: {self.fun_name!r} was lowered with symbolic dimensions "
        f"({', '.join(symbolic)}), which XLA cannot compile; trace with concrete "
        "shapes to compile, or export() and call the exported function with "
        "concrete arrays"
      )
    if (
      self._platforms == (target,)
      and target == jax.export.default_export_platform()
    ):
      compiled = self._lowered.compile()
    else:
      compiled = _compile_exported(
        self._stock_exported(()), target, self.in_avals, api
      )
    return Compiled(
      compiled,
      fun_name=self.fun_name,
      platform=target,
      lowered_for=self._platforms,
    )

  def _stock_exported(self, disabled_checks: tuple) -> jax.export.Exported:
    if self._exported is not None and self._exported[0] == disabled_checks:
      return self._exported[1]
    if self._constants_hoisted:
      raise ValueError(
        f"jaxworks.stages_aot.Lowered.export: {self.fun_name!r} was lowered by a "
        "traced object whose lower() takes no lowering parameters, while "
        "jax_use_simplified_jaxpr_constants moved constants out of the module; "
        "lower again with that flag off (jax.config.update("
        "'jax_use_simplified_jaxpr_constants', False)) to export"
      )
    exp = jax_internals.export_lowered(
      self._lowered, self.jaxpr, self.fun_name, disabled_checks=disabled_checks
    )
    self._exported = (disabled_checks, exp)
    return exp

  def export(
    self,
    *,
    vjp_order: int = 0,
    disabled_checks: Sequence[jax.export.DisabledSafetyCheck] = (),
  ) -> Exported:
    """Exports this lowering as a serializable program (a ``jax.export.Exported``).

    No second lowering happens: the module is the one this ``Lowered`` holds.

    Args:
      vjp_order: how many orders of VJP ``serialize()`` includes: 1 makes
        the deserialized function differentiable once (``jax.grad``), 2
        twice. The in-memory result is differentiable to any order.
      disabled_checks: ``jax.export.DisabledSafetyCheck`` s, e.g. to allow
        a custom call that jax.export does not know to be stable.

    Returns:
      An :class:`Exported`.

    >>> import jax.numpy as jnp, numpy as np
    >>> exp = trace(jnp.cos, jax.ShapeDtypeStruct((3,), jnp.float32)).lower().export()
    >>> exp.platforms, exp.fun_name
    (('cpu',), 'cos')
    >>> exp(np.zeros(3, np.float32))
    Array([1., 1., 1.], dtype=float32)
    """
    if (
      isinstance(vjp_order, bool)
      or not isinstance(vjp_order, int)
      or vjp_order < 0
    ):
      raise ValueError(
        f"jaxworks.stages_aot.Lowered.export: vjp_order must be an int >= 0, got "
        f"{vjp_order!r}; use 0 (no derivatives) or 1 (one order of jax.grad)"
      )
    checks = tuple(disabled_checks)
    for c in checks:
      if not isinstance(c, jax.export.DisabledSafetyCheck):
        raise TypeError(
          "jaxworks.stages_aot.Lowered.export: disabled_checks must hold "
          f"jax.export.DisabledSafetyCheck objects, got {c!r}; e.g. "
          "jax.export.DisabledSafetyCheck.custom_call('my_target')"
        )
    return Exported(self._stock_exported(checks), vjp_order=vjp_order)

  def __repr__(self) -> str:
    args = ", ".join(
      format_aval(a) for a in jax.tree_util.tree_leaves(self.in_avals)
    )
    return f"Lowered({self.fun_name}({args}), platforms={self._platforms})"


def _compile_exported(
  exp: jax.export.Exported, target: str, in_avals, api: str
):
  """Compiles an exported module for ``target``, its platform index fixed.

  ``exp.call`` inlines the module and passes the index of ``target``; inputs
  and outputs are placed on a mesh of the first ``exp.nr_devices`` devices of
  ``target`` with the exported shardings.
  """
  devices = jax.devices(target)
  in_shardings: Sequence[jax.sharding.Sharding | None]
  out_shardings: Sequence[jax.sharding.Sharding | None]
  in_shardings = (None,) * len(exp.in_avals)
  out_shardings = (None,) * len(exp.out_avals)
  if exp.nr_devices > 1:
    # jax's stubs type the mesh as required; None keeps the export's abstract
    # mesh, and the shardings are then NamedShardings (or None).
    abstract_shardings = (
      *exp.in_shardings_jax(None),  # type: ignore[arg-type]
      *exp.out_shardings_jax(None),  # type: ignore[arg-type]
    )
    named = [
      cast(jax.sharding.NamedSharding, s)
      for s in abstract_shardings
      if s is not None
    ]
    if not named or len(devices) < exp.nr_devices:
      raise ValueError(
        f"{api}: cannot place the multi-platform module of {exp.fun_name!r} on "
        f"{exp.nr_devices} {target} devices (this host has {len(devices)}, and the "
        f"module has {len(named)} input/output shardings); lower for "
        f"({target!r},) alone to compile it"
      )
    abstract = named[0].mesh
    mesh = jax.sharding.Mesh(
      np.array(devices[: exp.nr_devices]).reshape(abstract.axis_sizes),
      abstract.axis_names,
      axis_types=abstract.axis_types,
    )
    in_shardings = exp.in_shardings_jax(mesh)
    out_shardings = exp.out_shardings_jax(mesh)
  flat_avals = jax.tree_util.tree_leaves(in_avals)
  specs = [
    jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    for a, s in zip(flat_avals, in_shardings)
  ]
  # jax's stubs for PyTreeDef lack unflatten.
  args, kwargs = exp.in_tree.unflatten(specs)  # type: ignore[attr-defined]
  out_tree_shardings = exp.out_tree.unflatten(out_shardings)  # type: ignore[attr-defined]
  jitted = jax_internals.stock_jit(exp.call, out_shardings=out_tree_shardings)
  with jax.default_device(devices[0]):
    return (
      jitted.trace(*args, **kwargs)
      .lower(lowering_platforms=(target,))
      .compile()
    )


class Compiled:
  """An executable for one present platform; call it like the function.

  Attributes:
    fun_name: the function name.
    platform: the platform it was compiled for.
    lowered_for: the platforms of the lowering it came from.
  """

  __slots__ = (
    "_compiled",
    "fun_name",
    "platform",
    "lowered_for",
    "__weakref__",
  )

  def __init__(
    self,
    compiled: jax.stages.Compiled,
    *,
    fun_name: str,
    platform: str,
    lowered_for: tuple[str, ...],
  ):
    self._compiled = compiled
    self.fun_name = fun_name
    self.platform = platform
    self.lowered_for = lowered_for

  @property
  def jax_compiled(self) -> jax.stages.Compiled:
    """The stock ``jax.stages.Compiled`` this wraps."""
    return self._compiled

  def __call__(self, *args, **kwargs):
    return self._compiled(*args, **kwargs)

  def as_text(self) -> str | None:
    """The optimized HLO of the executable."""
    return self._compiled.as_text()

  def cost_analysis(self) -> Any:
    """XLA's cost analysis of the executable."""
    return self._compiled.cost_analysis()

  def memory_analysis(self) -> Any:
    """XLA's memory analysis of the executable."""
    return self._compiled.memory_analysis()

  @property
  def input_shardings(self):
    return self._compiled.input_shardings

  @property
  def output_shardings(self):
    return self._compiled.output_shardings

  def __repr__(self) -> str:
    return f"Compiled({self.fun_name}, platform={self.platform!r}, lowered_for={self.lowered_for})"


__all__ = ["Compiled", "Lowered", "Traced", "trace"]
