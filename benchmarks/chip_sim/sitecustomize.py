"""A one-chip TPU machine's constraints, simulated on a CPU host (trials only).

Put this directory first on PYTHONPATH (Python imports ``sitecustomize`` at
start) with any of:

* ``CHIP_SIM_LOCK=PATH``: a process's first backend initialisation takes an
  exclusive ``flock`` on PATH and keeps it until the process ends, and fails
  as libtpu does (``RuntimeError``, "libtpu multi-process lockfile") when
  another process holds it: one program at a time holds the chip.
* ``CHIP_SIM_OPEN_S=SECONDS``: that first initialisation then sleeps this
  long (opening the chip costs ~15 s).
* ``CHIP_SIM_NO_INET=1``: internet sockets fail with errno 97
  (EAFNOSUPPORT), as on that machine; unix sockets work.

``//benchmarks:tpu_round_test`` runs the TPU round's profile under it; by
hand: ``PYTHONPATH=benchmarks/chip_sim:$PYTHONPATH CHIP_SIM_LOCK=/tmp/lock
JAX_PLATFORMS=cpu python3 benchmarks/run_all.py --no-bazel --platform tpu``.
"""

import errno
import fcntl
import importlib.abc
import importlib.machinery
import os
import socket
import sys
import time

_LOCK = os.environ.get("CHIP_SIM_LOCK")
_OPEN_S = float(os.environ.get("CHIP_SIM_OPEN_S") or 0)
_HELD: list[int] = []


def _take_the_chip():
  if _HELD:
    return
  fd = os.open(_LOCK, os.O_CREAT | os.O_RDWR, 0o600)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError:
    os.close(fd)
    raise RuntimeError(
      "Internal error when accessing libtpu multi-process lockfile "
      f"(simulated by benchmarks/chip_sim: process {os.getpid()} found the "
      "chip held by another process)"
    ) from None
  _HELD.append(fd)
  sys.stderr.write(f"[chip_sim] process {os.getpid()} opened the chip\n")
  time.sleep(_OPEN_S)


class _WrapBackends(importlib.abc.MetaPathFinder):
  """Wraps ``jax._src.xla_bridge.backends`` (every backend initialisation
  goes through it) when that module is first imported."""

  def find_spec(self, name, path, target=None):
    if name != "jax._src.xla_bridge":
      return None
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
      return spec
    exec_module = spec.loader.exec_module

    def exec_and_wrap(module):
      exec_module(module)
      real = module.backends

      def backends():
        _take_the_chip()
        return real()

      module.backends = backends

    spec.loader.exec_module = exec_and_wrap
    return spec


if _LOCK:
  sys.meta_path.insert(0, _WrapBackends())

if os.environ.get("CHIP_SIM_NO_INET"):
  _Socket = socket.socket

  class _NoInternetSocket(_Socket):
    def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
      if fileno is None and family in (-1, socket.AF_INET, socket.AF_INET6):
        raise OSError(
          errno.EAFNOSUPPORT,
          "Address family not supported by protocol (simulated by "
          "benchmarks/chip_sim: no internet socket opens on a TPU machine)",
        )
      super().__init__(family, type, proto, fileno)

  socket.socket = _NoInternetSocket
