"""rename_axes: rewrite the axis names a jaxpr (or function) uses.

``rename_jaxpr`` checks the mapping and hands the bottom-up rewrite to
``rename_rewrite.Renamer``. A renamed function traces the user's function in
the current context under the old names (``context.py``), renames the jaxpr
and evaluates it with the caller's values, so every primitive is bound again
under the caller's transformations; custom rules in the jaxpr run the same
way when JAX calls them (``_wrap_rule``, given to the rewrite).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Mapping
import functools
from typing import Any
from typing import overload

import jax
import jax.extend.core
from jax.extend.core import ClosedJaxpr
from jax.extend.core import Jaxpr

from . import analysis
from . import context
from . import deep
from . import jax_internals
from . import rename_rewrite as rewrite
from . import rules
from . import tracing

# Stock JAX callables, bound at import: a program that swaps jaxworks (or
# anything else) in for a JAX entry point cannot make this module call it.
_eval_jaxpr = jax.core.eval_jaxpr
_tree_flatten = jax.tree_util.tree_flatten
_tree_unflatten = jax.tree_util.tree_unflatten
_Tracer = jax.core.Tracer

_API = rewrite.API


def rename_jaxpr(
  jaxpr: Jaxpr | ClosedJaxpr,
  mapping: Mapping[Hashable, Hashable],
  *,
  rule_env: Mapping[Hashable, int] | None = None,
) -> Jaxpr | ClosedJaxpr:
  """A jaxpr whose free axis names are renamed through ``mapping``.

  Renames collectives and axis queries, and the names in types (varying
  manual axes, shardings), meshes and specs. Sub-jaxprs and equations that
  mention no renamed name are shared with the input by identity; the input
  itself is returned when nothing changes.

  ``rule_env`` (old name -> size) is the axis environment the jaxpr was
  traced in: its custom rules (``custom_vjp``/``custom_jvp``), traced only
  when a transformation needs them, bind any of those names that is not
  bound where they run.

  Raises:
    ValueError: a new name would merge with a free name that is kept, would
      be captured by an inner binder, or the mapping is not one-to-one.
  """
  mapping = rewrite.check_mapping(mapping)
  core_jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
  if not isinstance(core_jaxpr, Jaxpr):
    raise TypeError(
      f"{_API}: expected a Jaxpr or ClosedJaxpr, got {type(jaxpr).__name__}"
    )
  effective = _effective_mapping(core_jaxpr, mapping)
  if not effective:
    return jaxpr
  new = rewrite.Renamer(_wrap_rule, rule_env).jaxpr(core_jaxpr, effective)
  if not isinstance(jaxpr, ClosedJaxpr):
    return new
  return jaxpr if new is core_jaxpr else ClosedJaxpr(new, jaxpr.consts)


def _effective_mapping(
  core_jaxpr: Jaxpr,
  mapping: Mapping,
  mentioned: frozenset | None = None,
  has_rules: bool | None = None,
) -> dict:
  """The entries of ``mapping`` that apply to ``core_jaxpr`` (all of them
  when it holds custom rules); raises if a new name would merge two axes.

  ``mentioned``, ``has_rules``: the jaxpr's ``rewrite.mentioned_names`` and
  whether it has ``analysis.rule_eqns``, when known."""
  if mentioned is None:
    mentioned = rewrite.mentioned_names(core_jaxpr)
  if has_rules is None:
    has_rules = bool(analysis.rule_eqns(core_jaxpr))
  if has_rules:
    # Custom rules may use any old name once they run: they get it all.
    effective = dict(mapping)
  else:
    effective = {o: n for o, n in mapping.items() if o in mentioned}
  clash = sorted(
    {
      repr(n)
      for n in effective.values()
      if n in mentioned and n not in effective
    }
  )
  if clash:
    raise ValueError(
      f"{_API}: mapping {dict(mapping)!r} renames onto {', '.join(clash)}, "
      f"which the function already uses (free names: "
      f"{sorted(mentioned, key=repr)}); that would merge two axes. Rename "
      "that name too, or pick a fresh one"
    )
  return effective


@overload
def rename_axes(
  fun: jax.extend.core.ClosedJaxpr, mapping: Mapping[Hashable, Hashable]
) -> jax.extend.core.ClosedJaxpr: ...


@overload
def rename_axes(
  fun: jax.extend.core.Jaxpr, mapping: Mapping[Hashable, Hashable]
) -> jax.extend.core.Jaxpr: ...


@overload
def rename_axes(
  fun: Callable[..., Any], mapping: Mapping[Hashable, Hashable]
) -> Callable[..., Any]: ...


def rename_axes(
  fun: Callable[..., Any] | jax.extend.core.Jaxpr | jax.extend.core.ClosedJaxpr,
  mapping: Mapping[Hashable, Hashable],
) -> Callable[..., Any] | jax.extend.core.Jaxpr | jax.extend.core.ClosedJaxpr:
  """A function like ``fun`` whose collectives use renamed axis names.

  Given a ``Jaxpr`` or ``ClosedJaxpr`` instead of a function, returns the
  renamed jaxpr (sharing every untouched sub-jaxpr and equation with the
  input, see ``rename_jaxpr``).

  ``rename_axes(f, {'i': 'batch'})`` behaves like ``f`` with every free use
  of axis ``'i'`` (``psum(x, 'i')``, ``axis_index('i')``, ...) replaced by
  ``'batch'``, so code written for one mesh runs under a ``shard_map``,
  ``pmap`` or ``vmap`` that binds other names. Names ``f`` binds itself
  (a ``shard_map`` inside ``f``) are left alone. The result works under
  ``jax.jit``, ``jax.grad``, ``jax.jvp``, ``jax.vmap``, ``jax.shard_map``
  and ``jax.pmap`` like ``f`` written with the new names, custom rules
  included: a ``custom_vjp``'s, ``custom_jvp``'s or ``custom_vmap``'s rules
  are renamed when JAX runs them. Inside a ``shard_map`` whose mesh also
  has an axis called like an old name, that axis is hidden while ``f`` is
  traced (so a swap works). A mapping that renames nothing returns ``fun``
  itself.

  Each call traces ``fun`` (inside ``jax.jit`` that is once per trace of
  the enclosing function); all arguments must be arrays or scalars.

  Args:
    fun: the function (or jaxpr) to rename.
    mapping: ``{old_name: new_name}``; one-to-one.

  Returns:
    The renamed function.

  Raises:
    ValueError: the mapping is not one-to-one, or would merge a new name
      with one ``fun`` keeps or have an inner binder capture it (for a name
      only a custom rule uses: when the rule runs).
    NameError: when called where a new name is not bound (no placeholder
      sizes are assumed).

  >>> import jax, jax.numpy as jnp
  >>> f = lambda x: jax.lax.psum(x, 'i')
  >>> g = rename_axes(f, {'i': 'batch'})
  >>> jax.vmap(g, axis_name='batch')(jnp.arange(4.))
  Array([6., 6., 6., 6.], dtype=float32)
  """
  if isinstance(fun, (Jaxpr, ClosedJaxpr)):
    return rename_jaxpr(fun, mapping)
  mapping = rewrite.check_mapping(mapping)
  if not callable(fun):
    raise TypeError(
      f"{_API}: fun must be callable, got {fun!r} of type {type(fun).__name__}"
    )
  if not mapping:
    return fun  # nothing to rename: the function itself, exactly as stock

  @functools.wraps(fun)
  def renamed(*args, **kwargs):
    return _run_renamed(fun, (args, kwargs), mapping, rule=False)

  return renamed


# ---------------------------------------------------------------------------
# Running code written for the old names, in the caller's context.


def _run_renamed(
  fun: Callable,
  args: tuple,
  mapping: Mapping,
  *,
  rule: bool,
  captured: Mapping | None = None,
  rule_env: Mapping | None = None,
) -> Any:
  """``fun(*args[0], **args[1])`` (``fun(*args)`` for a rule), renamed.

  Traces ``fun`` under the old names (``context.old_names``), renames the
  jaxpr forward and evaluates it on the caller's values, so each primitive
  is bound again under the caller's transformations. For a user function
  every argument leaf is traced and every output comes from the jaxpr. For
  a rule (``rule=True``), leaves that are not arrays (symbolic zeros,
  Python flags) stay static, and outputs that do not depend on the traced
  arguments (symbolic zeros, flags) are returned as they are, renamed;
  a rule that uses an old name in ``captured`` is an error.
  """
  ctx = context.with_fallback_env(context.old_names(mapping, _API), rule_env)
  leaves, treedef = _tree_flatten(args, is_leaf=jax_internals.is_zero)
  dyn = [
    i for i, x in enumerate(leaves) if not rule or context.is_array_like(x)
  ]
  statics = [_renamed_zero(x, ctx.inverse) for x in leaves]
  avals = context.arg_avals([leaves[i] for i in dyn], ctx, _API)
  out_box = []

  def flat_fun(*dyn_vals):
    vals = list(statics)
    for i, v in zip(dyn, dyn_vals):
      vals[i] = v
    a = _tree_unflatten(treedef, vals)
    out = fun(*a) if rule else fun(*a[0], **a[1])
    out_leaves, out_tree = _tree_flatten(out, is_leaf=jax_internals.is_zero)
    traced = [not rule or isinstance(x, _Tracer) for x in out_leaves]
    # Only the untraced outputs are kept: holding the trace's own tracers
    # past its end would leak them (JAX_CHECK_TRACER_LEAKS reports it).
    kept = [None if t else x for x, t in zip(out_leaves, traced)]
    out_box.append((out_tree, kept, traced))
    return [x for x, t in zip(out_leaves, traced) if t]

  try:
    with ctx.scope():
      trace_env = jax_internals.current_axis_sizes()
      # No placeholder sizes: a size baked into the trace (``pmean``,
      # ``axis_size``, ``all_gather`` shapes) would be silently wrong under
      # a transformation that handles the name without binding it.
      closed, _ = tracing.trace(
        flat_fun, tuple(avals), {}, {}, _API, use_placeholders=False
      )
  except NameError as e:
    who = f"{getattr(fun, '__name__', 'the function')!r}"
    err = _unbound_error(e, mapping, captured, who, ":")
    if err is None:
      raise
    raise err from e
  except AssertionError as e:
    # Inside a shard_map JAX asserts (rather than raising NameError) on a
    # collective over a name that is not a mesh axis.
    if captured:
      old = sorted(captured, key=repr)[0]
      raise captured[old].error(old) from e
    if not ctx.vacated:
      raise
    raise _vacated_error(fun, mapping, ctx, e) from e
  out_tree, out_leaves, traced = out_box[-1]
  _check_captured([closed.jaxpr], captured)
  dyn_args = [leaves[i] for i in dyn]
  trace = jax_internals.current_staging_trace()
  if trace is not None and not any(
    jax_internals.has_qdd(v.aval) for v in closed.jaxpr.invars
  ):
    # Staging (jit, make_jaxpr, a shard_map body): rename while emitting
    # the equations into the caller's trace, in one pass that also finds
    # the names the jaxpr mentions (for the merge check).
    renamer = rewrite.Renamer(_wrap_rule, trace_env)
    staged, mentioned, has_rules = renamer.stage(
      closed, ctx.forward, trace, dyn_args
    )
    _effective_mapping(closed.jaxpr, ctx.forward, mentioned, has_rules)
    outs = iter(staged)
  else:
    new = rename_jaxpr(closed, ctx.forward, rule_env=trace_env)
    assert isinstance(new, ClosedJaxpr)
    outs = iter(_eval_jaxpr(new.jaxpr, new.consts, *dyn_args))
  result = [
    next(outs) if t else _renamed_zero(x, ctx.forward)
    for x, t in zip(out_leaves, traced)
  ]
  return _tree_unflatten(out_tree, result)


def _renamed_zero(x: Any, mapping: Mapping) -> Any:
  """A symbolic zero ``x`` with its aval renamed; any other ``x`` itself."""
  if not jax_internals.is_zero(x):
    return x
  return jax_internals.with_aval(x, deep.rename(x.aval, mapping))


def _unbound_error(err, mapping, captured, who, sep) -> Exception | None:
  """The error for JAX's ``NameError`` ``err`` while ``who`` ran under the
  old names, or None when it is not about a renamed name."""
  old = jax_internals.unbound_axis_name(err)
  if captured and old in captured:
    return captured[old].error(old)
  if old is None or old not in mapping:
    return None
  return NameError(
    f"{_API}: {who} uses axis {old!r}, renamed to {mapping[old]!r}, which is "
    f"not bound here{sep} call it under a shard_map, pmap or vmap that binds "
    f"{mapping[old]!r}"
  )


def _vacated_error(fun, mapping, ctx, err) -> ValueError:
  names = ", ".join(f"{n!r} becomes {ctx.inverse[n]!r}" for n in ctx.vacated)
  return ValueError(
    f"{_API}: JAX failed ({type(err).__name__}) while tracing "
    f"{getattr(fun, '__name__', fun)!r} under its old names for "
    f"{dict(mapping)!r} inside the current mesh: there {names}, so a "
    "function that also uses the new name itself cannot be renamed here "
    "(that would merge two axes). Rename that name too (a swap works), or "
    "pick a new name the function does not use"
  )


def _split(mapping: Mapping) -> tuple[dict, dict]:
  """(user entries to apply, captured entries) of a renamer mapping."""
  entries = context.user_entries(mapping)
  captured = {
    o: n for o, n in entries.items() if isinstance(n, rewrite.Captured)
  }
  return {o: n for o, n in entries.items() if o not in captured}, captured


def _check_captured(jaxprs, captured: Mapping | None) -> None:
  if not captured:
    return
  for j in jaxprs:
    hit = rewrite.mentioned_names(j) & set(captured)
    if hit:
      old = min(hit, key=repr)
      raise captured[old].error(old)


def _wrap_rule(
  kind: str, fn: Any, mapping: Mapping, rule_env: Mapping | None
) -> Any:
  """A rule callable that runs ``fn`` under the old names of ``mapping``."""
  apply, captured = _split(mapping)
  if not apply and not captured:
    return fn
  if kind == rules.JAXPR_THUNK:

    def thunk(*args):
      ctx = context.with_fallback_env(context.old_names(apply, _API), rule_env)
      try:
        with ctx.scope():
          trace_env = jax_internals.current_axis_sizes()
          out = fn.call_wrapped(*args)
      except NameError as e:
        who = "a custom rule of the renamed function"
        err = _unbound_error(e, apply, captured, who, ";")
        if err is None:
          raise
        raise err from e
      jaxprs = [x for x in out if isinstance(x, (Jaxpr, ClosedJaxpr))]
      _check_captured(
        [j.jaxpr if isinstance(j, ClosedJaxpr) else j for j in jaxprs], captured
      )
      return type(out)(
        rename_jaxpr(x, ctx.forward, rule_env=trace_env)
        if isinstance(x, (Jaxpr, ClosedJaxpr))
        else x
        for x in out
      )

    return jax_internals.wrap_rule(thunk, fn)

  is_wrapped = isinstance(fn, jax_internals.WrappedFun)
  call = fn.call_wrapped if is_wrapped else fn

  def checked(*args):
    return _run_renamed(
      call, args, apply, rule=True, captured=captured, rule_env=rule_env
    )

  if is_wrapped:
    return jax_internals.wrap_rule(checked, fn)
  return _RenamedRule(fn, checked)


class _RenamedRule:
  """A plain rule callable (``custom_vmap``'s rule) run under old names."""

  def __init__(self, fn, call):
    self._fn = fn
    self._call = call

  def __call__(self, *args):
    return self._call(*args)

  def __str__(self):
    return str(self._fn)

  def __repr__(self):
    return f"rename_axes({self._fn!r})"
