"""What differs between re-created functions: closed-over values, defaults.

A sweep re-creates its step per configuration; each new function object has
an empty trace cache, and its program is compiled anew unless it equals one
compiled before. ``remember`` records, whenever a function of jit_cache
compiles or reuses an executable, a summary of what its code closes over;
``explain_new_function`` compares a new function with the records of earlier
functions of the same code (alive or not) and names the differences in the
user's terms.
"""

from __future__ import annotations

import collections
import threading
from typing import Any
import weakref

import numpy as np

from .lru import LRU

#: Functions of the same code remembered, and codes remembered.
PER_CODE = 8
CODES = 256
#: Arrays up to this many elements are summarized by value.
SMALL_ARRAY = 16

#: Code -> its functions' records, newest last; the codes used least recently
#: beyond ``CODES`` are forgotten.
_HISTORY: LRU[tuple, collections.deque] = LRU(CODES)
_LOCK = threading.Lock()


def _code_key(fun: Any) -> tuple | None:
  code = getattr(fun, "__code__", None)
  if code is None:
    return None
  return (code.co_filename, code.co_firstlineno, code.co_qualname)


def _summary(value: Any) -> str:
  """Equal for values that give the same program, in the user's terms."""
  if value is None or isinstance(value, (bool, int, float, complex, str)):
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
  shape = getattr(value, "shape", None)
  dtype = getattr(value, "dtype", None)
  if shape is not None and dtype is not None:
    described = f"{np.dtype(dtype).name}{list(shape)}"
    size = int(np.prod(shape))
    if size <= SMALL_ARRAY and type(value).__name__ != "DynamicJaxprTracer":
      try:
        return f"{described} {np.asarray(value).ravel().tolist()}"
      except Exception:  # pylint: disable=broad-except
        pass  # a tracer or an array that cannot be read: by identity
    return f"{described} (array at {id(value):#x})"
  if callable(value) and hasattr(value, "__qualname__"):
    return f"function {value.__qualname__}"
  if isinstance(value, (tuple, list)) and len(value) <= 8:
    inner = ", ".join(_summary(v) for v in value)
    return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
  return f"{type(value).__name__} object at {id(value):#x}"


def _describe(fun: Any) -> tuple:
  """(cells, defaults): ``((label, summary), ...)`` each."""
  code = fun.__code__
  cells = []
  for i, (name, cell) in enumerate(
    zip(code.co_freevars, fun.__closure__ or ())
  ):
    try:
      value = cell.cell_contents
    except ValueError:
      summary = "<empty>"
    else:
      summary = _summary(value)
    cells.append((f"closed-over constant `{name}` (cell {i})", summary))
  defaults = []
  names = code.co_varnames[: code.co_argcount]
  for name, value in zip(names[::-1], (fun.__defaults__ or ())[::-1]):
    defaults.append((f"default of `{name}`", _summary(value)))
  for name, value in (fun.__kwdefaults__ or {}).items():
    defaults.append((f"default of `{name}`", _summary(value)))
  return tuple(cells), tuple(defaults[::-1])


def owner_of(counters: Any) -> Any:
  """The core whose counters these are (None if it died)."""
  ref = counters.owner
  return ref() if ref is not None else None


def function_of(core: Any) -> Any:
  """The user's function of ``core`` (None once it died)."""
  fun = core._fun  # pylint: disable=protected-access
  if hasattr(fun, "__code__"):
    return fun
  return getattr(fun, "__wrapped__", None)  # a weak proxy: None when dead


def remember(counters: Any) -> None:
  """Records the closure of the function owning ``counters`` (it compiled
  or reused an executable)."""
  core = owner_of(counters)
  fun = function_of(core) if core is not None else None
  key = _code_key(fun)
  if key is None:
    return
  try:
    record = (weakref.ref(core), *_describe(fun))
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


def explain_new_function(core: Any, name: str) -> str | None:
  """Why a function with nothing cached yet will compile or reuse: how its
  closed-over values and defaults differ from the nearest earlier function
  of the same code, or None when there is none."""
  fun = function_of(core)
  key = _code_key(fun)
  if key is None:
    return None
  with _LOCK:
    records = [r for r in _HISTORY.peek(key) or () if r[0]() is not core]
  if not records:
    return None
  try:
    cells, defaults = _describe(fun)
  except Exception:  # pylint: disable=broad-except
    return None
  mine = dict(cells + defaults)

  def diffs(record: tuple) -> list[str]:
    out = []
    for label, old in record[1] + record[2]:
      new = mine.get(label, "<absent>")
      if new != old:
        fix = (
          f"; pass it as an argument to reuse the compiled {name}"
          if label.startswith("closed-over")
          else ""
        )
        out.append(f"{label}: {old} -> {new}{fix}")
    return out

  # The nearest; the newest of equally near ones.
  best = min((diffs(r) for r in reversed(records)), key=len)
  where = f"{len(records)} earlier {name} function" + (
    "s" if len(records) > 1 else ""
  )
  head = (
    f"{name}: miss: nothing is cached for this {name} yet (a new function "
    f"object); the nearest of {where} of the same code ({key[2]})"
  )
  if not best:
    return head + (
      " closed over equal values: its compiled executable is reused if "
      "tracing gives the same program"
    )
  return head + " differs in:\n  " + "\n  ".join(best)
