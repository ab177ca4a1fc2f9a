"""Reading ahead on one background thread, within a byte budget.

``restore`` reads batch k+1 of a checkpoint while batch k is placed
(``stream``). Batches are fixed before reading starts (every process of a
multi-process restore places the same batches, in the same order); only
when each one is read depends on timing.

>>> sizes = [4, 4, 4]
>>> with BatchReader(lambda k: f"batch {k}", sizes, budget=8) as reader:
...   for k in range(len(sizes)):
...     print(reader.take(k))
...     reader.release(k)
batch 0
batch 1
batch 2
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterable
import threading
from typing import Any

import jax

from .. import jax_internals
from .progress import Progress

THREAD_NAME = "jaxworks-restore-reader"
#: The most bytes in one batch, whatever the budget: smaller batches let
#: reading overlap placing in checkpoints of a few batches' size too.
BATCH_CAP = 16 * 2**20


class BatchReader:
  """Reads batches 0, 1, ... in order on a background thread.

  A batch's bytes count from when its reading starts until ``release(k)``;
  reading a batch waits until the bytes counted plus its own fit in
  ``budget``, or until nothing is counted (a larger batch is read alone).
  The consumer calls ``take(k)`` then ``release(k)`` for k = 0, 1, ...;
  ``take`` raises what ``read_batch`` raised (the same object); ``close()``
  (or leaving the ``with`` block) stops the thread and joins it. One batch
  is read by ``take(0)`` on the calling thread, with no thread started.
  """

  def __init__(
    self,
    read_batch: Callable[[int], Any],
    sizes: list[int],
    budget: int,
  ) -> None:
    self._read_batch = read_batch
    self._sizes = list(sizes)
    self._budget = budget
    self._cond = threading.Condition()
    self._ready: dict[int, Any] = {}
    self._counted = 0
    self._error: BaseException | None = None
    self._stop = False
    self._thread: threading.Thread | None = None
    if len(self._sizes) > 1:
      self._thread = threading.Thread(
        target=self._run, name=THREAD_NAME, daemon=True
      )
      self._thread.start()

  def __enter__(self) -> BatchReader:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def _run(self) -> None:
    try:
      for k, size in enumerate(self._sizes):
        with self._cond:
          while (
            not self._stop
            and self._counted
            and self._counted + size > self._budget
          ):
            self._cond.wait()
          if self._stop:
            return
          self._counted += size
        result = self._read_batch(k)
        with self._cond:
          self._ready[k] = result
          self._cond.notify_all()
    except BaseException as err:  # handed to the consumer by take()
      with self._cond:
        self._error = err
        self._cond.notify_all()

  def take(self, k: int) -> Any:
    """Batch k once it is read; raises what reading raised instead."""
    if self._thread is None:
      return self._read_batch(k)
    with self._cond:
      while k not in self._ready and self._error is None:
        self._cond.wait()
      if self._error is not None:
        raise self._error
      return self._ready.pop(k)

  def release(self, k: int) -> None:
    """Batch k is used: its bytes no longer count against the budget."""
    with self._cond:
      self._counted -= self._sizes[k]
      self._cond.notify_all()

  def close(self) -> None:
    """Stops reading (a batch being read is finished first) and joins."""
    with self._cond:
      self._stop = True
      self._cond.notify_all()
    if self._thread is not None:
      self._thread.join()
    self._ready.clear()


def split_batches(sizes: list[int], limit: int) -> list[list[int]]:
  """Consecutive indices in batches of at most ``limit`` bytes (a larger one alone).

  >>> split_batches([3, 3, 3, 9, 1], 6)
  [[0, 1], [2], [3], [4]]
  """
  batches: list[list[int]] = []
  batch: list[int] = []
  total = 0
  for i, n in enumerate(sizes):
    if batch and total + n > limit:
      batches.append(batch)
      batch, total = [], 0
    batch.append(i)
    total += n
  if batch:
    batches.append(batch)
  return batches


def stream(
  sizes: list[int],
  budget: int,
  read: Callable[[list[int]], Any],
  place: Callable[[list[int], Any], Iterable[Any]],
  progress: bool | None,
) -> list[Any]:
  """Reads and places arrays of ``sizes`` bytes in batches; the arrays in order.

  Batches hold at most half of ``budget`` bytes (and ``BATCH_CAP``).
  ``read(batch)`` gives the host data of a batch (a list of indices), on a
  ``BatchReader`` thread that reads the next batches while one is placed;
  ``place(batch, data)`` yields its placed arrays, each kept as soon as it
  exists. A batch's data is released once its arrays are ready. On any
  failure every array placed so far is deleted (nothing stays half-placed)
  before the error propagates. ``progress`` as ``Progress``'s ``enabled``.
  """
  # Host buffers of arrays already dropped (earlier restores, on CPU) go
  # first, not at Python's next garbage collection.
  jax_internals.release_dropped_host_buffers()
  batches = split_batches(sizes, min(max(1, budget // 2), BATCH_CAP))
  totals = [sum(sizes[i] for i in b) for b in batches]
  out: list[Any] = [None] * len(sizes)
  bar = Progress("restore", sum(sizes), enabled=progress)
  reader = BatchReader(lambda k: read(batches[k]), totals, budget)
  try:
    for k, batch in enumerate(batches):
      data = reader.take(k)
      for i, y in zip(batch, place(batch, data)):
        out[i] = y  # from here on deleted if anything fails
      del data
      jax.block_until_ready([out[i] for i in batch])
      reader.release(k)
      bar.update(totals[k])
  except BaseException:
    reader.close()
    for y in out:
      if isinstance(y, jax.Array) and not y.is_deleted():
        y.delete()
    raise
  finally:
    reader.close()
    bar.close()
  return out
