"""restore: a checkpoint written by save onto devices, validated and streamed.

``restore`` reads only the .npy headers first, checks every key, shape and dtype
against the target, and only then streams the data: batches of at most half of
``max_inflight_bytes`` (and at most ``BATCH_CAP``) are read on a background
thread straight into new aligned host buffers, ahead of the batch being placed
with one batched device_put.

>>> import os, shutil, tempfile, jax, numpy as np
>>> from jaxworks.batched_transfer import save
>>> tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.int32)}
>>> path = os.path.join(tempfile.mkdtemp(), "ckpt.npz")
>>> save(path, tree)
>>> like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
>>> out = restore(path, like, placement=jax.devices()[1])
>>> out["w"].devices(), np.asarray(out["w"])[1].tolist()
({CpuDevice(id=1)}, [3.0, 4.0, 5.0])
>>> shutil.rmtree(os.path.dirname(path))
"""

from __future__ import annotations

import os
from typing import Any

import jax
from jax.experimental.layout import Format
import numpy as np

from .. import jax_internals
from .. import prefetch
from .. import targets
from ..api import place
from ..progress import Progress
from ..transfer import placement_error
from . import commit
from . import files
from . import manifest
from . import sharded_restore
from .keys import check_keys
from .keys import leaf_keys
from .keys import python_scalar_dtype

_API = "jaxworks.batched_transfer"
# The most bytes in one batch, whatever the budget: smaller batches let
# reading overlap placing in checkpoints of a few batches' size too.
BATCH_CAP = 16 * 2**20


def _placement_of(leaf: Any) -> Any:
  fmt = getattr(leaf, "format", None)
  if isinstance(fmt, Format) and fmt.sharding is not None:
    return fmt if fmt.layout is not None else fmt.sharding
  return getattr(leaf, "sharding", None)


def _target_spec(
  api: str, where: str, x: Any
) -> tuple[tuple[int, ...], np.dtype, bool]:
  """(shape, dtype, weak_type) a target leaf asks for."""
  scalar_dtype = python_scalar_dtype(x)
  if (
    scalar_dtype is not None
  ):  # as jax.device_put places it, and save stores it
    return (
      (),
      scalar_dtype,
      not isinstance(x, bool),
    )  # JAX gives bools a strong type
  shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
  try:
    if shape is None:
      raise TypeError("no shape")
    shape, dtype = tuple(int(d) for d in shape), np.dtype(dtype)
  except TypeError:
    raise TypeError(
      f"{api}: the target leaf at {where} is {x!r:.80} of type {type(x).__name__}, which has no "
      "shape and dtype; use jax.ShapeDtypeStruct, an array or a Python scalar "
      "(jax.eval_shape(init_fn) gives such a tree)"
    ) from None
  return shape, dtype, bool(getattr(x, "weak_type", False))


def _dtype_text(dtype: np.dtype) -> str:
  return dtype.name if dtype.isnative else dtype.str


def _x32(dtype: np.dtype) -> np.dtype:
  """What JAX makes of ``dtype`` with jax_enable_x64 off."""
  with jax.enable_x64(False):
    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def _check_leaf(
  api: str,
  where: str,
  key: str,
  s: files.Stored,
  shape: tuple[int, ...],
  dtype: np.dtype,
) -> None:
  """Shape, dtype and data extent of one stored array against its target leaf."""
  if s.exact is None and s.dtype.kind == "V" and s.dtype.fields is None:
    raise ValueError(
      f"{api}: the leaf at {where} (key {key!r}) is stored in {s.where} as raw "
      f"{s.dtype.itemsize}-byte values with no dtype record, so its type is unknown (several "
      f"types are {s.dtype.itemsize} bytes wide); write the checkpoint with "
      "jaxworks.batched_transfer.save, which records exact dtype names"
    )
  stored = s.value_dtype
  # The target may name the stored dtype as JAX canonicalizes it (float32 for float64 data
  # with jax_enable_x64 off, as jax.eval_shape reports it): the data is then placed as
  # jax.device_put places it.
  same = (
    stored == dtype or np.dtype(jax.dtypes.canonicalize_dtype(stored)) == dtype
  )
  if s.shape != shape or not same:
    hint = ""
    if (
      s.shape == shape and jax_internals.enable_x64() and _x32(stored) == dtype
    ):
      hint = (
        f". With jax_enable_x64 on, {dtype.name} data is not {stored.name}: restore "
        f"into a target leaf of dtype {stored.name}, or outside jax.enable_x64"
      )
    raise ValueError(
      f"{api}: the leaf at {where} (key {key!r}) is stored as "
      f"{_dtype_text(stored)}{list(s.shape)} but the target expects "
      f"{dtype.name}{list(shape)}{hint}"
    )
  if s.data_bytes != s.nbytes:
    raise ValueError(
      f"{api}: the leaf at {where} (key {key!r}): {s.where} holds {s.data_bytes} bytes of "
      f"data but its header ({_dtype_text(stored)}{list(s.shape)}) needs {s.nbytes}; the file "
      "is truncated or damaged. Nothing was placed"
    )


def _weak(y: Any) -> Any:
  """``y`` with a weak type (as jax.device_put gives a Python scalar), sharing its buffer."""
  return jax_internals.committed_array(
    y, y.aval.update(weak_type=True), y.sharding, committed=y.committed
  )


def restore(
  path: str | os.PathLike[str],
  target: Any,
  *,
  placement: Any = None,
  max_inflight_bytes: int = 256 * 2**20,
  read_threads: int | None = None,
  progress: bool | None = None,
) -> Any:
  """Loads a checkpoint written by ``save`` onto devices, validated and streamed.

  Args:
    path: an .npz file or a directory of .npy files, or a directory that
      several processes wrote (a manifest and shard files), read onto the
      same kinds of targets, each process reading only what its devices
      hold.
    target: a pytree whose leaves say what to expect: jax.ShapeDtypeStruct,
      jax.Array or numpy array leaves (their .shape, .dtype and weak_type), or
      Python scalars (a 0-d array of the dtype and weak type jax.device_put
      gives them), as ``jax.eval_shape(init_fn)`` returns. Unless ``placement``
      is given, each leaf's .format / .sharding says where it goes (none: the
      default device).
    placement: a device_put target (Device, Sharding, Format or a pytree
      prefix of them) overriding the target leaves' placement.
    max_inflight_bytes: the most bytes read and not yet placed at once. The
      data is read in batches of at most half of it (and at most 16 MiB),
      the next batches while one is placed; a single larger leaf is read
      alone.
    read_threads: threads reading one array's file at once (default: the
      CPU count, at most 8); 1 reads each file on one thread.
    progress: draw a progress bar on stderr: True, False, or None (only when
      stderr is a terminal).

  Returns:
    A pytree like ``target`` of placed jax.Arrays (weakly typed where the target
    leaf is).

  Raises:
    ValueError: a key missing from or extra in the file, a shape or exact
      dtype that differs from the target's, or data shorter or longer than its
      header says (the message names the tree path and the file); raised
      before any array is placed. Also a file that is not a regular file, or
      one replaced or modified after it was validated (the data is read
      through the descriptors validated: a checkpoint replaced at ``path``
      meanwhile is read whole as validated); nothing stays placed.
    FileNotFoundError: nothing at ``path``.
    TypeError: a target leaf with no shape and dtype.
  """
  api = f"{_API}.restore"
  path = os.fspath(path)
  if not isinstance(max_inflight_bytes, int) or max_inflight_bytes <= 0:
    raise ValueError(
      f"{api}: max_inflight_bytes must be a positive int, got "
      f"{max_inflight_bytes!r}"
    )
  if read_threads is None:
    read_threads = files.default_read_threads()
  elif (
    isinstance(read_threads, bool)
    or not isinstance(read_threads, int)
    or read_threads <= 0
  ):
    raise ValueError(
      f"{api}: read_threads must be a positive int or None, got "
      f"{read_threads!r}"
    )
  keys, paths, leaves, treedef = leaf_keys(api, target)
  specs = [_target_spec(api, where, x) for where, x in zip(paths, leaves)]
  if not os.path.lexists(path):
    commit.recover(path)  # the old copy of a save killed between two renames
  opened_manifest = manifest.open_manifest(api, path)
  if opened_manifest is not None:  # written by several processes: shard files
    return sharded_restore.restore_tree(
      api,
      opened_manifest,
      target,
      treedef,
      leaves,
      keys,
      paths,
      specs,
      placement,
      _placement_of,
      _weak,
      max_inflight_bytes,
      read_threads,
      progress,
      BATCH_CAP,
    )
  # Opened once: the data is read through the descriptors validated here.
  with files.open_checkpoint(api, path) as opened:
    files.apply_record(api, path, opened.stored, opened.record)
    places = _validate(
      api,
      path,
      opened.stored,
      target,
      placement,
      keys,
      paths,
      leaves,
      treedef,
      specs,
    )
    out = _stream(
      api,
      opened.stored,
      keys,
      paths,
      places,
      specs,
      max_inflight_bytes,
      read_threads,
      progress,
    )
  return treedef.unflatten(out)


def _validate(
  api: str,
  path: str,
  stored: dict[str, files.Stored],
  target: Any,
  placement: Any,
  keys: list[str],
  paths: list[str],
  leaves: list[Any],
  treedef: Any,
  specs: list[tuple[tuple[int, ...], np.dtype, bool]],
) -> list[Any]:
  """Checks every key, shape, dtype, extent and placement; the placements."""
  check_keys(api, path, keys, paths, stored)
  places = targets.resolve_placement(
    api, placement, target, treedef, leaves, _placement_of
  )
  normalized: dict[int, Any] = {}
  for p, where, key, (want_shape, want_dtype, _) in zip(
    places, paths, keys, specs
  ):
    _check_leaf(api, where, key, stored[key], want_shape, want_dtype)
    if id(p) not in normalized:
      normalized[id(p)] = targets.restore_target(api, p, where)
    sharding = normalized[id(p)][0]
    if sharding is not None:
      try:
        sharding.shard_shape(want_shape)
      except Exception as err:  # the sharding's own message says why
        raise placement_error(
          err,
          sharding,
          want_shape,
          f"{api}: the leaf at {where} with shape {want_shape} cannot be "
          f"placed on {sharding}: {err}",
        ) from None
  return places


def _stream(
  api: str,
  stored: dict[str, files.Stored],
  keys: list[str],
  paths: list[str],
  places: list[Any],
  specs: list[tuple[tuple[int, ...], np.dtype, bool]],
  max_inflight_bytes: int,
  read_threads: int,
  progress: bool | None,
) -> list[Any]:
  """Reads and places the validated arrays; the placed leaves in order."""
  # Batches of at most half the budget (and BATCH_CAP); a background
  # thread reads ahead (straight into new aligned buffers of their own memory
  # maps, a large file by read_threads threads at once) while one is placed.
  # The buffers are restore's own, so placing them may alias them (on CPU the
  # device array takes the buffer over: no second copy).
  # Host buffers of arrays already dropped (earlier restores, on CPU) go first,
  # not at Python's next garbage collection.
  jax_internals.release_dropped_host_buffers()
  sizes = [stored[k].nbytes for k in keys]
  limit = min(max(1, max_inflight_bytes // 2), BATCH_CAP)
  batches = prefetch.split_batches(sizes, limit)
  out: list[Any] = [None] * len(keys)
  bar = Progress("restore", sum(sizes), enabled=progress)
  readers = files.Files(read_threads)

  def read_batch(k: int) -> list[np.ndarray]:
    return [
      files.load(api, paths[i], keys[i], stored[keys[i]], readers)
      for i in batches[k]
    ]

  reader = prefetch.BatchReader(
    read_batch, [sum(sizes[i] for i in b) for b in batches], max_inflight_bytes
  )

  def place_batch(batch: list[int], arrays: Any) -> None:
    placed = place(
      arrays, [places[i] for i in batch], private_host=True, api=api
    )
    for i, y in zip(batch, placed):
      out[i] = y  # from here on deleted if anything fails

  def after_batch(batch: list[int]) -> None:
    for i in batch:
      if specs[i][2]:
        out[i] = _weak(out[i])
    bar.update(sum(sizes[i] for i in batch))

  try:
    prefetch.place_batches(reader, batches, place_batch, out, after_batch)
  finally:
    readers.close()
    bar.close()
  return out
