"""A CheckpointManager's steps without its state: directory names, metrics,
retention rules (orbax's).

>>> names = StepNames("ckpt", 8)
>>> names.name(100), names.parse("ckpt_00000100"), names.parse("ckpt_100")
('ckpt_00000100', 100, None)
>>> to_remove([1, 2, 3, 4], max_to_keep=2, keep_period=2)
[1]
"""

from __future__ import annotations

from collections.abc import Callable
import datetime
import json
import re
from typing import Any

import jax
import numpy as np

from . import commit

#: The top-level key of a step's tree that holds its metrics (JSON text).
METRICS_KEY = "__jaxworks_metrics__"
_METRICS_FORMAT = 1


def check_step(api: str, step: Any) -> int:
  """``step`` as an int >= 0 (TypeError, ValueError otherwise)."""
  if isinstance(step, bool) or not hasattr(step, "__index__"):
    raise TypeError(f"{api}: step must be an int, got {step!r}")
  step = int(step.__index__())
  if step < 0:
    raise ValueError(f"{api}: step must be >= 0, got {step}")
  return step


def check_item_name(api: str, name: Any) -> None:
  """Raises ValueError unless ``name`` can name an item (and its file)."""
  if (
    not isinstance(name, str)
    or not name
    or name in (".", "..")
    or any(c in name for c in "/\\\0")
  ):
    raise ValueError(
      f"{api}: an item name must be a non-empty str naming a file (no '/', "
      f"'\\\\' or NUL), got {name!r}"
    )
  if name == METRICS_KEY:
    raise ValueError(
      f"{api}: the item name {name!r} is reserved for the step's metrics; "
      "rename the item"
    )


class StepNames:
  """Step directory names: ``<step>``, or ``<prefix>_<step>``, the step zero
  padded to ``fixed_length`` digits; only names of exactly that format are
  steps. ``temps`` matches the temporaries of saves of any step."""

  def __init__(self, prefix: str | None, fixed_length: int | None) -> None:
    self._head = "" if prefix is None else f"{prefix}_"
    self._length = fixed_length
    head = re.escape(self._head)
    self._pattern = re.compile(rf"^{head}([0-9]+)$")
    self.temps = commit.temp_pattern(rf"{head}[0-9]+")

  def name(self, step: int) -> str:
    n = self._length
    return self._head + (f"{step:0{n}d}" if n else str(step))

  def parse(self, name: str) -> int | None:
    """The step ``name`` names, or None."""
    m = self._pattern.match(name)
    if m is None:
      return None
    step = int(m.group(1))
    return step if self.name(step) == name else None


def metrics_json(api: str, metrics: Any) -> str:
  """The JSON text of ``metrics`` (arrays and numpy scalars as lists and
  numbers); TypeError naming what JSON cannot hold."""

  def convert(x: Any) -> Any:
    if isinstance(x, (np.ndarray, np.generic, jax.Array)):
      return np.asarray(x).tolist()
    raise TypeError(
      f"{api}: metrics hold {x!r:.60} of type {type(x).__name__}, which JSON "
      "cannot store; pass a dict of numbers, strings, lists and dicts"
    )

  try:
    return json.dumps(
      {"format": _METRICS_FORMAT, "metrics": metrics},
      default=convert,
      sort_keys=True,
    )
  except ValueError as err:  # a circular reference
    raise TypeError(
      f"{api}: metrics cannot be written as JSON: {err}"
    ) from None
  except TypeError as err:
    if str(err).startswith(api):  # convert's
      raise
    raise TypeError(  # keys JSON cannot sort or hold (int and str mixed)
      f"{api}: metrics cannot be written as JSON ({err}): a dict's keys "
      "must be all str (or all numbers, which JSON stores as str)"
    ) from None


def decode_metrics(api: str, step: int, path: str, text: str) -> Any:
  """The metrics in the JSON ``text`` of step ``step`` at ``path``."""
  try:
    decoded = json.loads(text)
    if not isinstance(decoded, dict) or decoded.get("format") != 1:
      raise ValueError("not a metrics record of format 1")
  except ValueError as err:
    raise ValueError(
      f"{api}: the metrics of step {step} in {path!r} cannot be read "
      f"({err}); delete the step or restore it with bt.restore"
    ) from None
  return decoded["metrics"]


def ranked(
  steps: list[int],
  metrics_of: Callable[[int], Any],
  best_fn: Callable[[Any], float],
  best_mode: str,
) -> tuple[list[int], list[int]]:
  """(steps without metrics, steps with metrics from worst to best; equal
  ones in the order of ``steps``). A step whose metrics raise
  FileNotFoundError (another manager deleted it after it was listed) is
  in neither."""
  without, scored = [], []
  for s in steps:
    try:
      m = metrics_of(s)
    except FileNotFoundError:
      continue
    if m is None:
      without.append(s)
    else:
      scored.append((s, m))
  scored.sort(key=lambda sm: best_fn(sm[1]), reverse=best_mode == "min")
  return without, [s for s, _ in scored]


def to_remove(
  steps: list[int],
  *,
  max_to_keep: int | None,
  keep_period: int | None = None,
  keep_time_interval: datetime.timedelta | None = None,
  commit_ns: Callable[[int], int] | None = None,
  rank: Callable[[list[int]], tuple[list[int], list[int]]] | None = None,
  keep_without_metrics: bool = True,
) -> list[int]:
  """The ``steps`` (oldest first: ascending, or in orbax's order, where the
  steps saved since the manager started come last, in save order) no
  retention rule keeps (the options of CheckpointManager; ``rank``:
  ``ranked`` with its ``best_fn``)."""
  n = max_to_keep
  if n is None:
    return []
  keep: set[int] = set()
  if rank is None or len(steps) <= n:
    keep.update(steps[-n:])
  else:
    without, best = rank(steps)
    keep.update(best[-n:])
    if keep_without_metrics:
      keep.update(without)
  if keep_period is not None:
    keep.update(s for s in steps if s % keep_period == 0)
  if keep_time_interval is not None and commit_ns is not None and steps:
    interval_ns = int(keep_time_interval.total_seconds()) * 10**9
    last = None
    for s in steps:
      try:
        t = commit_ns(s)
      except FileNotFoundError:
        continue
      if last is None or t - last >= interval_ns:
        keep.add(s)
        last = t
  return [s for s in steps if s not in keep]
