"""The record of a checkpoint (``jaxworks_dtypes.json``): what the .npy files
cannot say.

Written by save beside the arrays (a member of an .npz, a file of a
directory), read by restore and ``metadata``. Format 2 holds:

* ``dtypes``: every array's exact dtype name (.npy headers cannot name
  bfloat16, float8_*, int4 and the other ml_dtypes types, stored as raw
  ``V<n>`` bytes);
* ``python``: the arrays that were Python scalars (``bool``, ``int``,
  ``float``, ``complex``), stored as the 0-d array ``jax.device_put`` makes
  of them, and restored as that Python type when restore has no target;
* ``values``: the leaves that are not arrays, ``str`` and ``None``, by value;
* ``crc32c``: for a directory checkpoint one process wrote, the checksums of
  each ``<key>.npy`` file's data (see checksum);
* ``shardings``: the sharding of each saved jax.Array (see shardings), which
  ``metadata`` reports;
* ``tree``: every leaf's key and the kinds of its tree path's entries, in
  tree order, so that restore without a target rebuilds the nesting (dicts,
  and lists for sequences); an empty dict, list or tuple is an entry too,
  with a third element, "dict" or "list".

Format 1 (``dtypes`` alone) is still read.

>>> r = Record(dtypes={"w": "float32"}, values={"run": "exp-42"},
...            tree=[("w", "d"), ("run", "d")])
>>> decode("api", "here", encode(r)) == r
True
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax

NAME = "jaxworks_dtypes.json"
FORMAT = 2
_READS = (1, 2)
PYTHON_TYPES = {"bool": bool, "int": int, "float": float, "complex": complex}
#: The record's name for an empty container of each type.
#: What parsing a damaged JSON record or manifest raises.
DAMAGED = (
  UnicodeDecodeError,
  ValueError,
  KeyError,
  TypeError,
  AttributeError,
  RecursionError,
)
EMPTY: dict[type, str] = {dict: "dict", list: "list", tuple: "list"}


@dataclasses.dataclass
class Record:
  dtypes: dict[str, str] = dataclasses.field(default_factory=dict)
  python: dict[str, str] = dataclasses.field(default_factory=dict)
  values: dict[str, str | None] = dataclasses.field(default_factory=dict)
  crc32c: dict[str, list[int]] = dataclasses.field(default_factory=dict)
  shardings: dict[str, dict] = dataclasses.field(default_factory=dict)
  tree: list[tuple[str, ...]] | None = None


def encode(record: Record) -> bytes:
  data: dict[str, Any] = {"format": FORMAT, "dtypes": record.dtypes}
  if record.python:
    data["python"] = record.python
  if record.values:
    data["values"] = record.values
  if record.crc32c:
    data["crc32c"] = record.crc32c
  if record.shardings:
    data["shardings"] = record.shardings
  if record.tree is not None:
    data["tree"] = [list(e) for e in record.tree]
  return json.dumps(data, indent=0, sort_keys=True).encode()


def _strs(v: Any, what: str) -> dict[str, str]:
  if not isinstance(v, dict) or not all(
    isinstance(k, str) and isinstance(x, str) for k, x in v.items()
  ):
    raise ValueError(f"{what} is not an object of names")
  return v


def decode(api: str, where: str, data: bytes) -> Record:
  """The record in ``data``; ValueError naming ``where`` if it is damaged."""
  try:
    m = json.loads(data.decode())
    if not isinstance(m, dict) or m.get("format") not in _READS:
      raise ValueError(
        f"unknown format {m.get('format') if isinstance(m, dict) else m!r:.40}"
      )
    r = Record(dtypes=_strs(m["dtypes"], "'dtypes'"))
    r.python = _strs(m.get("python", {}), "'python'")
    if not set(r.python.values()) <= set(PYTHON_TYPES):
      raise ValueError(f"'python' names {sorted(set(r.python.values()))}")
    values = m.get("values", {})
    if not isinstance(values, dict) or not all(
      isinstance(x, (str, type(None))) for x in values.values()
    ):
      raise ValueError("'values' holds something other than str and null")
    r.values = values
    sums = m.get("crc32c", {})
    if not isinstance(sums, dict) or not all(
      isinstance(x, list) and all(type(c) is int for c in x)
      for x in sums.values()
    ):
      raise ValueError("'crc32c' is not an object of lists of ints")
    r.crc32c = sums
    shardings = m.get("shardings", {})
    if not isinstance(shardings, dict) or not all(
      isinstance(x, dict) for x in shardings.values()
    ):
      raise ValueError("'shardings' is not an object of objects")
    r.shardings = shardings
    tree = m.get("tree")
    if tree is not None:
      if not isinstance(tree, list) or not all(
        isinstance(e, list)
        and len(e) in (2, 3)
        and all(isinstance(x, str) for x in e)
        and (len(e) == 2 or e[2] in ("dict", "list"))
        for e in tree
      ):
        raise ValueError("'tree' is not a list of [key, kinds(, empty)]")
      r.tree = [tuple(e) for e in tree]
  except DAMAGED as err:
    raise ValueError(
      f"{api}: {where} is damaged ({err}); it was written by "
      "jaxworks.batched_transfer.save: write the checkpoint again"
    ) from None
  return r


_KINDS = {
  jax.tree_util.DictKey: "d",
  jax.tree_util.SequenceKey: "s",
  jax.tree_util.GetAttrKey: "a",
  jax.tree_util.FlattenedIndexKey: "f",
}


def path_kinds(path: Any) -> str:
  """One letter per entry of a tree path: d(ict), s(equence), a(ttribute),
  f(lattened index), o(ther)."""
  return "".join(_KINDS.get(type(e), "o") for e in path)


def rebuild(tree: list[tuple[str, ...]], value_of: Any) -> Any:
  """The nesting ``tree`` describes, with ``value_of(key)`` at each leaf:
  sequences become lists, every other node a dict keyed by its path names."""

  def leaf(entry: tuple[str, ...]) -> Any:
    if len(entry) == 3:
      return {} if entry[2] == "dict" else []
    return value_of(entry[0])

  if len(tree) == 1 and not tree[0][1]:
    return leaf(tree[0])
  top: dict[str, Any] = {}
  kinds: dict[tuple[str, ...], str] = {}
  leaves: set[tuple[str, ...]] = set()
  for entry in tree:
    key, entry_kinds = entry[0], entry[1]
    parts = key.split("/")
    if len(parts) != len(entry_kinds):
      raise ValueError(f"the key {key!r} does not match its kinds")
    node = top
    for i, part in enumerate(parts):
      kinds.setdefault(tuple(parts[:i]), entry_kinds[i])
      if i == len(parts) - 1:
        node[part] = leaf(entry)
        leaves.add(tuple(parts))
      else:
        node = node.setdefault(part, {})

  def build(prefix: tuple[str, ...], node: Any) -> Any:
    if prefix in leaves or prefix not in kinds:
      return node  # a leaf
    items = [(k, build(prefix + (k,), v)) for k, v in node.items()]
    if kinds[prefix] == "s":
      return [v for _, v in items]
    return dict(items)

  return build((), top)
