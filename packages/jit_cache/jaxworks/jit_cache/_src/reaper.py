"""Teardown off the caller's path: values freed on a daemon thread.

The shared executable cache (``cache.ExecutableCache``) evicts inside the call
that compiles a new program. Freeing an XLA executable is work of its own,
much of it outside the GIL; handing the evicted executable to ``REAPER``
takes that off the call. ``clear_caches()`` and exit wait for it (``flush``).
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any


class Reaper:
  """Frees dropped values on a daemon thread (see the module docstring);
  ``close`` flushes at exit, before JAX tears its backends down."""

  def __init__(self):
    self._cond = threading.Condition()
    self._items: list[Any] = []
    self._dropped = 0  # handed over
    self._freed = 0  # of those, released by the thread
    self._thread: threading.Thread | None = None
    self._closed = False

  def drop(self, values: list[Any]) -> None:
    """Takes over ``values`` (the caller's list is emptied); frees them here
    when no thread can be had (the interpreter is exiting)."""
    if not values:
      return
    with self._cond:
      if not self._closed and self._start_locked():
        self._items.extend(values)
        self._dropped += len(values)
        values.clear()
        self._cond.notify_all()
    values.clear()  # freed by the caller, after the lock

  def _start_locked(self) -> bool:
    if self._thread is not None and self._thread.is_alive():
      return True
    thread = threading.Thread(
      target=self._run, name="jaxworks-reaper", daemon=True
    )
    try:
      thread.start()
    except RuntimeError:
      return False
    self._thread = thread
    return True

  def _run(self) -> None:
    while True:
      with self._cond:
        while not self._items:
          self._cond.wait()
        items, self._items = self._items, []
      count = len(items)
      del items  # the teardown, without the lock
      with self._cond:
        self._freed += count
        self._cond.notify_all()

  def flush(self, timeout: float | None = None) -> bool:
    """Waits until what was handed over before this call is freed; False if
    ``timeout`` seconds passed first."""
    if threading.current_thread() is self._thread:
      return True  # a teardown that clears caches: nothing to wait for
    with self._cond:
      target = self._dropped
      return self._cond.wait_for(lambda: self._freed >= target, timeout)

  def close(self) -> None:
    """At exit: frees what is pending, then frees in the caller."""
    self.flush(timeout=10.0)
    with self._cond:
      self._closed = True

  def after_fork_in_child(self) -> None:
    """The child has no reaper thread: it starts its own when needed."""
    self._cond = threading.Condition()
    self._items, self._dropped, self._freed = [], 0, 0
    self._thread = None


REAPER = Reaper()
atexit.register(REAPER.close)
if hasattr(os, "register_at_fork"):
  os.register_at_fork(after_in_child=REAPER.after_fork_in_child)
