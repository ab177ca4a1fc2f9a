"""Python in a child process that imports what this test imports."""

import os
import subprocess
import sys


def env(drop: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
  """os.environ with PYTHONPATH set to this process's sys.path, without the
  variables in ``drop``, with ``extra`` on top."""
  out = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
  for name in drop:
    out.pop(name, None)
  out.update(extra)
  return out


def run(
  *args: str, child_env=None, timeout: float = 180
) -> subprocess.CompletedProcess:
  """Runs ``python *args``; asserts it exited 0 (with the end of its stderr
  as the message); returns the process (``stdout``, ``stderr``: text)."""
  proc = subprocess.run(
    [sys.executable, *args],
    capture_output=True,
    text=True,
    env=env() if child_env is None else child_env,
    timeout=timeout,
    check=False,
  )
  assert proc.returncode == 0, (proc.returncode, proc.stderr[-4000:])
  return proc
