"""The inner nodes of a saved tree: how the record describes them, and how
restore without a target builds them again.

A dict or a list needs no description (the kinds of the tree paths say
which: a list for sequence entries, a dict for the others). Every other
node type is described by ``describe``, a small JSON object the record
keeps under ``nodes`` (see format):

* ``{"type": "tuple"}``: a tuple;
* ``{"type": "namedtuple", "class": "<module>:<qualname>", "fields":
  [...]}``: a named tuple (optax's ``EmptyState``, ``MaskedNode``,
  ``ScaleByAdamState``, ...);
* ``{"type": "OrderedDict"}``;
* ``{"type": "node", "class": "<module>:<qualname>"}``: any other pytree
  node (an equinox module, flax's ``nnx.State``, a registered dataclass).

``build`` makes a node again from its description and its children. A
class named in a record is data: nothing is imported, unpickled or called.
A named tuple comes back as its class only where the program has loaded
that class already (looked up in ``sys.modules`` without ``getattr``, and
only if it is a named tuple with the same fields), built with
``tuple.__new__`` (so none of its code runs); elsewhere as a named tuple
class of the same name and fields made with ``collections.namedtuple``
(one per name and fields, so that two restores share it). Other nodes
come back as dicts keyed by their entries' names (lists for sequence
entries), as the keys of their leaves are.

>>> import collections
>>> P = collections.namedtuple("P", ["x", "y"])
>>> d = describe(P)
>>> d["type"], d["fields"]
('namedtuple', ['x', 'y'])
>>> build(d, "a", [("x", 1), ("y", 2)]) == P(1, 2)
True
>>> build({"type": "tuple"}, "s", [("0", 1), ("1", 2)])
(1, 2)
>>> build({"type": "node", "class": "m:C"}, "a", [("w", 1)])
{'w': 1}
"""

from __future__ import annotations

import collections
import keyword
import sys
import threading
from typing import Any

#: The ``type`` of each description.
TYPES = ("tuple", "namedtuple", "OrderedDict", "node")


def class_name(t: type) -> str:
  """``<module>:<qualname>`` of the class ``t``."""
  return f"{getattr(t, '__module__', '?')}:{getattr(t, '__qualname__', '?')}"


def is_namedtuple(t: type) -> bool:
  """Whether ``t`` is a named tuple class (as jax's pytrees see one)."""
  return issubclass(t, tuple) and _fields_of(t) is not None


def _fields_of(t: type) -> tuple[str, ...] | None:
  for base in t.__mro__:  # no getattr: a metaclass's __getattr__ stays out
    fields = vars(base).get("_fields")
    if fields is not None:
      return fields if isinstance(fields, tuple) else None
  return None


def describe(t: type) -> dict[str, Any] | None:
  """The record's description of a node of type ``t`` (None: a dict or a
  list, which need none)."""
  if t is dict or t is list:
    return None
  if t is tuple:
    return {"type": "tuple"}
  if issubclass(t, tuple):
    fields = _fields_of(t)
    if fields is not None:
      return {
        "type": "namedtuple",
        "class": class_name(t),
        "fields": [str(f) for f in fields],
      }
  if t is collections.OrderedDict:
    return {"type": "OrderedDict"}
  return {"type": "node", "class": class_name(t)}


def valid(desc: Any) -> bool:
  """Whether ``desc`` is a description ``describe`` writes."""
  if not isinstance(desc, dict) or desc.get("type") not in TYPES:
    return False
  if desc["type"] in ("namedtuple", "node") and not isinstance(
    desc.get("class"), str
  ):
    return False
  fields = desc.get("fields")
  if desc["type"] == "namedtuple":
    return isinstance(fields, list) and all(isinstance(f, str) for f in fields)
  return True


def _loaded_class(name: str, fields: tuple[str, ...]) -> type | None:
  """The named tuple class ``name`` (``<module>:<qualname>``) with
  ``fields``, where its module is loaded already; else None. Nothing is
  imported and no attribute hook runs (``vars``, not ``getattr``)."""
  module, _, qualname = name.partition(":")
  obj: Any = sys.modules.get(module)
  if obj is None or not qualname:
    return None
  for part in qualname.split("."):
    try:
      obj = vars(obj).get(part)
    except TypeError:  # no __dict__
      return None
    if obj is None:
      return None
  if not isinstance(obj, type) or not issubclass(obj, tuple):
    return None
  return obj if _fields_of(obj) == fields else None


_MADE: dict[tuple[str, tuple[str, ...]], type] = {}
_MADE_LOCK = threading.Lock()


def _identifier(s: str) -> bool:
  return s.isidentifier() and not keyword.iskeyword(s)


def _made_class(name: str, fields: tuple[str, ...]) -> type | None:
  """A named tuple class named as ``name``'s last part, with ``fields``
  (one per name and fields); None where they cannot name one."""
  short = name.rpartition(":")[2].rpartition(".")[2]
  if not _identifier(short):
    short = "SavedNamedTuple"
  if len(set(fields)) != len(fields) or not all(
    _identifier(f) and not f.startswith("_") for f in fields
  ):
    return None
  with _MADE_LOCK:
    if (name, fields) not in _MADE:
      made: Any = collections.namedtuple(short, fields)  # type: ignore[misc]
      made.__doc__ = f"A named tuple as saved, of the class {name}."
      _MADE[(name, fields)] = made
    return _MADE[(name, fields)]


def namedtuple_class(name: str, fields: tuple[str, ...]) -> type | None:
  """The class a saved named tuple ``name`` with ``fields`` comes back as:
  the loaded class, else one made (None: fields that name none)."""
  return _loaded_class(name, fields) or _made_class(name, fields)


def build(desc: Any, kind: str, items: list[tuple[Any, Any]]) -> Any:
  """The node ``desc`` describes (None: a dict, or a list where ``kind``,
  the kind of its entries' paths, is "s"), with the children ``items``
  (``(name, child)`` in tree order)."""
  if desc is not None and valid(desc):
    if desc["type"] == "tuple":
      return tuple(_by_index(items))
    if desc["type"] == "OrderedDict":
      return collections.OrderedDict(items)
    if desc["type"] == "namedtuple":
      fields = tuple(desc["fields"])
      if tuple(k for k, _ in items) == fields:
        cls = namedtuple_class(desc["class"], fields)
        if cls is not None:
          return tuple.__new__(cls, [v for _, v in items])
  if kind == "s":
    return _by_index(items)
  return dict(items)


def _by_index(items: list[tuple[Any, Any]]) -> list[Any]:
  """The children of a sequence at their indices, a gap (a node 0.6 did not
  record: an ``EmptyState()``) as None, as orbax restores one; in order
  where the names are not its indices."""
  try:
    at = [int(k) for k, _ in items]
  except ValueError:
    return [v for _, v in items]
  n = max(at, default=-1) + 1
  if len(set(at)) != len(at) or min(at, default=0) < 0 or n > 2 * len(at) + 16:
    return [v for _, v in items]
  out: list[Any] = [None] * n
  for i, (_, v) in zip(at, items):
    out[i] = v
  return out
