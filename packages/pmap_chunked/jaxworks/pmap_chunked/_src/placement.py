"""Putting pmap inputs where the program expects them, and device_put_*.

Inputs that already have the expected layout are passed through untouched
(same buffers). Everything else goes to its NamedSharding in one batched
transfer (jaxworks.batched_transfer.device_put). The two JAX 0.9 helpers
device_put_replicated / device_put_sharded are rebuilt the same way: one
batched transfer, then the per-device buffers are wrapped, without a copy, as
one global array whose shards keep their rank (shape [1, ...] per device).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from . import deps
from . import jax_internals
from .mesh import check_devices
from .mesh import make_mesh

# Name of the axis of the meshes device_put_replicated/sharded build. pmap
# accepts their outputs without a copy whatever its own axis name is: the
# shardings are equivalent (same devices, same split).
DEVICES_AXIS = "devices"

# Stock JAX callables bound at import, so reassigning jax.* later (adoption
# of jaxworks across a program) cannot change what this module calls.
_make_array_from_process_local_data = jax.make_array_from_process_local_data
_make_array_from_single_device_arrays = jax.make_array_from_single_device_arrays
_config = jax.config

# The transfer guard options a pmap's input transfers are checked against
# (read through jax.config, which sees the thread-local `with
# jax.transfer_guard(...)` levels as well as the global ones).
_GUARDS = (
  "jax_transfer_guard_host_to_device",
  "jax_transfer_guard_device_to_device",
)


# (array sharding, target sharding, mapped axis, rank) -> bool, for shardings
# that are not equal to the target (e.g. another axis name): the answer needs
# a slower comparison, and the same pairs come back call after call.
_layout_answers: dict = {}


def is_laid_out(
  x: Any, target: NamedSharding, axis_name: Any, axis: int | None
) -> bool:
  """Whether jax.Array ``x`` can be used as is for an input sharded ``target``."""
  sharding = x.sharding
  if sharding == target:
    return True
  key = (sharding, target, axis, x.ndim)
  answer = _layout_answers.get(key)
  if answer is None:
    if len(_layout_answers) > 4096:
      _layout_answers.clear()
    answer = _layout_answers[key] = _compatible(
      sharding, target, axis_name, axis, x.ndim
    )
  return answer


def _compatible(sharding, target, axis_name, axis, ndim) -> bool:
  if (
    isinstance(sharding, NamedSharding)
    and sharding.mesh == target.mesh
    and len(target.mesh.axis_names) > 1
  ):
    # A nested pmap's mesh: the array may also be split over the inner axes,
    # as long as this pmap's axis splits exactly the mapped dimension.
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    for dim, entry in enumerate(spec):
      names = entry if isinstance(entry, tuple) else (entry,)
      if axis_name in names and (dim != axis or entry != axis_name):
        return False
    return axis is None or spec[axis] == axis_name
  return sharding.is_equivalent_to(target, ndim)


def _rewrappable(x: jax.Array) -> bool:
  """Whether ``x``'s buffers can be wrapped as another array (no copy)."""
  return x.is_fully_addressable and not jax.dtypes.issubdtype(
    x.dtype, jax.dtypes.extended
  )


def transfer_guarded() -> bool:
  """Whether a host-to-device or device-to-device transfer guard other than
  ``"allow"`` is in force on this thread."""
  return any(getattr(_config, name) not in (None, "allow") for name in _GUARDS)


def _implicit(x: Any) -> Any:
  """A misplaced leaf as ``jit`` should receive it to move it implicitly."""
  if (
    isinstance(x, jax.Array)
    and getattr(x, "committed", False)
    and _rewrappable(x)
  ):
    # jit refuses a committed array on other devices (stock jax.pmap raises
    # ValueError); uncommitted, jit moves it like any other input.
    return jax_internals.uncommitted_view(x)
  return x


class DeletedInput(Exception):
  """Leaf ``index`` of a call is a deleted (or donated) jax.Array (the
  caller raises the error that names the argument)."""

  def __init__(self, index: int):
    super().__init__(index)
    self.index = index


def place_inputs(leaves: list, entry: Any) -> list:
  """The leaves to call ``entry`` (a ``programs.Entry``) with: misplaced ones
  moved in one batched transfer.

  A moved leaf is a copy; the caller's array is left as it is (also when its
  argument is donated: the copy is what gets donated, as in jax.pmap). A leaf
  laid out as its target but under another, equivalent sharding (another
  mesh or axis name over the same devices) is passed under the target
  sharding without a copy, so one program (and one output sharding object)
  serves both; donated leaves are passed as they are.

  Under a transfer guard (``jax.transfer_guard``, ``..._host_to_device``,
  ``..._device_to_device``) other than ``"allow"``, misplaced leaves are
  left to the jitted program, which moves them as ``jax.pmap``'s program
  does: implicit transfers, which the guard logs or refuses as it does for
  ``jax.pmap``.
  """
  targets, in_axes = entry.in_shardings, entry.in_axes
  axis_name = entry.axis_name
  moves = []
  relabeled = None
  for i, x in enumerate(leaves):
    if isinstance(x, jax.Array) and x.is_deleted():
      # A donated array passed to the jitted program crashes jaxlib 0.10.2
      # once that program is cached; jax.pmap's first call raises this.
      raise DeletedInput(i)
    if isinstance(x, jax.Array) and is_laid_out(
      x, targets[i], axis_name, in_axes[i]
    ):
      # Only a 1-D mesh's equivalence is exact (a nested pmap's mesh accepts
      # arrays also split over inner axes, which keep their own sharding).
      if (
        x.sharding != targets[i]
        and i not in entry.donated
        and len(targets[i].mesh.axis_names) == 1
        and _rewrappable(x)
      ):
        if relabeled is None:
          relabeled = list(leaves)
        relabeled[i] = _make_array_from_single_device_arrays(
          x.shape, targets[i], [s.data for s in x.addressable_shards]
        )
      continue
    moves.append(i)
  leaves = relabeled or leaves
  if not moves:
    return leaves
  values = [leaves[i] for i in moves]
  if jax.process_count() > 1:
    moved = _place_multiprocess(values, [targets[i] for i in moves])
  elif transfer_guarded():
    moved = [_implicit(x) for x in values]
  else:
    moved = deps.device_put(values, [targets[i] for i in moves])
  out = list(leaves)
  for i, y in zip(moves, moved):
    out[i] = y
  return out


def _place_multiprocess(values: list, targets: list) -> list:
  """Multi-process: host-local values become this process's part of global
  arrays; global arrays are resharded as a whole."""
  out = []
  for x, target in zip(values, targets):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      out.append(deps.device_put(x, target))
    else:
      local = x if isinstance(x, (jax.Array, np.ndarray)) else np.asarray(x)
      out.append(
        _make_array_from_process_local_data(
          target, local, global_shape_of(local.shape, target)
        )
      )
  return out


def global_shape_of(local_shape: tuple, sharding: NamedSharding) -> tuple:
  """Global shape of a host-local value with this process's part of the data."""
  mesh = sharding.mesh
  shape = list(local_shape)
  local_sizes = mesh.local_mesh.shape
  for dim, entry in enumerate(sharding.spec):
    for name in entry if isinstance(entry, tuple) else (entry,):
      if name is not None:
        shape[dim] = shape[dim] // local_sizes[name] * mesh.shape[name]
  return tuple(shape)


def _is_key(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _unwrap_keys(leaves: list) -> tuple[list, list]:
  """PRNG key arrays travel as their uint32 data; returns (leaves, impls)."""
  impls = [jax.random.key_impl(x) if _is_key(x) else None for x in leaves]
  data = [
    x if i is None else jax.random.key_data(x) for x, i in zip(leaves, impls)
  ]
  return data, impls


def _rewrap_keys(leaves: list, impls: list) -> list:
  return [
    x if i is None else jax.random.wrap_key_data(x, impl=i)
    for x, i in zip(leaves, impls)
  ]


def _as_array(x: Any) -> Any:
  """Arrays stay as they are; Python scalars keep their (weak) type."""
  if isinstance(
    x, (jax.Array, np.ndarray, np.generic, bool, int, float, complex)
  ):
    return x
  return np.asarray(x)


def _add_leading_axis(x: Any) -> Any:
  if isinstance(x, (bool, int, float, complex)):
    return jax.numpy.asarray(x)[None]  # keeps the weak type
  return x[None]


def _stacked_sharding(devices: tuple) -> NamedSharding:
  mesh = make_mesh(devices, (len(devices),), (DEVICES_AXIS,))
  return NamedSharding(mesh, P(DEVICES_AXIS))


def _assemble(shape: tuple, sharding: NamedSharding, pieces: list):
  """Wraps per-device [1, ...] buffers as one global array, without copying."""
  if pieces and pieces[0].weak_type:
    return jax_internals.weak_array_from_shards(
      shape, pieces[0].dtype, sharding, pieces
    )
  return _make_array_from_single_device_arrays(shape, sharding, pieces)


def device_put_replicated(x: Any, devices: Sequence[jax.Device]) -> Any:
  api = "jaxworks.pmap_chunked.device_put_replicated"
  devices = check_devices(api, devices)
  leaves, tree = jax.tree_util.tree_flatten(x)
  leaves, impls = _unwrap_keys(leaves)
  leaves = [_add_leading_axis(_as_array(l)) for l in leaves]
  sharding = _stacked_sharding(devices)
  replicated = NamedSharding(sharding.mesh, P())
  # One batched transfer: every leaf, as [1, ...], to every device.
  copies = deps.device_put(leaves, [replicated] * len(leaves))
  out = []
  for leaf, copy in zip(leaves, copies):
    by_device = {s.device: s.data for s in copy.addressable_shards}
    pieces = [by_device[d] for d in devices if d in by_device]
    out.append(
      _assemble((len(devices),) + tuple(leaf.shape[1:]), sharding, pieces)
    )
  return jax.tree_util.tree_unflatten(tree, _rewrap_keys(out, impls))


def device_put_sharded(
  shards: Sequence[Any], devices: Sequence[jax.Device]
) -> Any:
  api = "jaxworks.pmap_chunked.device_put_sharded"
  if not isinstance(shards, Sequence) or isinstance(shards, (str, bytes)):
    raise TypeError(
      f"{api}: shards must be a sequence (one entry per device), "
      f"got {type(shards).__name__}; pass e.g. [x0, x1, ...]."
    )
  devices = check_devices(api, devices)
  if len(shards) != len(devices):
    raise ValueError(
      f"{api}: len(shards) = {len(shards)} must equal "
      f"len(devices) = {len(devices)}; pass one shard per device."
    )
  flat = [jax.tree_util.tree_flatten(s) for s in shards]
  tree = flat[0][1]
  for i, (_, t) in enumerate(flat):
    # jax's stubs for PyTreeDef lack __ne__ and num_leaves.
    if t != tree:  # type: ignore[operator]
      raise ValueError(
        f"{api}: shards[{i}] has structure {t} but shards[0] "
        f"has {tree}; every shard must have the same pytree "
        "structure."
      )
  per_leaf, impls = [], []
  for k in range(tree.num_leaves):  # type: ignore[attr-defined]
    column, column_impls = _unwrap_keys([f[0][k] for f in flat])
    per_leaf.append([_as_array(v) for v in column])
    impls.append(column_impls[0])
  for k, column in enumerate(per_leaf):
    types = [(np.shape(v), jax.numpy.result_type(v)) for v in column]
    for i, t in enumerate(types):
      if t != types[0]:
        raise ValueError(
          f"{api}: shards must agree in shape and dtype, but leaf {k} of "
          f"shards[{i}] is {t[1]}{list(t[0])} and of shards[0] is "
          f"{types[0][1]}{list(types[0][0])}; cast or reshape them to match."
        )
  # One batched transfer: shard i of every leaf, as [1, ...], to devices[i]
  # (in a multi-process run, only the shards of this process's devices).
  local = [
    i for i, d in enumerate(devices) if d.process_index == jax.process_index()
  ]
  pieces = deps.device_put(
    [[_add_leading_axis(column[i]) for i in local] for column in per_leaf],
    [[devices[i] for i in local] for _ in per_leaf],
  )
  sharding = _stacked_sharding(devices)
  out = []
  for column, placed in zip(per_leaf, pieces):
    shape = (len(devices),) + tuple(np.shape(column[0]))
    out.append(_assemble(shape, sharding, list(placed)))
  return jax.tree_util.tree_unflatten(tree, _rewrap_keys(out, impls))
