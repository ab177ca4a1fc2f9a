"""Turning device_put's arguments into one flat request: a destination per leaf.

``resolve`` flattens the value once, broadcasts the target, src, donate and
may_alias prefix trees to one entry per leaf (as jax.device_put does), and
normalizes each distinct target object once: a Device becomes a
SingleDeviceSharding, a Format is split into its sharding and layout.

>>> import jax, numpy as np
>>> req = resolve("device_put", {"a": np.zeros(2), "b": (1.0, 2.0)},
...               {"a": jax.devices()[1], "b": None}, None, False, None)
>>> [type(s).__name__ if s is not None else None for s in req.dsts]
['SingleDeviceSharding', None, None]
>>> req.committed
[True, False, False]
>>> req.path(2)
"['b'][1]"
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any

import jax
from jax.experimental.layout import Format
from jax.experimental.layout import Layout
from jax.sharding import AxisType
from jax.sharding import PartitionSpec
from jax.sharding import Sharding
from jax.sharding import SingleDeviceSharding

from . import jax_internals

_REUSE = jax_internals.ArrayCopySemantics.REUSE_INPUT
_DONATE = jax_internals.ArrayCopySemantics.DONATE_INPUT
_COPY = jax_internals.ArrayCopySemantics.ALWAYS_COPY

_TARGET_TYPES = (jax.Device, Sharding, Format, PartitionSpec, jax.memory.Space)
TARGET_TEXT = (
  "None, a jax.Device, a jax.sharding.Sharding, a jax.experimental.layout.Format, "
  "a PartitionSpec or a jax.memory.Space"
)
_SINGLE_DEVICE: dict[Any, SingleDeviceSharding] = {}


def is_target_leaf(t: Any) -> bool:
  return t is None or isinstance(t, _TARGET_TYPES)


def _is_plain_leaf(t: Any) -> bool:
  """None or any value that is not a pytree container (for donate, may_alias, src)."""
  return t is None or jax.tree_util.all_leaves([t])


class Delegate(Exception):
  """Raised by ``resolve`` when stock jax.device_put must handle the whole call."""


class PlacementError(ValueError):
  """A ``device_put``, ``plan`` or ``place_for`` argument that cannot be
  placed (``jax.device_put`` rejects it too), found before anything moved.

  Public as ``jaxworks.batched_transfer.PlacementError``: a ``ValueError``
  whose message names the API, the leaf's tree path and the fix.
  """


@dataclasses.dataclass
class Request:
  """One device_put call, flattened: everything indexed by leaf number."""

  api: str
  tree: Any
  leaves: list[Any]
  treedef: Any
  # The user's target per leaf (for jax.device_put fallbacks).
  raw_targets: list[Any]
  dsts: list[Sharding | None]  # destination sharding per leaf, None = default
  layouts: list[Any] | None  # destination Layout per leaf (None: no layouts)
  committed: list[bool]
  semantics: list[Any]  # ArrayCopySemantics per leaf
  donate: list[bool]
  may_alias: list[bool | None]
  srcs: list[Any] | None
  default_dst: Sharding
  _paths: list[str] | None = None
  # Deleted (or donated) jax.Arrays that do not come back as they are:
  # jax.device_put raises for them (set by transfer.classify).
  deleted: list[int] = dataclasses.field(default_factory=list)
  # Whether some leaf's target is a Format (jax.device_put places those
  # through a jit, which reads the context mesh).
  formats: bool = False

  def path(self, i: int) -> str:
    """The tree path of leaf ``i``, as jax.tree_util.keystr writes it."""
    if self._paths is None:
      self._paths = tree_paths(self.tree)
    return self._paths[i]


def tree_paths(tree: Any) -> list[str]:
  """The keystr path of every leaf of ``tree`` ("<root>" for a lone leaf)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return [jax.tree_util.keystr(p) or "<root>" for p, _ in flat]


def broadcast_prefix(
  api: str,
  what: str,
  prefix: Any,
  tree: Any,
  treedef: Any,
  n: int,
  is_leaf,
  expected: str,
) -> list[Any]:
  """One entry of the prefix tree ``prefix`` per leaf of ``tree``."""
  if is_leaf(prefix):
    return [prefix] * n
  prefix_leaves, prefix_def = jax.tree_util.tree_flatten(
    prefix, is_leaf=is_leaf
  )
  if (
    jax.tree_util.treedef_is_leaf(prefix_def)
    and prefix_leaves
    and prefix_leaves[0] is prefix
  ):
    # jax.device_put raises ValueError for a target that is none of its kinds.
    raise PlacementError(
      f"{api}: {what} must be {expected} or a pytree prefix of the value "
      f"made of them, got {prefix!r} of type {type(prefix).__name__}"
    )
  try:
    # jax's stubs for PyTreeDef lack flatten_up_to.
    subtrees = prefix_def.flatten_up_to(tree)  # type: ignore[attr-defined]
  except Exception:  # noqa: BLE001 - the message is remade below
    # The structure does not match. jax's message shows the leaves, whose
    # repr can raise (a deleted jax.Array's does): made again over
    # placeholder leaves.
    placeholders = treedef.unflatten([0] * n)
    try:
      prefix_def.flatten_up_to(placeholders)  # type: ignore[attr-defined]
      err: Any = "the structures differ"
    except (ValueError, TypeError) as e:
      err = e
    raise PlacementError(
      f"{api}: {what} must be a pytree prefix of the value, whose structure is {treedef}; "
      f"got a {what} with structure {prefix_def}. Pass one {what} for the whole value or a tree "
      f"that matches the value's containers. ({err})"
    ) from None
  out: list[Any] = []
  for p, sub in zip(prefix_leaves, subtrees):
    out.extend([p] * len(jax.tree_util.tree_leaves(sub)))
  return out


def single_device_sharding(device: Any) -> SingleDeviceSharding:
  s = _SINGLE_DEVICE.get(device)
  if s is None:
    s = _SINGLE_DEVICE[device] = SingleDeviceSharding(device)
  return s


def _check_concrete(api: str, sharding: Sharding) -> None:
  """A NamedSharding over an AbstractMesh (what jax.eval_shape reports for a
  ShapeDtypeStruct's sharding) names no devices: jax.device_put raises
  ValueError for it, and so does this package, saying what to pass instead."""
  if isinstance(getattr(sharding, "mesh", None), jax.sharding.AbstractMesh):
    raise PlacementError(
      f"{api}: the target {sharding} is over an AbstractMesh, which names no devices; "
      "pass a sharding over a concrete mesh (jax.make_mesh(...)), e.g. "
      "NamedSharding(mesh, sharding.spec)"
    )


def normalize_target(api: str, t: Any) -> tuple[Sharding | None, Any, bool]:
  """(sharding or None, layout or None, committed) for one target object.

  Raises Delegate for targets that only stock jax.device_put handles (a
  PartitionSpec resolved against the current mesh, a jax.memory.Space).
  """
  if t is None:
    return None, None, False
  if isinstance(t, Sharding):
    _check_concrete(api, t)
    return t, None, True
  if isinstance(t, jax.Device):
    return single_device_sharding(t), None, True
  if isinstance(t, Format):
    layout, sharding = t.layout, t.sharding
    if layout is None and sharding is None:
      return None, None, False
    if not isinstance(sharding, Sharding):
      raise PlacementError(
        f"{api}: a Format target needs a concrete sharding, got {t}; "
        "use Format(layout, jax.sharding.SingleDeviceSharding(device)) or a NamedSharding"
      )
    _check_concrete(api, sharding)
    if layout is not None and not isinstance(layout, Layout):
      raise PlacementError(
        f"{api}: a Format target needs a concrete layout (a jax.experimental.layout.Layout "
        f"or None), got {layout!r}; use compiled.input_formats to get concrete formats"
      )
    return sharding, layout, True
  if isinstance(t, (PartitionSpec, jax.memory.Space)):
    raise Delegate()
  # jax.device_put raises ValueError for a target that is none of its kinds.
  raise PlacementError(
    f"{api}: target must be {TARGET_TEXT} or a pytree prefix of these; "
    f"got {t!r} of type {type(t).__name__}"
  )


def jit_context_mesh() -> bool:
  """Whether jit now runs under a context mesh: a concrete one
  (``jax.set_mesh``), or an abstract one with an Explicit axis (as jit itself
  decides)."""
  if not jax.sharding.get_mesh().empty:
    return True
  abstract = jax.sharding.get_abstract_mesh()
  return not abstract.empty and any(
    t == AxisType.Explicit for t in abstract.axis_types
  )


def copy_semantics(
  api: str, may_alias: Any, donate: Any, where: str = ""
) -> Any:
  """The ArrayCopySemantics of one leaf, by truth value as jax.device_put decides it."""
  if may_alias and donate:
    raise PlacementError(
      f"{api}: may_alias=True and donate=True{where} cannot both be set; "
      "donate=True already lets the result reuse the input's buffer"
    )
  if may_alias is None:
    may_alias = not donate
  if may_alias and not donate:
    return _REUSE
  return _DONATE if donate else _COPY


def resolve(
  api: str, tree: Any, target: Any, src: Any, donate: Any, may_alias: Any
) -> Request:
  """Flattens one device_put call; raises Delegate for calls stock JAX must handle."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  n = len(leaves)
  default_dst = single_device_sharding(jax_internals.default_device())
  if n == 0:
    _check_empty(api, tree, treedef, target, src, donate, may_alias)
    return Request(
      api, tree, [], treedef, [], [], None, [], [], [], [], None, default_dst
    )

  def per_leaf(what, prefix, is_leaf, expected):
    return broadcast_prefix(
      api, what, prefix, tree, treedef, n, is_leaf, expected
    )

  raw_targets = per_leaf("target", target, is_target_leaf, TARGET_TEXT)
  dsts, layouts, committed = _destinations(api, target, raw_targets)
  formats = isinstance(target, Format) or (
    not is_target_leaf(target)
    and any(isinstance(t, Format) for t in raw_targets)
  )
  # src is only read while tracing (by stock jax.device_put, which checks it);
  # eagerly, as in jax.device_put, any value is accepted.
  srcs = None
  if src is not None:
    srcs = per_leaf("src", src, _is_plain_leaf, TARGET_TEXT)
  # donate and may_alias are read by truth value, as jax.device_put reads them.
  donate_flat = per_leaf("donate", donate, _is_plain_leaf, "a bool")
  alias_flat = per_leaf(
    "may_alias", may_alias, _is_plain_leaf, "a bool or None"
  )
  if _is_plain_leaf(donate) and _is_plain_leaf(may_alias):
    semantics = [copy_semantics(api, may_alias, donate)] * n
  else:
    semantics = _leaf_semantics(api, tree, alias_flat, donate_flat)
  return Request(
    api, tree, leaves, treedef, raw_targets, dsts, layouts, committed,
    semantics, donate_flat, alias_flat, srcs, default_dst, formats=formats,
  )  # fmt: skip


def _check_empty(api, tree, treedef, target, src, donate, may_alias) -> None:
  """As in jax.device_put, a tree without leaves only has its prefixes'
  structure checked: any target, flag or src value is accepted."""
  names = ("target", "src", "donate", "may_alias")
  for what, prefix in zip(names, (target, src, donate, may_alias)):
    if prefix is not None:
      broadcast_prefix(
        api, what, prefix, tree, treedef, 0, _is_plain_leaf, TARGET_TEXT
      )


def _destinations(
  api: str, target: Any, raw_targets: list[Any]
) -> tuple[list[Sharding | None], list[Any] | None, list[bool]]:
  """The sharding, layout (None: no leaf has one) and committedness of each
  leaf. Each distinct target object is normalized once (targets are few,
  leaves many)."""
  n = len(raw_targets)
  if is_target_leaf(target):
    s, layout, committed = normalize_target(api, target)
    return [s] * n, None if layout is None else [layout] * n, [committed] * n
  norm: dict[int, tuple[Any, Any, bool]] = {}
  for t in raw_targets:
    if id(t) not in norm:
      norm[id(t)] = normalize_target(api, t)
  triples = [norm[id(t)] for t in raw_targets]
  layouts = [x[1] for x in triples]
  return (
    [x[0] for x in triples],
    None if all(l is None for l in layouts) else layouts,
    [x[2] for x in triples],
  )


def _leaf_semantics(
  api: str, tree: Any, alias_flat: list[Any], donate_flat: list[Any]
) -> list[Any]:
  """The copy semantics of each leaf; a conflict names the leaf's path."""
  semantics = []
  for i, (m, d) in enumerate(zip(alias_flat, donate_flat)):
    if m and d:
      copy_semantics(api, m, d, f" for the leaf at {tree_paths(tree)[i]}")
    semantics.append(copy_semantics(api, m, d))
  return semantics


def resolve_placement(
  api: str,
  placement: Any,
  target: Any,
  treedef: Any,
  leaves: list[Any],
  placement_of: Callable[[Any], Any],
) -> list[Any]:
  """One placement per leaf of a restore target: ``placement_of(leaf)``
  when ``placement`` is None, else ``placement`` broadcast as a tree prefix
  of ``target``."""
  if placement is None:
    return [placement_of(x) for x in leaves]
  return broadcast_prefix(
    api, "placement", placement, target, treedef, len(leaves), is_target_leaf,
    TARGET_TEXT,
  )  # fmt: skip
