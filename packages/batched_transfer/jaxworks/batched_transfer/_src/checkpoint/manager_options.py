"""A CheckpointManager's settings: ``CheckpointManagerOptions``, and their
checks, whose errors name the parameter as the user wrote it
(``CheckpointManager(best_mode=...)`` or ``CheckpointManagerOptions(...)``),
the bad value and the fix.

>>> o = CheckpointManagerOptions(max_to_keep=3, best_mode="min")
>>> checked(merged(o, CheckpointManagerOptions())).best_mode
'min'
>>> checked(merged(None, CheckpointManagerOptions(best_mode="best")))
Traceback (most recent call last):
ValueError: jaxworks.batched_transfer.CheckpointManager: best_mode must be 'max' or 'min', got 'best' (CheckpointManager(best_mode='best')); ...
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
import dataclasses
import datetime
import re
from typing import Any

from . import codec
from .steps import check_item_name

API = "jaxworks.batched_transfer.CheckpointManager"

#: A manager's ``pack_below`` unless given: each step's arrays of less than
#: 1 MiB go into one archive. A training state's small leaves (biases,
#: norms, optimizer counts, the data state) then cost one file, not one
#: each: measured with examples/train_lm.py's state (80 leaves, 5.2 MB) on
#: ext4 (2 cores), a save took 38 ms of CPU time (59 ms to commit) packed,
#: 95 ms (150 ms) as 80 files, and a training loop on a TPU v5e lost 22 ms
#: per save interval packed, 78 ms unpacked (training_loop_bench).
DEFAULT_PACK_BELOW = 1 << 20
_NAME_CHARS = re.compile(r"^[A-Za-z0-9_.+=-]+$")


@dataclasses.dataclass(frozen=True)
class CheckpointManagerOptions:
  """The settings of a ``CheckpointManager`` as one object, as orbax's users
  write them (``CheckpointManagerOptions``): the fields are the manager's
  keyword arguments, with the same names, defaults and meanings.
  (An example is in the manager module's docstring.)

  Passing ``options=`` and a keyword other than its default together
  raises TypeError (one source for each setting: set it in the options,
  e.g. ``dataclasses.replace(options, max_to_keep=5)``).
  """

  max_to_keep: int | None = None
  keep_period: int | None = None
  save_interval_steps: int = 1
  barrier_timeout_s: float = 300.0
  best_fn: Callable[[Any], float] | None = None
  best_mode: str = "max"
  keep_checkpoints_without_metrics: bool = True
  keep_time_interval: datetime.timedelta | None = None
  should_save_fn: Callable[[int, int | None], bool] | None = None
  save_on_steps: Iterable[int] | None = None
  step_prefix: str | None = None
  step_format_fixed_length: int | None = None
  read_only: bool = False
  item_names: Any = None
  storage_options: dict[str, Any] | None = None
  compression: str | None = None
  pack_below: int | None = DEFAULT_PACK_BELOW


@dataclasses.dataclass(frozen=True)
class Given:
  """Settings and how the user gave them: ``via`` is ``"CheckpointManager"``
  (keywords) or ``"CheckpointManagerOptions"`` (``options=``)."""

  options: CheckpointManagerOptions
  via: str


def merged(options: Any, keywords: CheckpointManagerOptions) -> Given:
  """``options`` (None: ``keywords``, the manager's keyword arguments).

  Raises:
    TypeError: ``options`` is not a CheckpointManagerOptions, or a keyword
      other than its default was passed with it.
  """
  if options is None:
    return Given(keywords, "CheckpointManager")
  if not isinstance(options, CheckpointManagerOptions):
    raise TypeError(
      f"{API}: options must be a jaxworks.batched_transfer."
      f"CheckpointManagerOptions, got {options!r:.80}; pass "
      "options=CheckpointManagerOptions(...), or the settings as keywords"
    )
  both = [
    f.name
    for f in dataclasses.fields(keywords)
    if getattr(keywords, f.name) is not f.default
    and getattr(keywords, f.name) != f.default
  ]
  if both:
    raise TypeError(
      f"{API}: {', '.join(both)} passed both as keywords and with "
      "options=; pass each setting one way: in the options (e.g. "
      f"dataclasses.replace(options, {both[0]}=...)) or as keywords"
    )
  return Given(options, "CheckpointManagerOptions")


@dataclasses.dataclass(frozen=True)
class Settings:
  """The checked settings a manager keeps (see CheckpointManager's Args)."""

  max_to_keep: int | None
  keep_period: int | None
  save_interval_steps: int
  barrier_timeout_s: float
  best_fn: Callable[[Any], float] | None
  best_mode: str
  keep_checkpoints_without_metrics: bool
  keep_time_interval: datetime.timedelta | None
  should_save_fn: Callable[[int, int | None], bool] | None
  save_on_steps: frozenset[int]
  step_prefix: str | None
  step_format_fixed_length: int | None
  read_only: bool
  item_names: tuple[str, ...] | None
  storage_options: dict[str, Any] | None
  compression: str | None
  pack_below: int | None


def checked(given: Given) -> Settings:
  """The settings of ``given``, checked.

  Raises:
    ValueError, TypeError: a setting of the wrong value or type: the
      message names it as the user passed it, the value and the fix.
  """
  o, via = given.options, given.via

  def bad(name: str, must: str, fix: str) -> str:
    value = getattr(o, name)
    return (
      f"{API}: {name} must be {must}, got {value!r:.80} "
      f"({via}({name}={value!r:.80})); {fix}"
    )

  def positive(name: str, none_ok: bool, example: str) -> int | None:
    value = getattr(o, name)
    if value is None and none_ok:
      return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
      must = "a positive int" + (" or None" if none_ok else "")
      raise ValueError(bad(name, must, f"pass e.g. {name}={example}"))
    return value

  def callable_or_none(name: str) -> Any:
    value = getattr(o, name)
    if value is not None and not callable(value):
      raise TypeError(
        bad(name, "a callable or None", f"pass a function, e.g. {name}="
            "lambda metrics: metrics['loss'], or None")
      )  # fmt: skip
    return value

  try:
    compression = codec.check(API, o.compression)
  except ValueError as err:
    raise ValueError(f"{err} ({via}(compression={o.compression!r}))") from None
  max_to_keep = positive("max_to_keep", True, "5")
  keep_period = positive("keep_period", True, "1000")
  save_interval_steps = positive("save_interval_steps", False, "100")
  assert save_interval_steps is not None
  timeout = o.barrier_timeout_s
  if isinstance(timeout, bool) or not (
    isinstance(timeout, (int, float)) and timeout > 0
  ):
    raise ValueError(
      bad(
        "barrier_timeout_s", "a positive number of seconds",
        "pass e.g. barrier_timeout_s=300.0",
      )
    )  # fmt: skip
  best_fn = callable_or_none("best_fn")
  if o.best_mode not in ("max", "min"):
    raise ValueError(
      bad(
        "best_mode", "'max' or 'min'",
        "pass best_mode='max' (the highest best_fn value is best) or "
        "best_mode='min' (the lowest, e.g. a loss)",
      )
    )  # fmt: skip
  if o.keep_time_interval is not None and not isinstance(
    o.keep_time_interval, datetime.timedelta
  ):
    raise TypeError(
      bad(
        "keep_time_interval", "a datetime.timedelta or None",
        "pass e.g. keep_time_interval=datetime.timedelta(hours=1)",
      )
    )  # fmt: skip
  should_save_fn = callable_or_none("should_save_fn")
  try:
    save_on_steps = frozenset(o.save_on_steps or ())
  except TypeError:
    raise TypeError(
      bad(
        "save_on_steps", "a container of steps",
        "pass e.g. save_on_steps=[1000, 5000], or None",
      )
    ) from None  # fmt: skip
  if o.step_prefix is not None and (
    not isinstance(o.step_prefix, str) or not _NAME_CHARS.match(o.step_prefix)
  ):
    raise ValueError(
      bad(
        "step_prefix",
        "a non-empty str of letters, digits and '_.+=-', or None",
        "pass e.g. step_prefix='ckpt' (steps named ckpt_<step>)",
      )
    )  # fmt: skip
  fixed_length = positive("step_format_fixed_length", True, "8")
  pack_below = positive("pack_below", True, "65536")
  item_names = o.item_names
  if item_names is not None:
    if isinstance(item_names, str):
      item_names = (item_names,)
    try:
      item_names = tuple(item_names)
    except TypeError:
      raise TypeError(
        bad(
          "item_names", "a sequence of item names or None",
          "pass e.g. item_names=('params', 'opt_state')",
        )
      ) from None  # fmt: skip
    for name in item_names:
      check_item_name(f"{API}: {via}(item_names=...)", name)
  return Settings(
    max_to_keep=max_to_keep,
    keep_period=keep_period,
    save_interval_steps=save_interval_steps,
    barrier_timeout_s=float(timeout),
    best_fn=best_fn,
    best_mode=o.best_mode,
    keep_checkpoints_without_metrics=bool(o.keep_checkpoints_without_metrics),
    keep_time_interval=o.keep_time_interval,
    should_save_fn=should_save_fn,
    save_on_steps=save_on_steps,
    step_prefix=o.step_prefix,
    step_format_fixed_length=fixed_length,
    read_only=bool(o.read_only),
    item_names=item_names,
    storage_options=o.storage_options,
    compression=compression,
    pack_below=pack_below,
  )
