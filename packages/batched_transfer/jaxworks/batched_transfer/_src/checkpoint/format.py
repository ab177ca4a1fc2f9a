"""The on-disk format of a checkpoint: file names, versions, the record and
the manifest. No I/O: the writer and the reader both use this module.

A checkpoint one process wrote is a directory with one ``<key>.npy`` per
array (keys: see keys) or an .npz with those members, plus the record
``jaxworks_dtypes.json`` (``RECORD``): what the .npy files cannot say.
Format 2 of the record holds:

* ``dtypes``: every array's exact dtype name (.npy headers cannot name
  bfloat16, float8_*, int4 and the other ml_dtypes types, stored as raw
  ``V<n>`` bytes);
* ``python``: the leaves that were Python scalars (``bool``, ``int``,
  ``float``, ``complex``), by type name, each stored as the 0-d array
  ``jax.device_put`` makes of it (restore onto a target places that), where
  one holds it;
* ``scalars`` (after 0.6.0): the exact value of each of those, as text
  (``encode_scalar``: a float's ``repr``, an int in decimal, ...), which
  restore without a target and ``metadata`` give back (a float as the
  float64 it was, not its float32 array); an int that no JAX dtype holds
  (past int32, or int64 with x64) has no array: its text is among the
  ``values`` too, so that every reader knows it has no file, and the
  record is format 4. Earlier versions ignore it (a record without it:
  the array's value, as 0.6 restored it);
* ``values``: the leaves that are not arrays, ``str`` and ``None``, by value;
* ``crc32c``: for a directory checkpoint one process wrote, the checksums of
  each ``<key>.npy`` file's data (see checksum);
* ``shardings``: the sharding of each saved jax.Array, which ``metadata``
  reports: a ``NamedSharding`` as its mesh (axis names, shape, axis types,
  device ids in mesh order), PartitionSpec and memory kind, a
  ``SingleDeviceSharding`` as its device id and memory kind (other kinds
  are not recorded; ``rebuild_sharding`` makes one again where every device
  it names is one of this job's);
* ``tree``: every leaf's key and the kinds of its tree path's entries, in
  tree order, so that restore without a target rebuilds the nesting (dicts,
  and lists for sequences); a node without children (an empty dict, list
  or tuple, and, after 0.6.0, any other: optax's ``EmptyState()`` and
  ``MaskedNode()``, an empty named tuple or custom node) is an entry too,
  with a third element, "dict" or "list" (the kind of node earlier
  versions rebuild);
* ``nodes`` (after 0.6.0): what each inner node that is not a dict or a list is,
  and each node without children, by its key prefix ("" for the root):
  ``{"type": "tuple"}``, ``{"type": "namedtuple", "class":
  "<module>:<qualname>", "fields": [...]}``, ``{"type": "OrderedDict"}``
  or ``{"type": "node", "class": ...}`` (see nodes, which builds them
  again: a class named here is data, never imported). Earlier versions
  ignore it (they rebuild dicts and lists); without it a sequence's
  missing index (an ``EmptyState()`` 0.6 did not list) reads as None;
* ``custom_metadata`` (after 0.6.0): save's ``custom_metadata``, a JSON object
  (``custom_metadata(path)`` reads it). Earlier versions ignore it;
* ``packed`` (after 0.6.0): the keys of the arrays stored together as the
  members ``<key>.npy`` of one uncompressed archive ``PACKED`` beside the
  record (save's ``pack_below``: small leaves, one file or object instead
  of one each; ``numpy.load`` reads it), in archive order; their
  ``crc32c`` are of each member's data;
* ``shapes``: the shape of each array stored raw in C order (what its .npy
  header says, with ``dtypes``), so that a restore from a bucket requests
  each array's header and data in one request, and checks the header when
  it arrives; an older record without it is read as before (each header
  read first). Earlier versions ignore it.
* ``c_order``: true where every array's file is in C order (its header
  says ``fortran_order: False``), as this version writes whatever the
  strides of the values saved; then a restore from a bucket trusts
  ``shapes`` for the one request of header and data. Records without it
  (0.6.0 and the versions before this one wrote a host copy in Fortran
  order as a Fortran-order file: a TPU hands such copies back) have each
  header read first, and a Fortran-order file restores as numpy reads it.
  Earlier versions ignore it.
* ``save_id``: 16 hex digits, unique to the save that wrote the checkpoint
  (a checkpoint is never modified after its commit, so this names one
  snapshot): every process of a restore checks that it read the same one,
  and a commit whose answer was lost is settled by reading it back.
  Earlier versions ignore it; a record without it reads as ``""``.

Format 3 is format 2 plus ``codecs``: the arrays stored compressed, by key
(``save(..., compression="zstd")``, see codec); it is written only when
there are any, so that raw checkpoints stay readable by earlier versions.
Format 4 (after 0.6.0) is format 3 with Python ints stored by value alone (see
``scalars``); it is written only when there are any, so that earlier
versions refuse such a record instead of restoring the int as a str.
Format 5 (after 0.6.0) is format 4 with ``packed``, written only where
leaves are packed, so that earlier versions refuse it instead of finding
those arrays missing.
Formats 1 (``dtypes`` alone), 2, 3 and 4 are still read.

A checkpoint several processes wrote is a directory whose manifest
``MANIFEST`` (the README shows one) says how its shard files tile each
array; ``parse_manifest`` checks its schema (every file name relative and
inside the directory, the shards tiling the array as a grid); the record
beside it holds no ``crc32c``.

>>> r = Record(dtypes={"w": "float32"}, values={"run": "exp-42"},
...            tree=[("w", "d"), ("run", "d")])
>>> decode_record("api", "here", encode_record(r)) == r
True
>>> m = {"format": MANIFEST_FORMAT, "processes": 1, "arrays": {"w": {
...   "shape": [4], "dtype": "float32", "shards": [
...     {"file": "w.shards/0.npy", "start": [0], "shape": [2]},
...     {"file": "w.shards/1.npy", "start": [2], "shape": [2]}]}}}
>>> entry = parse_manifest(encode_manifest(m))["w"]
>>> [s.file for s in entry.overlapping(((1, 3),))]
['w.shards/0.npy', 'w.shards/1.npy']
>>> import jax
>>> from jax.sharding import NamedSharding, PartitionSpec as P
>>> s = NamedSharding(jax.make_mesh((4, 2), ("a", "b")), P("a", None))
>>> rebuild_sharding(describe_sharding(s)) == s
True
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from collections.abc import Mapping
import dataclasses
import errno
import itertools
import json
import os
import secrets
import struct
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from jax.sharding import SingleDeviceSharding
import numpy as np

from . import codec
from . import nodes


def is_npz(path: str) -> bool:
  """Whether a checkpoint at ``path`` (a local path or a URL) is one
  ``.npz`` archive (else a directory, a prefix in a bucket): the one rule.

  >>> is_npz("run/ckpt.npz"), is_npz("s3://b/run/ckpt")
  (True, False)
  """
  return path.endswith(".npz")


RECORD = "jaxworks_dtypes.json"
RECORD_FORMAT = 2
#: The format of a record with ``codecs``.
CODECS_FORMAT = 3
#: The format of a record with Python scalars stored by value alone.
VALUES_FORMAT = 4
#: The format of a record with packed leaves.
PACKED_FORMAT = 5
_RECORD_READS = (1, 2, 3, 4, 5)
#: The archive of a directory checkpoint's packed leaves (``Record.packed``).
PACKED = "jaxworks_packed.npz"
PYTHON_TYPES = {"bool": bool, "int": int, "float": float, "complex": complex}
#: What parsing a damaged JSON record or manifest raises.
DAMAGED = (ValueError, KeyError, TypeError, AttributeError, RecursionError)
#: The record's name for an empty container of each type.
EMPTY: dict[type, str] = {dict: "dict", list: "list", tuple: "list"}


@dataclasses.dataclass
class Record:
  dtypes: dict[str, str] = dataclasses.field(default_factory=dict)
  python: dict[str, str] = dataclasses.field(default_factory=dict)
  values: dict[str, str | None] = dataclasses.field(default_factory=dict)
  crc32c: dict[str, list[int]] = dataclasses.field(default_factory=dict)
  shardings: dict[str, dict] = dataclasses.field(default_factory=dict)
  tree: list[tuple[str, ...]] | None = None
  codecs: dict[str, str] = dataclasses.field(default_factory=dict)
  shapes: dict[str, list[int]] = dataclasses.field(default_factory=dict)
  c_order: bool = False
  save_id: str = ""
  nodes: dict[str, dict] = dataclasses.field(default_factory=dict)
  scalars: dict[str, str] = dataclasses.field(default_factory=dict)
  custom_metadata: dict[str, Any] | None = None
  packed: list[str] = dataclasses.field(default_factory=list)

  def value_only(self, key: str) -> bool:
    """Whether ``key`` is a Python scalar stored by value alone (an int no
    JAX dtype holds): no array file, its text among the ``values`` too."""
    return key in self.scalars and key in self.values

  def files(self) -> list[str] | None:
    """The names of the array files of the checkpoint this record commits
    (one process wrote it): each array's own file, then ``PACKED`` where
    leaves are packed; None for a record that names none (format 1)."""
    if self.tree is None:
      return None
    packed = set(self.packed)
    names = [
      codec.file_name(e[0], self.codecs.get(e[0]))
      for e in self.tree
      if len(e) == 2 and e[0] not in self.values and e[0] not in packed
    ]
    return names + [PACKED] if packed else names


def new_save_id() -> str:
  """A new save's id (``Record.save_id``): 16 random hex digits."""
  return secrets.token_hex(8)


def check_arrays_present(
  api: str, path: str, record: Record, arrays: Any
) -> None:
  """Raises ``FileNotFoundError`` when ``record`` lists an array that the
  checkpoint at ``path`` holds no file for (deleted, or a partial copy):
  naming the API, the tree path and the fix, before anything is read."""
  if record.tree is None:  # written before the record listed the tree
    return
  for entry in record.tree:
    key = entry[0]
    if len(entry) == 2 and key not in record.values and key not in arrays:
      raise FileNotFoundError(
        errno.ENOENT,
        f"{api}: the checkpoint {path!r} has no data for the array at "
        f"{key!r}, which its record lists (its file was deleted, or the "
        "checkpoint was copied in part); copy the whole checkpoint again, "
        "or restore another one",
        path,
      )


def custom_metadata(api: str, value: Any) -> dict[str, Any] | None:
  """``value`` (save's ``custom_metadata``) as the record keeps it: a dict
  with str keys that JSON holds (None: none); TypeError naming ``api``
  otherwise, before anything is written.

  >>> custom_metadata("api", {"lr": 0.1, "tags": ["a"]})
  {'lr': 0.1, 'tags': ['a']}
  """
  if value is None:
    return None
  if not isinstance(value, Mapping) or not all(
    isinstance(k, str) for k in value
  ):
    raise TypeError(
      f"{api}: custom_metadata must be a dict with str keys of JSON values, "
      f"got {value!r:.80}"
    )
  try:
    data = json.loads(json.dumps(dict(value)))
  except (TypeError, ValueError, RecursionError) as err:
    raise TypeError(
      f"{api}: custom_metadata must hold JSON values (numbers, strings, "
      f"bools, None, lists, dicts with str keys): {err}; convert numpy and "
      "jax scalars with float() or int()"
    ) from None
  return data


def encode_record(record: Record) -> bytes:
  """The bytes of ``record`` (a JSON object, as ``decode_record`` reads it)."""
  number = CODECS_FORMAT if record.codecs else RECORD_FORMAT
  if any(record.value_only(k) for k in record.scalars):
    number = VALUES_FORMAT
  if record.packed:
    number = PACKED_FORMAT
  data: dict[str, Any] = {"format": number, "dtypes": record.dtypes}
  for name in (
    "python", "values", "crc32c", "shardings", "codecs", "shapes", "nodes",
    "scalars", "packed",
  ):  # fmt: skip
    if getattr(record, name):
      data[name] = getattr(record, name)
  if record.custom_metadata is not None:
    data["custom_metadata"] = record.custom_metadata
  if record.c_order:
    data["c_order"] = True
  if record.save_id:
    data["save_id"] = record.save_id
  if record.tree is not None:
    data["tree"] = [list(e) for e in record.tree]
  # One line: json's C encoder (an indent takes the pure-Python one, 4x
  # slower: 45 ms of a 1,000-leaf save's record with its shardings).
  return json.dumps(data, sort_keys=True).encode()


def _strs(v: Any, what: str) -> dict[str, str]:
  if not isinstance(v, dict) or not all(
    isinstance(k, str) and isinstance(x, str) for k, x in v.items()
  ):
    raise ValueError(f"{what} is not an object of names")
  return v


def decode_record(api: str, where: str, data: bytes) -> Record:
  """The record in ``data``; ValueError naming ``where`` if it is damaged."""
  try:
    m = json.loads(data.decode())
    if not isinstance(m, dict) or m.get("format") not in _RECORD_READS:
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
    shapes = m.get("shapes", {})
    if not isinstance(shapes, dict) or not all(
      isinstance(x, list) and all(type(d) is int and d >= 0 for d in x)
      for x in shapes.values()
    ):
      raise ValueError("'shapes' is not an object of lists of sizes")
    r.shapes = shapes
    c_order = m.get("c_order", False)
    if type(c_order) is not bool:
      raise ValueError(f"'c_order' is {c_order!r:.40}, not true or false")
    r.c_order = c_order
    save_id = m.get("save_id", "")
    if not isinstance(save_id, str) or len(save_id) > 64:
      raise ValueError(f"'save_id' is {save_id!r:.40}, not a save's id")
    r.save_id = save_id
    shardings = m.get("shardings", {})
    if not isinstance(shardings, dict) or not all(
      isinstance(x, dict) for x in shardings.values()
    ):
      raise ValueError("'shardings' is not an object of objects")
    r.shardings = shardings
    r.codecs = _strs(m.get("codecs", {}), "'codecs'")
    unknown = sorted(set(r.codecs.values()) - set(codec.SUFFIXES))
    if unknown:
      raise ValueError(
        f"'codecs' names {unknown}, which this version does not read (it "
        f"reads {sorted(codec.SUFFIXES)}; a newer jaxworks may read it)"
      )
    r.scalars = _strs(m.get("scalars", {}), "'scalars'")
    for key, text in r.scalars.items():
      if key not in r.python:
        raise ValueError(f"'scalars' holds {key!r}, which 'python' lacks")
      decode_scalar(r.python[key], text)
    for key in r.python:
      if key in r.values and r.values[key] != r.scalars.get(key):
        raise ValueError(f"'values' and 'scalars' differ at {key!r}")
    node_descs = m.get("nodes", {})
    if not isinstance(node_descs, dict) or not all(
      nodes.valid(d) for d in node_descs.values()
    ):
      raise ValueError("'nodes' is not an object of node descriptions")
    r.nodes = node_descs
    custom = m.get("custom_metadata")
    if custom is not None and not isinstance(custom, dict):
      raise ValueError("'custom_metadata' is not an object")
    r.custom_metadata = custom
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
    packed = m.get("packed", [])
    if not isinstance(packed, list) or not all(
      isinstance(k, str) for k in packed
    ):
      raise ValueError("'packed' is not a list of keys")
    stored = {e[0] for e in r.tree or () if len(e) == 2}
    if len(set(packed)) < len(packed) or not set(packed) <= stored - set(
      r.values
    ):
      raise ValueError("'packed' names keys that are not arrays of 'tree'")
    if packed and r.codecs.keys() & set(packed):
      raise ValueError("'packed' names keys that 'codecs' compresses")
    r.packed = packed
  except DAMAGED as err:
    raise ValueError(
      f"{api}: {where} is damaged ({err}); it was written by "
      "jaxworks.batched_transfer.save: write the checkpoint again"
    ) from None
  return r


def header_differences(
  shape: tuple[int, ...],
  dtype: np.dtype,
  fortran: bool,
  record_shape: Any = None,
  record_dtype: np.dtype | None = None,
  c_order: bool = False,
) -> str:
  """What an .npy header (``shape``, ``dtype``, ``fortran``) says that the
  record does not, each as "<header's> where the record says <record's>"
  ('' where they agree): the shape (``record_shape``, None: not recorded),
  the header dtype (``record_dtype``, None: not compared) and the order
  (``c_order``: the record says every file is in C order; a Fortran-order
  header of a record without it agrees, as save wrote it so before).

  >>> header_differences((2, 3), np.dtype("<f4"), True, [2, 3], None, True)
  'Fortran order where the record says C order'
  >>> header_differences((3, 2), np.dtype("<f4"), False, [2, 3])
  'shape (3, 2) where the record says shape (2, 3)'
  """
  out = []
  if record_shape is not None and tuple(shape) != tuple(record_shape):
    out.append(
      f"shape {tuple(shape)} where the record says shape {tuple(record_shape)}"
    )
  if record_dtype is not None and dtype != record_dtype:
    out.append(f"dtype {dtype.str} where the record says {record_dtype.str}")
  if fortran and c_order:
    out.append("Fortran order where the record says C order")
  return ", ".join(out)


def exact_dtype(api: str, where: str, key: str, name: Any) -> np.dtype:
  """The dtype a record names for ``key``; ValueError if numpy does not know it."""
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
  return exact


_KINDS = {
  jax.tree_util.DictKey: "d",
  jax.tree_util.SequenceKey: "s",
  jax.tree_util.GetAttrKey: "a",
  jax.tree_util.FlattenedIndexKey: "f",
}


def path_kinds(path: Any) -> str:
  """One letter per entry of a tree path: d(ict), i, b and r (a dict's
  int, bool or float key), s(equence), a(ttribute), f(lattened index),
  o(ther). A reader that knows no ``i``, ``b`` or ``r`` takes it for ``d``
  (the key as a str)."""
  return "".join(_kind(e) for e in path)


def _kind(entry: Any) -> str:
  if type(entry) is jax.tree_util.DictKey:
    return _DICT_KEY_KINDS.get(type(entry.key), "d")
  return _KINDS.get(type(entry), "o")


_DICT_KEY_KINDS = {int: "i", bool: "b", float: "r"}


def _typed_key(kind: str, part: str) -> int | float | str:
  """A dict key recorded as an int, a bool or a float (kind ``i``, ``b``
  or ``r``): the value its text is, the text itself where it is none (a
  hostile record)."""
  if kind == "b":
    return {"True": True, "False": False}.get(part, part)
  if kind == "r":  # str(x) of a float is its repr: the same float back
    try:
      x = float(part)
    except ValueError:
      return part
    return x if repr(x) == part else part
  try:
    n = int(part)
  except ValueError:
    return part
  return n if str(n) == part else part


def rebuild_tree(
  tree: list[tuple[str, ...]],
  value_of: Any,
  node_descs: dict[str, dict] | None = None,
) -> Any:
  """The nesting ``tree`` describes, with ``value_of(key)`` at each leaf:
  each inner node as ``node_descs`` (the record's ``nodes``, by key
  prefix) describes it (nodes.build), else a list for sequence entries
  and a dict for the others; an empty node as described, else as its
  entry's third element says."""
  descs = node_descs or {}

  def leaf(entry: tuple[str, ...]) -> Any:
    if len(entry) == 3:
      kind = "s" if entry[2] == "list" else "d"
      return nodes.build(descs.get(entry[0]), kind, [])
    return value_of(entry[0])

  if len(tree) == 1 and not tree[0][1]:
    return leaf(tree[0])
  top: dict[str, Any] = {}
  kinds: dict[tuple[str, ...], str] = {}
  leaves: set[tuple[str, ...]] = set()
  typed: dict[tuple[str, ...], str] = {}  # entries of int, bool, float keys
  for entry in tree:
    key, entry_kinds = entry[0], entry[1]
    parts = key.split("/")
    if len(parts) != len(entry_kinds):
      raise ValueError(f"the key {key!r} does not match its kinds")
    node = top
    for i, part in enumerate(parts):
      kinds.setdefault(tuple(parts[:i]), entry_kinds[i])
      if entry_kinds[i] in "ibr":
        typed[tuple(parts[: i + 1])] = entry_kinds[i]
      if i == len(parts) - 1:
        node[part] = leaf(entry)
        leaves.add(tuple(parts))
      else:
        node = node.setdefault(part, {})

  def build(prefix: tuple[str, ...], node: Any) -> Any:
    if prefix in leaves or prefix not in kinds:
      return node  # a leaf
    items = []
    for k, v in node.items():
      at = prefix + (k,)
      items.append(
        (_typed_key(typed[at], k) if at in typed else k, build(at, v))
      )
    return nodes.build(descs.get("/".join(prefix)), kinds[prefix], items)

  return build((), top)


def tree_path(key: str, kinds: str) -> str:
  """The tree path (as ``jax.tree_util.keystr``) of a record's ``key``
  whose entries are of ``kinds``.

  >>> tree_path("opt_state/1/0/mu", "dssa")
  "['opt_state'][1][0].mu"
  """
  if not kinds:
    return "<root>"
  out = []
  for part, kind in zip(key.split("/"), kinds):
    if kind in "sibr":
      out.append(f"[{part}]")
    elif kind == "a":
      out.append(f".{part}")
    else:
      out.append(f"[{part!r}]")
  return "".join(out)


def encode_scalar(x: bool | int | float | complex) -> str:
  """The exact text of a Python scalar (the record's ``scalars``): a bool
  as "True"/"False", an int in decimal (hex, "0x...", past 2,000 bits),
  a float as its ``repr`` (a NaN as "nan:" and its 64 bits in
  hex), a complex as its two floats joined by ","; ``decode_scalar`` reads
  it back bit for bit.

  >>> [encode_scalar(v) for v in (True, 2**70, 0.1, -0.0, complex(1, 2))]
  ['True', '1180591620717411303424', '0.1', '-0.0', '1.0,2.0']
  >>> decode_scalar("float", encode_scalar(0.1)) == 0.1
  True
  """
  if isinstance(x, bool):
    return "True" if x else "False"
  if isinstance(x, int):
    # Past 2,000 bits (602 digits) in hex: Python's digit limit on int <->
    # str conversions is at least 640 digits wherever it is read.
    return str(int(x)) if int(x).bit_length() <= 2000 else hex(int(x))
  if isinstance(x, float):
    if x != x:
      return "nan:" + hex(struct.unpack("<Q", struct.pack("<d", x))[0])
    return repr(float(x))
  return f"{encode_scalar(x.real)},{encode_scalar(x.imag)}"


def decode_scalar(name: str, text: str) -> bool | int | float | complex:
  """The Python scalar of type ``name`` (``PYTHON_TYPES``) that
  ``encode_scalar`` wrote as ``text``; ValueError if it is not one."""
  if name == "bool":
    if text not in ("True", "False"):
      raise ValueError(f"{text!r:.40} is not a bool")
    return text == "True"
  if name == "int":
    if not text.lstrip("-").isalnum():
      raise ValueError(f"{text!r:.40} is not an int")
    return int(text, 16) if text.lstrip("-").startswith("0x") else int(text)
  if name == "float":
    if text.startswith("nan:"):
      bits = int(text[4:], 16)
      if not 0 <= bits < 2**64:
        raise ValueError(f"{text!r:.40} is not a float")
      return struct.unpack("<d", struct.pack("<Q", bits))[0]
    return float(text)
  if name == "complex":
    real, sep, imag = text.partition(",")
    if not sep:
      raise ValueError(f"{text!r:.40} is not a complex")
    return complex(decode_scalar("float", real), decode_scalar("float", imag))  # type: ignore[arg-type]
  raise ValueError(f"{name!r:.40} is not a Python scalar type")


def _spec_entry(e: Any) -> Any:
  if e is None or isinstance(e, str):
    return e
  if isinstance(e, tuple) and all(isinstance(x, str) for x in e):
    return list(e)
  raise TypeError(e)


def describe_sharding(sharding: Any) -> dict[str, Any] | None:
  """The JSON record of ``sharding``, or None for a kind not recorded."""
  try:
    if isinstance(sharding, SingleDeviceSharding):
      device: Any = next(iter(sharding.device_set))
      return {"device": int(device.id), "memory_kind": sharding.memory_kind}
    if isinstance(sharding, NamedSharding):
      mesh, spec = sharding.mesh, sharding.spec
      if getattr(spec, "unreduced", None) or getattr(spec, "reduced", None):
        return None
      return {
        "mesh": {
          "axis_names": list(mesh.axis_names),
          "shape": [int(n) for n in mesh.devices.shape],
          "axis_types": [t.name for t in mesh.axis_types],
          "devices": [int(d.id) for d in mesh.devices.flat],
        },
        "spec": [_spec_entry(e) for e in spec],
        "memory_kind": sharding.memory_kind,
      }
  except (TypeError, AttributeError, ValueError):
    return None
  return None


def rebuild_sharding(desc: Any) -> Any:
  """The sharding ``desc`` records, on this job's devices; None where a
  device is missing or the record is not one ``describe`` writes."""
  try:
    by_id = {d.id: d for d in jax.devices()}
    if "device" in desc:
      return SingleDeviceSharding(
        by_id[desc["device"]], memory_kind=desc.get("memory_kind")
      )
    m = desc["mesh"]
    devices = np.array([by_id[i] for i in m["devices"]], dtype=object)
    mesh = jax.sharding.Mesh(
      devices.reshape(m["shape"]),
      tuple(m["axis_names"]),
      axis_types=tuple(jax.sharding.AxisType[t] for t in m["axis_types"]),
    )
    spec = PartitionSpec(
      *(tuple(e) if isinstance(e, list) else e for e in desc["spec"])
    )
    return NamedSharding(mesh, spec, memory_kind=desc.get("memory_kind"))
  except (KeyError, TypeError, ValueError, AttributeError):
    return None


MANIFEST = "jaxworks_manifest.json"
MANIFEST_FORMAT = 1

#: The largest manifest or record restore reads (a damaged or hostile one
#: may be huge).
MAX_MANIFEST_BYTES = 256 * 2**20

Bounds = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Shard:
  file: str  # relative to the checkpoint directory
  start: tuple[int, ...]
  shape: tuple[int, ...]
  crc32c: tuple[int, ...] | None = None  # checksums of its data (checksum)


@dataclasses.dataclass
class Entry:
  shape: tuple[int, ...]
  dtype: np.dtype
  shards: list[Shard]
  # The grid: the shards' distinct starts along each dimension, sorted, and
  # the shard at each combination of starts.
  starts: list[list[int]] = dataclasses.field(default_factory=list)
  at: dict[tuple[int, ...], Shard] = dataclasses.field(default_factory=dict)

  def overlapping(self, want: Bounds) -> Iterator[Shard]:
    """The shards that overlap the region ``want`` (none if it is empty)."""
    ranges = [
      range(bisect.bisect_right(st, w0) - 1, bisect.bisect_left(st, w1))
      for st, (w0, w1) in zip(self.starts, want)
    ]
    for idx in itertools.product(*ranges):
      yield self.at[tuple(st[i] for st, i in zip(self.starts, idx))]


def shard_stem(key: str, n: int) -> str:
  """The file name, less ``.npy``, of shard ``n`` of the array ``key``."""
  return f"{key}.shards/{n}"


def bounds(idx: tuple, shape: tuple[int, ...]) -> Bounds:
  """The (start, stop) per dimension of the index ``idx`` into ``shape``."""
  return tuple((s.indices(n)[0], s.indices(n)[1]) for s, n in zip(idx, shape))


def _ints(v: Any, n: int | None, what: str) -> tuple[int, ...]:
  if not isinstance(v, list) or (n is not None and len(v) != n):
    raise ValueError(f"{what} is {v!r:.80}, not a list of {n or ''} ints")
  if not all(type(d) is int and d >= 0 for d in v):
    raise ValueError(f"{what} is {v!r:.80}, not non-negative ints")
  return tuple(v)


def _file_name(v: Any) -> str:
  if (
    not isinstance(v, str)
    or not v.endswith(".npy")
    or "\0" in v
    or os.path.isabs(v)
    or os.path.normpath(v) != v
    or ".." in v.split("/")
  ):
    raise ValueError(f"the shard file name {v!r:.80} is not a relative path")
  return v


def encode_manifest(manifest: dict[str, Any]) -> bytes:
  """The bytes of ``manifest`` (a JSON object, as ``parse_manifest`` reads it)."""
  return json.dumps(manifest, indent=1, sort_keys=True).encode()


def parse_manifest(data: bytes) -> dict[str, Entry]:
  """The arrays a manifest describes; ValueError/KeyError/TypeError if damaged."""
  m = json.loads(data.decode())
  if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
    raise ValueError(
      f"unknown format {m.get('format') if isinstance(m, dict) else m!r:.40}"
    )
  arrays = m["arrays"]
  if not isinstance(arrays, dict):
    raise TypeError("'arrays' is not an object")
  out: dict[str, Entry] = {}
  for key, a in arrays.items():
    shape = _ints(a["shape"], None, f"the shape of {key!r}")
    if not isinstance(a["dtype"], str):
      raise TypeError(f"the dtype of {key!r} is not a name")
    dtype = np.dtype(a["dtype"])
    if dtype.hasobject or dtype.fields is not None:
      raise ValueError(f"the dtype of {key!r} is {dtype}")
    shards = []
    for s in a["shards"]:
      file = _file_name(s["file"])
      start = _ints(s["start"], len(shape), f"the start of {file!r}")
      sshape = _ints(s["shape"], len(shape), f"the shape of {file!r}")
      if any(b + n > d for b, n, d in zip(start, sshape, shape)):
        raise ValueError(
          f"the shard {file!r} lies outside {key!r} {list(shape)}"
        )
      sums = s.get("crc32c")
      if sums is not None:
        sums = _ints(sums, None, f"the checksums of {file!r}")
      shards.append(Shard(file, start, sshape, sums))
    _check_grid(key, shape, shards)
    starts = [sorted({x.start[d] for x in shards}) for d in range(len(shape))]
    out[key] = Entry(shape, dtype, shards, starts, {x.start: x for x in shards})
  return out


def _check_grid(key: str, shape: tuple[int, ...], shards: list[Shard]) -> None:
  """The shards tile the array as a grid (as a sharding's shards do): along
  each dimension their extents partition it, and each cell is one shard."""
  cells = 1
  for d, n in enumerate(shape):
    end = 0
    extents = sorted({(s.start[d], s.start[d] + s.shape[d]) for s in shards})
    for a, b in extents:
      if a != end or (a == b and n):
        break
      end = b
    if end != n or (extents and extents[-1][1] != n):
      raise ValueError(f"the shards of {key!r} do not tile dimension {d}")
    cells *= len(extents)
  if len({(s.start, s.shape) for s in shards}) != len(shards) or (
    len(shards) != cells
  ):
    raise ValueError(f"the shards of {key!r} do not tile the array")


def intersect(shard: Shard, want: Bounds) -> Bounds | None:
  """The part of the region ``want`` that ``shard`` holds (None: none)."""
  inter = tuple(
    (max(s, w0), min(s + n, w1))
    for s, n, (w0, w1) in zip(shard.start, shard.shape, want)
  )
  return None if any(a >= b for a, b in inter) else inter
