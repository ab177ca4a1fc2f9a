"""Leaf keys of a checkpoint, and the dtype JAX gives a Python scalar.

A leaf's key is its tree path joined by "/" ({"params": {"w": ...}} ->
"params/w"); a lone array is "leaf". In an .npz the key names the member
``<key>.npy``; in a directory the file ``<dir>/<key>.npy``.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import jax
import numpy as np

from . import format
from . import nodes

_API = "jaxworks.batched_transfer"
ROOT_KEY = "leaf"


def _key_part(api: str, entry: Any, path: Any) -> str:
  if isinstance(
    entry, (jax.tree_util.DictKey, jax.tree_util.FlattenedIndexKey)
  ):
    text = str(entry.key)
  elif isinstance(entry, jax.tree_util.SequenceKey):
    text = str(entry.idx)
  elif isinstance(entry, jax.tree_util.GetAttrKey):
    text = entry.name
  else:
    text = str(entry)
  if not text or text in (".", "..") or any(c in text for c in "/\\\0"):
    raise ValueError(
      f"{api}: the key {text!r} in tree path {jax.tree_util.keystr(path)} cannot name a file "
      "(empty, '.', '..', or containing '/', '\\\\' or NUL); rename it in the tree"
    )
  return text


def _no_children(x: Any) -> bool:
  leaves, treedef = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)
  return not leaves and not jax.tree_util.treedef_is_leaf(treedef)


_LEAF_TYPES = (
  jax.Array,
  np.ndarray,
  np.generic,
  str,
  bytes,
  int,
  float,
  complex,
)


def saved_leaf(x: Any) -> bool:
  """What save records as a leaf besides jax's leaves: None, and every
  pytree node without children (empty dicts, lists and tuples, optax's
  ``EmptyState()`` and ``MaskedNode()``, an empty custom node), which
  restore without a target rebuilds."""
  if x is None:
    return True
  if isinstance(x, (dict, list, tuple)):
    if x:
      return False
    t = type(x)
    return t in (dict, list, tuple) or nodes.is_namedtuple(t) or _no_children(x)
  if isinstance(x, _LEAF_TYPES):
    return False
  return _no_children(x)


def leaf_keys(
  api: str, tree: Any, is_leaf: Any = None
) -> tuple[list[str], list[str], list[Any], Any]:
  """(file keys, tree paths, leaves, treedef) of ``tree``; keys are unique.
  ``is_leaf`` as for jax.tree_util (save passes ``saved_leaf``)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  keys, paths, leaves = [], [], []
  seen: dict[str, str] = {}
  for path, leaf in flat:
    key = "/".join(_key_part(api, e, path) for e in path) or ROOT_KEY
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


def path_kinds(tree: Any) -> list[str]:
  """The kinds of each leaf's path entries (format.path_kinds), in the order
  of ``leaf_keys(api, tree, saved_leaf)``."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=saved_leaf)
  return [format.path_kinds(p) for p, _ in flat]


def node_descriptions(api: str, tree: Any) -> dict[str, dict[str, Any]]:
  """The record's ``nodes`` of ``tree``: the description (nodes.describe)
  of every inner node that is not a dict or a list, and of every node
  without children, by its key prefix ("" for the root)."""
  flat, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=saved_leaf)
  out: dict[str, dict[str, Any]] = {}

  def key_of(path: Any) -> str:
    return "/".join(_key_part(api, e, path) for e in path) or ROOT_KEY

  for path, x in flat:  # the nodes save records as leaves: empty ones
    if x is not None and type(x) not in (dict, list) and saved_leaf(x):
      desc = nodes.describe(type(x))
      if desc is not None:
        out[key_of(path)] = desc
  at = 0

  def walk(td: Any, depth: int) -> None:
    nonlocal at
    if td.num_leaves == 0 or jax.tree_util.treedef_is_leaf(td):
      at += td.num_leaves
      return
    data = td.node_data()
    desc = None if data is None else nodes.describe(data[0])
    if desc is not None:
      path = flat[at][0][:depth]
      out["/".join(_key_part(api, e, path) for e in path)] = desc
    for child in jax.tree_util.treedef_children(td):
      walk(child, depth + 1)

  walk(treedef, 0)
  return out


@dataclasses.dataclass(frozen=True)
class Structure:
  """What save records of a tree's structure, in the order of its leaves
  (``leaf_keys(api, tree, saved_leaf)``): file keys, tree paths, path kinds
  (``path_kinds``) and node descriptions (``node_descriptions``)."""

  keys: tuple[str, ...]
  paths: tuple[str, ...]
  kinds: tuple[str, ...]
  nodes: dict[str, dict[str, Any]]


#: The structures of the trees saved last, by treedef and leaf types: a
#: training loop saves the same tree at every interval, and deriving keys
#: and paths from tree paths in Python is most of a small save's call
#: (80 leaves: ~4 ms on 2 cores; a lookup ~0.1 ms).
_STRUCTURES: collections.OrderedDict[Any, Structure] = collections.OrderedDict()
_STRUCTURES_MAX = 16
_STRUCTURES_LOCK = threading.Lock()


def structure(api: str, tree: Any) -> tuple[Structure, list[Any]]:
  """``(Structure, leaves)`` of ``tree`` as save sees it (``saved_leaf``).

  The structure depends only on the treedef and the leaves' types (a
  childless node's description is its type's), so it is kept for the last
  trees seen; a treedef that cannot be hashed or compared (a custom node
  whose auxiliary data is not hashable) is derived every time."""
  leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=saved_leaf)
  try:
    # str(treedef) too: {1: x} and {1.0: x} are equal treedefs whose keys
    # name different files.
    cache_key: Any = (treedef, str(treedef), tuple(map(type, leaves)))
    with _STRUCTURES_LOCK:
      found = _STRUCTURES.get(cache_key)
      if found is not None:
        _STRUCTURES.move_to_end(cache_key)
        return found, leaves
  except Exception:  # noqa: BLE001  unhashable or incomparable aux data
    cache_key = None
  keys, paths, _, _ = leaf_keys(api, tree, saved_leaf)
  found = Structure(
    tuple(keys), tuple(paths), tuple(path_kinds(tree)),
    node_descriptions(api, tree),
  )  # fmt: skip
  if cache_key is not None:
    with _STRUCTURES_LOCK:
      _STRUCTURES[cache_key] = found
      while len(_STRUCTURES) > _STRUCTURES_MAX:
        _STRUCTURES.popitem(last=False)
  return found, leaves


def check_files(api: str, named: list[tuple[str, str]]) -> None:
  """Raises ValueError unless the files ``(relative file name, tree path)``
  are distinct and none of them is also a directory another one lies in:
  the keys of a checkpoint name its files one to one."""
  files: dict[str, str] = {}
  dirs: dict[str, str] = {}
  for file, where in named:
    if file in files:
      raise ValueError(
        f"{api}: the leaves at {files[file]} and {where} would both be "
        f"written to the file {file!r}; rename one of them in the tree"
      )
    files[file] = where
    parts = file.split("/")
    for i in range(1, len(parts)):
      dirs.setdefault("/".join(parts[:i]), where)
  for file, where in files.items():
    if file in dirs:
      raise ValueError(
        f"{api}: the leaf at {where} would be written to the file {file!r}, "
        f"which the leaf at {dirs[file]} needs as a directory; rename one of "
        "them in the tree"
      )


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
  if isinstance(x, np.generic):
    return None
  for t, dtype in _PY_SCALARS.items():  # bool first: bool is an int subclass
    if isinstance(x, t):
      return np.dtype(jax.dtypes.canonicalize_dtype(dtype))
  return None


def cast_to(stored: np.dtype, want: np.dtype) -> np.dtype | None:
  """The dtype to cast stored data to before placing, or None: data of the
  target's dtype, or of one JAX canonicalizes to it (float64 data into a
  float32 target with x64 off), is placed as it is (device_put converts)."""
  if stored == want or np.dtype(jax.dtypes.canonicalize_dtype(stored)) == want:
    return None
  return want


def astype(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
  """``a.astype(dtype)``, through float64 (complex128) where numpy has no
  direct cast between two ml_dtypes types (int4 -> uint4)."""
  try:
    return a.astype(dtype)
  except TypeError:
    wide = np.complex128 if a.dtype.kind == "c" else np.float64
    return a.astype(wide).astype(dtype)


def check_keys(
  api: str,
  path: str,
  keys: list[str],
  paths: list[str],
  stored: Any,
  partial: bool = False,
) -> None:
  """Raises ValueError naming the target leaves missing from the checkpoint
  at ``path`` (whose keys are ``stored``), else (unless ``partial``) the
  entries it has no leaf for."""
  missing = [(p, k) for p, k in zip(paths, keys) if k not in stored]
  if missing:
    listed = ", ".join(f"{p} (key {k!r})" for p, k in missing[:5])
    raise ValueError(
      f"{api}: {len(missing)} leaves of the target are missing from {path!r}: "
      f"{listed}{' ...' if len(missing) > 5 else ''}"
    )
  extra = [] if partial else sorted(set(stored) - set(keys))
  if extra:
    raise ValueError(
      f"{api}: {path!r} holds {len(extra)} leaves the target has no leaf for: "
      f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}; restore into a "
      "target with these leaves, or pass partial_restore=True to restore the "
      "target's leaves alone"
    )
