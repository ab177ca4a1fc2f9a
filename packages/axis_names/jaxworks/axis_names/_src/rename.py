"""rename_axes: rewrite the axis names a jaxpr (or function) uses.

The jaxpr rewrite is bottom-up and shares structure: an equation or
sub-jaxpr whose free names (memoized by ``analysis``) avoid the renamed
names is reused as the very same object, so renaming touches only the part
of the program that mentions a renamed axis. Binders shadow: inside a
``shard_map`` that binds ``'i'``, a rename of ``'i'`` does not apply; a
rename whose new name would be captured by such a binder is an error.

The function wrapper traces the user's function in the current context
with the context's names renamed back to the old ones (``context.py``),
rewrites the jaxpr to the new names, and evaluates it with the caller's
values, so every primitive is bound again under the caller's transformations
(jit, grad, vmap, shard_map, pmap).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Mapping
import dataclasses
import functools
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr
from jax.extend.core import DropVar
from jax.extend.core import Jaxpr
from jax.extend.core import JaxprEqn
from jax.extend.core import Literal
from jax.extend.core import Var

from . import analysis
from . import context
from . import deep
from . import jax_internals
from . import rules
from . import tracing
from .check import location

_API = "jaxworks.axis_names.rename_axes"

# Stock JAX callables, bound at import: a program that swaps jaxworks (or
# anything else) in for a JAX entry point cannot make this module call it.
_eval_jaxpr = jax.core.eval_jaxpr
_tree_flatten = jax.tree_util.tree_flatten
_tree_unflatten = jax.tree_util.tree_unflatten
_Tracer = jax.core.Tracer

# Jaxpr -> {frozen mapping: renamed Jaxpr}; only changed results are stored
# (an unchanged result is the key itself and must not keep it alive).
_RENAMED = analysis.WeakIdentityCache()


def check_mapping(mapping: Any, api: str = _API) -> dict[Hashable, Hashable]:
  """Validates a rename mapping; returns it as a dict without identities."""
  if not isinstance(mapping, Mapping):
    raise TypeError(
      f"{api}: mapping must be a dict from old axis name to new axis name, "
      f"got {mapping!r} of type {type(mapping).__name__}; pass e.g. "
      "{'i': 'batch'}"
    )
  out = {}
  for old, new in mapping.items():
    for role, n in (("old", old), ("new", new)):
      if n is None or isinstance(n, int) or not isinstance(n, Hashable):
        raise TypeError(
          f"{api}: {role} axis name {n!r} in mapping {dict(mapping)!r} is "
          "not a valid axis name (use hashable non-int names such as "
          "strings; ints are positional axes)"
        )
    if old != new:
      out[old] = new
  news = list(out.values())
  dupes = sorted({repr(n) for n in news if news.count(n) > 1})
  if dupes:
    raise ValueError(
      f"{api}: mapping {dict(mapping)!r} sends several axes to "
      f"{', '.join(dupes)}; renaming must be one-to-one (merging axes would "
      "change what collectives reduce over)"
    )
  return out


_EFFECT_OF: dict = {}  # axis name -> its NamedAxisEffect (effects are values)


def _effect(name):
  eff = _EFFECT_OF.get(name)
  if eff is None:
    eff = _EFFECT_OF.setdefault(name, jax_internals.NamedAxisEffect(name))
  return eff


def _rename_effects(effects, mapping: Mapping) -> Any:
  if not effects:
    return effects
  changed = False
  out = []
  for e in effects:
    if jax_internals.is_named_axis_effect(e) and e.name in mapping:
      out.append(_effect(mapping[e.name]))
      changed = True
    else:
      out.append(e)
  if not changed:
    return effects
  return frozenset(out) if isinstance(effects, frozenset) else set(out)


# ---------------------------------------------------------------------------
# What a jaxpr mentions: collective names plus names in types, meshes, specs.

_MENTIONS = analysis.WeakIdentityCache()


def _atom_names(v) -> frozenset:
  return deep.names_of(v.aval)


def eqn_mentions(eqn: JaxprEqn) -> frozenset:
  """Free axis names an equation mentions anywhere (not only collectives)."""
  names = set(analysis.eqn_axis_names(eqn))
  for v in eqn.outvars:
    n = _atom_names(v)
    if n:
      names |= n
  for a in eqn.invars:
    if isinstance(a, Literal):
      names |= _atom_names(a)
  mesh = jax_internals.eqn_context_mesh(eqn.ctx)
  if mesh is not None:
    names |= deep.names_of(mesh)
  if eqn.effects:
    names |= jax_internals.named_axis_effect_names(eqn.effects)
  bound = analysis.bound_names(eqn)
  for v in eqn.params.values():
    subs = analysis.subjaxprs({"v": v})
    if subs:
      for sub in subs:
        names |= mentioned_names(sub) - bound
    else:
      n = deep.names_of(v)
      if n:
        names |= n - bound
  return frozenset(names)


def mentioned_names(jaxpr: Jaxpr) -> frozenset:
  """Free axis names a jaxpr mentions anywhere, memoized per object."""
  used = analysis.jaxpr_axis_names(jaxpr)
  # JAX may annotate more than is used (cond gives every branch the union of
  # all branches' effects); the annotation must be renamed too.
  annotated = jax_internals.named_axis_effect_names(jaxpr.effects)
  if not analysis.has_manual_types(jaxpr):
    # Traced outside any shard_map: no types, meshes or specs mention
    # manual axes, so this is O(1) given the memoized analysis.
    return used | annotated if annotated else used
  hit = _MENTIONS.get(jaxpr)
  if hit is not None:
    return hit
  names = set(used) | annotated
  for v in (*jaxpr.constvars, *jaxpr.invars, *jaxpr.outvars):
    names |= _atom_names(v)
  for eqn in jaxpr.eqns:
    names |= eqn_mentions(eqn)
  result = frozenset(names)
  _MENTIONS.put(jaxpr, result)
  return result


def _holds_jaxpr(v: Any) -> bool:
  t = type(v)
  if t is ClosedJaxpr or t is Jaxpr:
    return True
  if isinstance(v, (tuple, list)):
    return bool(v) and bool(analysis.subjaxprs({None: v}))
  return isinstance(v, (ClosedJaxpr, Jaxpr))


class _Renamer:
  """One rename pass; memos keep shared sub-jaxprs and values shared."""

  def __init__(self, rule_env: Mapping | None = None):
    self.memo: dict[tuple, tuple[Jaxpr, Jaxpr]] = {}
    self.value_memo: dict[int, tuple[Any, Any]] = {}
    # Axis sizes the function was traced with, for its custom rules.
    self.rule_env = dict(rule_env) if rule_env else None
    self.env_key = frozenset(rule_env.items()) if rule_env else None

  def jaxpr(self, jaxpr: Jaxpr, mapping: Mapping) -> Jaxpr:
    if mentioned_names(jaxpr).isdisjoint(mapping) and not analysis.rule_eqns(
      jaxpr
    ):
      return jaxpr
    key = (frozenset(mapping.items()), self.env_key)
    per_mapping = _RENAMED.get(jaxpr)
    if per_mapping is not None and key in per_mapping:
      return per_mapping[key]
    hit = self.memo.get((id(jaxpr), key))
    if hit is not None:
      return hit[1]
    if analysis.has_local_manual_types(jaxpr):
      new = self._deep_jaxpr(jaxpr, mapping)
    else:
      # Traced outside shard_map: no type here mentions a manual axis (one
      # that a sub-jaxpr mentions is bound above, hence in this jaxpr's
      # context), so only equations using a renamed name change, and the
      # analysis already knows which those are.
      eqns = list(jaxpr.eqns)
      todo = {
        i
        for i, names in analysis.named_eqns(jaxpr)
        if not names.isdisjoint(mapping)
      }
      todo.update(analysis.rule_eqns(jaxpr))
      for i in sorted(todo):
        eqns[i] = self._light_eqn(eqns[i], mapping)
      new = jaxpr.replace(
        eqns=eqns,
        effects=_rename_effects(jaxpr.effects, mapping),
        debug_info=jaxpr.debug_info,
      )
    self.memo[(id(jaxpr), key)] = (jaxpr, new)  # keeps the id stable
    if per_mapping is None:
      per_mapping = {}
      _RENAMED.put(jaxpr, per_mapping)
    per_mapping[key] = new
    return new

  def _deep_jaxpr(self, jaxpr: Jaxpr, mapping: Mapping) -> Jaxpr:
    """Renames names in collectives and in every type, mesh and spec."""
    varmap: dict = {}

    def sub(v):
      if isinstance(v, Literal):
        aval = deep.rename(v.aval, mapping, self.value_memo)
        if aval is v.aval:
          return v
        return Literal(jax_internals.literal_value_with_aval(v.val, aval), aval)
      nv = varmap.get(v)
      if nv is None:
        aval = deep.rename(v.aval, mapping, self.value_memo)
        if aval is v.aval:
          nv = v
        elif isinstance(v, DropVar):
          nv = DropVar(aval)
        else:
          nv = Var(aval, v.initial_qdd, v.final_qdd)
        varmap[v] = nv
      return nv

    constvars = [sub(v) for v in jaxpr.constvars]
    invars = [sub(v) for v in jaxpr.invars]
    eqns = [self.eqn(e, mapping, sub) for e in jaxpr.eqns]
    outvars = [sub(v) for v in jaxpr.outvars]
    return jaxpr.replace(
      constvars=constvars,
      invars=invars,
      outvars=outvars,
      eqns=eqns,
      effects=_rename_effects(jaxpr.effects, mapping),
      debug_info=jaxpr.debug_info,
    )

  def param(self, v: Any, mapping: Mapping) -> Any:
    if isinstance(v, ClosedJaxpr):
      new = self.jaxpr(v.jaxpr, mapping)
      return v if new is v.jaxpr else ClosedJaxpr(new, v.consts)
    if isinstance(v, Jaxpr):
      return self.jaxpr(v, mapping)
    if isinstance(v, (tuple, list)):
      items = [self.param(x, mapping) for x in v]
      if all(a is b for a, b in zip(items, v)):
        return v
      if hasattr(v, "_make"):  # NamedTuple, e.g. custom_linear_solve jaxprs
        return v._make(items)
      return type(v)(items)
    return deep.rename(v, mapping, self.value_memo)

  def _params_and_inner(self, eqn: JaxprEqn, mapping: Mapping):
    """Own params renamed; the mapping that applies inside (binders shadow)."""
    prim = eqn.primitive.name
    params = dict(eqn.params)
    param = rules.AXIS_PARAMS.get(prim)
    subs = analysis.subjaxprs(params)
    if param is None and not subs and eqn.effects:
      opaque = jax_internals.named_axis_effect_names(eqn.effects) & set(mapping)
      if opaque:
        raise ValueError(
          f"{_API}: cannot rename axis names {sorted(opaque, key=repr)} of "
          f"primitive {prim!r} at {location(eqn) or 'an unknown location'}: "
          "jaxworks.axis_names has no rule for which of its params hold "
          "axis names. Rename the axis where that primitive is called."
        )
    if param is not None:
      params[param] = rules.rename_in_param(params[param], mapping)
    bound = analysis.bound_names(eqn)
    inner = (
      {o: n for o, n in mapping.items() if o not in bound} if bound else mapping
    )
    if subs and bound:
      captured = sorted(
        {
          repr(n)
          for o, n in inner.items()
          if n in bound and any(o in mentioned_names(s) for s in subs)
        }
      )
      if captured:
        raise ValueError(
          f"{_API}: renaming {dict(mapping)!r} would capture "
          f"{', '.join(captured)} inside {prim} at "
          f"{location(eqn) or 'an unknown location'}, which binds "
          f"{sorted(bound, key=repr)}; pick new names that the inner {prim} "
          "does not bind"
        )
      if any(n in bound for n in inner.values()):
        # No visible use below is captured, but a custom rule below may use
        # the old name once it runs: it learns the capture then.
        where = location(eqn) or "an unknown location"
        shown = repr(context.user_entries(mapping))
        inner = {
          o: (_Captured(n, prim, where, shown) if n in bound else n)
          for o, n in inner.items()
        }
    callables = rules.CALLABLE_PARAMS.get(prim)
    if callables and inner:
      for k, kind in callables.items():
        v = params.get(k)
        if v is not None:
          params[k] = _wrap_rule(kind, v, inner, self.rule_env)
    return params, param, inner, subs

  def _light_eqn(self, eqn: JaxprEqn, mapping: Mapping) -> JaxprEqn:
    """Renames an equation of a jaxpr whose types mention no manual axis.

    Only the collective's own param and the params holding sub-jaxprs can
    change; everything else is carried over.
    """
    params, param, inner, subs = self._params_and_inner(eqn, mapping)
    if subs and inner:
      for k, v in eqn.params.items():
        if k != param and _holds_jaxpr(v):
          params[k] = self.param(v, inner)
    return eqn.replace(
      params=params, effects=_rename_effects(eqn.effects, mapping)
    )

  def eqn(self, eqn: JaxprEqn, mapping: Mapping, sub) -> JaxprEqn:
    invars = [sub(v) for v in eqn.invars]
    in_changed = any(a is not b for a, b in zip(invars, eqn.invars))
    if (
      not in_changed
      and eqn_mentions(eqn).isdisjoint(mapping)
      and not analysis.eqn_has_rules(eqn)
    ):
      return eqn
    outvars = [sub(v) for v in eqn.outvars]
    params, param, inner, _ = self._params_and_inner(eqn, mapping)
    if inner:
      callables = rules.CALLABLE_PARAMS.get(eqn.primitive.name, {})
      for k, v in eqn.params.items():
        if k != param and k not in callables:
          params[k] = self.param(v, inner)
    mesh = jax_internals.eqn_context_mesh(eqn.ctx)
    ctx = eqn.ctx
    if mesh is not None:
      ctx = jax_internals.eqn_context_with_mesh(
        ctx, deep.rename(mesh, mapping, self.value_memo)
      )
    return eqn.replace(
      invars=invars,
      outvars=outvars,
      params=params,
      effects=_rename_effects(eqn.effects, mapping),
      ctx=ctx,
    )


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
  mapping = check_mapping(mapping)
  core_jaxpr = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
  if not isinstance(core_jaxpr, Jaxpr):
    raise TypeError(
      f"{_API}: expected a Jaxpr or ClosedJaxpr, got {type(jaxpr).__name__}"
    )
  mentioned = mentioned_names(core_jaxpr)
  if analysis.rule_eqns(core_jaxpr):
    # Custom rules may use any old name once they run: they get it all.
    effective = mapping
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
  if not effective:
    return jaxpr
  new = _Renamer(rule_env).jaxpr(core_jaxpr, effective)
  if not isinstance(jaxpr, ClosedJaxpr):
    return new
  return jaxpr if new is core_jaxpr else ClosedJaxpr(new, jaxpr.consts)


def rename_axes(
  fun: Callable | Jaxpr | ClosedJaxpr, mapping: Mapping[Hashable, Hashable]
) -> Callable | Jaxpr | ClosedJaxpr:
  """A function like ``fun`` whose collectives use renamed axis names.

  Given a ``Jaxpr`` or ``ClosedJaxpr`` instead of a function, returns the
  renamed jaxpr (sharing every untouched sub-jaxpr and equation with the
  input, see ``rename_jaxpr``).

  ``rename_axes(f, {'i': 'batch'})`` behaves like ``f`` with every free use
  of axis ``'i'`` (``psum(x, 'i')``, ``axis_index('i')``, ...) replaced by
  ``'batch'``, so code written for one mesh runs under a ``shard_map``,
  ``pmap`` or ``vmap`` that binds other names. Names ``f`` binds itself
  (a ``shard_map`` inside ``f``) are left alone. The result works under
  ``jax.jit``, ``jax.grad``, ``jax.jvp`` and ``jax.vmap``, custom rules
  included: a ``custom_vjp``'s or ``custom_jvp``'s rules are renamed when
  JAX runs them. Inside a ``shard_map`` whose mesh also has an axis called
  like an old name, that axis is hidden while ``f`` is traced. A mapping
  that renames nothing returns ``fun`` itself.

  Each call traces ``fun`` (inside ``jax.jit`` that is once per trace of
  the enclosing function); all arguments must be arrays or scalars.

  Args:
    fun: the function (or jaxpr) to rename.
    mapping: ``{old_name: new_name}``; one-to-one.

  Returns:
    The renamed function.

  >>> import jax, jax.numpy as jnp
  >>> f = lambda x: jax.lax.psum(x, 'i')
  >>> g = rename_axes(f, {'i': 'batch'})
  >>> jax.vmap(g, axis_name='batch')(jnp.arange(4.))
  Array([6., 6., 6., 6.], dtype=float32)
  """
  if isinstance(fun, (Jaxpr, ClosedJaxpr)):
    return rename_jaxpr(fun, mapping)
  mapping = check_mapping(mapping)
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
  if rule:
    dyn = [i for i, x in enumerate(leaves) if context.is_array_like(x)]
  else:
    dyn = list(range(len(leaves)))
  statics = list(leaves)
  for i, x in enumerate(leaves):
    if jax_internals.is_zero(x):
      statics[i] = jax_internals.with_aval(x, deep.rename(x.aval, ctx.inverse))
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
    out_box.append((out_tree, out_leaves, traced))
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
    old = jax_internals.unbound_axis_name(e)
    if captured and old in captured:
      raise captured[old].error(old) from e
    if old is not None and old in mapping:
      raise NameError(
        f"{_API}: {getattr(fun, '__name__', 'the function')!r} uses axis "
        f"{old!r}, renamed to {mapping[old]!r}, which is not bound here: "
        f"call it under a shard_map, pmap or vmap that binds "
        f"{mapping[old]!r}"
      ) from e
    raise
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
  new = rename_jaxpr(closed, ctx.forward, rule_env=trace_env)
  assert isinstance(new, ClosedJaxpr)
  outs = iter(_eval_jaxpr(new.jaxpr, new.consts, *[leaves[i] for i in dyn]))
  result = []
  for x, t in zip(out_leaves, traced):
    if t:
      result.append(next(outs))
    elif jax_internals.is_zero(x):
      result.append(
        jax_internals.with_aval(x, deep.rename(x.aval, ctx.forward))
      )
    else:
      result.append(x)
  return _tree_unflatten(out_tree, result)


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


@dataclasses.dataclass(frozen=True)
class _Captured:
  """A mapping entry whose new name an inner binder binds (``shard_map``).

  No visible use of the old name is below that binder (that is an error at
  rename time); a custom rule below that turns out to use it is an error
  when the rule runs.
  """

  new: Hashable
  primitive: str
  where: str
  mapping: str

  def error(self, old) -> ValueError:
    return ValueError(
      f"{_API}: renaming {self.mapping} would capture {self.new!r} inside "
      f"{self.primitive} at {self.where}, which binds it: a custom rule "
      f"(custom_vjp/custom_jvp) under it uses (or failed to trace without) "
      f"{old!r}; pick a new name that the inner {self.primitive} does not "
      "bind"
    )


def _split(mapping: Mapping) -> tuple[dict, dict]:
  """(user entries to apply, captured entries) of a renamer mapping."""
  apply, captured = {}, {}
  for o, n in context.user_entries(mapping).items():
    if isinstance(n, _Captured):
      captured[o] = n
    else:
      apply[o] = n
  return apply, captured


def _check_captured(jaxprs, captured: Mapping | None) -> None:
  if not captured:
    return
  for j in jaxprs:
    hit = mentioned_names(j) & set(captured)
    if hit:
      old = sorted(hit, key=repr)[0]
      raise captured[old].error(old)


def _core(j):
  return j.jaxpr if isinstance(j, ClosedJaxpr) else j


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
        old = jax_internals.unbound_axis_name(e)
        if old in captured:
          raise captured[old].error(old) from e
        if old is not None and old in apply:
          raise NameError(
            f"{_API}: a custom rule of the renamed function uses axis "
            f"{old!r}, renamed to {apply[old]!r}, which is not bound here; "
            f"call it under a shard_map, pmap or vmap that binds "
            f"{apply[old]!r}"
          ) from e
        raise
      jaxprs = [x for x in out if isinstance(x, (Jaxpr, ClosedJaxpr))]
      _check_captured([_core(j) for j in jaxprs], captured)
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
