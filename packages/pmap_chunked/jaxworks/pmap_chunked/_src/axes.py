"""in_axes / out_axes: validation, broadcasting against pytrees, PartitionSpecs.

An axes spec is an int, None, or a pytree prefix of the arguments (or outputs)
with ints and Nones as leaves. Negative ints count from the end of the
*global* array's rank, as in ``jax.vmap``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

_is_none = lambda x: x is None  # noqa: E731


class AxisOutOfRangeError(ValueError, IndexError):
  """An in_axes/out_axes entry outside the rank of its argument or output.

  A ``ValueError`` (as ``jax.vmap`` and ``jax.pmap`` raise for a bad output
  axis) and an ``IndexError`` (as ``jax.pmap`` raises for a bad input axis).
  """


def check_axes_spec(api: str, what: str, spec: Any) -> Any:
  """Validates an in_axes/out_axes spec; lists become tuples (like vmap)."""
  if isinstance(spec, list):
    spec = tuple(spec)
  leaves = jax.tree_util.tree_leaves(spec, is_leaf=_is_none)
  bad = [l for l in leaves if not (l is None or type(l) is int)]
  if bad:
    raise TypeError(
      f"{api}: {what} must be an int, None, or a (nested) tuple/list/dict of "
      f"those, but got {spec!r} (bad leaf {bad[0]!r} of type "
      f"{type(bad[0]).__name__}); use e.g. {what}=0 or {what}=(0, None)."
    )
  return spec


def has_negative(spec: Any) -> bool:
  return any(
    l is not None and l < 0
    for l in jax.tree_util.tree_leaves(spec, is_leaf=_is_none)
  )


class _Run:
  """The axes of one subtree's leaves (a class of its own, so that lists in
  a spec are never mistaken for it when flattening)."""

  __slots__ = ("axes",)

  def __init__(self, axes: list):
    self.axes = axes


def broadcast_axes(api: str, what: str, spec: Any, tree: Any) -> list:
  """One axis (int or None) per leaf of ``tree``, with ``spec`` a prefix of it."""
  if spec is None or type(spec) is int:
    return [spec] * len(jax.tree_util.tree_leaves(tree))
  try:
    per_subtree = jax.tree_util.tree_map(
      lambda ax, sub: _Run([ax] * len(jax.tree_util.tree_leaves(sub))),
      spec,
      tree,
      is_leaf=_is_none,
    )
  except (ValueError, TypeError) as e:
    # JAX's own description names the spec "tree_map tree": say what it is.
    detail = str(e).replace("tree_map tree", what).rstrip(".")
    one = "output" if what == "out_axes" else "positional argument"
    raise ValueError(
      f"{api}: {what}={spec!r} is not a pytree prefix of the {one}s "
      f"(structure {jax.tree_util.tree_structure(tree)}): {detail}. Give "
      f"one entry per {one} (or a single int/None for all)."
    ) from None
  runs = jax.tree_util.tree_leaves(
    per_subtree, is_leaf=lambda x: isinstance(x, _Run)
  )
  return [ax for run in runs for ax in run.axes]


def normalize_axis(
  api: str, what: str, axis: int, ndim: int, where: str
) -> int:
  """Maps a possibly negative axis into [0, ndim), with a clear error."""
  if not -ndim <= axis < ndim:
    raise AxisOutOfRangeError(
      f"{api}: {what} axis {axis} is out of range for {where} of rank "
      f"{ndim}; use an axis in [{-ndim}, {ndim}) or None to broadcast it."
    )
  return axis % ndim


def spec_for_axis(axis_name: Any, axis: int | None) -> P:
  """PartitionSpec splitting dimension ``axis`` over ``axis_name`` (P() if None)."""
  if axis is None:
    return P()
  return P(*([None] * axis), axis_name)


def out_specs_for(axis_name: Any, out_axes: Any) -> Any:
  """PartitionSpec prefix tree for shard_map's out_specs.

  Negative out_axes are sharded at position 0 inside shard_map and moved to
  their final place afterwards (their rank is only known after tracing).
  """
  return jax.tree_util.tree_map(
    lambda ax: spec_for_axis(axis_name, ax if ax is None else max(ax, 0)),
    out_axes,
    is_leaf=_is_none,
  )


def out_shardings_for(mesh: Any, axis_name: Any, out_axes: Any) -> Any:
  """Sharding prefix tree for jit's out_shardings: ``NamedSharding(mesh,
  spec)`` per out_axes leaf, as jax.pmap gives; None (the compiler's
  choice) for a negative one, whose place is known once traced
  (``global_spec`` gives its sharding then)."""
  return jax.tree_util.tree_map(
    lambda ax: (
      None
      if ax is not None and ax < 0
      else NamedSharding(mesh, spec_for_axis(axis_name, ax))
    ),
    out_axes,
    is_leaf=_is_none,
  )


def global_spec(axis_name: Any, axis: int, ndim: int) -> P:
  """The spec of an output of rank ``ndim`` mapped along ``axis`` (negative
  counts from the end)."""
  return spec_for_axis(axis_name, axis % ndim)


def leaf_paths(tree: Any) -> Sequence[str]:
  """Human-readable paths of the leaves of ``tree`` (for error messages only)."""
  with_path, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [jax.tree_util.keystr(path) for path, _ in with_path]
