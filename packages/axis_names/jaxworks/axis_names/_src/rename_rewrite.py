"""The jaxpr rewrite of ``rename_axes``: free axis names renamed bottom-up.

An equation or sub-jaxpr whose free names (memoized here and by
``analysis``) avoid the renamed names is reused as the very same object, so
renaming touches only the part of the program that mentions a renamed axis.
Binders shadow: inside a ``shard_map`` that binds ``'i'``, a rename of
``'i'`` does not apply; a rename whose new name would be captured by such a
binder is an error (or a ``Captured`` entry, when only a custom rule below
could use the old name). ``rename.py`` drives it and runs rule callables.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Mapping
from collections.abc import Sequence
import dataclasses
import functools
from typing import Any

from jax.extend.core import ClosedJaxpr
from jax.extend.core import DropVar
from jax.extend.core import Jaxpr
from jax.extend.core import JaxprEqn
from jax.extend.core import Literal
from jax.extend.core import Var
import numpy as np

from . import analysis
from . import context
from . import deep
from . import jax_internals
from . import rules
from .check import location

API = "jaxworks.axis_names.rename_axes"

# Jaxpr -> {frozen mapping: renamed Jaxpr}; only changed results are stored
# (an unchanged result is the key itself and must not keep it alive).
_RENAMED = analysis.WeakIdentityCache()


def check_mapping(mapping: Any, api: str = API) -> dict[Hashable, Hashable]:
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


# Axis name -> its NamedAxisEffect (effects are values: one object per name).
_effect = functools.cache(jax_internals.NamedAxisEffect)


def _rename_effects(effects, mapping: Mapping) -> Any:
  if not effects:
    return effects
  # One pass, no hashing of the effects that stay (this is on every
  # rebuilt equation's path).
  changed = False
  out = []
  for e in effects:
    if jax_internals.is_named_axis_effect(e) and e.name in mapping:
      e = _effect(mapping[e.name])
      changed = True
    out.append(e)
  if not changed:
    return effects
  return frozenset(out) if isinstance(effects, frozenset) else set(out)


# ---------------------------------------------------------------------------
# What a jaxpr mentions: collective names plus names in types, meshes, specs.

_MENTIONS = analysis.WeakIdentityCache()


def eqn_mentions(eqn: JaxprEqn) -> frozenset:
  """Free axis names an equation mentions anywhere (not only collectives)."""
  names = set(analysis.eqn_axis_names(eqn))
  names.update(*(deep.names_of(v.aval) for v in eqn.outvars))
  literals = (a for a in eqn.invars if isinstance(a, Literal))
  names.update(*(deep.names_of(a.aval) for a in literals))
  names |= deep.names_of(jax_internals.eqn_context_mesh(eqn.ctx))
  names |= jax_internals.named_axis_effect_names(eqn.effects)
  bound = analysis.bound_names(eqn)
  for v in eqn.params.values():
    # A param holding jaxprs mentions their names, any other its own.
    subs = analysis.subjaxprs({"v": v})
    for n in [mentioned_names(s) for s in subs] or [deep.names_of(v)]:
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
  atoms = (*jaxpr.constvars, *jaxpr.invars, *jaxpr.outvars)
  names.update(*(deep.names_of(v.aval) for v in atoms))
  names.update(*(eqn_mentions(eqn) for eqn in jaxpr.eqns))
  result = frozenset(names)
  _MENTIONS.put(jaxpr, result)
  return result


# Param values that cannot hold an axis name or a jaxpr.
_PLAIN = (type(None), bool, int, float, str, np.dtype)


def _literal_key(val: Any) -> Any:
  """A key telling a scalar literal's value apart bit for bit (``-0.0``
  from ``0.0``), or None for anything else."""
  t = type(val)
  if isinstance(val, np.ndarray):  # JAX's typed literals first
    return None if val.shape else (t, val.dtype, val.tobytes())
  if t is float:
    return (t, val.hex())
  if t is int or t is bool:
    return (t, val)
  return None


def _plain(params: dict) -> bool:
  for v in params.values():
    if not isinstance(v, _PLAIN):
      return False
  return True


# Primitives whose params name axes, bind them or hold rules.
_SPECIAL = frozenset(
  (*rules.AXIS_PARAMS, *rules.BINDERS, *rules.CALLABLE_PARAMS)
)


def _param_names(eqn: JaxprEqn, subs: list) -> set:
  """Free names an equation's params mention beyond its collective's own
  (those are in the analysis), as ``eqn_mentions`` finds them, given its
  sub-jaxprs ``subs``: names in sub-jaxprs not bound by the equation, and
  in meshes, specs and types."""
  names: set = set()
  bound = analysis.bound_names(eqn) if subs else frozenset()
  for v in eqn.params.values():
    if isinstance(v, _PLAIN):
      continue
    found = analysis.subjaxprs({"v": v}) if subs else ()
    for n in [mentioned_names(s) for s in found] or [deep.names_of(v)]:
      names |= n - bound
  return names


def _holds_jaxpr(v: Any) -> bool:
  t = type(v)
  if t is ClosedJaxpr or t is Jaxpr:
    return True
  if isinstance(v, (tuple, list)):
    return bool(v) and bool(analysis.subjaxprs({None: v}))
  return isinstance(v, (ClosedJaxpr, Jaxpr))


class Renamer:
  """One rename pass; memos keep shared sub-jaxprs and values shared.

  ``wrap_rule(kind, fn, mapping, rule_env)`` renames a rule callable held in
  an equation's params (``custom_vjp``/``custom_jvp``/``custom_vmap``): the
  caller supplies it (``rename.py`` runs rules under the old names), so the
  rewrite does not depend on how a renamed function runs.
  """

  def __init__(self, wrap_rule: Callable, rule_env: Mapping | None = None):
    self.wrap_rule = wrap_rule
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

  def stage(
    self,
    closed: ClosedJaxpr,
    mapping: Mapping,
    trace: Any,
    args: Sequence[Any],
  ) -> tuple[list, frozenset, bool]:
    """Emits ``closed`` renamed into the staging ``trace`` (``jit``,
    ``make_jaxpr``, a ``shard_map`` body) applied to ``args``.

    Returns its outputs, the free names the jaxpr mentions (what
    ``mentioned_names`` computes, found on the way) and whether it holds
    custom rules (``analysis.rule_eqns``).

    One pass: each equation is renamed (types, params, context mesh,
    effects; sub-jaxprs through the memoized rewrite) and emitted directly,
    as JAX inlines a jaxpr, so the function is neither rewritten into a new
    jaxpr first nor evaluated primitive by primitive (abstract evaluation
    ran in the first trace; the renamed types are the result types).

    Most equations (no effects, no param that can hold a name or a jaxpr,
    nothing JAX folds) change only in their types. Where the trace keeps
    every equation (it does not drop dead code as it goes), those go into
    its jaxpr as finished equations over variables, without a tracer per
    value (``jax_internals.eqn_adder``); the others go through JAX's
    staging (``stage_eqn``), with tracers made for their inputs on demand.
    """
    jaxpr = closed.jaxpr
    memo = self.value_memo
    # The names the jaxpr mentions, found on the way: collectives' names
    # from the equations that can have them (not a separate analysis walk).
    names = set(jax_internals.named_axis_effect_names(jaxpr.effects))
    has_rules = False
    avals: dict = {}  # old aval -> renamed
    qdd = False  # whether a renamed aval carries quasi-dynamic data
    literals: dict = {}  # (aval, scalar key) -> renamed Literal
    ctxs: dict = {}  # id(ctx) -> (ctx, renamed ctx)

    def aval_of(a):
      nonlocal qdd
      try:
        return avals[a]
      except KeyError:
        r = avals[a] = deep.rename(a, mapping, memo)
      except TypeError:  # an unhashable aval
        r = deep.rename(a, mapping, memo)
      qdd = qdd or r.has_qdd
      return r

    def literal(x):
      """``x`` (a ``Literal``) renamed; one per scalar value."""
      try:
        aval = avals[x.aval]
      except (KeyError, TypeError):
        aval = aval_of(x.aval)
      if aval is x.aval:
        return x
      val = x.val
      key = _literal_key(val)
      if key is not None:
        key = (x.aval, key)
        hit = literals.get(key)
        if hit is not None:
          return hit
      new = Literal(jax_internals.literal_value_with_aval(val, aval), aval)
      if key is not None:
        literals[key] = new
      return new

    def ctx_of(ctx):
      new_ctx = ctx
      mesh = jax_internals.eqn_context_mesh(ctx)
      if mesh is not None:
        new_mesh = deep.rename(mesh, mapping, memo)
        names.update(deep.names_of(mesh))
        if new_mesh is not mesh:
          new_ctx = jax_internals.eqn_context_with_mesh(ctx, new_mesh)
      ctxs[id(ctx)] = hit = (ctx, new_ctx)
      return hit

    def only_types_change(prim, params):
      """Whether renaming changes nothing but the types of an equation
      without effects (no param can hold a name or a jaxpr), and staging
      it cannot fold it into constants."""
      return (
        prim.name not in _SPECIAL
        and not jax_internals.has_fold_rule(prim)
        and (not params or _plain(params))
      )

    # Each value of the jaxpr: its atom in the trace (a variable or a
    # literal) and, where one exists, its tracer. A value whose variable a
    # tracer keeps bound to a constant is pinned: an equation using it is
    # staged with that tracer, which it keeps alive.
    atoms: dict = {}
    tracers: dict = {}
    pinned: set = set()
    src = jax_internals.current_source_info()

    def take(v, t):
      atoms[v] = t.val
      tracers[v] = t
      if jax_internals.is_constant_tracer(trace, t):
        pinned.add(v)

    def tracer_of(x, where):
      if type(x) is Literal:
        return jax_internals.staged_literal(trace, literal(x), where)
      t = tracers.get(x)
      if t is None:
        t = tracers[x] = jax_internals.var_tracer(trace, atoms[x], where)
      return t

    for v, c in zip(jaxpr.constvars, closed.consts):
      take(v, jax_internals.staged_const(trace, c, src))
    for v, x in zip(jaxpr.invars, args):
      take(v, jax_internals.staged_arg(trace, x, src))
    for v in (*jaxpr.constvars, *jaxpr.invars):
      aval_of(v.aval)

    add_eqn = jax_internals.eqn_adder(trace)
    new_var = jax_internals.new_var(trace)
    stage_eqn = jax_internals.stage_eqn
    # id(params) -> (params, primitive, only_types_change(...)): equations
    # inlined from one cached jaxpr share its params dicts.
    kinds: dict = {}
    stack = src.name_stack
    stacks: dict = {}  # id(eqn name stack) -> (it, under ``stack``)
    has_stack = bool(stack)
    for eqn in jaxpr.eqns:
      where = eqn.source_info
      if has_stack:
        ns = where.name_stack
        hit = stacks.get(id(ns))
        if hit is None:
          hit = stacks[id(ns)] = (ns, stack + ns)
        where = where.replace(name_stack=hit[1])
      ctx = ctxs.get(id(eqn.ctx)) or ctx_of(eqn.ctx)
      prim = eqn.primitive
      params = eqn.params
      effects = eqn.effects
      outvars = eqn.outvars
      kind = kinds.get(id(params))
      if kind is None or kind[1] is not prim:
        kind = (params, prim, only_types_change(prim, params))
        kinds[id(params)] = kind
      if (
        kind[2]
        and not effects
        and add_eqn is not None
        and (
          not pinned
          or not any(v in pinned for v in eqn.invars if type(v) is not Literal)
        )
      ):
        # Most equations: as they are, with the renamed types.
        ins = [
          atoms[v] if type(v) is not Literal else literal(v) for v in eqn.invars
        ]
        if len(outvars) == 1:
          (v,) = outvars
          try:
            a = avals[v.aval]
          except (KeyError, TypeError):
            a = aval_of(v.aval)
          if not qdd:
            atoms[v] = out = new_var(a)
            add_eqn(JaxprEqn(ins, [out], prim, params, effects, where, ctx[1]))
            continue
        else:
          out_avals = [aval_of(v.aval) for v in outvars]
          if not qdd:
            outs = [new_var(a) for a in out_avals]
            add_eqn(JaxprEqn(ins, outs, prim, params, effects, where, ctx[1]))
            atoms.update(zip(outvars, outs))
            continue
      ins = [tracer_of(v, where) for v in eqn.invars]
      out_avals = [aval_of(v.aval) for v in outvars]
      inner = None
      if prim.name in _SPECIAL or (params and not _plain(params)):
        params, _, inner, subs = self._params_and_inner(eqn, mapping)
        names |= _param_names(eqn, subs)
        names |= analysis.eqn_axis_names(eqn)
        has_rules = has_rules or analysis.eqn_has_rules(eqn)
      if effects:
        names |= jax_internals.named_axis_effect_names(effects)
        effects = _rename_effects(effects, mapping)
      if inner:
        callables = rules.CALLABLE_PARAMS.get(prim.name, {})
        param = rules.AXIS_PARAMS.get(prim.name)
        for k, v in eqn.params.items():
          if k != param and k not in callables:
            params[k] = self.param(v, inner)
      staged = eqn.replace(
        params=params, effects=effects, source_info=where, ctx=ctx[1]
      )
      outs = stage_eqn(trace, staged, ins, out_avals, atoms)
      for v, t in zip(outvars, outs):
        take(v, t)
    outs = [tracer_of(v, src) for v in jaxpr.outvars]
    names.update(*(deep.names_of(a) for a in avals))
    return outs, frozenset(names), has_rules

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
          f"{API}: cannot rename axis names {sorted(opaque, key=repr)} of "
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
          f"{API}: renaming {dict(mapping)!r} would capture "
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
          o: (Captured(n, prim, where, shown) if n in bound else n)
          for o, n in inner.items()
        }
    callables = rules.CALLABLE_PARAMS.get(prim)
    if callables and inner:
      for k, kind in callables.items():
        v = params.get(k)
        if v is not None:
          params[k] = self.wrap_rule(kind, v, inner, self.rule_env)
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


@dataclasses.dataclass(frozen=True)
class Captured:
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
      f"{API}: renaming {self.mapping} would capture {self.new!r} inside "
      f"{self.primitive} at {self.where}, which binds it: a custom rule "
      f"(custom_vjp/custom_jvp) under it uses (or failed to trace without) "
      f"{old!r}; pick a new name that the inner {self.primitive} does not "
      "bind"
    )
