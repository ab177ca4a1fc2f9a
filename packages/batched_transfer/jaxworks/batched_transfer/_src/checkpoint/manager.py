"""CheckpointManager: numbered steps in a directory, saved in the background,
committed atomically, kept by retention rules (names as orbax's).

Each step is a checkpoint directory ``<directory>/<step>`` written by save:
it appears under that name only once complete and durable (the atomic
rename is the commit), so every listed step is whole. Retention runs after
a step committed and deletes a step by renaming it away first.
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax

from . import commit
from . import pending
from . import saver
from .restore import restore

_API = "jaxworks.batched_transfer.CheckpointManager"
_STEP = re.compile(r"^(0|[1-9][0-9]*)$")


def _positive_or_none(name: str, value: Any) -> int | None:
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(
      f"{_API}: {name} must be a positive int or None, got {value!r}"
    )
  return value


def _step(api: str, step: Any) -> int:
  if isinstance(step, bool) or not hasattr(step, "__index__"):
    raise TypeError(f"{api}: step must be an int, got {step!r}")
  step = int(step.__index__())
  if step < 0:
    raise ValueError(f"{api}: step must be >= 0, got {step}")
  return step


class CheckpointManager:
  """Saves numbered steps of a training job under ``directory``.

  Args:
    directory: where the steps go, one subdirectory ``<step>`` each (created
      with its parents if missing). Local or mounted file systems only.
    max_to_keep: keep at most this many of the newest steps (None: all);
      older ones are deleted after a newer step committed.
    keep_period: also keep every step divisible by this (None: none).
    save_interval_steps: ``should_save(step)`` is true for multiples of it.
    barrier_timeout_s: with trees spanning processes (jax.distributed), how
      long a process waits for the others in a save before it raises (see
      ``save``).
  """

  def __init__(
    self,
    directory: str | os.PathLike[str],
    *,
    max_to_keep: int | None = None,
    keep_period: int | None = None,
    save_interval_steps: int = 1,
    barrier_timeout_s: float = 300.0,
  ) -> None:
    directory = os.fspath(directory)
    commit.check_local(_API, directory)
    self.directory = os.path.abspath(directory)
    self.max_to_keep = _positive_or_none("max_to_keep", max_to_keep)
    self.keep_period = _positive_or_none("keep_period", keep_period)
    interval = _positive_or_none("save_interval_steps", save_interval_steps)
    if interval is None:
      raise ValueError(f"{_API}: save_interval_steps must be a positive int")
    self.save_interval_steps = interval
    if isinstance(barrier_timeout_s, bool) or not (
      isinstance(barrier_timeout_s, (int, float)) and barrier_timeout_s > 0
    ):
      raise ValueError(
        f"{_API}: barrier_timeout_s must be a positive number of seconds, "
        f"got {barrier_timeout_s!r}"
      )
    self.barrier_timeout_s = float(barrier_timeout_s)
    if os.path.lexists(self.directory) and not os.path.isdir(self.directory):
      raise FileExistsError(
        f"{_API}: {directory!r} exists and is not a directory"
      )
    commit.make_parents(self.directory)
    self._handle: pending.SaveHandle | None = None

  def _path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def all_steps(self) -> list[int]:
    """The committed steps, ascending (a step being written is not one)."""
    steps = []
    for name in os.listdir(self.directory):
      if _STEP.match(name) and os.path.isdir(self._path(int(name))):
        steps.append(int(name))
    return sorted(steps)

  def latest_step(self) -> int | None:
    """The newest committed step, or None."""
    steps = self.all_steps()
    return steps[-1] if steps else None

  def should_save(self, step: int) -> bool:
    """True for a multiple of save_interval_steps newer than every saved step."""
    step = _step(f"{_API}.should_save", step)
    latest = self.latest_step()
    if latest is not None and step <= latest:
      return False
    return step % self.save_interval_steps == 0

  def save(
    self,
    step: int,
    tree: Any,
    *,
    blocking: bool = False,
    force: bool = False,
  ) -> bool:
    """Saves ``tree`` as ``step`` if ``should_save(step)`` (or ``force``).

    Waits for this manager's previous save first (raising its error). With
    ``blocking=False`` it returns once the leaves are in host memory and
    writes in the background; ``wait_until_finished()`` waits for it. The
    step is listed once complete and durable; retention then deletes the
    steps it no longer keeps.

    Returns:
      True if a save was started, False if ``should_save`` said no.

    Raises:
      FileExistsError: the step exists already.
    """
    api = f"{_API}.save"
    step = _step(api, step)
    # The previous save finishes first (should_save sees its step); its
    # error is raised before anything else, inside the collective save when
    # the tree spans processes (so every process raises it there, in step).
    handle, self._handle = self._handle, None
    failed: BaseException | None = None
    if handle is not None:
      try:
        handle.wait()
      except BaseException as err:  # raised below
        failed = err
    if not force and not self.should_save(step):
      if failed is not None:
        raise failed
      pending.raise_background_error(api)
      return False
    path = self._path(step)

    def prelude() -> None:
      if failed is not None:
        raise failed
      pending.raise_background_error(api)
      if os.path.lexists(path):
        raise FileExistsError(
          f"{api}: step {step} exists in {self.directory!r}; delete(step) first"
        )
      if jax.process_index() == 0:  # what killed saves of any step left
        with commit.locked(path):  # (process 0 alone: it commits)
          for _, p in commit.step_temporaries(self.directory):
            commit.remove(p)

    self._handle = saver.run_save(
      api,
      path,
      tree,
      overwrite=False,
      blocking=blocking,
      write_threads=None,
      max_inflight_bytes=saver.DEFAULT_INFLIGHT,
      barrier_timeout_s=self.barrier_timeout_s,
      prelude=prelude,
      after=self._retain,
    )
    return True

  def _retain(self) -> None:
    """Deletes the steps the retention rules no longer keep."""
    if self.max_to_keep is None:
      return
    steps = self.all_steps()
    keep = set(steps[-self.max_to_keep :])
    if self.keep_period is not None:
      keep.update(s for s in steps if s % self.keep_period == 0)
    for s in steps:
      if s not in keep:
        self.delete(s)

  def wait_until_finished(self) -> None:
    """Waits for the pending save; raises its error (once)."""
    handle, self._handle = self._handle, None
    if handle is not None:
      handle.wait()

  def restore(
    self,
    step: int | None = None,
    target: Any = None,
    *,
    placement: Any = None,
    **kwargs: Any,
  ) -> Any:
    """Restores ``step`` (default: the latest committed one) onto devices;
    ``target``, ``placement`` and ``kwargs`` as for ``restore``.

    Raises:
      FileNotFoundError: no committed step (or not ``step``).
    """
    api = f"{_API}.restore"
    if target is None:
      raise TypeError(
        f"{api}: pass target=, a tree of jax.ShapeDtypeStruct (e.g. "
        "jax.eval_shape(init_fn)) saying what to load"
      )
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(
          f"{api}: no committed step in {self.directory!r}"
        )
    step = _step(api, step)
    if not os.path.isdir(self._path(step)):
      raise FileNotFoundError(
        f"{api}: no step {step} in {self.directory!r}; the committed steps "
        f"are {self.all_steps()}"
      )
    return restore(self._path(step), target, placement=placement, **kwargs)

  def delete(self, step: int) -> None:
    """Deletes a committed step (renamed away first: never half listed)."""
    api = f"{_API}.delete"
    step = _step(api, step)
    path = self._path(step)
    if not os.path.isdir(path):
      raise FileNotFoundError(f"{api}: no step {step} in {self.directory!r}")
    with commit.locked(path):
      commit.delete(path)

  def close(self) -> None:
    """Waits for the pending save."""
    self.wait_until_finished()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def __repr__(self) -> str:
    return (
      f"CheckpointManager({self.directory!r}, max_to_keep={self.max_to_keep}, "
      f"keep_period={self.keep_period}, "
      f"save_interval_steps={self.save_interval_steps})"
    )
