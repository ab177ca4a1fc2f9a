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
from . import record as record_lib
from . import sharded_restore
from . import shardings
from .keys import ROOT_KEY
from .keys import astype
from .keys import cast_to
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
      "(jax.eval_shape(init_fn) gives such a tree; a str target leaf stands "
      "for a str leaf that save stored, and this one is an array)"
    ) from None
  return shape, dtype, bool(getattr(x, "weak_type", False))


def _dtype_text(dtype: np.dtype) -> str:
  return dtype.name if dtype.isnative else dtype.str


def _check_leaf(
  api: str,
  path: str,
  where: str,
  key: str,
  s: files.Stored,
  shape: tuple[int, ...],
) -> None:
  """Shape, dtype and data extent of one stored array against its target
  leaf (a dtype other than the stored one is a cast, see load)."""
  if s.exact is None and s.dtype.kind == "V" and s.dtype.fields is None:
    raise ValueError(
      f"{api}: the leaf at {where} (key {key!r}) is stored in {s.where} as raw "
      f"{s.dtype.itemsize}-byte values with no dtype record, so its type is unknown (several "
      f"types are {s.dtype.itemsize} bytes wide); write the checkpoint with "
      "jaxworks.batched_transfer.save, which records exact dtype names"
    )
  if s.shape != shape:
    raise ValueError(
      f"{api}: the leaf at {where} (key {key!r}) is stored in {s.where} as "
      f"{_dtype_text(s.value_dtype)}{list(s.shape)} but the target expects "
      f"shape {list(shape)}; restore into a target of the stored shape "
      "(bt.metadata(path) lists them)"
    )
  if s.data_bytes != s.nbytes:
    raise ValueError(
      f"{api}: the leaf at {where} (key {key!r}): {s.where} holds {s.data_bytes} bytes of "
      f"data but its header ({_dtype_text(s.value_dtype)}{list(s.shape)}) needs {s.nbytes}; the file "
      "is truncated or damaged. Nothing was placed"
    )


class Target:
  """A restore target's leaves sorted against a checkpoint: the arrays to
  read (indices into the flat target), the leaves stored by value (``str``
  and None), and, without a target, one built from the checkpoint's record
  (arrays as saved; Python scalars back as their type)."""

  def __init__(
    self,
    api: str,
    path: str,
    target: Any,
    arrays: dict[str, tuple[tuple[int, ...], np.dtype]],
    record: record_lib.Record,
    partial: bool,
  ) -> None:
    self.python: dict[int, type] = {}
    built = target is None
    if built:
      target = _as_saved(arrays, record)
    keys, paths, leaves, self.treedef = leaf_keys(api, target)
    self.target, self.keys, self.paths, self.leaves = (
      target,
      keys,
      paths,
      leaves,
    )
    stored = set(arrays) | {
      k for k, v in record.values.items() if v is not None
    }
    check_keys(api, path, keys, paths, stored, partial and not built)
    self.values: dict[int, str] = {}
    self.arrays: list[int] = []
    for i, (key, where, x) in enumerate(zip(keys, paths, leaves)):
      if key in record.values:
        if not isinstance(x, str):
          raise ValueError(
            f"{api}: the leaf at {where} (key {key!r}) is stored in {path!r} "
            f"as the str {record.values[key]!r:.40} but the target expects "
            f"{_describe(x)}; put a str in the target there"
          )
        self.values[i] = record.values[key]  # type: ignore[assignment]
        continue
      if built and key in record.python:
        self.python[i] = record_lib.PYTHON_TYPES[record.python[key]]
      self.arrays.append(i)

  def pick(self, items: list[Any]) -> list[Any]:
    """``items`` (one per target leaf) of the array leaves."""
    return [items[i] for i in self.arrays]

  def finish(self, placed: list[Any]) -> Any:
    """The restored tree from the placed arrays (in ``arrays`` order)."""
    out: list[Any] = [None] * len(self.leaves)
    for i, value in self.values.items():
      out[i] = value
    for i, y in zip(self.arrays, placed):
      t = self.python.get(i)
      out[i] = y if t is None else t(np.asarray(y).item())
    return self.treedef.unflatten(out)


def _describe(x: Any) -> str:
  shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
  if shape is not None and dtype is not None:
    return f"an array {np.dtype(dtype).name}{list(shape)}"
  return f"{x!r:.40}"


def _as_saved(
  arrays: dict[str, tuple[tuple[int, ...], np.dtype]],
  record: record_lib.Record,
  with_shardings: bool = False,
) -> Any:
  """The tree a checkpoint holds, with a jax.ShapeDtypeStruct per array
  (restore without a target, and ``metadata``, which also gives each the
  sharding it was saved with, where this job has its devices)."""
  tree = record.tree
  if tree is None:  # written before the record had it: dicts by key
    keys = sorted(set(arrays) | set(record.values))
    if keys == [ROOT_KEY]:
      tree = [(ROOT_KEY, "")]
    else:
      tree = [(k, "d" * len(k.split("/"))) for k in keys]

  def leaf(key: str) -> Any:
    if key in record.values:
      return record.values[key]
    shape, dtype = arrays[key]
    desc = record.shardings.get(key) if with_shardings else None
    sharding = None if desc is None else shardings.rebuild(desc)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

  return record_lib.rebuild(tree, leaf)


def _weak(y: Any) -> Any:
  """``y`` with a weak type (as jax.device_put gives a Python scalar), sharing its buffer."""
  return jax_internals.committed_array(
    y, y.aval.update(weak_type=True), y.sharding, committed=y.committed
  )


def restore(
  path: str | os.PathLike[str],
  target: Any = None,
  *,
  placement: Any = None,
  partial_restore: bool = False,
  verify: bool = True,
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
      gives them), as ``jax.eval_shape(init_fn)`` returns; ``str`` leaves
      where str leaves were saved. A dtype other than the stored one is a
      cast (numpy's ``astype``). Unless ``placement`` is given, each leaf's
      .format / .sharding says where it goes (none: the default device).
      None: the tree as saved (nested dicts, lists for sequences), every
      array on the default device (or ``placement``), str and None leaves
      as saved, Python scalars as their Python type.
    placement: a device_put target (Device, Sharding, Format or a pytree
      prefix of them) overriding the target leaves' placement.
    partial_restore: let ``target`` name a subset of the stored leaves (a
      subtree, say ``{"params": ...}`` of a checkpoint that also holds
      ``opt_state``): only those are read. False: a stored leaf the target
      lacks raises ValueError.
    verify: check every array's data against the checksums save recorded
      (CRC-32C of each 8 MiB of a directory checkpoint's files, the CRC-32
      of each .npz member), in the threads that read it; a mismatch raises
      ValueError naming the file and nothing stays placed.
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
    leaf is), with the stored values at its str leaves.

  Raises:
    ValueError: a key missing from or extra in the file, a shape that
      differs from the target's, data shorter or longer than its header
      says, or data failing its checksum (the message names the tree path,
      the checkpoint and the file); raised before any array is placed
      (checksums: while reading, and nothing stays placed). Also a file that
      is not a regular file, or one replaced or modified after it was
      validated (the data is read through the descriptors validated: a
      checkpoint replaced at ``path`` meanwhile is read whole as validated).
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
  if not os.path.lexists(path):
    commit.recover(path)  # the old copy of a save killed between two renames
  opened_manifest = manifest.open_manifest(api, path)
  if opened_manifest is not None:  # written by several processes: shard files
    with opened_manifest:
      record = opened_manifest.read_record()
      arrays = {
        k: (e.shape, e.dtype) for k, e in opened_manifest.arrays.items()
      }
      t = Target(api, path, target, arrays, record, partial_restore)
      specs = [
        _target_spec(api, where, x)
        for where, x in zip(t.pick(t.paths), t.pick(t.leaves))
      ]
      places = t.pick(
        targets.resolve_placement(
          api, placement, t.target, t.treedef, t.leaves, _placement_of
        )
      )
      placed = sharded_restore.restore_arrays(
        api,
        opened_manifest,
        t.pick(t.keys),
        t.pick(t.paths),
        specs,
        places,
        _weak,
        max_inflight_bytes,
        read_threads,
        progress,
        BATCH_CAP,
        verify,
      )
    return t.finish(placed)
  # Opened once: the data is read through the descriptors validated here.
  with files.open_checkpoint(api, path) as opened:
    record = files.apply_record(api, path, opened.stored, opened.record)
    arrays = {k: (s.shape, s.value_dtype) for k, s in opened.stored.items()}
    t = Target(api, path, target, arrays, record, partial_restore)
    keys, paths = t.pick(t.keys), t.pick(t.paths)
    specs = [
      _target_spec(api, where, x) for where, x in zip(paths, t.pick(t.leaves))
    ]
    places = t.pick(
      targets.resolve_placement(
        api, placement, t.target, t.treedef, t.leaves, _placement_of
      )
    )
    _validate(api, path, opened.stored, places, keys, paths, specs)
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
      verify,
    )
  return t.finish(out)


def metadata(path: str | os.PathLike[str]) -> Any:
  """The tree a checkpoint holds, read from its headers, manifest and record
  only (no array data): a ``jax.ShapeDtypeStruct`` (shape, exact dtype, and
  the sharding a saved jax.Array had, where every device it names is one of
  this job's, else None) per array, the stored value per ``str`` or None
  leaf, nested as ``restore`` without a target nests it. A Python scalar
  leaf is the ShapeDtypeStruct of its 0-d array. ``restore(path,
  metadata(path))`` restores onto the saved shardings.

  >>> import os, tempfile, numpy as np
  >>> from jaxworks.batched_transfer import save
  >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
  >>> save(path, {"w": np.zeros((2, 3), np.float32), "run": "exp-42"})
  >>> metadata(path)
  {'run': 'exp-42', 'w': ShapeDtypeStruct(shape=(2, 3), dtype=float32)}
  """
  api = f"{_API}.metadata"
  return _as_saved(*read_record(api, os.fspath(path)), with_shardings=True)


def read_record(
  api: str, path: str
) -> tuple[dict[str, tuple[tuple[int, ...], np.dtype]], record_lib.Record]:
  """(key -> (shape, exact dtype) of every array, the record) of the
  checkpoint at ``path``, from its headers, manifest and record only."""
  if not os.path.lexists(path):
    commit.recover(path)
  opened_manifest = manifest.open_manifest(api, path)
  if opened_manifest is not None:
    with opened_manifest:
      record = opened_manifest.read_record()
      arrays = {
        k: (e.shape, e.dtype) for k, e in opened_manifest.arrays.items()
      }
  else:
    with files.open_checkpoint(api, path) as opened:
      record = files.apply_record(api, path, opened.stored, opened.record)
      arrays = {k: (s.shape, s.value_dtype) for k, s in opened.stored.items()}
  return arrays, record


def read_values(api: str, path: str) -> dict[str, str | None]:
  """The ``str`` and None leaves of the directory checkpoint at ``path``,
  from its record alone (no header is read)."""
  fd = os.open(path, manifest.DIR_FLAGS)
  try:
    data = manifest.read_small(api, path, fd, record_lib.NAME, "the record")
  finally:
    os.close(fd)
  if data is None:
    return {}
  where = f"the record {record_lib.NAME!r} of {path!r}"
  return record_lib.decode(api, where, data).values


def _validate(
  api: str,
  path: str,
  stored: dict[str, files.Stored],
  places: list[Any],
  keys: list[str],
  paths: list[str],
  specs: list[tuple[tuple[int, ...], np.dtype, bool]],
) -> None:
  """Checks every array's shape, extent and placement."""
  normalized: dict[int, Any] = {}
  for p, where, key, (want_shape, _, _) in zip(places, paths, keys, specs):
    _check_leaf(api, path, where, key, stored[key], want_shape)
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
  verify: bool = True,
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
  readers = files.Files(read_threads, verify)
  casts = [
    cast_to(stored[k].value_dtype, spec[1]) for k, spec in zip(keys, specs)
  ]

  def read_batch(k: int) -> list[np.ndarray]:
    out = []
    for i in batches[k]:
      a = files.load(api, paths[i], keys[i], stored[keys[i]], readers)
      cast = casts[i]
      out.append(a if cast is None else astype(a, cast))
    return out

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
