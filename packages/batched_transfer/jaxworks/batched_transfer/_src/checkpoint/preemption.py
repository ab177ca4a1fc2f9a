"""Preemption: how a training job learns that it is being stopped, so it
saves its current step and exits (``CheckpointManager.reached_preemption``).

In a jax.distributed job of several processes this is JAX's preemption
sync point (``jax.experimental.multihost_utils``): the scheduler's notice
(SIGTERM) reaching any process makes every process reach the same step.
In a process alone, ``watch`` installs a SIGTERM handler (from the main
thread, the first time a manager is asked) that only notes the signal; the
job then saves and exits on its own. The handler is given back after the
first SIGTERM, so a second one acts as before it (by default: the process
ends).

>>> import os, signal
>>> watch("example")
True
>>> os.kill(os.getpid(), signal.SIGTERM)
>>> received()
True
>>> reset()
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from jax.experimental import multihost_utils

from . import multiprocess
from .storage import LOG

_lock = threading.Lock()
_received = threading.Event()
#: The SIGTERM handler before ``watch``'s (given back after the signal).
_previous: Any = None
_watching = False


def _on_sigterm(signum: int, frame: Any) -> None:
  del frame
  global _watching
  _received.set()
  _watching = False
  signal.signal(signum, _previous)  # a second SIGTERM acts as before
  LOG.warning(
    "jaxworks.batched_transfer: SIGTERM received; "
    "CheckpointManager.reached_preemption is now True (save the current "
    "step and exit; a second SIGTERM acts as without jaxworks)"
  )


def watch(api: str) -> bool:
  """Notes SIGTERM from now on (once per process); False where no handler
  can be installed (not the main thread: then it warns, once)."""
  global _previous, _watching
  with _lock:
    if _watching or _received.is_set():
      return True
    if threading.current_thread() is not threading.main_thread():
      LOG.warning(
        "%s: SIGTERM cannot be watched from a thread other than the main "
        "thread (Python installs signal handlers there only); call "
        "reached_preemption once from the main thread first",
        api,
      )
      return False
    _previous = signal.signal(signal.SIGTERM, _on_sigterm)
    _watching = True
    return True


def received() -> bool:
  """Whether this process got SIGTERM since ``watch``."""
  return _received.is_set()


def reached(api: str, step: int) -> bool:
  """Whether the job should save ``step`` and stop: JAX's preemption sync
  point in a job of several processes (every process reaches the same
  step), else this process got SIGTERM."""
  if multiprocess.multi_process():
    try:
      return bool(multihost_utils.reached_preemption_sync_point(step))
    except RuntimeError as err:  # the preemption service is off
      raise RuntimeError(
        f"{api}: JAX's preemption service is not running ({err}); a job of "
        "several processes learns of a preemption from it, so that every "
        "process saves the same step: leave jax_enable_preemption_service "
        "on (the default) when calling jax.distributed.initialize"
      ) from None
  watch(api)
  return _received.is_set()


def reset() -> None:
  """Forgets a received SIGTERM and gives the handler back (tests)."""
  global _watching
  with _lock:
    if _watching:
      signal.signal(signal.SIGTERM, _previous)
    _watching = False
    _received.clear()
