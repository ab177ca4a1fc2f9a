"""What differs between re-created functions: closed-over values, defaults.

A sweep re-creates its step per configuration; each new function object has
an empty trace cache, and its program is compiled anew unless it equals one
compiled before. ``remember`` records, whenever a function of jit_cache
compiles or reuses an executable, a description of everything its code
closes over, followed through nested closures, partials, containers and
objects (``optax.adam(lr)`` keeps ``lr`` in a closure of its ``update``
function); ``explain_new_function`` compares a new function with the records
of earlier functions of the same code (alive or not) and names the first
differing value at its path, or says plainly what it cannot see into. It
never predicts that an executable will be reused: that is decided after
tracing, by the program's fingerprint.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import threading
from typing import Any
import weakref

import numpy as np

from .cache import CoreView
from .cache import Counters
from .lru import LRU

#: Functions of the same code remembered, and codes remembered.
PER_CODE = 8
CODES = 256
#: Arrays up to this many elements are summarized by value, larger ones by a
#: digest of their content.
SMALL_ARRAY = 16
#: jax Arrays up to this many bytes are keyed by content (as the fingerprint
#: does); larger ones by identity.
CONTENT_BYTES = 1 << 16
#: How deep, and how many values, a description follows.
MAX_DEPTH = 8
MAX_VALUES = 400

#: Code -> its functions' records, newest last; the codes used least recently
#: beyond ``CODES`` are forgotten.
_HISTORY: LRU[tuple, collections.deque] = LRU(CODES)
_LOCK = threading.Lock()

#: The summary of a value explain_miss cannot see into.
OPAQUE = "<cannot see into>"


def _code_key(fun: Any) -> tuple | None:
  code = getattr(fun, "__code__", None)
  if code is None:
    return None
  return (code.co_filename, code.co_firstlineno, code.co_qualname)


def _short(text: str) -> str:
  return text if len(text) <= 60 else text[:57] + "..."


def _array_summary(value: Any) -> str:
  """Equal for arrays the fingerprint keys alike: by content (numpy arrays,
  small jax Arrays) or by identity (large jax Arrays)."""
  shape, dtype = value.shape, value.dtype
  try:
    described = f"{np.dtype(dtype).name}{list(shape)}"
  except TypeError:
    described = f"{dtype}{list(shape)}"
  nbytes = getattr(value, "nbytes", None)
  by_identity = not isinstance(value, np.ndarray) and (
    nbytes is None or nbytes > CONTENT_BYTES
  )
  if type(value).__name__.endswith("Tracer") or by_identity:
    return f"{described} (array at {id(value):#x})"
  try:
    data = np.asarray(value)
  except Exception:  # pylint: disable=broad-except
    return f"{described} (array at {id(value):#x})"
  if data.size <= SMALL_ARRAY:
    return f"{described} {data.ravel().tolist()}"
  digest = hashlib.blake2b(
    # numpy's stubs declare the buffer protocol only for Python >= 3.12.
    np.ascontiguousarray(data).view(np.uint8).reshape(-1),  # type: ignore[arg-type]
    digest_size=8,
  ).hexdigest()
  return f"{described} (content {digest})"


class _Describer:
  """Flattens a value into ``(path, summary)`` pairs, following closures,
  partials, containers, dataclasses and objects' attributes."""

  def __init__(self):
    self.out: list[tuple[str, str]] = []
    self.seen: set[int] = set()

  def add(self, path: str, summary: str) -> None:
    self.out.append((path, summary))

  def value(self, path: str, value: Any, depth: int) -> None:
    if len(self.out) >= MAX_VALUES:
      self.add(path, OPAQUE + " (too many values)")
      return
    if value is None or isinstance(value, (bool, int, float, complex, str)):
      self.add(path, _short(repr(value)))
      return
    if hasattr(value, "shape") and hasattr(value, "dtype"):
      self.add(path, _array_summary(value))
      return
    if isinstance(value, type):
      self.add(path, f"class {value.__qualname__}")
      return
    if depth >= MAX_DEPTH:
      self.add(path, OPAQUE + " (nested too deep)")
      return
    if id(value) in self.seen:  # a cycle, or the same object again
      self.add(path, f"(the same {type(value).__name__} as before)")
      return
    self.seen.add(id(value))
    self.compound(path, value, depth + 1)

  def compound(self, path: str, value: Any, depth: int) -> None:
    if isinstance(value, functools.partial):
      self.value(f"{path} -> partial function", value.func, depth)
      for i, a in enumerate(value.args):
        self.value(f"{path} -> partial argument {i}", a, depth)
      for k, a in sorted(value.keywords.items()):
        self.value(f"{path} -> partial keyword `{k}`", a, depth)
    elif hasattr(value, "__code__"):  # a Python function
      self.function(path, value, depth)
    elif isinstance(value, tuple) and hasattr(value, "_fields"):
      self.add(path, f"{type(value).__name__}")
      for field in value._fields:
        self.value(f"{path}.{field}", getattr(value, field), depth)
    elif isinstance(value, (tuple, list)):
      self.add(path, f"{type(value).__name__} of {len(value)}")
      for i, v in enumerate(value):
        self.value(f"{path}[{i}]", v, depth)
    elif isinstance(value, dict):
      self.add(path, f"dict of {len(value)}")
      for k, v in sorted(value.items(), key=lambda kv: repr(kv[0])):
        self.value(f"{path}[{k!r}]", v, depth)
    elif dataclasses.is_dataclass(value):
      self.add(path, f"{type(value).__name__}")
      for field in dataclasses.fields(value):
        self.value(f"{path}.{field.name}", getattr(value, field.name), depth)
    elif hasattr(value, "__self__") and hasattr(value, "__func__"):
      self.value(f"{path} -> method", value.__func__, depth)
      self.value(f"{path} -> bound to", value.__self__, depth)
    elif hasattr(value, "__dict__") and isinstance(vars(value), dict):
      self.add(path, f"{type(value).__qualname__} object")
      for k, v in sorted(vars(value).items()):
        self.value(f"{path}.{k}", v, depth)
    else:
      self.add(path, f"{OPAQUE} ({type(value).__name__})")

  def function(self, path: str, fun: Any, depth: int) -> None:
    code = fun.__code__
    self.add(path, f"function {getattr(fun, '__qualname__', '?')}")
    for name, cell in zip(code.co_freevars, fun.__closure__ or ()):
      try:
        inner = cell.cell_contents
      except ValueError:
        self.add(f"{path} -> closure `{name}`", "<empty>")
        continue
      self.value(f"{path} -> closure `{name}`", inner, depth)
    for i, default in enumerate(fun.__defaults__ or ()):
      self.value(f"{path} -> default {i}", default, depth)


def _describe(fun: Any) -> tuple[tuple[str, str], ...]:
  """``((path, summary), ...)`` of everything ``fun`` closes over and its
  defaults, followed into nested values."""
  describer = _Describer()
  describer.seen.add(id(fun))
  code = fun.__code__
  for i, (name, cell) in enumerate(
    zip(code.co_freevars, fun.__closure__ or ())
  ):
    label = f"closed-over constant `{name}` (cell {i})"
    try:
      value = cell.cell_contents
    except ValueError:
      describer.add(label, "<empty>")
      continue
    describer.value(label, value, 0)
  names = code.co_varnames[: code.co_argcount]
  for name, value in zip(names[::-1], (fun.__defaults__ or ())[::-1]):
    describer.value(f"default of `{name}`", value, 0)
  for name, value in sorted((fun.__kwdefaults__ or {}).items()):
    describer.value(f"default of `{name}`", value, 0)
  return tuple(describer.out)


def owner_of(counters: Counters) -> CoreView | None:
  """The core whose counters these are (None if it died)."""
  ref = counters.owner
  return ref() if ref is not None else None


def remember(counters: Counters) -> None:
  """Records the closure of the function owning ``counters`` (it compiled
  or reused an executable)."""
  core = owner_of(counters)
  fun = core.user_function if core is not None else None
  key = _code_key(fun)
  if key is None:
    return
  try:
    record = (weakref.ref(core), _describe(fun))
  except Exception:  # pylint: disable=broad-except
    return  # an unusual function object: nothing to explain with
  with _LOCK:
    history = _HISTORY.get(key)
    if history is None:
      history = collections.deque(maxlen=PER_CODE)
    for i, old in enumerate(history):
      if old[0]() is core:
        del history[i]
        break
    history.append(record)
    _HISTORY.put(key, history)


def _first_difference(old: tuple, new: tuple) -> tuple[str, str, str] | None:
  """(path, old summary, new summary) of the first difference in order."""
  old_d, new_d = dict(old), dict(new)
  for path, summary in new:
    was = old_d.get(path, "<absent>")
    if was != summary:
      return path, was, summary
  for path, summary in old:
    if path not in new_d:
      return path, summary, "<absent>"
  return None


def explain_new_function(
  core: CoreView, argument_diffs: Any = None
) -> str | None:
  """Why a function with nothing cached yet will compile or reuse: the
  first closed-over value (or default) that differs from the nearest earlier
  function of the same code, at its path; or None when there is none.

  ``argument_diffs(earlier_core)`` lists how this call's arguments differ
  from what that earlier function was called with (None when unknown).
  """
  name = core.name
  fun = core.user_function
  key = _code_key(fun)
  if key is None:
    return None
  with _LOCK:
    records = [r for r in _HISTORY.peek(key) or () if r[0]() is not core]
  if not records:
    return None
  try:
    mine = _describe(fun)
  except Exception:  # pylint: disable=broad-except
    return None
  where = f"{len(records)} earlier {name} function" + (
    "s" if len(records) > 1 else ""
  )
  head = (
    f"{name}: miss: nothing is cached for this {name} yet (a new function "
    f"object); the nearest of {where} of the same code ({key[2]})"
  )
  found = [(_first_difference(r[1], mine), r) for r in reversed(records)]
  equal = [r for diff, r in found if diff is None]
  newest = found[0][0]
  if not equal and newest is not None:
    path, was, now = newest  # the first difference from the newest one
    fix = (
      f"; pass it as an argument to reuse the compiled {name}"
      if path.startswith("closed-over")
      else ""
    )
    return f"{head} differs first in:\n  {path}: {was} -> {now}{fix}"
  record = equal[0]
  lines = []
  earlier = record[0]()
  args = argument_diffs(earlier) if argument_diffs and earlier else None
  if args:
    lines.append("its arguments differ: " + "; ".join(args))
  elif args is None:
    lines.append(
      "how its arguments compare is not known (that function is gone)"
    )
  opaque = sorted({p for p, s in mine if s.startswith(OPAQUE)})
  if opaque:
    lines.append(
      "explain_miss cannot see into: "
      + ", ".join(opaque[:5])
      + (" ..." if len(opaque) > 5 else "")
    )
  lines.append(
    "whether its compiled executable is reused is decided after tracing, "
    "when the traced program's fingerprint is looked up"
  )
  return (
    f"{head} closed over equal values as far as explain_miss can see:\n  "
    + "\n  ".join(lines)
  )
