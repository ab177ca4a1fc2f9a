"""Saves running in the background: their handles, errors, and process exit.

Each non-blocking save writes on a thread of its own (not a daemon thread:
the interpreter joins it before exiting, so a pending save finishes first).
An error in the background is kept on the handle (``wait()`` raises it) and,
until some ``wait()`` or ``save`` raised it, in a list the next ``save``
raises from. At exit, errors nobody saw are printed to stderr.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
import contextlib
import logging
import os
import sys
import threading

from .storage import ThreadStartError

#: The package logger (Python logging; never print).
_log = logging.getLogger("jaxworks.batched_transfer")

#: Name prefix of the threads that write non-blocking saves.
THREAD_PREFIX = "jaxworks-save"

_lock = threading.Lock()
_pending: set[SaveHandle] = set()
_unseen: list[SaveHandle] = []
# The paths that saves of this process are writing, and how many saves each.
_reserved: dict[str, int] = {}
# Per path, the reservation of the save of this process called last.
_last: dict[str, Reservation] = {}


class Reservation:
  """A path a save of this process is writing, from the call until its
  commit (or failure); ``release()`` once. ``wait_turn()`` waits until the
  save to the same path called before this one (by this process) is
  released: saves to one path commit in call order, the last call's last."""

  def __init__(self, path: str, before: Reservation | None) -> None:
    self.path = path
    self._held = True
    self._before = before
    self._released = threading.Event()

  def wait_turn(self) -> None:
    before, self._before = self._before, None
    if before is not None:
      before._released.wait()

  def release(self) -> None:
    with _lock:
      if self._held:
        self._held = False
        _reserved[self.path] -= 1
        if not _reserved[self.path]:
          del _reserved[self.path]
        if _last.get(self.path) is self:
          del _last[self.path]
      self._before = None
      self._released.set()


def reserve(api: str, path: str, overwrite: bool) -> Reservation:
  """Reserves ``path`` for a save; without ``overwrite``, FileExistsError if
  a save of this process (one with ``blocking=False`` still writing) holds
  it: that save will create the path, which this one may not replace."""
  key = os.path.abspath(path)
  with _lock:
    if key in _reserved and not overwrite:
      raise FileExistsError(
        f"{api}: a save to {path!r} is still being written (blocking=False); "
        "wait() for it, save elsewhere, or pass overwrite=True to replace it"
      )
    _reserved[key] = _reserved.get(key, 0) + 1
    r = _last[key] = Reservation(key, _last.get(key))
  return r


class SaveHandle:
  """A save running in the background (``save(..., blocking=False)``)."""

  def __init__(self, path: str) -> None:
    self.path = path
    self._event = threading.Event()
    self._error: BaseException | None = None

  def done(self) -> bool:
    """True once the save finished (durably, or with an error)."""
    return self._event.is_set()

  def wait(self, timeout: float | None = None) -> None:
    """Waits until the checkpoint is durable at ``path``.

    Raises:
      TimeoutError: ``timeout`` seconds passed first.
      BaseException: the error the save met in the background (each call).
    """
    if not self._event.wait(timeout):
      raise TimeoutError(
        f"jaxworks.batched_transfer.SaveHandle.wait: the save to "
        f"{self.path!r} did not finish within {timeout} s"
      )
    if self._error is not None:
      with _lock:
        if self in _unseen:
          _unseen.remove(self)
      raise self._error

  def __repr__(self) -> str:
    state = "done" if self.done() else "pending"
    if self._error is not None:
      state = f"failed: {self._error!r}"
    return f"SaveHandle({self.path!r}, {state})"


#: How much lower (in nice steps) the CPU priority of a background save's
#: threads is than the process's: the training steps running beside it get
#: the CPU first (its writer threads, started by it, inherit it).
BACKGROUND_NICE = 10


def yield_cpu() -> None:
  """Lowers this thread's CPU priority by ``BACKGROUND_NICE`` (Linux, where
  a thread has its own; elsewhere nothing)."""
  if not hasattr(os, "setpriority") or sys.platform != "linux":
    return
  tid = threading.get_native_id()
  with contextlib.suppress(OSError):
    now = os.getpriority(os.PRIO_PROCESS, tid)
    os.setpriority(os.PRIO_PROCESS, tid, min(19, now + BACKGROUND_NICE))


def start(path: str, work: Callable[[], None]) -> SaveHandle:
  """Runs ``work`` on a new thread; returns its handle.

  Raises:
    ThreadStartError: the thread could not start (``work`` never runs:
      the caller lets go of what the save held).
  """
  handle = SaveHandle(path)

  def run() -> None:
    try:
      yield_cpu()
      work()
    except BaseException as err:  # kept for wait() and the next save
      err.add_note(
        f"(raised in the background by save(..., blocking=False) to {path!r})"
      )
      handle._error = err
      with _lock:
        _unseen.append(handle)
    finally:
      with _lock:
        _pending.discard(handle)
      handle._event.set()

  thread = threading.Thread(target=run, name=f"{THREAD_PREFIX}-{path}")
  with _lock:
    _pending.add(handle)
  try:
    thread.start()
  except RuntimeError as err:  # "can't start new thread": no save pending
    with _lock:
      _pending.discard(handle)
    raise ThreadStartError(
      f"jaxworks.batched_transfer.save: could not start the thread of the "
      f"non-blocking save to {path!r}: {err}; nothing was written or "
      "committed: the checkpoint that was at the path (if any) is still "
      "there. Save with blocking=True, or raise the process's thread limit "
      "(ulimit -u), then save again"
    ) from err
  return handle


def raise_background_error(api: str) -> None:
  """Raises the error of the earliest failed background save no one saw yet."""
  with _lock:
    if not _unseen:
      return
    handle = _unseen.pop(0)
  assert handle._error is not None
  raise handle._error


def wait_all(timeout: float | None = None) -> None:
  """Waits for every pending save (their errors stay with their handles)."""
  with _lock:
    handles = list(_pending)
  for h in handles:
    h._event.wait(timeout)


@atexit.register
def _at_exit() -> None:
  wait_all()
  with _lock:
    unseen = list(_unseen)
    _unseen.clear()
  for h in unseen:
    _log.error(
      "jaxworks.batched_transfer: the background save to %r failed and no "
      "one waited for it: %r",
      h.path,
      h._error,  # pylint: disable=protected-access
    )
