"""The only module of jaxworks.axis_names that touches private JAX names.

Every name here is covered by tests/jax_internals_test.py, so a JAX upgrade
that moves one of them fails in one obvious place. Public JAX
(``jax.extend.core``, ``jax.core``, ``jax.lax``) is imported directly by the
other modules; only what has no public door lives here: ``NamedAxisEffect``,
user frames of tracebacks, the names in JAX's unbound-axis errors (and the
names bound where they were raised), equation contexts and typed literals,
the axis environment, emitting equations into a staging trace, symbolic
zeros, and ``WrappedFun`` for rule callables.
"""

from __future__ import annotations

from . import deps as _deps

_deps.check_jax()  # before any private JAX name is imported

import os
import re

from jax._src import ad_util as _ad_util
from jax._src import config as _config
from jax._src import core as _core
from jax._src import effects as _effects
from jax._src import linear_util as _lu
from jax._src import literals as _literals
from jax._src import source_info_util as _source_info_util
from jax._src import traceback_util as _traceback_util
from jax._src.interpreters import partial_eval as _pe
import numpy as np

#: The effect JAX attaches to equations (and jaxprs) that use a named axis.
NamedAxisEffect = _core.NamedAxisEffect


def named_axis_effect_names(effects) -> frozenset:
  """Axis names of the ``NamedAxisEffect`` objects in ``effects``."""
  return frozenset(e.name for e in effects if type(e) is NamedAxisEffect)


def is_named_axis_effect(effect) -> bool:
  """Whether ``effect`` is a ``NamedAxisEffect``."""
  return type(effect) is NamedAxisEffect


def user_location(source_info) -> tuple[str, int, str] | None:
  """``(file_name, line, function_name)`` of the innermost user frame.

  ``source_info`` is a ``JaxprEqn.source_info``; None when it has no user
  frame (for example an equation JAX created itself).
  """
  traceback = getattr(source_info, "traceback", None)
  if traceback is None:
    return None
  frame = _source_info_util.user_frame(traceback)
  if frame is None:
    return None
  return (frame.file_name, frame.start_line, frame.function_name)


def user_call(source_info) -> str | None:
  """Name of the function the innermost user frame called (``pmean`` for
  the ``psum`` equation it created), or None."""
  traceback = getattr(source_info, "traceback", None)
  frames = getattr(traceback, "frames", None)
  if not frames:
    return None
  for i, frame in enumerate(frames):  # innermost first
    if _source_info_util.is_user_filename(frame.file_name):
      return frames[i - 1].function_name if i > 0 else None
  return None


# JAX 0.10.2 messages: "Found an unbound axis name: i. To fix this, ..." and
# "unbound axis name: i". The name is printed with str(), so only string names
# can be recovered from it.
_UNBOUND_RE = re.compile(r"unbound axis name: (.+?)(?:\. To fix this|$)", re.S)


def unbound_axis_name(err: BaseException) -> str | None:
  """The axis name in JAX's unbound-axis ``NameError``, or None."""
  if not isinstance(err, NameError):
    return None
  m = _UNBOUND_RE.search(str(err))
  return m.group(1).strip() if m else None


_CORE_FILE = os.path.abspath(_core.__file__)


def unfiltered_traceback(err: BaseException):
  """``err``'s traceback with JAX's frames: JAX's traceback filtering
  ("remove_frames") keeps it on an ``UnfilteredStackTrace`` cause."""
  cause = err.__cause__
  if isinstance(cause, _traceback_util.UnfilteredStackTrace):
    return cause.__traceback__
  return err.__traceback__


def traceback_filtering_off():
  """Context in which JAX leaves tracebacks whole (``jax_traceback_filtering``
  off, for this thread)."""
  return _config.traceback_filtering("off")


def unbound_in_shard_map(err: BaseException) -> tuple[tuple, tuple] | None:
  """``(axis names, mesh axis names)`` of JAX's bare ``AssertionError`` for
  a collective over names that are not axes of the ``shard_map``'s mesh
  (read from the locals of ``core.pvary``'s frame), or None for any other
  error."""
  if not isinstance(err, AssertionError):
    return None
  tb = unfiltered_traceback(err)
  while tb is not None:
    frame = tb.tb_frame
    code = frame.f_code
    if code.co_name == "pvary" and (
      os.path.abspath(code.co_filename) == _CORE_FILE
    ):
      axes = frame.f_locals.get("axes")
      mesh = frame.f_locals.get("cur_mesh")
      names = getattr(mesh, "axis_names", None)
      if isinstance(axes, tuple) and isinstance(names, tuple):
        return axes, names
    tb = tb.tb_next
  return None


def axis_names_at_error(err: BaseException) -> tuple | None:
  """The axis names bound where JAX raised ``err`` (an unbound-axis
  ``NameError``), read from the ``AxisEnv`` in the innermost frame of its
  traceback that holds one (``AxisEnv.axis_size``'s ``self``,
  ``_check_axis_names``' ``axis_env``), or None."""
  tb = unfiltered_traceback(err)
  found = None
  while tb is not None:
    for value in tb.tb_frame.f_locals.values():
      if type(value) is _core.AxisEnv:
        found = value.axis_names()
        break
    tb = tb.tb_next
  return found


def eqn_context_mesh(ctx):
  """The abstract mesh an equation was traced under (``JaxprEqn.ctx``)."""
  return getattr(ctx, "cur_abstract_mesh", None)


def eqn_context_with_mesh(ctx, mesh):
  """``ctx`` (a ``JaxprEqnContext``) with its abstract mesh replaced.

  ``JaxprEqnContext`` is interned and has no public constructor taking
  values; ``_create`` is its interning constructor.
  """
  if ctx.cur_abstract_mesh is mesh:
    return ctx
  xla_metadata = ctx.xla_metadata
  if xla_metadata is not None:
    xla_metadata = tuple(sorted(xla_metadata.items()))
  return _core.JaxprEqnContext._create(
    ctx.compute_type,
    ctx.threefry_partitionable,
    mesh,
    ctx.remove_size_one_mesh_axis,
    xla_metadata,
  )


def literal_value_with_aval(val, aval):
  """A literal's value carrying ``aval`` (for renaming a ``Literal``).

  JAX 0.10 stores array literals as ``TypedNdArray``, which carries its own
  abstract value (including the sharding mesh) and is what ``eval_jaxpr``
  binds; it must be rebuilt together with the ``Literal``.
  """
  if isinstance(val, _literals.TypedNdArray):
    return _literals.TypedNdArray(np.asarray(val), aval)
  return val


def current_axis_sizes() -> dict:
  """``{name: size}`` of every axis name bound where this is called."""
  return dict(_core.get_axis_env().axis_sizes)


def extend_axis_env(name_size_pairs):
  """Context manager binding each ``(name, size)`` in the axis environment.

  For a custom rule of a renamed function, which traces itself (around a
  whole trace ``jax.make_jaxpr(axis_env=...)`` does the same). Later pairs override earlier bindings of the same name (a swap binds both
  names with each other's sizes).
  """
  return _core.extend_axis_env_nd(list(name_size_pairs))


# -- staging a renamed jaxpr into the caller's trace --------------------------


def current_staging_trace():
  """The current trace when it is a plain jaxpr-staging trace (``jit``,
  ``make_jaxpr``, a ``shard_map`` body), else None.

  Under such a trace a renamed jaxpr can be emitted equation by equation
  (``stage_eqn``) instead of being evaluated primitive by primitive: the
  equations are the same, abstract evaluation is not run twice.
  """
  trace = _core.trace_ctx.trace
  if type(trace) is not _pe.DynamicJaxprTrace:
    return None
  if _config.eager_constant_folding.value or _config.enable_checks.value:
    return None
  return trace


def staged_arg(trace, x, source_info):
  """``x`` (a caller's value) as a tracer of the staging ``trace``."""
  return trace.to_jaxpr_tracer(x, source_info)


def staged_const(trace, c, source_info):
  return trace.new_const(c, source_info)


def staged_literal(trace, literal, source_info):
  return _pe.DynamicJaxprTracer(trace, literal.aval, literal, source_info)


def current_source_info():
  return _source_info_util.current()


def stage_eqn(trace, eqn, in_tracers, out_avals, atoms):
  """Emits ``eqn`` (its primitive, params, effects, source info and context;
  its variables are not read) into ``trace`` with the given inputs and out
  avals, folding constants as JAX's own inlining does; the out tracers.

  ``atoms`` maps the source jaxpr's variables to their variables (or
  literals) in ``trace`` (for effects tied to an input)."""
  params, effects, src = eqn.params, eqn.effects, eqn.source_info
  folded = _pe.try_constant_folding(
    eqn.primitive, in_tracers, params, out_avals
  )
  if folded is not None:
    return [
      trace.new_const(c, source_info=src, aval=a)
      for c, a in zip(folded, out_avals)
    ]
  if effects:
    effects = {
      e.replace(atoms[e.input])
      if isinstance(e, _effects.JaxprInputEffect)
      else e
      for e in effects
    }
  return trace.emit_eqn(
    in_tracers, out_avals, eqn.primitive, params, effects, src, eqn.ctx
  )


def has_fold_rule(primitive) -> bool:
  """Whether JAX folds ``primitive`` when an input is a known constant
  (``stage_eqn`` then may emit constants instead of the equation)."""
  return primitive in _pe.const_fold_rules


def eqn_adder(trace):
  """``add(eqn)``: adds the finished ``JaxprEqn`` ``eqn`` to the jaxpr the
  staging ``trace`` builds; None where the trace drops dead equations as
  it goes (``linearize``'s tangent traces), which needs JAX's tracer
  record of each equation.

  The trace's frame takes finished equations next to its tracer records
  (JAX's own ``lower_jaxpr`` adds them so) and lists them in its jaxpr in
  order. The caller guarantees what a record would: no effects, inputs
  that are the trace's variables or literals, and no input variable bound
  to a constant unless a live tracer holds it (the frame forgets a
  constant when its last tracer dies).
  """
  frame = trace.frame
  return None if frame.auto_dce else frame.tracing_eqns.append


def new_var(trace):
  """``new_var(aval)``: a fresh variable of the staging ``trace``."""
  return trace.frame.gensym


def var_tracer(trace, var, source_info):
  """A tracer of the staging ``trace`` for its variable or literal ``var``
  (an equation's input, staged through JAX)."""
  if type(var) is _core.Literal:
    return staged_literal(trace, var, source_info)
  return trace.var_to_tracer(var, source_info)


def is_constant_tracer(trace, tracer) -> bool:
  """Whether ``tracer``'s variable is bound to a constant of ``trace``'s
  jaxpr, which the trace keeps only while a tracer of it lives."""
  val = tracer.val
  return type(val) is not _core.Literal and val in trace.frame.constvar_to_val


def has_qdd(aval) -> bool:
  return bool(getattr(aval, "has_qdd", False))


_ZERO_TYPES = (_ad_util.Zero, _ad_util.SymbolicZero)


def is_zero(x) -> bool:
  """Whether ``x`` is a symbolic zero (``Zero`` or the public
  ``SymbolicZero``), which custom rules take and return."""
  return type(x) in _ZERO_TYPES


def with_aval(zero, aval):
  """A symbolic zero like ``zero`` (same kind) with abstract value ``aval``."""
  return zero if aval is zero.aval else type(zero)(aval)


WrappedFun = _lu.WrappedFun


def wrap_rule(fun, like):
  """``fun`` as a ``WrappedFun`` carrying the debug info of ``like``."""
  return _lu.wrap_init(fun, debug_info=like.debug_info)


# -- traceback filtering ---------------------------------------------------------

#: ``api_boundary(fun)``: ``fun`` as a JAX API boundary: JAX filters the
#: traceback of an exception raised below it (``jax_traceback_filtering``).
api_boundary = _traceback_util.api_boundary

#: ``hide_frames_of(path)``: frames from files under ``path`` are hidden in
#: JAX's filtered tracebacks, as JAX hides its own.
hide_frames_of = _traceback_util.register_exclusion
