"""save / restore of pytrees as .npz files or directories of .npy files.

A leaf's key is its tree path joined by "/" ({"params": {"w": ...}} ->
"params/w"); a lone array is "leaf". In an .npz the key names the member
`<key>.npy`; in a directory the file `<dir>/<key>.npy`.

`restore` reads only the .npy headers first, checks every key, shape and dtype
against the target, and only then streams the data, memory-mapped, in batches
of at most `max_inflight_bytes`, each placed with one batched device_put.

>>> import os, tempfile, jax, numpy as np
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

import dataclasses
import os
import shutil
import struct
import tempfile
import zipfile
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental.layout import Format

from jaxworks.batched_transfer._src import targets
from jaxworks.batched_transfer._src.api import place
from jaxworks.batched_transfer._src.progress import Progress

_API = "jaxworks.batched_transfer"
_ROOT_KEY = "leaf"
_ZIP_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # 30 bytes; last two: name and extra lengths


def _key_part(api: str, entry: Any, path: Any) -> str:
  if isinstance(entry, jax.tree_util.DictKey):
    text = str(entry.key)
  elif isinstance(entry, jax.tree_util.SequenceKey):
    text = str(entry.idx)
  elif isinstance(entry, jax.tree_util.GetAttrKey):
    text = entry.name
  elif isinstance(entry, jax.tree_util.FlattenedIndexKey):
    text = str(entry.key)
  else:
    text = str(entry)
  if not text or text in (".", "..") or any(c in text for c in "/\\\0"):
    raise ValueError(
        f"{api}: the key {text!r} in tree path {jax.tree_util.keystr(path)} cannot name a file "
        "(empty, '.', '..', or containing '/', '\\\\' or NUL); rename it in the tree")
  return text


def leaf_keys(api: str, tree: Any) -> tuple[list[str], list[str], list[Any], Any]:
  """(file keys, tree paths, leaves, treedef) of `tree`; keys are unique."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  keys, paths, leaves = [], [], []
  seen: dict[str, str] = {}
  for path, leaf in flat:
    key = "/".join(_key_part(api, e, path) for e in path) or _ROOT_KEY
    where = jax.tree_util.keystr(path) or "<root>"
    if key in seen:
      raise ValueError(f"{api}: tree paths {seen[key]} and {where} both map to the key {key!r}; "
                       "use distinct keys")
    seen[key] = where
    keys.append(key)
    paths.append(where)
    leaves.append(leaf)
  return keys, paths, leaves, treedef


# ----------------------------------------------------------------------------- save


def _host_array(api: str, path: str, x: Any) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    raise ValueError(
        f"{api}: the leaf at {path} spans devices of other processes; gather it first "
        "(jax.experimental.multihost_utils.process_allgather) or save per process")
  return np.asarray(jax.device_get(x))


def save(path: str | os.PathLike[str], tree: Any, *, overwrite: bool = False) -> None:
  """Writes `tree` to an .npz file (path ends in .npz) or a directory of .npy files.

  Args:
    path: "<name>.npz" for one uncompressed archive (members memory-map on
      restore), anything else for a directory with one "<key>.npy" per leaf.
    tree: a pytree of arrays (numpy, jax.Array, scalars). Device arrays are
      fetched one at a time.
    overwrite: replace an existing file or directory of .npy files.

  Raises:
    FileExistsError: `path` exists and overwrite is False.
    ValueError: a key that cannot name a file, or two paths with one key.
  """
  api = f"{_API}.save"
  path = os.fspath(path)
  keys, paths, leaves, _ = leaf_keys(api, tree)
  if os.path.lexists(path) and not overwrite:
    raise FileExistsError(f"{api}: {path!r} exists; pass overwrite=True to replace it")
  parent = os.path.dirname(os.path.abspath(path))
  if path.endswith(".npz"):
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=parent)
    os.close(fd)
    try:
      with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key, where, x in zip(keys, paths, leaves):
          with zf.open(key + ".npy", "w", force_zip64=True) as f:
            np.lib.format.write_array(f, _host_array(api, where, x), allow_pickle=False)
      os.replace(tmp, path)
    except BaseException:
      os.unlink(tmp)
      raise
    return
  if os.path.lexists(path):
    _check_replaceable(api, path)
  tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
  try:
    for key, where, x in zip(keys, paths, leaves):
      file = os.path.join(tmp, *key.split("/")) + ".npy"
      os.makedirs(os.path.dirname(file), exist_ok=True)
      with open(file, "wb") as f:
        np.lib.format.write_array(f, _host_array(api, where, x), allow_pickle=False)
    if os.path.lexists(path):
      shutil.rmtree(path)
    os.replace(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _check_replaceable(api: str, path: str) -> None:
  if not os.path.isdir(path) or os.path.islink(path):
    raise FileExistsError(f"{api}: {path!r} exists and is not a directory; remove it first")
  for root, _, files in os.walk(path):
    for name in files:
      if not name.endswith(".npy"):
        raise FileExistsError(
            f"{api}: {path!r} holds {os.path.join(root, name)!r}, which is not an .npy file; "
            "overwrite only replaces directories written by save")


# ----------------------------------------------------------------------------- restore


@dataclasses.dataclass
class _Stored:
  """One array on disk: its header, and how to get the data."""

  shape: tuple[int, ...]
  dtype: np.dtype
  fortran: bool
  load: Callable[[], np.ndarray]  # memory-mapped where the format allows

  @property
  def nbytes(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _read_header(f: Any) -> tuple[tuple[int, ...], bool, np.dtype]:
  version = np.lib.format.read_magic(f)
  if version == (1, 0):
    return np.lib.format.read_array_header_1_0(f)
  return np.lib.format.read_array_header_2_0(f)


def _mapper(file: str, offset: int, shape: tuple[int, ...], dtype: np.dtype,
            fortran: bool) -> Callable[[], np.ndarray]:
  def load() -> np.ndarray:
    if int(np.prod(shape, dtype=np.int64)) == 0:
      return np.empty(shape, dtype, order="F" if fortran else "C")
    return np.memmap(file, dtype=dtype, mode="r", offset=offset, shape=shape,
                     order="F" if fortran else "C")
  return load


def _open_directory(api: str, path: str) -> dict[str, _Stored]:
  out: dict[str, _Stored] = {}
  for root, dirs, files in os.walk(path):
    dirs.sort()
    for name in sorted(files):
      if not name.endswith(".npy"):
        continue
      file = os.path.join(root, name)
      key = os.path.relpath(file, path)[:-4].replace(os.sep, "/")
      try:
        with open(file, "rb") as f:
          shape, fortran, dtype = _read_header(f)
          offset = f.tell()
      except (OSError, ValueError) as err:
        raise ValueError(f"{api}: {file!r} is not a readable .npy file: {err}") from None
      if dtype.hasobject:
        raise ValueError(f"{api}: {file!r} holds Python objects, which restore does not load")
      out[key] = _Stored(tuple(shape), dtype, fortran, _mapper(file, offset, shape, dtype, fortran))
  return out


def _open_npz(api: str, path: str) -> dict[str, _Stored]:
  out: dict[str, _Stored] = {}
  try:
    zf = zipfile.ZipFile(path)
  except (OSError, zipfile.BadZipFile) as err:
    raise ValueError(f"{api}: {path!r} is not a readable .npz file: {err}") from None
  with zf, open(path, "rb") as raw:
    for info in zf.infolist():
      if not info.filename.endswith(".npy"):
        continue
      key = info.filename[:-4]
      try:
        if info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1:
          raw.seek(info.header_offset)
          fields = _ZIP_LOCAL_HEADER.unpack(raw.read(_ZIP_LOCAL_HEADER.size))
          raw.seek(info.header_offset + _ZIP_LOCAL_HEADER.size + fields[-2] + fields[-1])
          shape, fortran, dtype = _read_header(raw)
          load = _mapper(path, raw.tell(), shape, dtype, fortran)
        else:  # compressed members cannot be mapped; they are read when their batch comes
          with zf.open(info) as member:
            shape, fortran, dtype = _read_header(member)
          load = _reader(path, info.filename)
      except (OSError, ValueError, struct.error) as err:
        raise ValueError(f"{api}: member {info.filename!r} of {path!r} is not a readable "
                         f".npy: {err}") from None
      if dtype.hasobject:
        raise ValueError(f"{api}: member {info.filename!r} of {path!r} holds Python objects")
      out[key] = _Stored(tuple(shape), dtype, fortran, load)
  return out


def _reader(path: str, member: str) -> Callable[[], np.ndarray]:
  def load() -> np.ndarray:
    with zipfile.ZipFile(path) as zf, zf.open(member) as f:
      return np.lib.format.read_array(f, allow_pickle=False)
  return load


def _compatible(stored: np.dtype, want: np.dtype) -> bool:
  # Types numpy cannot describe in .npy headers (bfloat16, float8, ...) are
  # stored as raw void data of the same width.
  return stored == want or (stored.kind == "V" and stored.fields is None and
                            stored.itemsize == want.itemsize and want.kind == "V")


def _placement_of(leaf: Any) -> Any:
  fmt = getattr(leaf, "format", None)
  if isinstance(fmt, Format) and fmt.sharding is not None:
    return fmt if fmt.layout is not None else fmt.sharding
  return getattr(leaf, "sharding", None)


def restore(path: str | os.PathLike[str], target: Any, *, placement: Any = None,
            max_inflight_bytes: int = 256 * 2**20, progress: bool | None = None) -> Any:
  """Loads a checkpoint written by `save` onto devices, validated and streamed.

  Args:
    path: an .npz file or a directory of .npy files.
    target: a pytree whose leaves have .shape and .dtype (jax.ShapeDtypeStruct,
      jax.Array, numpy arrays): the structure, shapes and dtypes to expect.
      Unless `placement` is given, each leaf's .format / .sharding says where
      it goes (none: the default device).
    placement: a device_put target (Device, Sharding, Format or a pytree
      prefix of them) overriding the target leaves' placement.
    max_inflight_bytes: the most bytes read and transferred at once; a batch
      is placed and finished before the next is read. A single larger leaf
      goes alone.
    progress: draw a progress bar on stderr: True, False, or None (only when
      stderr is a terminal).

  Returns:
    A pytree like `target` of placed jax.Arrays.

  Raises:
    ValueError: a key missing from or extra in the file, or a shape or dtype
      that differs from the target's (the message names the tree path); raised
      before any array is placed.
  """
  api = f"{_API}.restore"
  path = os.fspath(path)
  if not isinstance(max_inflight_bytes, int) or max_inflight_bytes <= 0:
    raise ValueError(f"{api}: max_inflight_bytes must be a positive int, got "
                     f"{max_inflight_bytes!r}")
  keys, paths, leaves, treedef = leaf_keys(api, target)
  if os.path.isdir(path):
    stored = _open_directory(api, path)
  elif os.path.isfile(path):
    stored = _open_npz(api, path)
  else:
    raise FileNotFoundError(f"{api}: no checkpoint at {path!r} (expected an .npz file or a "
                            "directory of .npy files written by save)")

  # 1. Validate everything before placing anything.
  missing = [(p, k) for p, k in zip(paths, keys) if k not in stored]
  if missing:
    listed = ", ".join(f"{p} (key {k!r})" for p, k in missing[:5])
    raise ValueError(f"{api}: {len(missing)} leaves of the target are missing from {path!r}: "
                     f"{listed}{' ...' if len(missing) > 5 else ''}")
  extra = sorted(set(stored) - set(keys))
  if extra:
    raise ValueError(f"{api}: {path!r} holds {len(extra)} arrays the target has no leaf for: "
                     f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}; restore into a "
                     "target with these leaves")
  if placement is None:
    places = [_placement_of(x) for x in leaves]
  else:
    places = targets.broadcast_prefix(api, "placement", placement, target, treedef, len(leaves),
                                      targets.is_target_leaf, targets.TARGET_TEXT)
  normalized: dict[int, Any] = {}
  for p, where, key, x in zip(places, paths, keys, leaves):
    want_shape, want_dtype = tuple(x.shape), np.dtype(x.dtype)
    s = stored[key]
    if s.shape != want_shape or not _compatible(s.dtype, want_dtype):
      raise ValueError(f"{api}: the leaf at {where} (key {key!r}) is stored as "
                       f"{s.dtype.name}{list(s.shape)} but the target expects "
                       f"{want_dtype.name}{list(want_shape)}")
    if id(p) not in normalized:
      try:
        normalized[id(p)] = targets.normalize_target(api, p)
      except targets.Delegate:
        raise ValueError(f"{api}: placement {p!r} at {where} depends on the mesh context; pass "
                         "a Sharding") from None
    sharding = normalized[id(p)][0]
    if sharding is not None:
      try:
        sharding.shard_shape(want_shape)
      except Exception as err:  # the sharding's own message says why
        raise ValueError(f"{api}: the leaf at {where} with shape {want_shape} cannot be "
                         f"placed on {sharding}: {err}") from None

  # 2. Stream: read (memory-mapped) and place batch by batch.
  out: list[Any] = [None] * len(leaves)
  bar = Progress("restore", sum(stored[k].nbytes for k in keys), enabled=progress)
  batch: list[int] = []
  batch_bytes = 0

  def flush() -> None:
    arrays = []
    for i in batch:
      a = stored[keys[i]].load()
      want = np.dtype(leaves[i].dtype)
      arrays.append(a if a.dtype == want else a.view(want))
    # A copy, not an alias of the mapped file: the arrays must not change (or fault) when
    # the file is rewritten, and max_inflight_bytes bounds real reads.
    placed = place(arrays, [places[i] for i in batch], copy_host=True, api=api)
    jax.block_until_ready(placed)
    for i, y in zip(batch, placed):
      out[i] = y
    bar.update(sum(stored[keys[i]].nbytes for i in batch))

  try:
    for i, key in enumerate(keys):
      nbytes = stored[key].nbytes
      if batch and batch_bytes + nbytes > max_inflight_bytes:
        flush()
        batch, batch_bytes = [], 0
      batch.append(i)
      batch_bytes += nbytes
    if batch:
      flush()
  except BaseException:
    for y in out:  # nothing stays half-placed
      if isinstance(y, jax.Array) and not y.is_deleted():
        y.delete()
    raise
  finally:
    bar.close()
  return treedef.unflatten(out)
