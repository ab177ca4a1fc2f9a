"""save / restore of pytrees as .npz files or directories of .npy files.

A leaf's key is its tree path joined by "/" ({"params": {"w": ...}} ->
"params/w"); a lone array is "leaf". In an .npz the key names the member
``<key>.npy``; in a directory the file ``<dir>/<key>.npy``.

``restore`` reads only the .npy headers first, checks every key, shape and dtype
against the target, and only then streams the data, memory-mapped, in batches
of at most ``max_inflight_bytes``, each placed with one batched device_put.

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

from collections.abc import Callable
import dataclasses
import json
import os
import shutil
import struct
import tempfile
from typing import Any
import zipfile
import zlib

import jax
from jax.experimental.layout import Format
import numpy as np

from . import jax_internals
from . import targets
from .api import place
from .progress import Progress

_API = "jaxworks.batched_transfer"
_ROOT_KEY = "leaf"
_ZIP_LOCAL_HEADER = struct.Struct(
  "<4s5H3L2H"
)  # 30 bytes; last two: name and extra lengths
# The exact dtype name of every leaf, next to the arrays (a member of the .npz, a file in
# the directory): .npy headers cannot name bfloat16, float8_*, int4, ... types.
DTYPE_RECORD = "jaxworks_dtypes.json"
_RECORD_FORMAT = 1


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
      "(empty, '.', '..', or containing '/', '\\\\' or NUL); rename it in the tree"
    )
  return text


def leaf_keys(
  api: str, tree: Any
) -> tuple[list[str], list[str], list[Any], Any]:
  """(file keys, tree paths, leaves, treedef) of ``tree``; keys are unique."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
  keys, paths, leaves = [], [], []
  seen: dict[str, str] = {}
  for path, leaf in flat:
    key = "/".join(_key_part(api, e, path) for e in path) or _ROOT_KEY
    where = jax.tree_util.keystr(path) or "<root>"
    if key in seen:
      raise ValueError(
        f"{api}: tree paths {seen[key]} and {where} both map to the key {key!r}; "
        "use distinct keys"
      )
    seen[key] = where
    keys.append(key)
    paths.append(where)
    leaves.append(leaf)
  return keys, paths, leaves, treedef


# ----------------------------------------------------------------------------- save


_PY_SCALARS = {
  bool: np.dtype(bool),
  int: np.dtype(np.int64),
  float: np.dtype(np.float64),
  complex: np.dtype(np.complex128),
}


def _python_scalar_dtype(x: Any) -> np.dtype | None:
  """The dtype jax.device_put gives a Python scalar (bool, int, float, complex), else None.

  Follows jax_enable_x64: a Python float is float32 with x64 off, float64 with it on.
  numpy scalars are not Python scalars here (they keep their dtype).
  """
  if isinstance(x, np.generic) or not isinstance(
    x, (bool, int, float, complex)
  ):
    return None
  for t in (
    bool,
    int,
    float,
    complex,
  ):  # bool before int: bool is an int subclass
    if isinstance(x, t):
      return np.dtype(jax.dtypes.canonicalize_dtype(_PY_SCALARS[t]))
  return None  # pragma: no cover - the isinstance above covers every case


def _host_array(api: str, path: str, x: Any) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    raise ValueError(
      f"{api}: the leaf at {path} spans devices of other processes; gather it first "
      "(jax.experimental.multihost_utils.process_allgather) or save per process"
    )
  scalar_dtype = _python_scalar_dtype(x)
  if scalar_dtype is not None:
    # Stored as jax.device_put would place it (and jax.eval_shape describes it).
    try:
      return np.asarray(x, dtype=scalar_dtype)
    except OverflowError as err:
      raise OverflowError(
        f"{api}: the Python scalar {x!r} at {path} does not fit "
        f"{scalar_dtype.name}, the dtype JAX gives it ({err}); pass a numpy "
        "array of a wider dtype or enable jax_enable_x64"
      ) from None
  a = np.asarray(jax.device_get(x))
  if not a.dtype.isnative:
    raise TypeError(
      f"{api}: the leaf at {path} has non-native byte order ({a.dtype.str}), which JAX does "
      "not accept (jax.device_put raises TypeError); convert it first with "
      "x.astype(x.dtype.newbyteorder('='))"
    )
  return a


def _storable(a: np.ndarray) -> np.ndarray:
  """``a``, or a raw-bytes view of it when numpy cannot describe its dtype in an .npy header
  (bfloat16, float8, int4, ...: their exact names go into the dtype record)."""
  try:
    descr = np.lib.format.dtype_to_descr(a.dtype)
    if np.lib.format.descr_to_dtype(descr) == a.dtype:
      return a
  except (TypeError, ValueError):
    pass
  return a.view(np.dtype(f"V{a.dtype.itemsize}"))


def _write_npy(f: Any, a: np.ndarray) -> None:
  np.lib.format.write_array(f, _storable(a), allow_pickle=False)


def _dtype_record(keys: list[str], arrays: list[np.ndarray]) -> bytes:
  return json.dumps(
    {
      "format": _RECORD_FORMAT,
      "dtypes": {k: a.dtype.name for k, a in zip(keys, arrays)},
    },
    indent=0,
    sort_keys=True,
  ).encode()


def save(
  path: str | os.PathLike[str], tree: Any, *, overwrite: bool = False
) -> None:
  """Writes ``tree`` to an .npz file (path ends in .npz) or a directory of .npy files.

  Args:
    path: "<name>.npz" for one uncompressed archive (members memory-map on
      restore), anything else for a directory with one "<key>.npy" per leaf.
    tree: a pytree of arrays (numpy, jax.Array, scalars). Device arrays are
      fetched one at a time.
    overwrite: replace an existing file or directory of .npy files.

  Raises:
    FileExistsError: ``path`` exists and overwrite is False.
    ValueError: a key that cannot name a file, or two paths with one key.
  """
  api = f"{_API}.save"
  path = os.fspath(path)
  keys, paths, leaves, _ = leaf_keys(api, tree)
  if os.path.lexists(path) and not overwrite:
    raise FileExistsError(
      f"{api}: {path!r} exists; pass overwrite=True to replace it"
    )
  parent = os.path.dirname(os.path.abspath(path))
  arrays = [_host_array(api, where, x) for where, x in zip(paths, leaves)]
  record = _dtype_record(keys, arrays)
  if path.endswith(".npz"):
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=parent)
    os.close(fd)
    try:
      with zipfile.ZipFile(
        tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True
      ) as zf:
        for key, a in zip(keys, arrays):
          with zf.open(key + ".npy", "w", force_zip64=True) as f:
            _write_npy(f, a)
        zf.writestr(DTYPE_RECORD, record)
      os.replace(tmp, path)
    except BaseException:
      os.unlink(tmp)
      raise
    return
  if os.path.lexists(path):
    _check_replaceable(api, path)
  tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
  try:
    for key, a in zip(keys, arrays):
      file = os.path.join(tmp, *key.split("/")) + ".npy"
      os.makedirs(os.path.dirname(file), exist_ok=True)
      with open(file, "wb") as f:
        _write_npy(f, a)
    with open(os.path.join(tmp, DTYPE_RECORD), "wb") as f:
      f.write(record)
    if os.path.lexists(path):
      shutil.rmtree(path)
    os.replace(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise


def _check_replaceable(api: str, path: str) -> None:
  if not os.path.isdir(path) or os.path.islink(path):
    raise FileExistsError(
      f"{api}: {path!r} exists and is not a directory; remove it first"
    )
  for root, _, files in os.walk(path):
    for name in files:
      if not name.endswith(".npy") and not (
        root == path and name == DTYPE_RECORD
      ):
        raise FileExistsError(
          f"{api}: {path!r} holds {os.path.join(root, name)!r}, which is not an .npy file; "
          "overwrite only replaces directories written by save"
        )


# ----------------------------------------------------------------------------- restore


@dataclasses.dataclass
class _Stored:
  """One array on disk: its header, where its data lies, and how to get it."""

  shape: tuple[int, ...]
  dtype: (
    np.dtype
  )  # as the .npy header says (may be raw void bytes, may be big-endian)
  fortran: bool
  where: str  # "'<file>'" or "member '<name>' of '<file>'", for messages
  data_bytes: int  # the bytes of data present after the header
  load: Callable[[], np.ndarray]  # memory-mapped where the format allows
  exact: np.dtype | None = None  # the dtype the record names (None: no record)

  @property
  def nbytes(self) -> int:
    """The bytes of data the header describes."""
    return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

  @property
  def value_dtype(self) -> np.dtype:
    """The dtype of the values: the recorded one, else the header's, in native order."""
    if self.exact is not None:
      return self.exact
    return self.dtype.newbyteorder("=")


def _read_header(f: Any) -> tuple[tuple[int, ...], bool, np.dtype]:
  version = np.lib.format.read_magic(f)
  if version == (1, 0):
    return np.lib.format.read_array_header_1_0(f)
  return np.lib.format.read_array_header_2_0(f)


def _mapper(
  file: str, offset: int, shape: tuple[int, ...], dtype: np.dtype, fortran: bool
) -> Callable[[], np.ndarray]:
  def load() -> np.ndarray:
    if int(np.prod(shape, dtype=np.int64)) == 0:
      return np.empty(shape, dtype, order="F" if fortran else "C")
    return np.memmap(
      file,
      dtype=dtype,
      mode="r",
      offset=offset,
      shape=shape,
      order="F" if fortran else "C",
    )

  return load


def _open_directory(
  api: str, path: str
) -> tuple[dict[str, _Stored], bytes | None]:
  out: dict[str, _Stored] = {}
  record = None
  for root, dirs, files in os.walk(path):
    dirs.sort()
    for name in sorted(files):
      file = os.path.join(root, name)
      if root == path and name == DTYPE_RECORD:
        with open(file, "rb") as f:
          record = f.read()
        continue
      if not name.endswith(".npy"):
        continue
      key = os.path.relpath(file, path)[:-4].replace(os.sep, "/")
      try:
        with open(file, "rb") as f:
          shape, fortran, dtype = _read_header(f)
          offset = f.tell()
          size = os.fstat(f.fileno()).st_size
      except (OSError, ValueError, EOFError) as err:
        raise ValueError(
          f"{api}: {file!r} is not a readable .npy file: {err}"
        ) from None
      if dtype.hasobject:
        raise ValueError(
          f"{api}: {file!r} holds Python objects, which restore does not load"
        )
      out[key] = _Stored(
        tuple(shape),
        dtype,
        fortran,
        repr(file),
        size - offset,
        _mapper(file, offset, shape, dtype, fortran),
      )
  return out, record


def _open_npz(api: str, path: str) -> tuple[dict[str, _Stored], bytes | None]:
  out: dict[str, _Stored] = {}
  record = None
  try:
    zf = zipfile.ZipFile(path)
  except (OSError, zipfile.BadZipFile) as err:
    raise ValueError(
      f"{api}: {path!r} is not a readable .npz file: {err}"
    ) from None
  with zf, open(path, "rb") as raw:
    file_size = os.fstat(raw.fileno()).st_size
    for info in zf.infolist():
      where = f"member {info.filename!r} of {path!r}"
      try:
        if info.filename == DTYPE_RECORD:
          record = zf.read(info)
          continue
        if not info.filename.endswith(".npy"):
          continue
        key = info.filename[:-4]
        if (
          info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1
        ):
          raw.seek(info.header_offset)
          fields = _ZIP_LOCAL_HEADER.unpack(raw.read(_ZIP_LOCAL_HEADER.size))
          start = (
            info.header_offset
            + _ZIP_LOCAL_HEADER.size
            + fields[-2]
            + fields[-1]
          )
          raw.seek(start)
          shape, fortran, dtype = _read_header(raw)
          offset = raw.tell()
          # The member's data ends where the archive says it does, and never past the file.
          end = min(
            start + info.file_size, start + info.compress_size, file_size
          )
          data_bytes = end - offset
          load = _mapper(path, offset, shape, dtype, fortran)
        else:  # compressed members cannot be mapped; they are read when their batch comes
          with zf.open(info) as member:
            shape, fortran, dtype = _read_header(member)
            data_bytes = info.file_size - member.tell()
          load = _reader(path, info.filename)
      except (
        OSError,
        ValueError,
        EOFError,
        struct.error,
        zipfile.BadZipFile,
        zlib.error,
      ) as err:
        raise ValueError(
          f"{api}: {where} is not a readable .npy: {err}"
        ) from None
      if dtype.hasobject:
        raise ValueError(f"{api}: {where} holds Python objects")
      out[key] = _Stored(tuple(shape), dtype, fortran, where, data_bytes, load)
  return out, record


def _reader(path: str, member: str) -> Callable[[], np.ndarray]:
  def load() -> np.ndarray:
    with zipfile.ZipFile(path) as zf, zf.open(member) as f:
      return np.lib.format.read_array(f, allow_pickle=False)

  return load


def _apply_record(
  api: str, path: str, stored: dict[str, _Stored], record: bytes | None
) -> None:
  """Sets each stored array's exact dtype from the dtype record written by save."""
  if record is None:
    return
  where = f"the dtype record {DTYPE_RECORD!r} of {path!r}"
  try:
    data = json.loads(record.decode())
    names = data["dtypes"]
    if data.get("format") != _RECORD_FORMAT or not isinstance(names, dict):
      raise ValueError(f"unknown format {data.get('format')!r}")
  except (
    UnicodeDecodeError,
    ValueError,
    KeyError,
    TypeError,
    AttributeError,
  ) as err:
    raise ValueError(
      f"{api}: {where} is damaged ({err}); it was written by "
      "jaxworks.batched_transfer.save: write the checkpoint again"
    ) from None
  for key, s in stored.items():
    name = names.get(key)
    if name is None:
      continue
    try:
      exact = np.dtype(name) if isinstance(name, str) else None
    except TypeError:
      exact = None
    if (
      exact is None
      or exact.name != name
      or exact.hasobject
      or exact.fields is not None
    ):
      raise ValueError(
        f"{api}: {where} names the dtype {name!r} for key {key!r}, which is not "
        "a dtype numpy or ml_dtypes knows; is a newer ml_dtypes needed?"
      )
    header = s.dtype.newbyteorder("=")
    if exact.itemsize != s.dtype.itemsize or (
      header.kind != "V" and header != exact
    ):
      raise ValueError(
        f"{api}: {s.where} has a header of dtype {s.dtype.str} but {where} "
        f"says {name}; the checkpoint is damaged"
      )
    s.exact = exact


def _placement_of(leaf: Any) -> Any:
  fmt = getattr(leaf, "format", None)
  if isinstance(fmt, Format) and fmt.sharding is not None:
    return fmt if fmt.layout is not None else fmt.sharding
  return getattr(leaf, "sharding", None)


def _target_spec(
  api: str, where: str, x: Any
) -> tuple[tuple[int, ...], np.dtype, bool]:
  """(shape, dtype, weak_type) a target leaf asks for."""
  scalar_dtype = _python_scalar_dtype(x)
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
  s: _Stored,
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


def _load(api: str, where: str, key: str, s: _Stored) -> np.ndarray:
  """The data of one stored array, with its exact dtype in native byte order."""
  try:
    a = s.load()
  except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as err:
    raise ValueError(
      f"{api}: the leaf at {where} (key {key!r}): reading {s.where} failed: "
      f"{err}; the file changed or is damaged since restore validated it"
    ) from None
  if a.dtype.kind == "V" and s.exact is not None:
    return a.view(s.exact)
  if not a.dtype.isnative:
    return a.astype(a.dtype.newbyteorder("="))
  return a


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
  progress: bool | None = None,
) -> Any:
  """Loads a checkpoint written by ``save`` onto devices, validated and streamed.

  Args:
    path: an .npz file or a directory of .npy files.
    target: a pytree whose leaves say what to expect: jax.ShapeDtypeStruct,
      jax.Array or numpy array leaves (their .shape, .dtype and weak_type), or
      Python scalars (a 0-d array of the dtype and weak type jax.device_put
      gives them), as ``jax.eval_shape(init_fn)`` returns. Unless ``placement``
      is given, each leaf's .format / .sharding says where it goes (none: the
      default device).
    placement: a device_put target (Device, Sharding, Format or a pytree
      prefix of them) overriding the target leaves' placement.
    max_inflight_bytes: the most bytes read and transferred at once; a batch
      is placed and finished before the next is read. A single larger leaf
      goes alone.
    progress: draw a progress bar on stderr: True, False, or None (only when
      stderr is a terminal).

  Returns:
    A pytree like ``target`` of placed jax.Arrays (weakly typed where the target
    leaf is).

  Raises:
    ValueError: a key missing from or extra in the file, a shape or exact
      dtype that differs from the target's, or data shorter or longer than its
      header says (the message names the tree path and the file); raised
      before any array is placed.
    TypeError: a target leaf with no shape and dtype.
  """
  api = f"{_API}.restore"
  path = os.fspath(path)
  if not isinstance(max_inflight_bytes, int) or max_inflight_bytes <= 0:
    raise ValueError(
      f"{api}: max_inflight_bytes must be a positive int, got "
      f"{max_inflight_bytes!r}"
    )
  keys, paths, leaves, treedef = leaf_keys(api, target)
  specs = [_target_spec(api, where, x) for where, x in zip(paths, leaves)]
  if os.path.isdir(path):
    stored, record = _open_directory(api, path)
  elif os.path.isfile(path):
    stored, record = _open_npz(api, path)
  else:
    raise FileNotFoundError(
      f"{api}: no checkpoint at {path!r} (expected an .npz file or a "
      "directory of .npy files written by save)"
    )
  _apply_record(api, path, stored, record)

  # 1. Validate everything before placing anything.
  missing = [(p, k) for p, k in zip(paths, keys) if k not in stored]
  if missing:
    listed = ", ".join(f"{p} (key {k!r})" for p, k in missing[:5])
    raise ValueError(
      f"{api}: {len(missing)} leaves of the target are missing from {path!r}: "
      f"{listed}{' ...' if len(missing) > 5 else ''}"
    )
  extra = sorted(set(stored) - set(keys))
  if extra:
    raise ValueError(
      f"{api}: {path!r} holds {len(extra)} arrays the target has no leaf for: "
      f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}; restore into a "
      "target with these leaves"
    )
  if placement is None:
    places = [_placement_of(x) for x in leaves]
  else:
    places = targets.broadcast_prefix(
      api,
      "placement",
      placement,
      target,
      treedef,
      len(leaves),
      targets.is_target_leaf,
      targets.TARGET_TEXT,
    )
  normalized: dict[int, Any] = {}
  for p, where, key, (want_shape, want_dtype, _) in zip(
    places, paths, keys, specs
  ):
    _check_leaf(api, where, key, stored[key], want_shape, want_dtype)
    if id(p) not in normalized:
      try:
        normalized[id(p)] = targets.normalize_target(api, p)
      except targets.Delegate:
        raise ValueError(
          f"{api}: placement {p!r} at {where} depends on the mesh context; pass "
          "a Sharding"
        ) from None
      except ValueError as err:
        raise ValueError(
          f"{err} (the placement of the leaf at {where}; a target leaf's "
          "sharding is its placement unless placement= is given)"
        ) from None
    sharding = normalized[id(p)][0]
    if sharding is not None:
      try:
        sharding.shard_shape(want_shape)
      except Exception as err:  # the sharding's own message says why
        raise ValueError(
          f"{api}: the leaf at {where} with shape {want_shape} cannot be "
          f"placed on {sharding}: {err}"
        ) from None

  # 2. Stream: read (memory-mapped) and place batch by batch.
  out: list[Any] = [None] * len(leaves)
  bar = Progress(
    "restore", sum(stored[k].nbytes for k in keys), enabled=progress
  )
  batch: list[int] = []
  batch_bytes = 0

  def flush() -> None:
    arrays = [_load(api, paths[i], keys[i], stored[keys[i]]) for i in batch]
    # A copy, not an alias of the mapped file: the arrays must not change (or fault) when
    # the file is rewritten, and max_inflight_bytes bounds real reads.
    placed = place(arrays, [places[i] for i in batch], copy_host=True, api=api)
    jax.block_until_ready(placed)
    for i, y in zip(batch, placed):
      out[i] = _weak(y) if specs[i][2] else y
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
