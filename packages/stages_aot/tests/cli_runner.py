"""Runs the stages_aot CLI in a new process, for cli_test and cli_stages_test."""

import os
import pathlib
import subprocess
import sys

import jaxworks.stages_aot as sa


def run_cli(workdir, *args, cwd=None, umask=-1, **env_vars):
  """``python -m jaxworks.stages_aot *args`` run in ``cwd or workdir``.

  The subprocess gets PYTHONPATH as absolute paths: ``workdir``, this
  checkout's packages, what this process was given, and every sys.path entry
  holding a part of the jaxworks namespace.
  """
  passed = [
    os.path.abspath(p)
    for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if p
  ]
  portions = [
    os.path.abspath(p)
    for p in sys.path
    if p and os.path.isdir(os.path.join(p, "jaxworks"))
  ]
  paths = (
    [str(workdir), str(pathlib.Path(sa.__file__).resolve().parents[2])]
    + passed
    + portions
  )
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths), JAX_PLATFORMS="cpu")
  env.pop("BUILD_WORKING_DIRECTORY", None)  # set only by the tests that want it
  env.update(env_vars)
  return subprocess.run(
    [sys.executable, "-m", "jaxworks.stages_aot", *args],
    cwd=cwd or workdir,
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
    umask=umask,
  )
