"""Leaf keys of a checkpoint, and the dtype JAX gives a Python scalar.

A leaf's key is its tree path joined by "/" ({"params": {"w": ...}} ->
"params/w"); a lone array is "leaf". In an .npz the key names the member
``<key>.npy``; in a directory the file ``<dir>/<key>.npy``.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

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


def check_keys(
  api: str, path: str, keys: list[str], paths: list[str], stored: Any
) -> None:
  """Raises ValueError naming the target leaves missing from the checkpoint
  at ``path`` (whose keys are ``stored``), else the arrays it has no leaf for."""
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
