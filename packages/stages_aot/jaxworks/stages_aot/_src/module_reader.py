"""Reads serialized StableHLO modules, in-process or in a child process.

The StableHLO bytecode reader that ``jax.export`` and XLA use trusts its
input: some damaged modules crash it (a segmentation fault takes the whole
process down) or make it loop. :func:`describe_modules` therefore hands
untrusted bytes to a child process (``jax_internals.MODULE_READER_SOURCE``,
running ``module_describe.py``), which deserializes and verifies each module
and reports the types of its ``main`` function. A module that crashes or
stalls the child is reported as unreadable, and the next request starts a
fresh child. The child exits once it has been idle for
:data:`IDLE_TIMEOUT_S` seconds. Answers are cached by the sha256 of the
bytes, so reading the same untrusted module twice costs one read.

Modules whose sha256 the caller vouches for (``trusted``: an artifact whose
manifest records that sha256, see ``artifact.load_artifact``) are read
in-process by the same code, unless the caller asks for isolation.
"""

from __future__ import annotations

import atexit
from collections import OrderedDict
import hashlib
import json
import os
import queue
import struct
import subprocess
import sys
import threading
import time
from typing import IO
from typing import Any
from typing import cast

from . import jax_internals
from . import module_describe

#: Seconds a request may take before the child is considered stuck (plus
#: one second per MiB of module).
TIMEOUT_S = 30.0

#: Seconds without a request after which the child process is stopped (the
#: next untrusted module starts a fresh one).
IDLE_TIMEOUT_S = 5.0

_CACHE_SIZE = 256


class ReaderUnavailable(RuntimeError):
  """The child process cannot be started (nothing is known about the module)."""


class _Reader:
  def __init__(self):
    self._lock = threading.Lock()
    self._proc: subprocess.Popen | None = None
    self._pid = None  # the process that started the child (not a fork of it)
    self._lines: queue.Queue | None = None
    self._cache: OrderedDict[str, dict[str, Any]] = OrderedDict()
    self._last_use = 0.0
    self._timer: threading.Timer | None = None

  def _start(self) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    flags = ["-P"] if sys.version_info >= (3, 11) else []
    try:
      proc = subprocess.Popen(
        [
          sys.executable,
          *flags,
          "-c",
          jax_internals.MODULE_READER_SOURCE,
          module_describe.__file__,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
      )
    except OSError as e:
      raise ReaderUnavailable(f"cannot start {sys.executable} ({e})") from None
    lines: queue.Queue = queue.Queue()
    stdout = proc.stdout

    def pump():
      for line in stdout:
        lines.put(line)
      lines.put(None)  # the child exited

    threading.Thread(
      target=pump, name="stages_aot-module-reader", daemon=True
    ).start()
    try:
      ready = lines.get(timeout=TIMEOUT_S)
    except queue.Empty:
      ready = None
    if ready != b"ready\n":
      proc.kill()
      proc.wait()
      raise ReaderUnavailable(
        f"{sys.executable} could not import jaxlib's StableHLO reader in a child "
        "process; run with an interpreter that can import jaxlib"
      )
    self._proc, self._pid, self._lines = proc, os.getpid(), lines

  def stop(self) -> None:
    proc, self._proc = self._proc, None
    if proc is None or self._pid != os.getpid():
      return
    try:
      # Started with stdin=PIPE, so stdin is a pipe.
      cast(IO[bytes], proc.stdin).close()
    except OSError:
      pass
    try:
      proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()

  def _ask(self, blob: bytes) -> dict[str, Any] | None:
    """The child's answer for one module; None if it died or stalled on it."""
    if (
      self._proc is None
      or self._pid != os.getpid()
      or self._proc.poll() is not None
    ):
      self._proc = None
      self._start()
    proc, lines = self._proc, self._lines
    if proc is None or proc.stdin is None or lines is None:
      raise RuntimeError("module reader: the child process was not started")
    request = struct.pack("<Q", 1) + struct.pack("<Q", len(blob)) + blob
    try:
      proc.stdin.write(request)
      proc.stdin.flush()
      line = lines.get(timeout=TIMEOUT_S + len(blob) / 2**20)
    except (OSError, queue.Empty):
      line = None
    if line is None:
      proc.kill()
      proc.wait()
      self._proc = None
      return None
    (answer,) = json.loads(line)
    return answer

  def _stop_if_idle(self) -> None:
    with self._lock:
      self._timer = None
      left = self._last_use + IDLE_TIMEOUT_S - time.monotonic()
      if left > 0:
        self._arm(left)
      else:
        self.stop()

  def _arm(self, delay: float) -> None:
    """Stops the child after ``delay`` seconds unless it was used since."""
    if self._timer is None and self._proc is not None:
      timer = threading.Timer(delay, self._stop_if_idle)
      timer.daemon = True
      timer.name = "stages_aot-module-reader-idle"
      self._timer = timer
      timer.start()

  def describe(self, blobs: list[bytes]) -> list[dict[str, Any]]:
    keys = [hashlib.sha256(b).hexdigest() for b in blobs]
    with self._lock:
      try:
        for blob, key in zip(blobs, keys):
          if key in self._cache:
            continue
          # One module at a time, so that a crash blames the right one; a
          # second try in a fresh child rules out a child that died for
          # another reason.
          answer = self._ask(blob)
          if answer is None:
            answer = self._ask(blob)
          if answer is None:
            answer = {"error": "the StableHLO reader crashed or stalled on it"}
          self._cache[key] = answer
          while len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        for k in keys:
          self._cache.move_to_end(k)
        return [self._cache[k] for k in keys]
      finally:
        self._last_use = time.monotonic()
        self._arm(IDLE_TIMEOUT_S)


_READER = _Reader()
atexit.register(_READER.stop)


def child_pid() -> int | None:
  """The process id of the reader's child process, None when none runs."""
  proc = _READER._proc
  return proc.pid if proc is not None and proc.poll() is None else None


def describe_modules(
  blobs: list[bytes],
  *,
  trusted: frozenset[str] = frozenset(),
  isolate: bool = False,
) -> list[dict[str, Any]]:
  """Describes serialized StableHLO modules.

  Args:
    blobs: the serialized modules.
    trusted: sha256 hex digests of modules the caller vouches for (they come
      from a file whose recorded sha256 matched): those are read in this
      process, unless ``isolate``. Every other module is read in the child
      process.
    isolate: read every module in the child process.

  Raises:
    ReaderUnavailable: the child process cannot be started.

  Returns:
    One ``module_describe.describe`` answer per module (``{"error": text}``
    also when it crashes or stalls the reader).
  """
  blobs = [bytes(b) for b in blobs]
  local = [
    not isolate and hashlib.sha256(b).hexdigest() in trusted for b in blobs
  ]
  answers: list[dict[str, Any] | None] = [None] * len(blobs)
  if any(local):
    # Imported here: jax.extend costs about 200 ms to import (it imports
    # Pallas), and a load whose modules the manifest vouches for reads none.
    from jax.extend.mlir import deserialize_portable_artifact
    from jax.extend.mlir import ir as mlir_ir

    context = mlir_ir.Context()  # one per call: a context keeps what it read
    for i, blob in enumerate(blobs):
      if local[i]:
        answers[i] = module_describe.describe_safely(
          blob, deserialize_portable_artifact, mlir_ir, context
        )
  rest = [b for b, here in zip(blobs, local) if not here]
  if rest:
    isolated = iter(_READER.describe(rest))
    answers = [a if here else next(isolated) for a, here in zip(answers, local)]
  return cast(list[dict[str, Any]], answers)
