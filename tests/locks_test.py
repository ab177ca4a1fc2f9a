"""The GPU and TPU locks: each extends requirements_lock.txt with the plugin wheels that match its jax.

`test_lock_resolves_and_installs` asks the package index (pip's resolver, nothing installed) whether every pin of a
lock resolves with exactly the lock's own set; it is the `locks_install_test` target, tagged manual (minutes, and the
index must be reachable): ./tools/bazel test //tests:locks_install_test_cpu
"""

import importlib.metadata
import json
import os
import pathlib
import re
import subprocess
import sys

from packaging.requirements import Requirement
import pytest


def _root():
  srcdir = os.environ.get("TEST_SRCDIR")
  if srcdir:
    return pathlib.Path(srcdir) / os.environ.get("TEST_WORKSPACE", "jaxworks")
  return pathlib.Path(__file__).resolve().parent.parent


def _norm(name):
  return re.sub(r"[-_.]+", "-", name).lower()


def _lock(name):
  pins = {}
  for line in (_root() / name).read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
      req, _, version = line.partition("==")
      pins[_norm(req)] = version
  return pins


BASE = _lock("requirements_lock.txt")
LOCKS = {"gpu": "requirements_gpu_lock.txt", "tpu": "requirements_tpu_lock.txt"}


def _jax_extra(extra):
  """jax's own requirements for an extra (e.g. libtpu==0.0.42.* for 'tpu')."""
  reqs = [Requirement(r) for r in importlib.metadata.requires("jax")]
  return {
    _norm(r.name): r.specifier
    for r in reqs
    if r.marker and r.marker.evaluate({"extra": extra})
  }


@pytest.mark.parametrize("kind", sorted(LOCKS))
def test_accelerator_lock_extends_the_base_lock(kind):
  lock = _lock(LOCKS[kind])
  for name, version in BASE.items():
    assert lock.get(name) == version, (
      f"{LOCKS[kind]}: {name} is {lock.get(name)}, requirements_lock.txt {version}"
    )


def test_gpu_lock_has_the_cuda_plugin_of_this_jax():
  lock, jax_version = _lock(LOCKS["gpu"]), BASE["jax"]
  for name, spec in _jax_extra("cuda12-local").items():
    assert name in lock and lock[name] in spec, (
      f"{name}{spec} (jax[cuda12-local]) vs lock {lock.get(name)}"
    )
  assert lock["jax-cuda12-plugin"] == lock["jax-cuda12-pjrt"] == jax_version


def test_tpu_lock_has_the_libtpu_of_this_jax():
  lock = _lock(LOCKS["tpu"])
  spec = _jax_extra("tpu")["libtpu"]
  assert lock["libtpu"] in spec, (
    f"libtpu{spec} (jax[tpu]) vs lock {lock['libtpu']}"
  )


@pytest.mark.parametrize("kind", sorted(LOCKS))
def test_lock_resolves_and_installs(kind, tmp_path):
  report = tmp_path / "report.json"
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "pip",
      "install",
      "--dry-run",
      "--ignore-installed",
      "--quiet",
      "--disable-pip-version-check",
      "--report",
      str(report),
      "-r",
      str(_root() / LOCKS[kind]),
    ],
    capture_output=True,
    text=True,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  resolved = {
    _norm(i["metadata"]["name"]): i["metadata"]["version"]
    for i in json.loads(report.read_text())["install"]
  }
  assert resolved == _lock(LOCKS[kind]), set(resolved.items()) ^ set(
    _lock(LOCKS[kind]).items()
  )
