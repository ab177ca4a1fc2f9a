"""Moving the groups: one batched backend call per group.

After the C++ grouping, each group is split by route (the README's table):
``alias`` (the input object is the result), ``host`` (a loop over
``batched_device_put``, with avals, device lists and shard slices cached),
``copy`` (one ``batched_copy_array_to_devices_with_sharding`` per group) and
``jax`` (everything else, in one stock jax.device_put call, which keeps its
exact semantics). Leaves whose target has a layout their runtime layout
lacks are then relaid out by one jitted identity per destination device set.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
import dataclasses
import math
import threading
from typing import Any
import warnings

import jax
from jax.experimental.layout import Format
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
import numpy as np

from . import grouping
from . import jax_internals
from .targets import TARGET_TEXT
from .targets import Request
from .targets import broadcast_prefix
from .targets import is_target_leaf
from .targets import single_device_sharding
from .targets import tree_paths

# Stock JAX callables bound at import (the drop-in contract: never looked up
# on ``jax`` at call time).
_typeof = jax.typeof

ALIAS, HOST, COPY, JAX = "alias", "host", "copy", "jax"

_REUSE = jax_internals.ArrayCopySemantics.REUSE_INPUT
_DONATE = jax_internals.ArrayCopySemantics.DONATE_INPUT
_COPY = jax_internals.ArrayCopySemantics.ALWAYS_COPY

# (shape, dtype, sharding, x64, committed) -> HostEntry
_HOST_CACHE: dict[tuple[Any, ...], HostEntry] = {}
# (src sharding, dst sharding, shape) -> same index on each device-list position
_SAME_INDICES: dict[tuple[Any, ...], bool] = {}
# (dst sharding, shape) pairs check_placement accepted
_PLACEABLE: dict[tuple[Any, Any], bool] = {}
# (aval, sharding) -> aval of the result, None when it is the input's
_DST_AVAL: dict[tuple[Any, Any], Any] = {}
_MISSING = object()
# dtype -> whether the host fast path can take it
_HOST_DTYPES: dict[Any, bool] = {}
_CACHE_LIMIT = 8192
#: Host leaves of at least this many bytes, when a call has two or more, are
#: put from a pool of threads: each put copies its leaf into the runtime's
#: host buffer before the DMA starts, and those copies then overlap (on a
#: TPU v5e, 16 leaves of 64 MiB: 80 ms instead of 82, the link's limit).
PARALLEL_PUT_BYTES = 16 * 2**20
_PUT_THREADS = 8
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class HostEntry:
  """How one (shape, dtype, sharding, x64, committed) goes from host to devices."""

  aval: Any  # of the result
  devices: list[Any]  # the addressable devices, in the sharding's order
  slices: list[Any] | None  # each device's index; None: all get the whole
  multihost: bool  # the value must be equal on every process
  # For shardings where several devices hold the same index (replicated mesh axes):
  # (shard aval, SingleDeviceSharding) per device, for copies that are placed device by
  # device. jaxlib 0.10.2's batched_device_put with force_copy fails
  # ("bad_function_call") when shards of a partly replicated sharding share an index.
  per_device: list[tuple[Any, Any]] | None


@dataclasses.dataclass
class Batch:
  """The leaves of one group that take one route."""

  group: Any  # the _grouping.Group
  route: str
  indices: list[int]
  relayout: list[int] = dataclasses.field(default_factory=list)  # planned


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> Any:
  if len(cache) >= _CACHE_LIMIT:
    cache.clear()
  cache[key] = value
  return value


def host_dtype_ok(dtype: Any) -> bool:
  """Whether the host fast path can take arrays of ``dtype``: a numeric or
  bool type that JAX holds (not float128, complex256, timedelta64, ... which
  the runtime would fail on where jax.device_put raises TypeError)."""
  ok = _HOST_DTYPES.get(dtype)
  if ok is None:
    try:
      _typeof(np.empty(0, dtype))
      valid = True
    except (TypeError, ValueError):
      valid = False
    ok = _HOST_DTYPES[dtype] = bool(
      valid
      and dtype != jax.dtypes.float0
      and dtype.fields is None
      and (dtype == np.bool_ or jax.dtypes.issubdtype(dtype, np.number))
    )
  return ok


def byte_order_error(api: str, path: str, dtype: Any) -> TypeError:
  return TypeError(
    f"{api}: the leaf at {path} is a numpy array of non-native byte order ({dtype.str}), "
    "which JAX does not accept (jax.device_put raises TypeError too); convert it first with "
    "x.astype(x.dtype.newbyteorder('='))"
  )


def placeable(req: Request, i: int, dst: Any, shape: tuple[int, ...]) -> bool:
  """True once ``check_placement`` accepted ``dst`` for ``shape`` (it raises
  otherwise, as jax.device_put does before it moves anything)."""
  key = (dst, shape)
  if key not in _PLACEABLE:
    check_placement(req, i, dst, shape)
    _remember(_PLACEABLE, key, True)
  return True


def same_indices(
  req: Request, i: int, src: Any, dst: Any, shape: tuple[int, ...]
) -> bool:
  """Whether position k of src's device list holds the same index as position k of dst's."""
  key = (src, dst, shape)
  same = _SAME_INDICES.get(key)
  if same is not None:
    return same
  check_placement(req, i, dst, shape)
  if src.num_devices != dst.num_devices:
    same = False
  elif src.num_devices == 1:
    same = True
  else:
    a, b = src.devices_indices_map(shape), dst.devices_indices_map(shape)
    same = all(
      a[p] == b[q]
      for p, q in zip(
        jax_internals.device_list(src), jax_internals.device_list(dst)
      )
    )
  return _remember(_SAME_INDICES, key, same)


class SpecRankError(ValueError, AssertionError):
  """A PartitionSpec that shards more dimensions than the leaf has.

  Public as ``jaxworks.batched_transfer.SpecRankError``. ``jax.device_put``
  fails there on an internal assertion (``AssertionError``); this error is
  that class too, and a ``ValueError`` like the package's other placement
  errors.
  """


def check_placement(
  req: Request, i: int, sharding: Any, shape: tuple[int, ...]
) -> None:
  spec = getattr(sharding, "spec", None)
  if isinstance(spec, PartitionSpec) and any(
    p is not None for p in spec[len(shape) :]
  ):
    raise SpecRankError(
      f"{req.api}: cannot place the leaf at {req.path(i)} with shape {shape} on {sharding}: "
      f"its spec {spec} shards more than the leaf's {len(shape)} dimensions; use a spec of at "
      f"most {len(shape)} entries"
    )
  check_shard_shape(
    sharding,
    shape,
    lambda: (
      f"{req.api}: cannot place the leaf at {req.path(i)} with shape "
      f"{shape} on {sharding}"
    ),
  )


def check_shard_shape(
  sharding: Any, shape: tuple[int, ...], what: Callable[[], str]
) -> None:
  """Raises, as jax.device_put would, where ``sharding`` cannot split
  ``shape``: ``what()``, then the sharding's own message (which says why)."""
  try:
    sharding.shard_shape(shape)
  except Exception as err:
    raise placement_error(err, sharding, shape, f"{what()}: {err}") from None


def placement_error(
  err: Exception, sharding: Any, shape: tuple[int, ...], message: str
) -> Exception:
  """``message`` as the error jax.device_put raises where ``sharding`` cannot
  split ``shape``: a plain ValueError where a dimension is indivisible by the
  Explicit mesh axes of a NamedSharding (JAX checks those first, when it
  makes the abstract value), else the class ``sharding.shard_shape`` raised
  (jax's IndivisibleError, a ValueError subclass, e.g. for Auto axes)."""
  if isinstance(err, ValueError) and not _explicit_indivisible(sharding, shape):
    try:
      new = type(err)(message)
    except Exception:  # a constructor that takes other arguments
      return ValueError(message)
    if str(new) == message:
      return new
  return ValueError(message)


def _explicit_indivisible(sharding: Any, shape: tuple[int, ...]) -> bool:
  """Whether the Explicit mesh axes of a NamedSharding leave a dimension of
  ``shape`` indivisible."""
  if not isinstance(sharding, NamedSharding):
    return False
  mesh = sharding.mesh
  explicit = {
    name
    for name, kind in zip(mesh.axis_names, mesh.axis_types)
    if kind == AxisType.Explicit
  }
  for entry, n in zip(sharding.spec, shape):
    names = entry if isinstance(entry, tuple) else (entry,)
    ways = math.prod(mesh.shape[a] for a in names if a in explicit)
    if n % ways:
      return True
  return False


def deleted_text(api: str, path: str, x: Any) -> str:
  return (
    f"{api}: the leaf at {path} is a deleted jax.Array "
    f"({x.dtype.name}{list(x.shape)}: deleted, or donated to an earlier "
    "call); place the array before it is donated or deleted"
  )


def deleted_to_space_error(
  api: str, tree: Any, target: Any
) -> Exception | None:
  """The error jax.device_put raises for a deleted (or donated) leaf going to
  a jax.memory.Space, if there is one. Stock places those with a jitted
  primitive, which, once cached, crashes on a donated array (jaxlib 0.10.2):
  its first call's RuntimeError, raised without calling it."""
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  if not any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
    return None
  per_leaf = broadcast_prefix(
    api, "target", target, tree, treedef, len(leaves), is_target_leaf,
    TARGET_TEXT,
  )  # fmt: skip
  for i, (x, t) in enumerate(zip(leaves, per_leaf)):
    if (
      isinstance(t, jax.memory.Space)
      and isinstance(x, jax.Array)
      and x.is_deleted()
    ):
      path = tree_paths(tree)[i]
      return RuntimeError(
        f"{deleted_text(api, path, x)} (jax.device_put: Array has been deleted)"
      )
  return None


def deleted_error(req: Request) -> Exception:
  """What jax.device_put raises for the first deleted (or donated) leaf that
  it does not return as it is (``req.deleted``), without calling it: a
  jitted relayout of a donated array can crash jaxlib 0.10.2.

  A RuntimeError ("Array has been deleted"); jaxlib's JaxRuntimeError (a
  RuntimeError) for a copy to a Device; a ValueError where the target is a
  Format with a layout and the array, the target or the context mesh name
  different devices (jax.device_put's relayout jit checks those first).
  """
  i = min(req.deleted)
  x, t, cs = req.leaves[i], req.raw_targets[i], req.semantics[i]
  text = deleted_text(req.api, req.path(i), x)
  if isinstance(t, Format) and t.layout is not None:
    mismatch = _jit_devices_mismatch(x, t.sharding)
    if mismatch:
      return ValueError(
        f"{text}. jax.device_put relayouts it with a jit, which reports "
        f"incompatible devices first: {mismatch}"
      )
  if (
    isinstance(t, jax.Device)
    and cs == _COPY
    and len(x.sharding.device_set) == 1
  ):
    return jax.errors.JaxRuntimeError(
      f"{text} (jax.device_put: INVALID_ARGUMENT: device_put expects an "
      "array with exactly one shard)"
    )
  return RuntimeError(f"{text} (jax.device_put: Array has been deleted)")


def _jit_devices_mismatch(x: Any, sharding: Any) -> str:
  """Why a jit of a committed ``x`` with output ``sharding`` under the
  current context mesh fails jit's device check, or ""."""
  lists = {"the target": tuple(jax_internals.device_list(sharding))}
  if x.committed:
    lists["the array"] = tuple(jax_internals.device_list(x.sharding))
  mesh = jax.sharding.get_mesh()
  abstract = jax.sharding.get_abstract_mesh()
  if not mesh.empty:
    lists["the context mesh"] = tuple(mesh.devices.flat)
  elif not abstract.empty and any(
    a == AxisType.Explicit for a in abstract.axis_types
  ):
    if any(len(d) != abstract.size for d in lists.values()):
      return f"the context mesh has {abstract.size} devices"
  if len(set(lists.values())) <= 1:
    return ""
  return "; ".join(
    f"{k}: device ids {[d.id for d in v]}" for k, v in lists.items()
  )


def check_placements_in_order(req: Request) -> None:
  """Raises the placement error of the first leaf, in tree order, that has one (error path)."""
  for i, (x, s) in enumerate(zip(req.leaves, req.dsts)):
    if s is not None:
      check_placement(req, i, s, tuple(_typeof(x).shape))


def _host_entry(req: Request, i: int, key: tuple[Any, ...]) -> HostEntry:
  shape, dtype, sharding, _, committed = key
  check_placement(req, i, sharding, shape)
  index_map = sharding.addressable_devices_indices_map(shape)
  devices = list(index_map)
  indices = list(index_map.values())
  slices: list[Any] | None = indices
  if all(all(s == slice(None) for s in idx) for idx in indices):
    slices = None  # every device gets the whole value
  aval = jax_internals.ShapedArray(shape, jax.dtypes.canonicalize_dtype(dtype))
  if committed:
    aval = jax_internals.device_put_aval(aval, sharding)
  per_device = None
  # Zero-size shards are views at one address, which the forced copy treats as
  # one shared host buffer too: place those device by device as well.
  shared = slices is not None and (
    len({tuple((k.start, k.stop, k.step) for k in i) for i in slices})
    < len(slices)
    or 0 in shape
  )
  if shared:
    shard_shape = tuple(sharding.shard_shape(shape))
    shard_aval = jax_internals.ShapedArray(shard_shape, aval.dtype)
    per_device = [(shard_aval, single_device_sharding(d)) for d in devices]
  multihost = (
    not sharding.is_fully_addressable
    and jax.process_count() > 1
    and len({d.process_index for d in sharding.device_set})
    == jax.process_count()
  )
  return _remember(
    _HOST_CACHE, key, HostEntry(aval, devices, slices, multihost, per_device)
  )


def layout_matches(wanted: Any, actual: Any) -> bool:
  """Whether an array with layout ``actual`` satisfies a requested layout.

  As in XLA, a requested layout without tiling asks only for the dimension
  order; with tiling it must match exactly.

  >>> from jax.experimental.layout import Layout
  >>> layout_matches(Layout((1, 0)), Layout((1, 0), tiling=()))
  True
  >>> layout_matches(Layout((1, 0)), Layout((0, 1)))
  False
  """
  if actual is None:
    return False
  if not wanted.tiling:
    return tuple(wanted.major_to_minor) == tuple(actual.major_to_minor)
  return wanted == actual


def _addressable(devices: Any) -> bool:
  """Whether every device of a device list belongs to this process."""
  me = jax.process_index()
  return all(d.process_index == me for d in devices)


def _format_matches(x: Any, sharding: Any, layout: Any) -> bool:
  fmt = x.format
  return fmt.sharding == sharding and layout_matches(layout, fmt.layout)


def classify(req: Request, groups: list[Any]) -> list[Batch]:
  """Splits every group by route, without moving anything."""
  leaves, dsts, sems, layouts = req.leaves, req.dsts, req.semantics, req.layouts
  batches: list[Batch] = []
  for g in groups:
    routes: dict[str, list[int]] = {}
    if g.kind == grouping.HOST_ARRAY:
      for i in g.indices:
        dtype = leaves[i].dtype
        if not dtype.isnative:
          raise byte_order_error(req.api, req.path(i), dtype)
        routes.setdefault(HOST if host_dtype_ok(dtype) else JAX, []).append(i)
    elif g.kind == grouping.DEVICE_ARRAY:
      # Facts shared by the whole group: its source and destination device
      # lists and memory kinds are the same for every leaf.
      in_place = (
        g.src_devices == g.dst_devices
        and g.src_memory_kind == g.dst_memory_kind
      )
      addressable = _addressable(g.src_devices) and _addressable(g.dst_devices)
      single = len(g.src_devices) == 1 and len(g.dst_devices) == 1
      for i in g.indices:
        x, s, cs = leaves[i], dsts[i], sems[i]
        if s is None:
          if cs == _REUSE:  # returned as it is, deleted or not (as in jax)
            routes.setdefault(ALIAS, []).append(i)
          else:
            if x.is_deleted():
              req.deleted.append(i)
            routes.setdefault(JAX, []).append(i)
          continue
        layout = None if layouts is None else layouts[i]
        if (
          in_place
          and cs == _REUSE
          and x.committed
          and x.sharding == s
          and (layout is None or _format_matches(x, s, layout))
          and not (
            # jax.device_put returns an array in place as it is for a
            # Sharding target, deleted or not, but places it anew for a
            # Device, which raises for a deleted array.
            isinstance(req.raw_targets[i], jax.Device) and x.is_deleted()
          )
        ):
          route = ALIAS
        elif x.is_deleted():  # jax.device_put raises for it
          req.deleted.append(i)
          route = JAX
        elif not addressable:
          route = JAX
        elif (
          # One device to one: checked as same_indices checks a target.
          placeable(req, i, s, x.shape)
          if single
          else same_indices(req, i, x.sharding, s, x.shape)
        ):
          route = COPY
        else:
          route = JAX
        routes.setdefault(route, []).append(i)
    else:
      routes[JAX] = list(g.indices)
      req.deleted.extend(
        i
        for i in g.indices
        if isinstance(leaves[i], jax.Array) and leaves[i].is_deleted()
      )
    for route, idx in routes.items():
      batch = Batch(g, route, idx)
      if layouts is not None and route != ALIAS:
        batch.relayout = [
          i for i in idx if layouts[i] is not None and _needs_relayout(req, i)
        ]
      batches.append(batch)
  return batches


def _needs_relayout(req: Request, i: int) -> bool:
  """Whether leaf i, placed plainly, would not have its target layout (a prediction)."""
  assert req.layouts is not None
  x, s, layout = req.leaves[i], req.dsts[i], req.layouts[i]
  if isinstance(x, jax.Array):
    try:
      # jax's stubs for jax.Array lack .format (ArrayImpl has it).
      current = x.format.layout  # type: ignore[attr-defined]
    except Exception:  # a layout the runtime does not report
      return True
    return not layout_matches(layout, current)
  if s is None:  # no target sharding: check after placing
    return True
  try:
    shape = tuple(np.shape(x))
    dtype = jax.dtypes.canonicalize_dtype(np.result_type(x))
    device = next(iter(jax_internals.device_list(s)))
    default = jax_internals.default_layout(
      dtype, tuple(s.shard_shape(shape)), device
    )
  except Exception:  # not an array, or no default layout: check after placing
    return True
  return not layout_matches(layout, default)


def execute(
  req: Request,
  batches: list[Batch],
  copy_host: bool = False,
  restored: bool = False,
) -> list[Any]:
  """Runs the batches; returns the flat results in leaf order.

  With ``copy_host``, host arrays are always copied. Otherwise the runtime may
  alias a numpy array (a memory map, say) as jax.device_put does on CPU.
  ``restored``: the numpy arrays are restore's reads. They are the caller's
  own buffers: a shard may alias its host buffer, but devices that hold the
  same index (replicated mesh axes) each get a copy (one buffer backing
  several shards would let a donation on one device change another's
  input). And they were read from the one save every process of a
  collective restore agreed on: they are equal on every process by
  construction, so no collective compares them (a process whose read failed
  would leave the others waiting in it; the restore's board tells them).
  """
  out: list[Any] = [None] * len(req.leaves)
  # Whether each result holds a new buffer we may donate to a relayout.
  fresh = [False] * len(req.leaves)
  delegated: list[int] = []
  multihost: list[Any] = []
  with jax_internals.explicit_device_put_scope():
    host_batches = [b for b in batches if b.route == HOST]
    if not restored:
      _check_host_values(req, host_batches, multihost)
    if host_batches:  # every group's host leaves in one go (_put_host)
      host = [i for b in host_batches for i in b.indices]
      _put_host(req, host, out, fresh, copy_host, restored)
    for b in batches:
      if b.route == ALIAS:
        for i in b.indices:
          out[i] = req.leaves[i]
      elif b.route == COPY:
        _copy_device(req, b, out, fresh)
      elif b.route != HOST:
        delegated.extend(b.indices)
    if delegated:
      delegated.sort()
      _put_with_jax(req, delegated, out)
    if req.layouts is not None:
      _relayout(req, batches, out, fresh)
  return out


def _check_host_values(
  req: Request, host_batches: list[Batch], found: list[Any]
) -> None:
  """Host values going to shardings over all processes must be equal on every process
  (as jax.device_put requires); checked in one collective for the whole call."""
  if jax.process_count() == 1 or not host_batches:
    return
  x64 = jax_internals.enable_x64()
  for b in host_batches:
    for i in b.indices:
      x = req.leaves[i]
      s = req.dsts[i] or req.default_dst
      key = (x.shape, x.dtype, s, x64, req.committed[i])
      entry = _HOST_CACHE.get(key) or _host_entry(req, i, key)
      if entry.multihost:
        found.append(x)
  if found:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

    multihost_utils.assert_equal(
      found,
      fail_message=f"{req.api}: numpy values placed on shardings that span all "
      "processes must be equal on every process; pass the same values on each process, or "
      "place per-process values with jax.make_array_from_process_local_data",
    )


def _put_pool() -> ThreadPoolExecutor:
  global _pool
  with _pool_lock:
    if _pool is None:
      _pool = ThreadPoolExecutor(_PUT_THREADS, "jaxworks-device-put")
    return _pool


def _put_host(
  req: Request,
  indices: list[int],
  out: list[Any],
  fresh: list[bool],
  copy: bool,
  private: bool = False,
) -> None:
  """Puts the host leaves at ``indices``; two or more large ones from the
  put pool (PARALLEL_PUT_BYTES), under this thread's transfer guard."""
  x64 = jax_internals.enable_x64()
  large = [i for i in indices if req.leaves[i].nbytes >= PARALLEL_PUT_BYTES]
  parallel = set(large) if len(large) > 1 else set()
  entries = {}
  for i in indices:
    key = (
      req.leaves[i].shape,
      req.leaves[i].dtype,
      req.dsts[i] or req.default_dst,
      x64,
      req.committed[i],
    )
    entries[i] = _HOST_CACHE.get(key) or _host_entry(req, i, key)
    if i not in parallel:
      out[i] = _put_one(req, i, entries[i], copy, private)
    fresh[i] = True
  if parallel:
    level = jax_internals.host_to_device_guard()

    def put(i: int) -> Any:
      with jax_internals.guarded_as(level):
        return _put_one(req, i, entries[i], copy, private)

    for i, y in zip(large, _put_pool().map(put, large)):
      out[i] = y


def _put_one(
  req: Request, i: int, entry: HostEntry, copy: bool, private: bool
) -> Any:
  """Host leaf ``i`` put onto the devices of its sharding (``entry``)."""
  put = jax_internals.batched_device_put
  x, c = req.leaves[i], req.committed[i]
  s = req.dsts[i] or req.default_dst
  devices, slices = entry.devices, entry.slices
  if slices is None:
    shards = [x] * len(devices)
  else:
    shards = [x[k] for k in slices]
  copy_x = copy or (
    private
    and (entry.per_device is not None or (slices is None and len(devices) > 1))
  )
  if copy_x and entry.per_device is not None:
    # Each device gets its own copy of its index, then the copies are
    # assembled into one array without another copy.
    shards = [
      put(shard_aval, one, [shard], [d], True, True)
      for (shard_aval, one), shard, d in zip(entry.per_device, shards, devices)
    ]
    return put(entry.aval, s, shards, devices, c, False)
  return put(entry.aval, s, shards, devices, c, copy_x)


def _copy_device(
  req: Request, b: Batch, out: list[Any], fresh: list[bool]
) -> None:
  leaves, dsts, sems = req.leaves, req.dsts, req.semantics
  xs = [leaves[i] for i in b.indices]
  shardings = [dsts[i] for i in b.indices]
  last, last_list = None, None
  device_lists = []
  for s in shardings:
    if s is not last:
      last, last_list = s, jax_internals.device_list(s)
    device_lists.append(last_list)
  same_place = (
    b.group.src_devices == b.group.dst_devices
    and b.group.src_memory_kind == b.group.dst_memory_kind
  )
  semantics = [sems[i] for i in b.indices]
  if not same_place:
    # Donation is best effort. A copy to other devices never reuses the input
    # buffer, and jaxlib 0.10.2 (CPU) leaves a cross-device DONATE_INPUT source
    # in a state that crashes on its next use, so such leaves are plain copies.
    semantics = [_REUSE if cs == _DONATE else cs for cs in semantics]
  ys = jax_internals.batched_copy(xs, device_lists, shardings, semantics)
  for i, x, y, s in zip(b.indices, xs, ys, shardings):
    # The copy keeps the input's aval and committedness; jax.device_put's result is
    # committed, with the aval the target sharding gives.
    src_aval = x.aval
    key = (src_aval, s)
    aval = _DST_AVAL.get(key, _MISSING)
    if aval is _MISSING:
      dst_aval = jax_internals.device_put_aval(src_aval, s)
      aval = _remember(
        _DST_AVAL, key, None if dst_aval == src_aval else dst_aval
      )
    if aval is not None or not y.committed:
      y = jax_internals.committed_array(
        y, src_aval if aval is None else aval, s
      )
    out[i] = y
    fresh[i] = not same_place or sems[i] != _REUSE


def _put_with_jax(req: Request, indices: list[int], out: list[Any]) -> None:
  values = [req.leaves[i] for i in indices]
  # Layouts are applied afterwards by _relayout, on the target devices: jax.device_put
  # cannot relayout an array committed to other devices.
  targets = [
    req.raw_targets[i]
    if req.layouts is None or req.layouts[i] is None
    else req.dsts[i]
    for i in indices
  ]
  srcs = None if req.srcs is None else [req.srcs[i] for i in indices]
  results = jax_internals.stock_device_put(
    values,
    targets,
    src=srcs,
    donate=[req.donate[i] for i in indices],
    may_alias=[req.may_alias[i] for i in indices],
  )
  for i, y in zip(indices, results):
    out[i] = y


def _identity(*xs: Any) -> tuple[Any, ...]:
  return xs


def _relayout(
  req: Request, batches: list[Batch], out: list[Any], fresh: list[bool]
) -> None:
  """One jitted identity per destination device set for leaves whose layout differs."""
  layouts = req.layouts
  assert layouts is not None
  by_devices: dict[Any, list[int]] = {}
  for b in batches:
    if b.route == ALIAS:
      continue
    for i in b.indices:
      layout = layouts[i]
      if layout is not None and not layout_matches(
        layout, out[i].format.layout
      ):
        by_devices.setdefault(b.group.dst_devices, []).append(i)
  for indices in by_devices.values():
    formats = tuple(Format(layouts[i], req.dsts[i]) for i in indices)
    donate = tuple(
      k
      for k, i in enumerate(indices)
      if fresh[i] or req.semantics[i] == _DONATE
    )
    with warnings.catch_warnings():
      warnings.filterwarnings(
        "ignore", message="Some donated buffers were not usable"
      )
      ys = jax_internals.stock_jit(
        _identity, out_shardings=formats, donate_argnums=donate
      )(*[out[i] for i in indices])
    for i, y in zip(indices, ys):
      out[i] = y
