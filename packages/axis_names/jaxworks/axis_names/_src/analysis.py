"""Bottom-up axis-name analysis of jaxprs, memoized per jaxpr object.

The names a jaxpr uses are the union over its equations of the names an
equation's own params mention (``rules.AXIS_PARAMS``) and those of every
sub-jaxpr in its params, minus the names the equation binds
(``rules.BINDERS``). Sub-jaxprs are computed first (an explicit post-order
walk: no recursion limit) and each ``Jaxpr``'s result is cached in a table
keyed by identity and held weakly, so a repeated query is one lookup.
"""

from __future__ import annotations

from collections.abc import Hashable
import functools
from typing import Any
import weakref

import jax
from jax.extend.core import ClosedJaxpr
from jax.extend.core import Jaxpr
from jax.extend.core import JaxprEqn

from . import deep
from . import jax_internals
from . import rules

_Traced = jax.stages.Traced
_Lowered = jax.stages.Lowered

_EMPTY: frozenset = frozenset()


class WeakIdentityCache:
  """A dict keyed by object identity that does not keep its keys alive.

  ``Jaxpr`` does not define ``__eq__``/``__hash__`` beyond identity, but a
  plain ``id()``-keyed dict would return stale entries once an id is reused.
  Each entry therefore stores a weak reference to its key; a lookup checks
  that the reference still points at the very object asked about, and the
  reference's callback removes the entry when the key dies.
  """

  __slots__ = ("_entries", "__weakref__")

  def __init__(self):
    self._entries: dict[int, tuple[weakref.ref, Any]] = {}

  def get(self, obj, default=None):
    entry = self._entries.get(id(obj))
    if entry is not None and entry[0]() is obj:
      return entry[1]
    return default

  def put(self, obj, value) -> None:
    key = id(obj)
    ref = weakref.ref(obj, functools.partial(_evict, self._entries, key))
    self._entries[key] = (ref, value)

  def __len__(self) -> int:
    return len(self._entries)

  def clear(self) -> None:
    self._entries.clear()


def _evict(entries: dict, key: int, ref: weakref.ref) -> None:
  # Only drop the entry this reference belongs to: the id may already have
  # been reused by a newer object with its own entry.
  entry = entries.get(key)
  if entry is not None and entry[0] is ref:
    entries.pop(key, None)


# Jaxpr -> frozenset of the axis names it uses.
_NAMES = WeakIdentityCache()


def cache_size() -> int:
  """Number of jaxprs whose names are currently memoized."""
  return len(_NAMES)


def clear_cache() -> None:
  """Forget every memoized result (the next query recomputes)."""
  for cache in (_NAMES, _MANUAL, _NAMED_EQNS, _HIDDEN, _RULE_EQNS, _WALK):
    cache.clear()


def _scan_seq(seq, out: list) -> None:
  for v in seq:
    t = type(v)
    if t is ClosedJaxpr:
      out.append(v.jaxpr)
    elif t is Jaxpr:
      out.append(v)
    elif t is tuple or t is list:
      _scan_seq(v, out)
    elif isinstance(v, ClosedJaxpr):
      out.append(v.jaxpr)
    elif isinstance(v, Jaxpr):
      out.append(v)
    elif isinstance(v, (tuple, list)):  # e.g. NamedTuples of jaxprs
      _scan_seq(v, out)


def subjaxprs(params: dict) -> list[Jaxpr]:
  """Every ``Jaxpr`` in ``params`` values (``ClosedJaxpr`` unwrapped).

  Scans each value, and tuples/lists of values to any depth, so a new
  higher-order primitive is handled without being listed anywhere.
  """
  out: list[Jaxpr] = []
  _scan_seq(params.values(), out)
  return out


def own_names(eqn: JaxprEqn) -> tuple[Hashable, ...]:
  """Names an equation uses itself (not through a sub-jaxpr), in order."""
  param = rules.AXIS_PARAMS.get(eqn.primitive.name)
  if param is not None:
    return rules.names_in_param(eqn.params.get(param))
  return ()


def binder_sizes(eqn: JaxprEqn) -> dict:
  """``{name: size or None}`` of the names ``eqn`` binds (empty for most)."""
  binder = rules.BINDERS.get(eqn.primitive.name)
  return binder(eqn.params) if binder is not None else {}


def bound_names(eqn: JaxprEqn) -> frozenset:
  """Names the equation binds for its sub-jaxprs (empty for most)."""
  binder = rules.BINDERS.get(eqn.primitive.name)
  return frozenset(binder(eqn.params)) if binder is not None else _EMPTY


def eqn_axis_names(eqn: JaxprEqn) -> frozenset:
  """The free axis names of one equation.

  Requires the equation's sub-jaxprs to be analysed already (true inside
  the walk; ``used_axis_names`` of the enclosing jaxpr guarantees it).
  """
  return _eqn_names(eqn, subjaxprs(eqn.params))


def _eqn_names(eqn: JaxprEqn, subs: list) -> frozenset:
  prim = eqn.primitive.name
  params = eqn.params
  param = rules.AXIS_PARAMS.get(prim)
  if not subs:
    if param is not None:
      return frozenset(rules.names_in_param(params.get(param)))
    effects = eqn.effects
    if not effects:
      return _EMPTY
    # A primitive we have no rule for: trust the effects JAX attached.
    return jax_internals.named_axis_effect_names(effects)
  inner: set = set()
  for sub in subs:
    names = _NAMES.get(sub)
    if names is None:
      names = jaxpr_axis_names(sub)
    inner |= names
  binder = rules.BINDERS.get(prim)
  if binder is not None and inner:
    inner.difference_update(binder(params))
  if param is not None:
    inner.update(rules.names_in_param(params.get(param)))
  return frozenset(inner)


# Jaxprs whose types may mention manual axes (traced inside a shard_map):
# _LOCAL for a jaxpr traced under manual axes itself, _BELOW for one that
# only contains such a sub-jaxpr. Absent for all others, so plain programs
# pay nothing.
_MANUAL = WeakIdentityCache()
_LOCAL, _BELOW = 2, 1


def has_manual_types(jaxpr: Jaxpr) -> bool:
  """Whether ``jaxpr`` or a sub-jaxpr was traced under manual mesh axes.

  Only such jaxprs can mention axis names in types, meshes or shardings;
  for all others the names used by collectives are all there is.
  """
  jaxpr_axis_names(jaxpr)
  return _MANUAL.get(jaxpr, 0) > 0


def has_local_manual_types(jaxpr: Jaxpr) -> bool:
  """Whether ``jaxpr``'s own equations or binders have manual types."""
  jaxpr_axis_names(jaxpr)
  return _MANUAL.get(jaxpr, 0) == _LOCAL


# Jaxpr -> ((index, names), ...) of its equations that use any axis name;
# present only for jaxprs that use some. Lets a rename visit just those.
_NAMED_EQNS = WeakIdentityCache()


def named_eqns(jaxpr: Jaxpr) -> tuple[tuple[int, frozenset], ...]:
  """``(index, free names)`` of each equation of ``jaxpr`` that uses names."""
  jaxpr_axis_names(jaxpr)
  return _NAMED_EQNS.get(jaxpr, ())


# Jaxprs that contain, at any depth, a binder whose body uses axis names
# (which are then hidden from the outside): present only for those.
_HIDDEN = WeakIdentityCache()


def uses_axes_anywhere(jaxpr: Jaxpr) -> bool:
  """Whether any equation at any depth uses an axis name, bound or free.

  ``jit(shard_map(psum over 'x'))`` uses no free name but still runs a
  collective; walks that look for collectives descend where this is true.
  """
  return bool(jaxpr_axis_names(jaxpr)) or _HIDDEN.get(jaxpr, False)


# Jaxpr -> indices of its equations holding rule callables (a custom_vjp's
# rules, ``rules.CALLABLE_PARAMS``) directly or at any depth below; present
# only for jaxprs that have some. The names such rules use are unknown until
# they run, so a rename must reach them even where no name is visible.
_RULE_EQNS = WeakIdentityCache()


def rule_eqns(jaxpr: Jaxpr) -> tuple[int, ...]:
  """Indices of equations of ``jaxpr`` with rule callables at any depth."""
  jaxpr_axis_names(jaxpr)
  return _RULE_EQNS.get(jaxpr, ())


def eqn_has_rules(eqn: JaxprEqn) -> bool:
  """Whether ``eqn`` or a sub-jaxpr of it holds rule callables."""
  return eqn.primitive.name in rules.CALLABLE_PARAMS or any(
    rule_eqns(s) for s in subjaxprs(eqn.params)
  )


# Jaxpr -> the equations a walk for axis names visits (``walk_entries``).
_WALK = WeakIdentityCache()


def walk_entries(jaxpr: Jaxpr) -> tuple:
  """What a top-down walk needs of each equation of ``jaxpr`` that uses an
  axis name, or holds a sub-jaxpr that uses one at any depth, in order.

  Each entry is ``(eqn, names, own, subs, sizes, length)``: the names to
  check (``own_names``, or for a primitive without a rule the names its
  effects carry), ``own_names(eqn)``, the sub-jaxprs to descend into, the
  ``binder_sizes`` it adds for them and their static trip count (a
  ``scan``'s length, else 1). Memoized per jaxpr object, held weakly, so a
  shared sub-jaxpr, and every later walk of it, costs one lookup.
  """
  hit = _WALK.get(jaxpr)
  if hit is None:
    jaxpr_axis_names(jaxpr)  # the sub-jaxprs' names, memoized
    hit = _summarize(jaxpr)
    _WALK.put(jaxpr, hit)
  return hit


def _summarize(jaxpr: Jaxpr) -> tuple:
  """``walk_entries`` of ``jaxpr``, computed (its sub-jaxprs analysed)."""
  out: list[tuple] = []
  for eqn in jaxpr.eqns:
    subs = subjaxprs(eqn.params)
    own = own_names(eqn)
    if not subs:
      if own:
        out.append((eqn, own, own, (), {}, 1))
      elif eqn.effects and eqn.primitive.name not in rules.AXIS_PARAMS:
        # A primitive without a rule: its effects name the axes it uses.
        names = jax_internals.named_axis_effect_names(eqn.effects)
        if names:
          out.append((eqn, tuple(sorted(names, key=repr)), own, (), {}, 1))
      continue
    # Descend even where a binder hides every name from the outside.
    used = tuple(s for s in subs if uses_axes_anywhere(s))
    if not used and not own:
      continue
    length = eqn.params.get("length")
    if eqn.primitive.name != "scan" or not isinstance(length, int):
      length = 1  # a while body counts once
    out.append((eqn, own, own, used, binder_sizes(eqn), length))
  return tuple(out)


def _compute(jaxpr: Jaxpr) -> frozenset:
  names: set = set()
  named: list = []
  with_rules: list = []
  local = below = hidden = False
  last_ctx = None
  for i, eqn in enumerate(jaxpr.eqns):
    subs = subjaxprs(eqn.params)
    n = _eqn_names(eqn, subs)
    if n:
      names |= n
      named.append((i, n))
    if eqn.primitive.name in rules.CALLABLE_PARAMS or (
      subs and any(_RULE_EQNS.get(s) for s in subs)
    ):
      with_rules.append(i)
    if subs and not hidden:
      hidden = any(_HIDDEN.get(s, False) for s in subs) or (
        eqn.primitive.name in rules.BINDERS and any(_NAMES.get(s) for s in subs)
      )
    if not local:
      ctx = eqn.ctx
      if ctx is not last_ctx:  # contexts are interned: usually one per jaxpr
        last_ctx = ctx
        mesh = jax_internals.eqn_context_mesh(ctx)
        local = mesh is not None and bool(deep.names_of(mesh))
    if subs and not below:
      below = any(_MANUAL.get(s, 0) for s in subs)
  if not local:
    # A jaxpr without equations (an identity branch) still has typed binders.
    local = any(
      deep.names_of(v.aval)
      for v in (*jaxpr.constvars, *jaxpr.invars, *jaxpr.outvars)
    )
  if local or below:
    _MANUAL.put(jaxpr, _LOCAL if local else _BELOW)
  if named:
    _NAMED_EQNS.put(jaxpr, tuple(named))
  if hidden:
    _HIDDEN.put(jaxpr, True)
  if with_rules:
    _RULE_EQNS.put(jaxpr, tuple(with_rules))
  result = frozenset(names) if names else _EMPTY
  _NAMES.put(jaxpr, result)
  return result


def jaxpr_axis_names(jaxpr: Jaxpr) -> frozenset:
  """Free axis names of a core ``Jaxpr``, memoized per object."""
  hit = _NAMES.get(jaxpr)
  if hit is not None:
    return hit
  # Iterative post-order walk: a jaxpr is computed after all its sub-jaxprs.
  # A node may be pushed more than once; it is expanded once (``expanded``)
  # and the copy pushed last is expanded first, before its parent finishes.
  expanded: set[int] = set()
  stack: list[tuple[Jaxpr, bool]] = [(jaxpr, False)]
  keep_alive: list[Jaxpr] = []  # ids in ``expanded`` must not be reused
  while stack:
    j, children_done = stack.pop()
    if children_done:
      if _NAMES.get(j) is None:
        _compute(j)
      continue
    if id(j) in expanded or _NAMES.get(j) is not None:
      continue
    expanded.add(id(j))
    keep_alive.append(j)
    stack.append((j, True))
    for eqn in j.eqns:
      for sub in subjaxprs(eqn.params):
        if _NAMES.get(sub) is None:
          stack.append((sub, False))
  return _NAMES.get(jaxpr)


def stage_jaxpr(x: Any, api: str) -> Any:
  """The ``ClosedJaxpr`` of a stage (``x`` itself for anything else).

  A ``jax.stages.Traced`` (stock or jaxworks', from ``jit_cache.jit(f)``,
  ``stages_aot.trace`` or ``pmap_chunked.pmap(f)``) and jaxworks' ``Lowered``
  carry their jaxpr; a stock ``jax.stages.Lowered`` does not.
  """
  if isinstance(x, _Traced):
    return x.jaxpr
  if isinstance(x, _Lowered):
    jaxpr = getattr(x, "jaxpr", None)
    if not isinstance(jaxpr, ClosedJaxpr):
      raise TypeError(
        f"{api}: a stock jax.stages.Lowered carries no jaxpr; pass the "
        "Traced it came from (jax.jit(f).trace(...)), or jaxworks' Lowered "
        "(jaxworks.jit_cache.jit(f).lower(...)), which keeps it"
      )
    return jaxpr
  return x


def closed_or_open_names(
  x, api: str = "jaxworks.axis_names"
) -> frozenset | None:
  """Names for a ``ClosedJaxpr``/``Jaxpr`` or a stage; None for anything else."""
  x = stage_jaxpr(x, api)
  if isinstance(x, ClosedJaxpr):
    j = x.jaxpr
  elif isinstance(x, Jaxpr):
    j = x
  else:
    return None
  hit = _NAMES.get(j)
  return hit if hit is not None else jaxpr_axis_names(j)
