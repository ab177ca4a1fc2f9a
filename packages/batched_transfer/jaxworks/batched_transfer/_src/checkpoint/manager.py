"""CheckpointManager: numbered steps in a directory, saved in the background,
committed atomically, kept by retention rules (names as orbax's, settings as
keywords or one ``CheckpointManagerOptions``).

The manager owns its directory's ``destination.Destination`` (each step is
its child: listed, checked, timed and deleted through it) and the
directory's writer lease. A step is one checkpoint directory written by
the same ``job.SaveJob`` as ``save`` (``_StepSave``, whose ``committed``
runs the retention; named items are the one tree ``{name: item}``, metrics
its str leaf ``METRICS_KEY``), so it commits in one rename; its names and
retention rules are in ``steps``.

>>> import shutil, tempfile
>>> from jaxworks import batched_transfer as bt
>>> options = bt.CheckpointManagerOptions(max_to_keep=3, save_interval_steps=100)
>>> directory = tempfile.mkdtemp()
>>> mgr = bt.CheckpointManager(directory, options=options)
>>> mgr.max_to_keep, mgr.save_interval_steps
(3, 100)
>>> shutil.rmtree(directory)
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Mapping
import contextlib
import dataclasses
import datetime
import os
import threading
from typing import Any
import warnings
import weakref

import jax
import numpy as np

from .. import jax_internals
from . import api as ckpt
from . import destination
from . import format
from . import job as job_lib
from . import lease as lease_lib
from . import manager_options as options_lib
from . import multiprocess
from . import pending
from . import preemption
from . import steps as steps_lib
from . import target as target_lib
from .keys import leaf_keys
from .manager_options import (
  CheckpointManagerOptions as CheckpointManagerOptions,
)
from .steps import METRICS_KEY
from .steps import check_item_name
from .steps import check_step
from .storage import LOG

_API = options_lib.API
#: The keyword arguments of ``restore`` that ``CheckpointManager.restore``
#: passes on (placement is its own argument).
_RESTORE_KWARGS = frozenset(
  f.name for f in dataclasses.fields(ckpt.ReadOptions)
) - {"placement"}


@dataclasses.dataclass(frozen=True)
class StepMetadata:
  """What ``CheckpointManager.metadata(step)`` says about a step, read
  without its array data (the names of orbax's ``StepMetadata``).

  Attributes:
    step: the step.
    item_metadata: the saved tree (``{name: item}`` for named items) with a
      jax.ShapeDtypeStruct for each array and the value of each str, None or
      Python scalar leaf.
    metrics: the metrics saved with the step (decoded JSON), or None.
    commit_timestamp_nsecs: the step's commit time (its directory's
      modification time), in nanoseconds since the epoch.
    custom_metadata: the ``custom_metadata`` saved with the step (``{}``
      where none was, as orbax).
  """

  step: int
  item_metadata: Any
  metrics: Any
  commit_timestamp_nsecs: int
  custom_metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


class _StepSave(job_lib.SaveJob):
  """The save job of one step of ``manager``: once committed (process 0 of
  a collective save, inside it), a log line (DEBUG: the save's own INFO
  line names the checkpoint), then the manager's retention."""

  def __init__(self, manager: CheckpointManager, step: int, *args: Any) -> None:
    super().__init__(*args)
    self.manager, self.step = manager, step

  def committed(self) -> None:
    LOG.debug("%s: step %d committed at %r", _API, self.step, self.path)
    try:
      self.manager._retain()
    except OSError as err:  # the step is saved; the next save retries
      LOG.warning("%s: retention failed (%s); the next save retries", _API, err)


def _python_value(record: format.Record, key: str, x: Any) -> Any:
  """The Python scalar ``key`` of ``record`` as saved, restored as ``x``
  (its value where the record has it, else ``x``'s, as 0.6 restored it)."""
  if key in record.scalars:
    return target_lib.exact_value(record, key)
  if not hasattr(x, "shape"):
    return x
  return format.PYTHON_TYPES[record.python[key]](np.asarray(x).item())


class CheckpointManager:
  """Saves numbered steps of a training job under ``directory``.

  The options are the keyword arguments of orbax's
  ``CheckpointManagerOptions`` with the same names and meanings, given as
  keywords or as one ``CheckpointManagerOptions`` (``options=``); the
  manager is also a context manager (``close()`` on exit).

  A step is the checkpoint directory ``<directory>/<step>`` (see
  ``step_prefix``), written under a temporary name, fsynced and renamed into
  place (the commit): it is listed only once complete and durable. A step
  deleted (``delete``, or by retention) is renamed away first, so no
  half-deleted step is listed; what a killed save or deletion left
  (``.<name>.jaxworks-*``) is never listed and is removed by the next
  ``save``. Steps are read from the directory at every call.

  The metrics of a step are stored inside its checkpoint, as the top-level
  str leaf ``__jaxworks_metrics__`` (their JSON text), so they commit with
  the step's arrays in the same rename; the name is reserved, and
  ``restore`` and ``metadata`` leave the leaf out. A step's commit time is
  its directory's modification time (its last file's write, just before the
  commit).

  One process writes a directory at a time: the first ``save`` or
  ``delete`` takes its writer lease (``<directory>/.jaxworks-writer/``,
  naming this host and process, with a heartbeat; created without
  replacing, by a conditional put in a bucket), which ``close()`` gives
  back. While a live process of another manager holds it, ``save`` and
  ``delete`` raise ``WriterConflictError``; reading needs no lease. The
  lease of a process that is gone (same host: it no longer runs; another
  host: no heartbeat for 60 s) is taken over with a warning. Managers of
  one process share the lease; in a jax.distributed job process 0 holds it.

  ``save`` logs why it skipped a step (``jaxworks.batched_transfer``
  logger: WARNING for a step that exists or is older than the last saved,
  DEBUG for the save interval); retention and ``delete`` log one INFO line
  per step they delete (a save's own INFO line names each step written).

  In a jax.distributed job every process makes the same calls: ``save`` is
  collective (see ``jaxworks.batched_transfer.save``; process 0's metrics
  are the step's), retention runs on process 0 after the commit and before
  the others' ``save`` returns, and ``delete`` is collective; once
  ``wait_until_finished()`` or ``close()`` returned (they wait for this
  process's part of the save) every process lists the same steps.

  Args:
    directory: where the steps go, one subdirectory per step (created with
      its parents if missing, unless ``read_only``): a local path, or an
      ``s3://``, ``gs://`` or ``az://`` URL (one prefix per step).
    max_to_keep: keep at most this many steps: the newest, or with
      ``best_fn`` the best; the others are deleted after a newer step
      committed, unless another rule keeps them (as orbax, a step any rule
      keeps is kept). None: nothing is deleted.
    keep_period: also keep every step divisible by this (None: none).
    save_interval_steps: ``should_save(step)`` is true for multiples of it.
    barrier_timeout_s: in a multi-process job (jax.distributed), how long a
      process waits for the others in a save or ``delete`` before it raises.
    best_fn: metrics -> float: ranks the steps saved with ``metrics=``;
      retention keeps the ``max_to_keep`` best and ``best_step()`` is the
      best (None: the newest are kept).
    best_mode: ``"max"`` (the highest ``best_fn`` is best) or ``"min"``.
    keep_checkpoints_without_metrics: with ``best_fn``, never delete a step
      saved without metrics (False: such steps go first).
    keep_time_interval: a datetime.timedelta: also keep the oldest step and
      every step committed at least this long (whole seconds, as orbax)
      after the previous step kept this way.
    should_save_fn: ``(step, last_saved_step or None) -> bool`` decides
      ``should_save`` instead of ``save_interval_steps`` and
      ``save_on_steps``.
    save_on_steps: steps always saved (a container of ints).
    step_prefix: name steps ``<step_prefix>_<step>`` (None: ``<step>``).
    step_format_fixed_length: zero pad the step to this many digits
      (``ckpt_00000100``); None: no padding. Only names of exactly this
      format are steps.
    read_only: never write: ``save`` and ``delete`` warn and do nothing,
      retention never runs, the directory is never created; reading works.
    item_names: the names ``save(items=...)`` may use (None: any).
    storage_options: for an ``s3://``, ``gs://`` or ``az://`` ``directory``
      (each step a prefix, committed by its head; see the README,
      "Object stores"), settings over the cloud's standard environment.
    compression: the codec of every step's arrays, as ``save``'s (None:
      raw ``.npy`` files; ``"zstd"``: compressed, for compressible states).
    pack_below: as ``save``'s: a step's arrays of fewer bytes (1 MiB
      unless given) in one archive: one file, fsync and bucket request for
      a training state's small leaves; None: one file per array.
    options: every setting above as one ``CheckpointManagerOptions``
      (then pass none of them as a keyword: TypeError).
  """

  def __init__(
    self,
    directory: str | os.PathLike[str],
    *,
    max_to_keep: int | None = None,
    keep_period: int | None = None,
    save_interval_steps: int = 1,
    barrier_timeout_s: float = 300.0,
    best_fn: Callable[[Any], float] | None = None,
    best_mode: str = "max",
    keep_checkpoints_without_metrics: bool = True,
    keep_time_interval: datetime.timedelta | None = None,
    should_save_fn: Callable[[int, int | None], bool] | None = None,
    save_on_steps: Iterable[int] | None = None,
    step_prefix: str | None = None,
    step_format_fixed_length: int | None = None,
    read_only: bool = False,
    item_names: Any = None,
    storage_options: dict[str, Any] | None = None,
    compression: str | None = None,
    pack_below: int | None = options_lib.DEFAULT_PACK_BELOW,
    options: CheckpointManagerOptions | None = None,
  ) -> None:
    given = CheckpointManagerOptions(
      max_to_keep=max_to_keep, keep_period=keep_period,
      save_interval_steps=save_interval_steps,
      barrier_timeout_s=barrier_timeout_s, best_fn=best_fn, best_mode=best_mode,
      keep_checkpoints_without_metrics=keep_checkpoints_without_metrics,
      keep_time_interval=keep_time_interval,
      should_save_fn=should_save_fn,
      save_on_steps=save_on_steps,
      step_prefix=step_prefix,
      step_format_fixed_length=step_format_fixed_length,
      read_only=read_only,
      item_names=item_names,
      storage_options=storage_options,
      compression=compression, pack_below=pack_below,
    )  # fmt: skip
    self._configure(directory, options_lib.merged(options, given))

  def _configure(self, directory: Any, given: options_lib.Given) -> None:
    """Checks the settings ``given`` and opens the directory."""
    o = options_lib.checked(given)
    self._dir = destination.open_directory(_API, directory, o.storage_options)
    self.directory = self._dir.path
    self._compression, self._pack_below = o.compression, o.pack_below
    self._options = o.storage_options
    self.max_to_keep = o.max_to_keep
    self.keep_period = o.keep_period
    self.save_interval_steps = o.save_interval_steps
    self.barrier_timeout_s = o.barrier_timeout_s
    self.best_fn = o.best_fn
    self.best_mode = o.best_mode
    self.keep_checkpoints_without_metrics = o.keep_checkpoints_without_metrics
    self.keep_time_interval = o.keep_time_interval
    self.should_save_fn = o.should_save_fn
    self.save_on_steps = o.save_on_steps
    self.step_prefix = o.step_prefix
    self.step_format_fixed_length = o.step_format_fixed_length
    self.read_only = o.read_only
    self.item_names = o.item_names
    self._dir.make_directory(create=not self.read_only)
    self._names = steps_lib.StepNames(o.step_prefix, o.step_format_fixed_length)
    self._handle: pending.SaveHandle | None = None
    # The step this manager saved last (None: none since reload()).
    self._pending_step: int | None = None
    self._watching = False  # reached_preemption was called
    self._preempt_at: int | None = None  # the step to save and stop at
    self._lock = threading.Lock()
    self._metrics_cache: dict[int, Any] = {}  # step -> metrics or None
    # The steps this manager saved, in save order (since reload()).
    self._saved: list[int] = []
    # The directory's writer lease, taken by the first save or delete.
    self._lease: lease_lib.Lease | None = None
    self._lease_ref: weakref.finalize | None = None

  def _step(self, step: int) -> destination.Destination:
    """The destination of ``step``: ``<directory>/<its name>``."""
    return self._dir.child(self._names.name(step))

  def _path(self, step: int) -> str:
    return self._step(step).path

  def _committed(self, step: int) -> bool:
    """Whether ``step`` is committed (a bucket: a head names a version, or
    0.6.x's record is there: remote.committed)."""
    return self._step(step).committed()

  def _no_step(self, api: str, step: int) -> FileNotFoundError:
    return FileNotFoundError(
      f"{api}: no step {step} in {self.directory!r}; the committed steps "
      f"are {self.all_steps()}"
    )

  def _refuse(self, api: str, step: int, what: str) -> bool:
    """Warns and returns True in a ``read_only`` manager."""
    if self.read_only:
      warnings.warn(
        f"{api}: {self.directory!r} is read only (read_only=True); step "
        f"{step} is not {what}",
        stacklevel=3,
      )
    return self.read_only

  def _forget(self, step: int) -> None:
    """Forgets what this manager read of ``step`` (gone, or saved anew)."""
    with self._lock:
      self._metrics_cache.pop(step, None)
      if self._pending_step == step:  # e.g. retention deleted it
        self._pending_step = None

  # Listing.

  def all_steps(self) -> list[int]:
    """The committed steps, ascending (a step being written is not one)."""
    named = {
      name: step
      for name in self._dir.children()
      if (step := self._names.parse(name)) is not None
    }
    return sorted(named[n] for n in self._dir.committed_among(list(named)))

  def _in_save_order(self, steps: list[int]) -> list[int]:
    """``steps`` in orbax's order: those this manager did not save (since
    ``reload()``) ascending, then those it saved, in save order."""
    listed = set(steps)
    with self._lock:
      mine = [s for s in self._saved if s in listed]
    return sorted(listed.difference(mine)) + mine

  def latest_step(self) -> int | None:
    """The newest committed step, or None: as orbax's, the one this manager
    saved last, if it is still there (after ``save(5, force=True)``
    following step 10: 5), else the highest (after a restart, or
    ``reload()``)."""
    steps = self._in_save_order(self.all_steps())
    return steps[-1] if steps else None

  def reload(self) -> None:
    """Forgets what this manager read of its steps (their metrics) and the
    order it saved them in (so the newest is the highest again, as after a
    restart; as orbax's reload), for a directory another manager or
    process changed; the steps themselves are read from the directory at
    every call."""
    with self._lock:
      self._metrics_cache.clear()
      self._saved.clear()
      if self._handle is None:
        self._pending_step = None

  def should_save(self, step: int) -> bool:
    """Whether ``save(step)`` saves (orbax's rules).

    False with ``read_only`` and for a step not newer than every saved (or
    pending) one; else ``should_save_fn(step, last_saved_step)`` if given,
    otherwise true for a multiple of ``save_interval_steps``, a step in
    ``save_on_steps``, or the first step of an empty directory.
    """
    step = check_step(f"{_API}.should_save", step)
    if self.read_only:
      return False
    return self._skip(step) is None

  def reached_preemption(self, step: int) -> bool:
    """Whether the job is being stopped and should save ``step`` and exit
    (as orbax's): in a jax.distributed job of several processes, JAX's
    preemption sync point (call it at every step on every process; all
    reach the same step), else whether this process got SIGTERM since the
    first call, which starts watching for it (from the main thread; the
    signal then only sets this flag, until the job exits on its own; a
    second SIGTERM acts as before). From then on ``should_save`` is also
    true for such a step, so the loop's ``save`` saves it::

      mgr.save(step, items=...)
      if mgr.reached_preemption(step):
        mgr.wait_until_finished()
        sys.exit(0)
    """
    api = f"{_API}.reached_preemption"
    step = check_step(api, step)
    self._watching = True
    if not preemption.reached(api, step):
      return False
    if multiprocess.multi_process():
      return True  # JAX's sync point: the step every process saves
    # Alone, the step is that of the first call to see the signal if its
    # save saw it too (it saved), else the next (as JAX's sync point: a
    # step after the notice, whose save sees it).
    if self._preempt_at is None:
      self._preempt_at = step if self._pending_step == step else step + 1
    return step >= self._preempt_at

  def _skip(self, step: int) -> tuple[str, int | None] | None:
    """Why ``save(step)`` would not save (None: it would): ``("old",
    last)`` for a step not newer than the last saved (``last``), else
    ``("policy", last)``."""
    # The step this manager saved last (orbax's latest; no listing while
    # it saves), else the directory's newest.
    last = self._pending_step
    if last is None:
      last = self.latest_step()
    if last is not None and step <= last:
      return "old", last
    if self._watching and preemption.reached(f"{_API}.save", step):
      return None  # a job being stopped saves its current step
    if self.should_save_fn is not None:
      ok = bool(self.should_save_fn(step, last))
    else:
      ok = (
        step % self.save_interval_steps == 0
        or step in self.save_on_steps
        or last is None
      )
    return None if ok else ("policy", last)

  def _log_skip(self, api: str, step: int, why: tuple[str, int | None]) -> None:
    """Says why ``save(step)`` returned False: a WARNING for a step that
    exists or is older than the last saved (a silent no-op hides a restart
    into a used directory, or a second writer), DEBUG for the interval."""
    kind, last = why
    if kind == "policy":
      rule = (
        "should_save_fn returned False"
        if self.should_save_fn is not None
        else f"not a multiple of save_interval_steps={self.save_interval_steps}"
        " nor in save_on_steps"
      )
      LOG.debug(
        "%s: step %d not saved (%s); force=True saves it", api, step, rule
      )
      return
    if step == last or self._committed(step):
      LOG.warning(
        "%s: step %d was not saved: it exists in %r already (the last saved "
        "step is %s). To replace it, delete(%d) first; to keep both, save "
        "under a new step number or into another directory",
        api, step, self.directory, last, step,
      )  # fmt: skip
      return
    LOG.warning(
      "%s: step %d was not saved: it is older than the last saved step %s in "
      "%r (steps are saved in increasing order). Pass force=True to save it "
      "anyway; if the directory holds steps of an earlier run, use a new "
      "directory or delete them",
      api, step, last, self.directory,
    )  # fmt: skip

  # Saving.

  @jax_internals.api_boundary
  def save(
    self,
    step: int,
    tree: Any = None,
    *,
    items: Mapping[str, Any] | None = None,
    metrics: Any = None,
    blocking: bool = False,
    force: bool = False,
    custom_metadata: dict[str, Any] | None = None,
  ) -> bool:
    """Saves ``tree`` (or the named ``items``) as ``step`` if
    ``should_save(step)`` (or ``force``).

    Waits for this manager's previous save first (raising its error). With
    ``blocking=False`` it returns once the leaves are copied (as ``save``'s)
    and writes in the background; ``wait_until_finished()`` waits for it. The
    step is listed once complete and durable; retention then deletes the
    steps it no longer keeps.

    Args:
      step: the step, an int >= 0.
      tree: the pytree to save (or pass ``items``).
      items: named items saved together as one step, the tree ``{name:
        item}`` (one commit), e.g. ``{"params": params, "opt_state":
        opt_state, "data": {"epoch": 3}}``; ``restore(step, items=...)``
        reads any of them.
      metrics: JSON-able metrics of the step (numbers, strings, lists,
        dicts; numpy and jax scalars become numbers, arrays lists) for
        ``best_fn``; stored in the step's checkpoint (the tree must be a
        dict, or use ``items``).
      blocking: wait until the step is committed.
      force: save even if ``should_save(step)`` is false.
      custom_metadata: a dict of JSON values (str keys) stored with the
        step, read back by ``metadata(step).custom_metadata`` without the
        arrays (as orbax's).

    Returns:
      True if a save was started, False if ``should_save`` said no (logged:
      a WARNING for a step that exists or is older than the last saved one)
      or the manager is ``read_only`` (it warns).

    Raises:
      FileExistsError: the step exists already (and is saved anyway, e.g.
        with ``force``).
      WriterConflictError: another live process writes this directory.
    """
    api = f"{_API}.save"
    step = check_step(api, step)
    if self._refuse(api, step, "saved"):
      return False
    # Decided first: a step that is not saved never waits for the save in
    # flight (only a finished one's error is raised, once).
    why = None if force else self._skip(step)
    if why is not None:
      self.check_for_errors()
      pending.raise_background_error(api)
      self._log_skip(api, step, why)
      return False
    # The previous save finishes first; its error is raised before anything
    # else, inside the collective save when the tree spans processes (so
    # every process raises it there, in step).
    failed = self._finish()  # raised below
    self._saving(step)
    # A collective save's number before any check of the tree: an error
    # below is every process's (a process whose calls got out of step
    # anyway meets another step's path, which the save refuses).
    with multiprocess.ticket(api, self._path(step)) as ticket:
      if failed is not None:  # the previous save's error first
        raise failed
      tree = self._tree_to_save(api, step, tree, items, metrics)
      custom = format.custom_metadata(api, custom_metadata)
      job = self._job(api, step, tree, blocking, custom)
      self._handle = multiprocess.run(job, ticket)
    self._pending_step = step
    return True

  def _saving(self, step: int) -> None:
    """Records ``step`` as saved last (before its retention runs)."""
    listed = set(self.all_steps()) if len(self._saved) >= 1024 else None
    with self._lock:
      if listed is not None:  # forget the steps gone
        self._saved = [s for s in self._saved if s in listed]
      if step in self._saved:
        self._saved.remove(step)
      self._saved.append(step)

  def _tree_to_save(
    self, api: str, step: int, tree: Any, items: Any, metrics: Any
  ) -> Any:
    """save's tree (``{name: item}`` for ``items``), checked, with the
    metrics as its str leaf ``METRICS_KEY``."""
    tree = self._tree(api, tree, items)
    if metrics is not None:
      if not isinstance(tree, dict):
        raise TypeError(
          f"{api}: metrics are stored beside the tree's top-level keys, so "
          f"the tree must be a dict, got {type(tree).__name__}; pass "
          "items={'state': tree} instead"
        )
      if METRICS_KEY in tree:
        raise ValueError(
          f"{api}: the key {METRICS_KEY!r} is reserved for the step's "
          "metrics; rename it in the tree"
        )
      return {**tree, METRICS_KEY: steps_lib.metrics_json(api, metrics)}
    if self.best_fn is not None:
      warnings.warn(
        f"{api}: best_fn is set but step {step} is saved without metrics=",
        stacklevel=4,
      )
    return tree

  def _job(
    self,
    api: str,
    step: int,
    tree: Any,
    blocking: bool,
    custom_metadata: dict[str, Any] | None = None,
  ) -> _StepSave:
    """The save job of ``step``, once the directory's lease is held, no
    earlier background save failed and the step is not there (what
    killed saves left in the directory is removed: process 0 commits)."""
    self._hold(api)
    pending.raise_background_error(api)
    at = self._step(step)
    if at.committed():
      raise FileExistsError(
        f"{api}: step {step} exists in {self.directory!r}; delete(step) first"
      )
    if jax.process_index() == 0:
      self._dir.remove_leftovers(self._names.temps)
    self._forget(step)
    options = job_lib.Options(
      blocking=blocking, barrier_timeout_s=self.barrier_timeout_s,
      compression=self._compression, primary_keys=(METRICS_KEY,),
      custom_metadata=custom_metadata, pack_below=self._pack_below,
    )  # fmt: skip
    return _StepSave(self, step, api, tree, at, options)

  def _hold(self, api: str) -> None:
    """Takes (or checks) this directory's writer lease before a write:
    WriterConflictError while another live process writes here. In a
    jax.distributed job process 0 holds it for all."""
    if jax.process_index() != 0:
      return
    held = self._lease
    if held is None:
      held = lease_lib.acquire(api, self._dir.storage(), self.directory)
      self._lease = held
      self._lease_ref = weakref.finalize(self, lease_lib.release, held)
    held.check(api)

  def _release(self) -> None:
    """Gives this manager's share of the writer lease back."""
    ref, self._lease_ref, self._lease = self._lease_ref, None, None
    if ref is not None:
      ref()

  def _tree(self, api: str, tree: Any, items: Any) -> Any:
    if items is None:
      if tree is None:
        raise TypeError(f"{api}: pass the tree to save, or items=")
      return tree
    if tree is not None:
      raise TypeError(f"{api}: pass the tree or items=, not both")
    if not isinstance(items, Mapping) or not items:
      raise TypeError(
        f"{api}: items must be a non-empty dict of item name -> pytree, got "
        f"{items!r:.80}"
      )
    for name in items:
      check_item_name(api, name)
      if self.item_names is not None and name not in self.item_names:
        raise ValueError(
          f"{api}: the item {name!r} is not one of item_names "
          f"{list(self.item_names)}; add it to item_names"
        )
    return dict(items)

  # Metrics and retention.

  def metrics(self, step: int) -> Any:
    """The metrics saved with ``step`` (decoded JSON), or None: read from
    the step's record (the str leaf ``__jaxworks_metrics__``), cached until
    ``reload()``."""
    api = f"{_API}.metrics"
    step = check_step(api, step)
    with self._lock:
      if step in self._metrics_cache:
        return self._metrics_cache[step]
    try:
      values = ckpt.read_values(self._step(step))
    except FileNotFoundError:
      raise self._no_step(api, step) from None
    return self._metrics_in(step, values)

  def _metrics_in(self, step: int, values: dict[str, str | None]) -> Any:
    """The metrics of ``step`` in its record's str leaves ``values``
    (cached)."""
    text = values.get(METRICS_KEY)
    value = None
    if text is not None:
      value = steps_lib.decode_metrics(_API, step, self._path(step), text)
    with self._lock:
      self._metrics_cache[step] = value
    return value

  def _commit_ns(self, step: int) -> int:
    ns = self._step(step).commit_ns()
    if ns is None:
      raise self._no_step(f"{_API}.all_steps", step)
    return ns

  def _ranked(self, steps: list[int]) -> tuple[list[int], list[int]]:
    assert self.best_fn is not None
    return steps_lib.ranked(steps, self.metrics, self.best_fn, self.best_mode)

  def best_step(self) -> int | None:
    """The best step by ``best_fn`` of its metrics (None if no step has
    metrics; of equal ones the newest, in ``latest_step``'s order, as
    orbax); without ``best_fn``, ``latest_step()`` (as orbax)."""
    if self.best_fn is None:
      return self.latest_step()
    _, ranked = self._ranked(self._in_save_order(self.all_steps()))
    return ranked[-1] if ranked else None

  def _to_remove(self, steps: list[int]) -> list[int]:
    """The steps the retention rules no longer keep, over the steps in
    orbax's order (``_in_save_order``: the newest are the last saved)."""
    return steps_lib.to_remove(
      self._in_save_order(steps),
      max_to_keep=None if self.read_only else self.max_to_keep,
      keep_period=self.keep_period, keep_time_interval=self.keep_time_interval,
      commit_ns=self._commit_ns,
      rank=None if self.best_fn is None else self._ranked,
      keep_without_metrics=self.keep_checkpoints_without_metrics,
    )  # fmt: skip

  def _retain(self) -> None:
    """Deletes the steps the retention rules no longer keep (process 0)."""
    for s in self._to_remove(self.all_steps()):
      if self._delete_local(s, missing_ok=True):
        LOG.info(
          "%s: retention deleted step %d from %r", _API, s, self.directory
        )

  # Waiting and errors.

  def _finish(self, wait: bool = True) -> BaseException | None:
    """Waits for the pending save (``wait``; else only a finished one);
    forgets it and returns its error if this call is the first to see it
    finished. Every thread that calls it waits: the save stays pending, and
    listed by is_saving_in_progress, until it finished."""
    handle = self._handle
    if handle is None or not (wait or handle.done()):
      return None
    error = None
    try:
      handle.wait()
    except BaseException as err:
      error = err
    with self._lock:
      if self._handle is not handle:  # another thread saw it finish first
        return None
      self._handle = None
      if error is not None:  # not saved: the directory says what is
        self._pending_step = None
    return error

  def wait_until_finished(self) -> None:
    """Waits for the pending save (also while other threads wait for it)
    and for the removal of the steps it replaced or deleted; raises its
    error (once: in the first caller to see it finished)."""
    error = self._finish()
    self._dir.settle()
    if error is not None:
      raise error

  def is_saving_in_progress(self) -> bool:
    """True while this manager's last save is still being written."""
    handle = self._handle
    return handle is not None and not handle.done()

  def check_for_errors(self) -> None:
    """Raises the error of this manager's finished background save (once),
    without waiting for one still running."""
    error = self._finish(wait=False)
    if error is not None:
      raise error

  # Reading.

  def _existing(self, api: str, step: int | None) -> int:
    """``step`` (None: the latest), committed."""
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(
          f"{api}: no committed step in {self.directory!r}"
        )
    step = check_step(api, step)
    if not self._committed(step):
      raise self._no_step(api, step)
    return step

  @jax_internals.api_boundary
  def restore(
    self,
    step: int | None = None,
    target: Any = None,
    *,
    items: Mapping[str, Any] | None = None,
    placement: Any = None,
    **kwargs: Any,
  ) -> Any:
    """Restores ``step`` (default: the latest committed one) onto devices.

    The step's commit point is read once: everything returned (arrays, str
    and Python leaves, the metrics left out) is of that one save, also
    while another manager deletes or replaces the step (then the read is
    made again, or raises ``CheckpointReplacedError``).

    Args:
      step: the step (None: the latest).
      target: as for ``restore``: a tree of jax.ShapeDtypeStruct (e.g.
        ``jax.eval_shape(init_fn)``) saying what to load, exactly its leaves
        (pass ``partial_restore=True`` for a subset); None: every leaf as
        saved (arrays on the default device).
      items: instead of ``target``, for a step saved with ``items=``: a dict
        of the item names to restore -> each one's target, or None to
        restore that item as saved. Returns a dict of those items only.
      placement: as for ``restore``.
      **kwargs: as for ``restore``: ``partial_restore``, ``verify``,
        ``max_inflight_bytes``, ``read_threads``, ``progress``,
        ``collective``, ``barrier_timeout_s``.

    Raises:
      FileNotFoundError: no committed step (or not ``step``).
      KeyError: an item the step does not hold.
    """
    api = f"{_API}.restore"
    unknown = sorted(set(kwargs) - _RESTORE_KWARGS)
    if unknown:
      raise TypeError(
        f"{api}: unexpected keyword argument(s) {unknown}; it takes "
        f"{sorted(_RESTORE_KWARGS)} (the manager's storage_options are its "
        "own)"
      )
    step = self._existing(api, step)
    if items is not None:
      return self._restore_items(api, step, target, items, placement, kwargs)
    partial = bool(kwargs.pop("partial_restore", False))

    def choose(_: Any, record: format.Record) -> tuple[Any, bool]:
      # The metrics leaf is the manager's: a target without it is whole.
      if target is None or partial or METRICS_KEY not in record.values:
        return target, partial
      if isinstance(target, dict):  # dict, OrderedDict, ...: its own type
        with contextlib.suppress(TypeError):
          joined = type(target)(target)
          joined[METRICS_KEY] = ""
          return joined, partial
      return target, True

    options = ckpt.ReadOptions(
      placement=placement, partial_restore=partial, **kwargs
    )
    out, _ = ckpt.restore_at(api, self._step(step), target, options, choose)
    if isinstance(out, dict):
      out.pop(METRICS_KEY, None)
    return out

  def _restore_items(
    self,
    api: str,
    step: int,
    target: Any,
    items: Any,
    placement: Any,
    kwargs: dict[str, Any],
  ) -> dict[str, Any]:
    if target is not None:
      raise TypeError(f"{api}: pass target= or items=, not both")
    if not isinstance(items, Mapping) or not items:
      raise TypeError(
        f"{api}: items must be a non-empty dict of item name -> target (or "
        f"None), got {items!r:.80}"
      )
    for name in items:
      check_item_name(api, name)

    def choose(arrays: Any, record: format.Record) -> tuple[Any, bool]:
      stored = target_lib.as_saved(arrays, record, with_shardings=True)
      held = sorted(stored) if isinstance(stored, dict) else []
      like: dict[str, Any] = {}
      for name, t in items.items():
        if name not in held or name == METRICS_KEY:
          raise KeyError(
            f"{api}: step {step} in {self.directory!r} holds no item "
            f"{name!r}; its items are "
            f"{[n for n in held if n != METRICS_KEY]}"
          )
        like[name] = stored[name] if t is None else t
      return like, True

    kwargs.pop("partial_restore", None)  # items are always a part
    given = {n: t for n, t in items.items() if t is not None}
    if kwargs.get("collective") is None and len(given) < len(items):
      # Where the saved shardings of an item restored as saved span
      # processes, every process restores (as for a target that does).
      if multiprocess.multi_process():
        at = self._step(step)
        saved = target_lib.as_saved(*ckpt.read_record(at), with_shardings=True)
        kwargs["collective"] = ckpt.spans(saved, placement) or None
    options = ckpt.ReadOptions(
      placement=placement, partial_restore=True, **kwargs
    )
    out, record = ckpt.restore_at(api, self._step(step), given, options, choose)
    # Items restored as saved: Python scalar leaves back as Python scalars,
    # exactly as saved (as restore without a target gives them).
    for name, t in items.items():
      if t is None and record.python:
        keys, _, leaves, treedef = leaf_keys(api, {name: out[name]})
        leaves = [
          _python_value(record, k, x) if k in record.python else x
          for k, x in zip(keys, leaves)
        ]
        out[name] = treedef.unflatten(leaves)[name]
    return dict(out)

  @jax_internals.api_boundary
  def metadata(self, step: int | None = None) -> StepMetadata:
    """The metadata of ``step`` (default: the latest), reading no array
    data; its tree, metrics and custom metadata are of one save (the
    step's commit point read once).

    Raises:
      FileNotFoundError: no committed step (or not ``step``).
    """
    api = f"{_API}.metadata"
    step = self._existing(api, step)
    at = self._step(step)
    arrays, record = ckpt.read_record(at)
    tree = ckpt.saved_tree(api, at.path, arrays, record)
    if isinstance(tree, dict):
      tree.pop(METRICS_KEY, None)
    return StepMetadata(
      step=step,
      item_metadata=tree,
      metrics=self._metrics_in(step, record.values),
      commit_timestamp_nsecs=self._commit_ns(step),
      custom_metadata=dict(record.custom_metadata or {}),
    )

  def item_metadata(self, step: int) -> Any:
    """``metadata(step).item_metadata``: the saved tree (``{name: item}``)
    with jax.ShapeDtypeStruct for arrays, reading no array data."""
    return self.metadata(
      check_step(f"{_API}.item_metadata", step)
    ).item_metadata

  # Deleting.

  def _delete_local(self, step: int, missing_ok: bool = False) -> bool:
    """Deletes ``step``; False if it was gone (``missing_ok``)."""
    api = f"{_API}.delete"
    self._hold(api)
    if not self._step(step).delete():  # never half listed
      if missing_ok:
        return False
      raise self._no_step(api, step)
    self._forget(step)
    return True

  def delete(self, step: int) -> None:
    """Deletes a committed step (renamed away first: never half listed).

    Waits for this manager's pending save first (whose retention may
    delete steps). In a multi-process job every process calls it: process
    0 deletes once every process called it, the others return once it did
    (or raise RuntimeError naming its error; TimeoutError after
    ``barrier_timeout_s``). With ``read_only`` it warns and does nothing.

    Raises:
      FileNotFoundError: no such step.
      WriterConflictError: another live process writes this directory.
    """
    api = f"{_API}.delete"
    step = check_step(api, step)
    if self._refuse(api, step, "deleted"):
      return
    handle = self._handle
    if handle is not None:  # its retention decides first; its error stays
      with contextlib.suppress(Exception):  # for the next call to raise
        handle.wait()
    if jax.process_count() > 1:

      def on_process_0() -> None:
        self._delete_local(step)

      multiprocess.run_collective(
        api,
        "delete",
        self._step(step).key,
        on_process_0,
        self.barrier_timeout_s,
      )
      self._forget(step)
    else:
      self._delete_local(step)
    LOG.info("%s: deleted step %d from %r", _API, step, self.directory)

  def close(self) -> None:
    """Waits for the pending save, then gives the directory's writer lease
    back (a later save or delete takes it again)."""
    try:
      self.wait_until_finished()
    finally:
      self._release()

  def __enter__(self) -> CheckpointManager:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def __repr__(self) -> str:
    best = (
      f", best_fn={self.best_fn!r}, best_mode={self.best_mode!r}"
      if self.best_fn is not None
      else ""
    )
    return (
      f"CheckpointManager({self.directory!r}, max_to_keep={self.max_to_keep}, "
      f"keep_period={self.keep_period}, "
      f"save_interval_steps={self.save_interval_steps}{best}"
      + (", read_only=True" if self.read_only else "")
      + ")"
    )
