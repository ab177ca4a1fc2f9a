"""The caller's tracing context with axis names renamed back to the old ones.

``rename_axes(f, {'i': 'k'})`` is called where ``'k'`` is bound (inside a
``shard_map`` over ``'k'``, a ``vmap(axis_name='k')``, ...). To trace ``f``,
which speaks of ``'i'``, we present it the same context under the old names:

* the axis environment binds ``'i'`` with the size ``'k'`` has here;
* the abstract mesh (inside ``shard_map``) has its ``'k'`` axis renamed ``'i'``;
* each argument's abstract value has ``'k'`` renamed ``'i'`` in its varying
  manual axes and in its sharding.

A mesh axis already called ``'i'`` is hidden under a ``deep.HiddenName``
for the trace and renamed back afterwards, so the renaming stays one-to-one.
The jaxpr is then renamed forward with ``OldNames.forward``. A custom rule
traced later (under ``grad`` or ``jvp``) gets the context of that moment;
hidden names are deterministic, so it agrees with the recorded types.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Mapping
import contextlib
import dataclasses
from typing import Any

import jax
from jax.sharding import NamedSharding

from . import deep
from . import jax_internals


@dataclasses.dataclass(frozen=True)
class OldNames:
  """How to trace under the old names here, and how to rename back.

  Attributes:
    forward: old name -> new name (the user's mapping, plus each hidden
      name -> the mesh axis it hides).
    inverse: the inverse of ``forward``.
    env: ``{old name: size}`` for each old name whose new name is bound.
    mesh: the abstract mesh under the old names (the current one if none).
    mesh_changed: whether ``mesh`` differs from the current mesh.
    vacated: the new names that are manual mesh axes here and are not mesh
      axes under the old names (a function that uses one of them itself
      cannot be renamed here).
  """

  forward: dict
  inverse: dict
  env: dict
  mesh: Any
  mesh_changed: bool
  vacated: tuple = ()

  @contextlib.contextmanager
  def scope(self):
    """Binds the old names (axis sizes and abstract mesh) for a trace."""
    with contextlib.ExitStack() as stack:
      if self.mesh_changed:
        stack.enter_context(jax.sharding.use_abstract_mesh(self.mesh))
      if self.env:
        stack.enter_context(jax_internals.extend_axis_env(self.env.items()))
      yield


def user_entries(mapping: Mapping) -> dict:
  """``mapping`` without the entries that rename hidden names back."""
  return {
    o: n for o, n in mapping.items() if not isinstance(o, deep.HiddenName)
  }


def old_names(mapping: Mapping[Hashable, Hashable], api: str) -> OldNames:
  """The context for tracing code written for the old names of ``mapping``.

  ``mapping`` is the user's ``{old: new}`` (one-to-one, checked).
  """
  env: dict[Hashable, int] = {}
  for old, new in mapping.items():
    try:
      env[old] = jax.lax.axis_size(new)
    except NameError:
      pass  # ``new`` is not bound here; tracing binds ``old`` if needed
  cur = jax.sharding.get_abstract_mesh()
  forward = dict(mapping)
  inverse = {new: old for old, new in mapping.items()}
  if not cur.empty:
    axis_names = set(cur.axis_names)
    manual = set(getattr(cur, "manual_axes", ()) or ())
    for old, new in mapping.items():
      # The mesh axis ``new`` becomes ``old`` for the trace; a mesh axis
      # that already is ``old`` and is not itself renamed away must make
      # room (renaming only touches manual axes).
      if (
        new in manual
        and old in axis_names
        and not (old in manual and old in inverse)
      ):
        h = deep.hidden(old)
        if h in axis_names:
          raise ValueError(
            f"{api}: cannot hide mesh axis {old!r} of {cur} while "
            f"renaming {dict(mapping)!r}: the mesh already has an axis "
            f"named {h!r}"
          )
        inverse[old] = h
        forward[h] = old
        try:
          env[h] = jax.lax.axis_size(old)
        except NameError:
          pass  # an Auto/Explicit mesh axis: no collective can name it
  try:
    mesh = deep.rename(cur, inverse)
  except ValueError as e:
    raise ValueError(
      f"{api}: cannot rename {dict(mapping)!r} inside the current mesh "
      f"{cur}: under the old names its axes would be "
      f"{tuple(inverse.get(n, n) for n in cur.axis_names)!r}, which repeat "
      "a name. Rename the clashing axis too (for example swap both "
      "names), or call the function outside this mesh"
    ) from e
  vacated = ()
  if mesh is not cur:
    vacated = tuple(
      n for n in cur.axis_names if n in inverse and n not in mesh.axis_names
    )
  return OldNames(forward, inverse, env, mesh, mesh is not cur, vacated)


def with_fallback_env(ctx: OldNames, fallback: Mapping | None) -> OldNames:
  """``ctx`` also binding each name of ``fallback`` not bound here.

  A custom rule recorded in a jaxpr is traced only when a transformation
  needs it, possibly where a name the function was traced with is not in
  the axis environment (a ``vmap`` axis inside ``pmap``, under ``grad``);
  ``fallback`` holds the sizes from the function's own trace.
  """
  if not fallback:
    return ctx
  bound = jax_internals.current_axis_sizes()
  extra = {
    n: s for n, s in fallback.items() if n not in ctx.env and n not in bound
  }
  if not extra:
    return ctx
  return dataclasses.replace(ctx, env={**extra, **ctx.env})


def is_array_like(x: Any) -> bool:
  """Whether a rule's argument is a value to trace (not a static marker)."""
  return isinstance(x, (jax.Array, jax.core.Tracer)) or (
    hasattr(x, "shape") and hasattr(x, "dtype") and not jax_internals.is_zero(x)
  )


def arg_avals(leaves, ctx: OldNames, api: str) -> list:
  """Abstract values of ``leaves`` under the old names."""
  avals = []
  memo: dict = {}
  for i, leaf in enumerate(leaves):
    try:
      aval = deep.rename(jax.typeof(leaf), ctx.inverse, memo)
    except TypeError as e:
      raise TypeError(
        f"{api}: argument leaf {i} ({leaf!r:.60}) is not an array or scalar;"
        " a renamed function takes only array arguments (bind static values "
        "with functools.partial before renaming)"
      ) from e
    sharding = getattr(aval, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
      sharding = None
    avals.append(
      jax.ShapeDtypeStruct(
        aval.shape,
        aval.dtype,
        sharding=sharding,
        weak_type=aval.weak_type,
        manual_axis_type=getattr(aval, "mat", None),
      )
    )
  return avals
