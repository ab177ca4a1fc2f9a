"""Shared by the tests that start jax.distributed processes on 127.0.0.1."""

import json
import os
import socket
import subprocess
import sys

import ml_dtypes  # noqa: F401  (np.dtype of ml_dtypes names needs it imported)
import numpy as np


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def numpy_read(path: str) -> dict:
  """Every array of a multi-process checkpoint, with numpy and json alone:
  what the README's manifest schema promises a reader needs."""
  with open(os.path.join(path, "jaxworks_manifest.json")) as f:
    manifest = json.load(f)
  out = {}
  for key, entry in manifest["arrays"].items():
    dtype = np.dtype(entry["dtype"])
    a = np.empty(entry["shape"], dtype)
    for shard in entry["shards"]:
      data = np.load(os.path.join(path, shard["file"]))
      where = tuple(
        slice(s, s + n) for s, n in zip(shard["start"], shard["shape"])
      )
      a[where] = data.view(dtype) if data.dtype.kind == "V" else data
    out[key] = a
  return out


def run_two(worker, base, timeout=150):
  """Runs ``worker`` (python source; argv: process id, port, base) as the
  two processes of a jax.distributed job; asserts both printed WORKER-OK."""
  return run_n(worker, base, 2, timeout=timeout)


def run_n(worker, base, n, timeout=150, devices=4, extra=(), dead=()):
  """Runs ``worker`` (python source; argv: process id, port, base, then
  ``extra``) as the ``n`` processes of a jax.distributed job with
  ``devices`` CPU devices each; asserts each printed WORKER-OK <its id>
  (but those in ``dead``, which kill themselves). Returns their outputs."""
  env = dict(os.environ)
  env.update(
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
  )
  port = str(free_port())
  dump = (
    "import faulthandler; "
    f"faulthandler.dump_traceback_later({timeout - 30}, exit=True)\n"
  )
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", dump + worker, str(i), port, base, *extra],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(n)
  ]
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=timeout)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  failed = [
    i
    for i, text in enumerate(outputs)
    if f"WORKER-OK {i}" not in text and i not in dead
  ]
  # Every process's output: one that failed first often leaves the others
  # waiting, and it is the first that says why.
  assert not failed, "\n".join(
    f"process {i}:\n{text[-4000:]}" for i, text in enumerate(outputs)
  )
  return outputs
