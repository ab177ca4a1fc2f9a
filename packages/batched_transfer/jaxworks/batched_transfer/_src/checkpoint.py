"""save of pytrees as .npz files or directories of .npy files; leaf keys.

A leaf's key is its tree path joined by "/" ({"params": {"w": ...}} ->
"params/w"); a lone array is "leaf". In an .npz the key names the member
``<key>.npy``; in a directory the file ``<dir>/<key>.npy``. The exact dtype
name of every leaf goes into a record next to the arrays (see
checkpoint_files); restore is in checkpoint_restore.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any
import zipfile

import jax
import numpy as np

from .checkpoint_files import DTYPE_RECORD
from .checkpoint_files import RECORD_FORMAT

_API = "jaxworks.batched_transfer"
_ROOT_KEY = "leaf"


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


def python_scalar_dtype(x: Any) -> np.dtype | None:
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
  scalar_dtype = python_scalar_dtype(x)
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
      "format": RECORD_FORMAT,
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
    path: "<name>.npz" for one uncompressed archive (restore reads its
      members in place), anything else for a directory with one "<key>.npy"
      per leaf.
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
