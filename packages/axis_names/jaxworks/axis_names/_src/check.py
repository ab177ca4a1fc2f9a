"""check_axis_names: unbound or mismatched axis names, reported with file:line.

The walk is top-down with an environment ``{name: size}``: the caller's
``axis_sizes`` at the top, extended by each binder (``shard_map`` adds its
newly manual mesh axes with their mesh sizes). Sub-jaxprs whose (memoized)
free names are empty are skipped, so the walk only visits the parts of the
program that use axis names.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn

from . import analysis
from . import jax_internals
from . import tracing
from .errors import AxisNameError

_API = "jaxworks.axis_names.check_axis_names"


def location(eqn: JaxprEqn) -> str | None:
  """``file:line (function)`` of the user code that created ``eqn``."""
  loc = jax_internals.user_location(eqn.source_info)
  if loc is None:
    return None
  file_name, line, fn = loc
  return f"{file_name}:{line} ({fn})"


def binder_sizes(eqn: JaxprEqn) -> dict[Hashable, int]:
  """``{name: size}`` for the names ``eqn`` binds in its sub-jaxprs."""
  bound = analysis.bound_names(eqn)
  if not bound:
    return {}
  params = eqn.params
  mesh = params.get("mesh")
  if mesh is not None:
    shape = dict(mesh.shape)
    return {n: shape[n] for n in bound if n in shape}
  size = params.get("axis_size")
  if isinstance(size, int):
    return {n: size for n in bound}
  return {n: None for n in bound}


def walk(jaxpr: Jaxpr, env: Mapping[Hashable, int | None], multiplier: int = 1
         ) -> Iterator[tuple[JaxprEqn, dict, int]]:
  """Yields ``(eqn, env, multiplier)`` for every equation that uses a name.

  ``env`` is the axis environment at the equation; ``multiplier`` is how
  many times it runs per call of the top jaxpr as far as static trip counts
  say (``scan`` lengths; a ``while`` body counts once).
  """
  analysis.jaxpr_axis_names(jaxpr)  # memoize every sub-jaxpr first
  stack = [(jaxpr, dict(env), multiplier)]
  while stack:
    j, e, mult = stack.pop()
    for eqn in j.eqns:
      subs = analysis.subjaxprs(eqn.params)
      if not subs:
        if analysis.eqn_axis_names(eqn):
          yield eqn, e, mult
        continue
      # Descend even where a binder hides every name from the outside.
      used_subs = [s for s in subs if analysis.jaxpr_axis_names(s)]
      if not used_subs and not analysis.own_names(eqn):
        continue
      yield eqn, e, mult
      inner_env = {**e, **binder_sizes(eqn)}
      length = eqn.params.get("length")
      inner_mult = mult * length if (eqn.primitive.name == "scan" and
                                     isinstance(length, int)) else mult
      for sub in reversed(used_subs):
        stack.append((sub, inner_env, inner_mult))


def _size_problems(eqn: JaxprEqn, names: tuple, env: Mapping) -> list[str]:
  """Size mismatches JAX does not catch at trace time."""
  sizes = [env.get(n) for n in names]
  if any(s is None for s in sizes):
    return []
  total = 1
  for s in sizes:
    total *= s
  out = []
  perm = eqn.params.get("perm")
  if perm is not None:
    bad = sorted({i for pair in perm for i in pair if not 0 <= i < total})
    if bad:
      out.append(f"perm {tuple(perm)} has indices {bad} outside the axis of "
                 f"size {total}")
  groups = eqn.params.get("axis_index_groups")
  if groups is not None:
    flat = sorted(i for g in groups for i in g)
    if flat != list(range(total)):
      out.append(f"axis_index_groups {tuple(map(tuple, groups))} do not "
                 f"partition range({total}) (the axis size)")
    elif len({len(g) for g in groups}) > 1:
      out.append(f"axis_index_groups {tuple(map(tuple, groups))} have "
                 "unequal sizes")
  return out


def _describe(name: Hashable, bound: tuple) -> str:
  hint = ""
  strs = [b for b in bound if isinstance(b, str)]
  if isinstance(name, str) and strs:
    close = difflib.get_close_matches(name, strs, n=1)
    if close:
      hint = f" (did you mean {close[0]!r}?)"
  return hint


def problems_in(jaxpr: Jaxpr, env: Mapping[Hashable, int | None]
                ) -> list[tuple[str, Hashable, tuple, str | None, str]]:
  """Every unbound or size-mismatched use of an axis name in ``jaxpr``."""
  problems = []
  for eqn, e, _ in walk(jaxpr, env):
    names = analysis.own_names(eqn)
    if not names and not analysis.subjaxprs(eqn.params):
      # Primitive without a rule: its effects name the axes it uses.
      names = tuple(sorted(analysis.eqn_axis_names(eqn), key=repr))
    if not names:
      continue
    bound = tuple(e)
    prim = eqn.primitive.name
    for n in names:
      if n not in e:
        problems.append((prim, n, bound, location(eqn),
                         f"unbound{_describe(n, bound)}"))
    if all(n in e for n in names):
      for detail in _size_problems(eqn, names, e):
        problems.append((prim, names[0] if len(names) == 1 else names, bound,
                         location(eqn), detail))
  return problems


def format_problem(prim, name, bound, loc, detail) -> str:
  where = loc or "an unknown location"
  if detail.startswith("unbound"):
    return (f"{prim} uses axis name {name!r} at {where}, but it is not bound "
            f"there{detail[len('unbound'):]}; bound axis names: {bound}")
  return (f"{prim} over axis name {name!r} at {where}: {detail}; bound axis "
          f"names: {bound}")


def raise_problems(problems, api: str) -> None:
  prim, name, bound, loc, detail = problems[0]
  lines = [format_problem(*p) for p in problems]
  if any(p[4].startswith("unbound") for p in problems):
    fix = ("Fix: bind the name (call the function under jax.shard_map or "
           "jax.pmap with that axis name, or pass axis_sizes={name: size}), "
           "or use one of the bound names (jaxworks.axis_names.rename_axes "
           "renames the axes of existing code).")
  else:
    fix = ("Fix: make the collective's permutation or axis_index_groups fit "
           "the axis size, or pass the intended size in axis_sizes.")
  if len(lines) == 1:
    msg = f"{api}: {lines[0]}. {fix}"
  else:
    msg = (f"{api}: {len(lines)} problems with axis names:\n  - "
           + "\n  - ".join(lines) + f"\n{fix}")
  raise AxisNameError(msg, primitive=prim, axis_name=name, bound=bound,
                      location=loc, problems=problems)


def check_axis_names(fun: Callable | ClosedJaxpr | Jaxpr, *args: Any,
                     axis_sizes: Mapping[Hashable, int] | None = None,
                     **kwargs: Any) -> frozenset:
  """Checks that every axis name ``fun`` uses is bound, with a consistent size.

  ``fun`` is traced with ``args``/``kwargs`` and the names in ``axis_sizes``
  bound (as a ``shard_map`` or ``pmap`` over those names would). Any other
  free axis name is an error, as is a collective whose params disagree with
  the axis size (a ``ppermute`` permutation or ``axis_index_groups`` outside
  ``range(size)``). Names bound inside ``fun`` (by a ``shard_map``) are
  checked against their mesh sizes.

  Args:
    fun: a function (traced with ``jax.make_jaxpr``), or a Jaxpr/ClosedJaxpr.
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
    axis_sizes: ``{axis_name: size}`` of the names the caller will bind.
    **kwargs: keyword arguments for ``fun``.

  Returns:
    The free axis names ``fun`` uses (all of them keys of ``axis_sizes``).

  Raises:
    AxisNameError: (a ``NameError``) naming the primitive, the axis name,
      the bound names and the user's ``file:line``; ``.problems`` lists all.

  >>> import jax, jax.numpy as jnp
  >>> def f(x):
  ...   return jax.lax.psum(x, 'batch')
  >>> sorted(check_axis_names(f, jnp.ones(3), axis_sizes={'batch': 4}))
  ['batch']
  >>> try:
  ...   check_axis_names(f, jnp.ones(3), axis_sizes={'batc': 4})
  ... except NameError as e:
  ...   print(e.primitive, e.axis_name, e.bound)
  psum batch ('batc',)
  """
  sizes = tracing.check_axis_sizes(axis_sizes, _API)
  if isinstance(fun, (ClosedJaxpr, Jaxpr)):
    if args or kwargs:
      raise TypeError(
          f"{_API}: got a {type(fun).__name__} plus example arguments; those "
          "are only for a callable. Pass the jaxpr alone.")
    jaxpr = fun.jaxpr if isinstance(fun, ClosedJaxpr) else fun
  else:
    try:
      closed, _ = tracing.trace(fun, args, kwargs, sizes, _API)
    except NameError as e:
      if isinstance(e, AxisNameError):
        raise
      loc = tracing.user_location_of_exception(e)
      raise AxisNameError(
          f"{_API}: {e} (at {loc or 'an unknown location'}); bound axis names:"
          f" {tuple(sizes)}. Pass the name in axis_sizes or bind it with "
          "jax.shard_map.", primitive="unknown", axis_name=None,
          bound=tuple(sizes), location=loc) from e
    jaxpr = closed.jaxpr
  problems = problems_in(jaxpr, sizes)
  if problems:
    raise_problems(problems, _API)
  return analysis.jaxpr_axis_names(jaxpr)
