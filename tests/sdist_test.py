"""The sdists: the same Python files as the Bazel wheels, and they build with pip.

Each package's sdist (``//packages/<pkg>:sdist``, pyproject.toml with
setuptools, pybind11 for the two extensions) is compared with its wheel file by
file, then all five are installed with ``pip install --no-binary <them>
--no-deps`` into a fresh virtualenv (pip fetches setuptools and pybind11 from
the package index into its isolated build environment; jax and jaxlib come
from the build's virtualenv through a .pth file), and a smoke test compares one
call of each extension's API with stock JAX from a neutral directory.
"""

import glob
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

from install_smoke import SMOKE
from install_smoke import clean_env
import pytest


def _found(env, pattern):
  found = []
  for d in os.environ[env].split():
    found += glob.glob(os.path.join(d, pattern))
  return sorted(found)


def _dist(path):
  return os.path.basename(path).split("-")[0]


def _python_files_of_sdist(path):
  with tarfile.open(path) as tf:
    names = [n.split("/", 1)[1] for n in tf.getnames()]
  return {n for n in names if n.startswith("jaxworks/")}


def _python_files_of_wheel(path):
  with zipfile.ZipFile(path) as zf:
    return {
      n
      for n in zf.namelist()
      if n.startswith("jaxworks/") and not n.endswith(".so")
    }


def test_each_sdist_holds_exactly_its_wheels_python_files():
  sdists = {_dist(s): s for s in _found("JAXWORKS_SDIST_DIRS", "*.tar.gz")}
  wheels = {_dist(w): w for w in _found("JAXWORKS_WHEEL_DIRS", "*.whl")}
  assert len(sdists) == 5 and set(sdists) == set(wheels), (sdists, wheels)
  for name, sdist in sdists.items():
    in_sdist = _python_files_of_sdist(sdist)
    in_wheel = _python_files_of_wheel(wheels[name])
    assert in_sdist == in_wheel, (
      name,
      sorted(in_sdist ^ in_wheel),
    )
    assert any(n.endswith(".py") for n in in_sdist), name
    with tarfile.open(sdist) as tf:
      top = {n.split("/", 1)[1] for n in tf.getnames()}
    assert {"pyproject.toml", "PKG-INFO", "README.md", "LICENSE"} <= top, top
    wheel_has_ext = wheels[name].endswith("_x86_64.whl")
    assert ("setup.py" in top) == wheel_has_ext, (name, top)


def test_sdists_build_with_pip_and_pass_the_smoke_test(tmp_path):
  venv = tmp_path / "venv"
  subprocess.run(
    [sys.executable, "-m", "venv", str(venv)], check=True, env=clean_env()
  )
  python = str(venv / "bin" / "python")
  site = subprocess.run(
    [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
    check=True,
    capture_output=True,
    text=True,
  ).stdout.strip()
  with open(os.path.join(site, "_build_venv.pth"), "w") as f:
    f.write(sysconfig.get_paths()["purelib"] + "\n")
  sdists = _found("JAXWORKS_SDIST_DIRS", "*.tar.gz")
  names = ",".join(_dist(s).replace("_", "-") for s in sdists)
  out = subprocess.run(
    [
      python,
      "-m",
      "pip",
      "install",
      "--disable-pip-version-check",
      "--no-cache-dir",
      "-q",
      "--no-deps",
      "--no-binary",
      names,
      *sdists,
    ],
    capture_output=True,
    text=True,
    env=clean_env(),
    timeout=900,
  )
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  run = subprocess.run(
    [python, "-c", SMOKE],
    cwd=str(tmp_path),
    capture_output=True,
    text=True,
    env=dict(clean_env(), XLA_FLAGS="--xla_force_host_platform_device_count=8"),
  )
  assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
  assert "smoke ok" in run.stdout
  check = subprocess.run(
    [python, "-m", "pip", "check"],
    capture_output=True,
    text=True,
    env=clean_env(),
  )
  assert check.returncode == 0, check.stdout


if __name__ == "__main__":
  sys.exit(pytest.main([__file__]))
