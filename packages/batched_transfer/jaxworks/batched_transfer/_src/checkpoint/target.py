"""A restore target sorted against a checkpoint's arrays and record.

``Target`` splits a target tree into the arrays to read and the leaves the
record stores by value (``str`` and None), or, without a target, builds one
from the checkpoint's record (``as_saved``, which ``metadata`` also
returns); ``target_spec`` is the shape, dtype and weak type a target leaf
asks for, ``placement_of`` where it goes, ``restore_placement`` that
placement checked; ``Request`` is what restore asks of the checkpoint it
opened (``restore_arrays`` of restore_files' ``Opened`` or restore_shards'
``Manifest``): the leaves ``Target`` picked, and how to read them.

>>> import numpy as np
>>> r = format.Record(values={"run": "exp-42"},
...                   tree=[("run", "d"), ("w", "d")])
>>> as_saved({"w": ((2,), np.dtype(np.float32))}, r)
{'run': 'exp-42', 'w': ShapeDtypeStruct(shape=(2,), dtype=float32)}
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.experimental.layout import Format
import numpy as np

from .. import jax_internals
from .. import targets
from ..transfer import check_shard_shape
from . import format
from .keys import ROOT_KEY
from .keys import check_keys
from .keys import leaf_keys
from .keys import python_scalar_dtype


@dataclasses.dataclass(frozen=True)
class Request:
  """The arrays a restore reads (in the order ``Target`` picked them), where
  each goes, and how they are read."""

  api: str
  keys: list[str]  # the stored arrays
  paths: list[str]  # their tree paths, for messages
  specs: list[tuple[tuple[int, ...], np.dtype, bool]]  # see target_spec
  places: list[Any]  # device_put targets, one per array
  max_inflight_bytes: int
  read_threads: int
  progress: bool | None
  verify: bool


def placement_of(leaf: Any) -> Any:
  """Where a target leaf goes: its format (with a layout) or sharding."""
  fmt = getattr(leaf, "format", None)
  if isinstance(fmt, Format) and fmt.sharding is not None:
    return fmt if fmt.layout is not None else fmt.sharding
  return getattr(leaf, "sharding", None)


def restore_placement(
  api: str, t: Any, where: str, shape: tuple[int, ...], cache: dict[int, Any]
) -> tuple[Any, Any, bool]:
  """``normalize_target`` of the placement ``t`` of restore's leaf at
  ``where`` (once per object: ``cache``), its sharding checked to split
  ``shape``; restore's words for a target it cannot take."""
  if id(t) not in cache:
    try:
      cache[id(t)] = targets.normalize_target(api, t)
    except targets.Delegate:
      raise ValueError(
        f"{api}: placement {t!r} at {where} depends on the mesh context; "
        "pass a Sharding"
      ) from None
    except ValueError as err:
      raise ValueError(
        f"{err} (the placement of the leaf at {where}; a target leaf's "
        "sharding is its placement unless placement= is given)"
      ) from None
  sharding = cache[id(t)][0]
  if sharding is not None:
    check_shard_shape(
      sharding,
      shape,
      lambda: (
        f"{api}: the leaf at {where} with shape {shape} cannot be "
        f"placed on {sharding}"
      ),
    )
  return cache[id(t)]


def target_spec(
  api: str, where: str, x: Any
) -> tuple[tuple[int, ...], np.dtype, bool]:
  """(shape, dtype, weak_type) a target leaf asks for."""
  scalar_dtype = python_scalar_dtype(x)
  # As jax.device_put places a Python scalar (a bool strongly typed), and as
  # save stores it.
  if scalar_dtype is not None:
    return (), scalar_dtype, not isinstance(x, bool)
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
    record: format.Record,
    partial: bool,
  ) -> None:
    self.python: dict[int, type] = {}
    built = target is None
    if built:
      target = as_saved(arrays, record)
    self.target = target
    self.keys, self.paths, self.leaves, self.treedef = leaf_keys(api, target)
    keys, paths, leaves = self.keys, self.paths, self.leaves
    stored = set(arrays) | {
      k for k, v in record.values.items() if v is not None
    }
    # Without a target: the recorded tree, as metadata gives it (a stray
    # .npy file beside it is no leaf of it).
    try:
      check_keys(api, path, keys, paths, stored, partial or built)
    except ValueError as err:
      first = first_difference(keys, paths, record, stored, partial)
      if not first:
        raise
      raise ValueError(f"{err}; {first}") from None
    self.values: dict[int, Any] = {}
    self.arrays: list[int] = []
    for i, (key, where, x) in enumerate(zip(keys, paths, leaves)):
      if record.value_only(key):
        value = exact_value(record, key)
        if not built and python_scalar_dtype(x) is None:
          raise ValueError(
            f"{api}: the leaf at {where} (key {key!r}) is stored in {path!r} "
            f"as the Python {record.python[key]} {value!r:.40}, which no "
            f"array of JAX's dtypes holds, but the target expects "
            f"{_describe(x)}; put a Python scalar in the target there"
          )
        self.values[i] = value
        continue
      if key in record.values:
        if not isinstance(x, str):
          raise ValueError(
            f"{api}: the leaf at {where} (key {key!r}) is stored in {path!r} "
            f"as the str {record.values[key]!r:.40} but the target expects "
            f"{_describe(x)}; put a str in the target there"
          )
        self.values[i] = record.values[key]
        continue
      if built and key in record.python:
        if key in record.scalars:  # exact, from the record: nothing read
          self.values[i] = exact_value(record, key)
          continue
        self.python[i] = format.PYTHON_TYPES[record.python[key]]
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


def exact_value(record: format.Record, key: str) -> Any:
  """The Python scalar ``key`` of ``record`` as saved (its ``scalars``)."""
  return format.decode_scalar(record.python[key], record.scalars[key])


def as_saved(
  arrays: dict[str, tuple[tuple[int, ...], np.dtype]],
  record: format.Record,
  with_shardings: bool = False,
) -> Any:
  """The tree a checkpoint holds, with a jax.ShapeDtypeStruct per array
  (restore without a target, and ``metadata``, which also gives each the
  sharding it was saved with, where this job has its devices), the value
  of each str, None and Python scalar leaf (a checkpoint of 0.6 and
  before: the ShapeDtypeStruct of a Python scalar's 0-d array), and each
  inner node as the record describes it (format.rebuild_tree)."""
  tree = record.tree
  if tree is None:  # written before the record had it: dicts by key
    keys = sorted(set(arrays) | set(record.values))
    if keys == [ROOT_KEY]:
      tree = [(ROOT_KEY, "")]
    else:
      tree = [(k, "d" * len(k.split("/"))) for k in keys]

  def leaf(key: str) -> Any:
    if key in record.scalars:
      return exact_value(record, key)
    if key in record.values:
      return record.values[key]
    shape, dtype = arrays[key]
    desc = record.shardings.get(key) if with_shardings else None
    sharding = None if desc is None else format.rebuild_sharding(desc)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

  return format.rebuild_tree(tree, leaf, record.nodes)


def first_difference(
  keys: list[str],
  paths: list[str],
  record: format.Record,
  stored: set[str],
  partial: bool,
) -> str:
  """Where a target's leaves (``keys``, at tree ``paths``, in tree order)
  first differ from the checkpoint's (its ``record``, whose leaves with
  data are ``stored``; ``partial``: only a target leaf the checkpoint
  lacks differs): a sentence naming that tree path and what each side has
  there ('' where the record lists no tree, or they do not differ)."""
  if record.tree is None:
    return ""
  mine = list(zip(keys, paths))
  saved = [(e[0], e[1]) for e in record.tree if len(e) == 2 and e[0] in stored]
  mine_keys, saved_keys = set(keys), {k for k, _ in saved}

  def theirs(b: tuple[str, str] | None) -> str:
    if b is None:
      return "nothing"
    return f"the leaf {format.tree_path(b[0], b[1])} (key {b[0]!r})"

  def ours(a: tuple[str, str] | None) -> str:
    return "nothing" if a is None else f"the leaf {a[1]} (key {a[0]!r})"

  for i in range(max(len(mine), len(saved))):
    a = mine[i] if i < len(mine) else None
    b = saved[i] if i < len(saved) else None
    if a is not None and b is not None and a[0] == b[0]:
      continue
    if a is not None and a[0] not in saved_keys:
      return (
        f"the first difference in tree order is at {a[1]}: the target has "
        f"a leaf there (key {a[0]!r}) where the checkpoint has {theirs(b)}"
      )
    if b is not None and b[0] not in mine_keys and not partial:
      return (
        f"the first difference in tree order is at "
        f"{format.tree_path(b[0], b[1])}: the checkpoint has a leaf there "
        f"(key {b[0]!r}) where the target has {ours(a)}"
      )
  return ""


def weak(y: Any) -> Any:
  """``y`` with a weak type (as jax.device_put gives a Python scalar), sharing its buffer."""
  return jax_internals.committed_array(
    y, y.aval.update(weak_type=True), y.sharding, committed=y.committed
  )
