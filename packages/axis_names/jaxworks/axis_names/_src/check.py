"""check_axis_names: unbound or mismatched axis names, reported with file:line.

The walk is top-down with an environment ``{name: size}``: the caller's
``axis_sizes`` at the top, extended by each binder (``shard_map`` adds its
newly manual mesh axes with their mesh sizes). Sub-jaxprs that use no axis
name at any depth (memoized by ``analysis``) are skipped, so the walk only
visits the parts of the program that use axis names; sizes are checked
where each name is used.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Iterator
from collections.abc import Mapping
import difflib
import math
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr
from jax.extend.core import Jaxpr
from jax.extend.core import JaxprEqn

from . import analysis
from . import jax_internals
from . import tracing
from .errors import AxisNameError

_API = "jaxworks.axis_names.check_axis_names"


def written(eqn: JaxprEqn) -> str:
  """The collective as the user wrote it (``pmean``; its equation is a
  ``psum``), or the primitive's name."""
  name = jax_internals.user_call(eqn.source_info) or ""
  if name != eqn.primitive.name and callable(getattr(jax.lax, name, None)):
    return name
  return eqn.primitive.name


def location(eqn: JaxprEqn) -> str | None:
  """``file:line (function)`` of the user code that created ``eqn``."""
  loc = jax_internals.user_location(eqn.source_info)
  return None if loc is None else "{}:{} ({})".format(*loc)


def walk(
  jaxpr: Jaxpr, env: Mapping[Hashable, int | None], multiplier: int = 1
) -> Iterator[tuple[JaxprEqn, dict, int]]:
  """Yields ``(eqn, env, multiplier)`` for every equation that uses a name.

  ``env`` is the axis environment at the equation; ``multiplier`` is how
  many times it runs per call of the top jaxpr as far as static trip counts
  say (``scan`` lengths; a ``while`` body counts once), summed over every
  place the jaxpr holding it occurs. Each jaxpr is visited once per axis
  environment it occurs under, however often it is shared (a jitted
  function called twice at every level of a nest), parents before children
  and in program order.
  """
  for e, entries, mult in walk_nodes(jaxpr, env, multiplier):
    for entry in entries:
      yield entry[0], e, mult


def walk_nodes(
  jaxpr: Jaxpr, env: Mapping[Hashable, int | None], multiplier: int = 1
) -> list[tuple[dict, tuple, int]]:
  """``walk`` by jaxpr: ``(env, analysis.walk_entries(j), multiplier)`` for
  each distinct (jaxpr ``j``, axis environment), parents before children."""
  nodes = _visits(jaxpr, dict(env))
  mults = {next(iter(nodes)): multiplier}
  out = []
  for key, (e, entries, children) in nodes.items():
    mult = mults[key]
    for child, length in children:
      mults[child] = mults.get(child, 0) + mult * length
    out.append((e, entries, mult))
  return out


def _visits(jaxpr: Jaxpr, env: dict) -> dict:
  """``{(id(jaxpr), env items): (env, entries, children)}`` of every
  distinct (jaxpr, environment) under ``jaxpr``, parents before children.

  ``entries`` are ``analysis.walk_entries`` of the jaxpr (its equations that
  use a name or hold a sub-jaxpr that does; memoized per jaxpr, so a shared
  or already walked jaxpr costs a lookup), ``children`` the
  ``(key, trip count)`` of each use of a sub-jaxpr. An explicit depth-first
  walk (no recursion limit); the reversed post-order is a topological order
  of the DAG.
  """
  root = (id(jaxpr), tuple(env.items()))
  found: dict = {}
  post: list = []
  stack: list = [(root, jaxpr, env, False)]
  entries_of = analysis.walk_entries
  while stack:
    key, j, e, done = stack.pop()
    if done:
      post.append(key)
      continue
    if key in found:
      continue
    entries = entries_of(j)
    children: list = []
    found[key] = (e, entries, children)
    stack.append((key, j, e, True))
    for _, _, _, subs, sizes, length in entries:
      if not subs:
        continue
      if sizes:
        inner_env = {**e, **sizes}
        inner_items = tuple(inner_env.items())
      else:
        inner_env, inner_items = e, key[1]
      for s in subs:
        child = (id(s), inner_items)
        children.append((child, length))
        if child not in found:
          stack.append((child, s, inner_env, False))
  # The jaxprs are alive (held by ``jaxpr``) while ``found`` is used.
  return {key: found[key] for key in reversed(post)}


# The param naming the operand dimension a collective splits over the axis.
_SPLIT_PARAMS = {
  "all_to_all": "split_axis",
  "reduce_scatter": "scatter_dimension",
}


def _size_problems(
  eqn: JaxprEqn, names: tuple, env: Mapping, traced_sizes: bool = True
) -> list[str]:
  """Params and operand shapes of ``eqn`` that do not fit the axis size.

  ``traced_sizes``: whether ``eqn`` was traced with the sizes in ``env``
  (then a recorded ``axis_size`` param must equal them).
  """
  sizes = [env.get(n) for n in names]
  if any(s is None for s in sizes):
    return []
  total = math.prod(s or 1 for s in sizes)
  out = []
  params, prim = eqn.params, eqn.primitive.name
  perm = params.get("perm")
  if perm is not None:
    bad = sorted({i for pair in perm for i in pair if not 0 <= i < total})
    if bad:
      out.append(
        f"perm {tuple(perm)} has indices {bad} outside the axis of size {total}"
      )
  source = params.get("source")
  if (
    prim in ("pbroadcast", "pbroadcast_start")
    and isinstance(source, int)
    and not 0 <= source < total
  ):
    out.append(f"source {source} is outside the axis of size {total}")
  groups = params.get("axis_index_groups")
  n = total  # the number of devices the collective runs over
  if groups is not None:
    n = len(groups[0]) if groups else total
    shown = tuple(map(tuple, groups))
    if sorted(i for g in groups for i in g) != list(range(total)):
      out.append(
        f"axis_index_groups {shown} do not partition range({total}) (the "
        "axis size)"
      )
    elif len({len(g) for g in groups}) > 1:
      out.append(f"axis_index_groups {shown} have unequal sizes")
  recorded = params.get("axis_size")
  if traced_sizes and isinstance(recorded, int) and recorded != n:
    out.append(
      f"it was traced for an axis of size {recorded}, but the axis "
      f"has size {n} here"
    )
  # Operand dimensions JAX splits over the axis (it checks them only while
  # tracing, with the sizes it was traced with).
  what = _SPLIT_PARAMS.get(prim.removesuffix("_start"))
  dim = params.get(what) if what else None
  shape = getattr(eqn.invars[0].aval, "shape", None) if eqn.invars else None
  if shape is not None and isinstance(dim, int) and 0 <= dim < len(shape):
    size = shape[dim]
    tiled = params.get("tiled", True) or prim.startswith("all_to_all")
    if tiled and size % n:
      out.append(
        f"operand dimension {what}={dim} has size {size}, not "
        f"divisible by the axis size {n}"
      )
    elif not tiled and size != n:
      out.append(
        f"operand dimension {what}={dim} has size {size}, but an "
        f"untiled {prim} needs it equal to the axis size {n}"
      )
  return out


def _unbound(name: Hashable, bound: tuple) -> str:
  """The detail of an unbound ``name``, with a "did you mean" hint."""
  strs = [b for b in bound if isinstance(b, str)]
  close = (
    difflib.get_close_matches(name, strs, n=1) if isinstance(name, str) else []
  )
  return f"unbound (did you mean {close[0]!r}?)" if close else "unbound"


def problems_in(
  jaxpr: Jaxpr,
  env: Mapping[Hashable, int | None],
  traced_sizes: bool = True,
  nodes: list | None = None,
) -> list[tuple[str, Hashable, tuple, str | None, str]]:
  """Every unbound or size-mismatched use of an axis name in ``jaxpr``.

  ``traced_sizes``: whether ``jaxpr`` was traced with the sizes in ``env``
  (False for a retrace with placeholder sizes). ``nodes``:
  ``walk_nodes(jaxpr, env)``, when the caller has it already.
  """
  problems = []
  if nodes is None:
    nodes = walk_nodes(jaxpr, env)
  for e, entries, _ in nodes:
    bound = None
    for eqn, names, _, _, _, _ in entries:
      if not names:
        continue
      if bound is None:
        bound = tuple(e)
      details = [(n, _unbound(n, bound)) for n in names if n not in e]
      if not details:
        name = names[0] if len(names) == 1 else names
        sized = _size_problems(eqn, names, e, traced_sizes)
        details = [(name, d) for d in sized]
      if details:
        prim, loc = written(eqn), location(eqn)
        problems += [(prim, n, bound, loc, d) for n, d in details]
  return problems


def format_problem(prim, name, bound, loc, detail) -> str:
  """One problem of ``problems_in`` as a sentence."""
  where = loc or "an unknown location"
  if detail.startswith("unbound"):
    return (
      f"{prim} uses axis name {name!r} at {where}, but it is not bound "
      f"there{detail[len('unbound') :]}; bound axis names: {bound}"
    )
  return (
    f"{prim} over axis name {name!r} at {where}: {detail}; bound axis "
    f"names: {bound}"
  )


def placeholder_problems(
  placeholders: Mapping[Hashable, NameError], sizes: Mapping
) -> list[tuple[str, Hashable, tuple, str | None, str]]:
  """The unbound names tracing bound with a placeholder size, as problems.

  Each is a name JAX raised ``NameError`` for. Some leave no equation behind
  (``lax.axis_size``, ``psum`` of a constant, which JAX computes from the
  placeholder size), so they are reported from the error itself: the user's
  line and the function called there, and the names bound at that point.
  """
  out = []
  for name, err in placeholders.items():
    loc, called = tracing.user_call_of_exception(err)
    prim = called if callable(getattr(jax.lax, called or "", None)) else None
    bound = jax_internals.axis_names_at_error(err)
    if bound is None:
      bound = tuple(sizes)
    bound = tuple(b for b in bound if b not in placeholders)
    out.append(
      (prim or "a collective", name, bound, loc, _unbound(name, bound))
    )
  return out


def traced_jaxpr(
  fun, args: tuple, kwargs: dict, sizes: Mapping, api: str, fix: str
) -> tuple[Jaxpr, list]:
  """The jaxpr of ``fun`` and the unbound names only tracing saw.

  Returns the jaxpr (traced with placeholder sizes for unbound names) and
  ``placeholder_problems`` of those names. When a retry with placeholders
  fails (a placeholder size that does not fit a shape), the unbound names
  found before are raised as an ``AxisNameError``: JAX raised for them.
  """
  found: dict[Hashable, NameError] = {}
  try:
    jaxpr = tracing.jaxpr_of(fun, args, kwargs, sizes, api, fix, found)
  except Exception as e:
    if found and not isinstance(e, AxisNameError):
      found = _with_jax_frames(found, fun, args, kwargs, sizes, api)
      raise problems_error(placeholder_problems(found, sizes), api) from e
    raise
  found = _with_jax_frames(found, fun, args, kwargs, sizes, api)
  return jaxpr, placeholder_problems(found, sizes)


def _with_jax_frames(found, fun, args, kwargs, sizes, api) -> dict:
  """``found`` with each error raised again with JAX's frames kept.

  JAX drops its own frames from tracebacks (and with them the axis
  environment and the function the user called); only on this error path
  is each unbound name traced again, with the names found before it bound
  as they were.
  """
  out: dict[Hashable, NameError] = {}
  env = dict(sizes)
  for name, err in found.items():
    if jax_internals.axis_names_at_error(err) is None:
      try:
        with jax_internals.traceback_filtering_off():
          tracing.trace(fun, args, kwargs, env, api, use_placeholders=False)
      except NameError as again:
        if jax_internals.unbound_axis_name(again) == name:
          err = again
      except Exception:  # noqa: BLE001 - keep the error as first raised
        pass
    out[name] = err
    env[name] = tracing.PLACEHOLDER_SIZE
  return out


def all_problems(
  jaxpr: Jaxpr, sizes: Mapping, from_tracing: list, nodes: list | None = None
) -> list:
  """``problems_in(jaxpr, sizes)`` plus the unbound names of
  ``from_tracing`` not already reported at the same line."""
  problems = problems_in(jaxpr, sizes, nodes=nodes)

  def line(p):  # file:line (the function names differ in qualification)
    return p[1], p[3] and p[3].split(" (")[0]

  seen = {line(p) for p in problems}
  return problems + [p for p in from_tracing if line(p) not in seen]


def problems_error(problems, api: str) -> AxisNameError:
  """The AxisNameError listing ``problems``, each once."""
  problems = list(dict.fromkeys(problems))
  prim, name, bound, loc, _ = problems[0]
  lines = [format_problem(*p) for p in problems]
  if any(p[4].startswith("unbound") for p in problems):
    fix = (
      "Fix: bind the name (call the function under jax.shard_map or "
      "jax.pmap with that axis name, or pass axis_sizes={name: size}), "
      "or use one of the bound names (jaxworks.axis_names.rename_axes "
      "renames the axes of existing code)."
    )
  else:
    fix = (
      "Fix: make the collective's perm, source, axis_index_groups or "
      "operand shape fit the axis size, or pass the intended size in "
      "axis_sizes."
    )
  if len(lines) == 1:
    msg = f"{api}: {lines[0]}. {fix}"
  else:
    listed = "\n  - ".join(lines)
    msg = f"{api}: {len(lines)} problems with axis names:\n  - {listed}\n{fix}"
  return AxisNameError(
    msg,
    primitive=prim,
    axis_name=name,
    bound=bound,
    location=loc,
    problems=problems,
  )


def _raise_if_sizes_misfit(fun, args, kwargs, sizes, err) -> None:
  """Explains a trace failure that only the given axis sizes cause.

  JAX checks shapes against axis sizes while tracing (``psum_scatter``,
  ``all_to_all``) and raises a plain ``ValueError``. If ``fun`` traces with
  every axis of size 1, the sizes are the cause: the collective in that trace
  is reported like any other mismatch. Returns when they are not the cause.
  """
  if not sizes:
    return
  try:
    closed, _ = tracing.trace(fun, args, kwargs, dict.fromkeys(sizes, 1), _API)
  except Exception:  # noqa: BLE001 - fails anyway: not about axis sizes
    return
  problems = problems_in(closed.jaxpr, sizes, traced_sizes=False)
  if problems:
    raise problems_error(problems, _API) from err
  loc = tracing.user_location_of_exception(err)
  raise AxisNameError(
    f"{_API}: tracing with axis_sizes={sizes!r} failed at "
    f"{loc or 'an unknown location'} ({type(err).__name__}: {err}), but "
    "succeeds with every axis of size 1: a shape does not fit an axis "
    "size. Fix the shapes or pass the intended sizes in axis_sizes.",
    primitive="unknown",
    axis_name=None,
    bound=tuple(sizes),
    location=loc,
  ) from err


def check_axis_names(
  fun: Callable | ClosedJaxpr | Jaxpr,
  *args: Any,
  axis_sizes: Mapping[Hashable, int] | None = None,
  **kwargs: Any,
) -> frozenset:
  """Checks that every axis name ``fun`` uses is bound, with a consistent size.

  ``fun`` is traced with ``args``/``kwargs`` and the names in ``axis_sizes``
  bound (as a ``shard_map`` or ``pmap`` over those names would). Any other
  free axis name is an error, as is a collective whose params or operand
  disagree with the axis size (a ``ppermute`` permutation, ``pbroadcast``
  source or ``axis_index_groups`` outside ``range(size)``, an ``all_to_all``
  or ``psum_scatter`` dimension the size does not divide, a jaxpr traced for
  another size). Names bound inside ``fun`` (by ``shard_map``, ``pmap`` or
  a Pallas grid) are checked against their own sizes, also under ``jit``.

  Args:
    fun: a function (traced with ``jax.make_jaxpr``), or a Jaxpr/ClosedJaxpr.
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
    axis_sizes: ``{axis_name: size}`` of the names the caller will bind.
    **kwargs: keyword arguments for ``fun``.

  Returns:
    The free axis names ``fun`` uses (all of them keys of ``axis_sizes``).

  Raises:
    AxisNameError: naming the collective as written (``pmean``), the axis
      name, the bound names, the user's ``file:line`` and the fix, with a
      "did you mean" hint; ``.problems`` lists every problem once. Also for
      JAX's bare ``ValueError`` or ``AssertionError`` (inside a
      ``shard_map``) when the sizes or names cause it.

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
  try:
    jaxpr, from_tracing = traced_jaxpr(
      fun,
      args,
      kwargs,
      sizes,
      _API,
      f"bound axis names: {tuple(sizes)}. Pass the name in axis_sizes or "
      "bind it with jax.shard_map.",
    )
  except AxisNameError:
    raise
  except Exception as e:  # noqa: BLE001 - re-raised unless sizes explain it
    raise_if_unbound(e, fun, args, kwargs, sizes, _API)
    if not isinstance(fun, (ClosedJaxpr, Jaxpr)):
      _raise_if_sizes_misfit(fun, args, kwargs, sizes, e)
    raise
  problems = all_problems(jaxpr, sizes, from_tracing)
  if problems:
    raise problems_error(problems, _API) from None
  return analysis.jaxpr_axis_names(jaxpr)


def raise_if_unbound(err, fun, args, kwargs, sizes, api: str) -> None:
  """Raises the ``AxisNameError`` for a trace failure ``err`` that an
  unbound name caused (JAX's bare ``AssertionError`` inside a
  ``shard_map``); returns for any other failure."""
  found = diagnose(err, api=api) or _diagnose_again(
    err, fun, args, kwargs, sizes, api
  )
  if found is not None:
    raise found from err


def _diagnose_again(err, fun, args, kwargs, sizes, api) -> AxisNameError | None:
  """``diagnose`` of a stock ``AssertionError`` whose traceback JAX filtered:
  the function is traced again with the frames kept."""
  if not isinstance(err, AssertionError) or not callable(fun):
    return None
  try:
    with jax_internals.traceback_filtering_off():
      tracing.trace(fun, args, kwargs, sizes, api)
  except AssertionError as again:
    return diagnose(again, api=api)
  except Exception:  # noqa: BLE001 - another failure: not diagnosable
    pass
  return None


def diagnose(
  err: BaseException,
  fun: Callable | None = None,
  *args: Any,
  api: str = "jaxworks.axis_names.diagnose",
  **kwargs: Any,
) -> AxisNameError | None:
  """The diagnostic for an error JAX raised for an unbound axis name.

  For entry points that trace user code (``jaxworks.jit_cache.jit``): JAX
  raises a ``NameError`` for an unbound axis name, and a bare
  ``AssertionError`` for one inside a ``shard_map``. This returns what
  ``check_axis_names`` would raise instead (``file:line``, "did you mean",
  the collective as written), an ``AxisNameError``, which is an instance of
  both, so the caller can raise it from ``err``; None for other errors.

  Args:
    err: the exception, with its traceback (unfiltered: call this below
      the outermost JAX API boundary).
    fun: the function traced; a ``NameError`` is diagnosed by tracing it
      again with the arguments (every problem listed).
    *args: its positional arguments.
    api: the entry point named in the message.
    **kwargs: its keyword arguments.
  """
  if isinstance(err, AxisNameError):
    return None
  found = jax_internals.unbound_in_shard_map(err)
  if found is not None:
    names, bound = found
    loc, called = tracing.user_call_of_exception(err)
    lax_fn = callable(getattr(jax.lax, called or "", None))
    prim = called if lax_fn else "a collective"
    problems = [
      (prim, n, bound, loc, _unbound(n, bound)) for n in names if n not in bound
    ]
    return problems_error(problems, api) if problems else None
  name = jax_internals.unbound_axis_name(err)
  if name is None:
    return None
  bound_here = jax_internals.axis_names_at_error(err)
  if bound_here is not None:
    # Read from the error where JAX raised it: the function is not run
    # again (stock runs it once).
    loc, called = tracing.user_call_of_exception(err)
    lax_fn = callable(getattr(jax.lax, called or "", None))
    prim = called if lax_fn else "a collective"
    bound = tuple(bound_here)
    return problems_error(
      [(prim, name, bound, loc, _unbound(name, bound))], api
    )
  if fun is None:
    return None
  try:
    check_axis_names(fun, *args, **kwargs)
  except AxisNameError as e:
    e.args = (e.args[0].replace(_API, api, 1),) + e.args[1:]
    return e
  except Exception:  # noqa: BLE001 - not diagnosable: the caller re-raises
    pass
  return None
