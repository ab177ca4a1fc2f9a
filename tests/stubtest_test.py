"""The checked-in .pyi stub of every C++ extension agrees with the built extension (mypy's stubtest).

Extensions are found as the stubs beside them (packages/<pkg>/jaxworks/<pkg>/<module>.pyi, each required by the
pybind_extension macro), so a new extension is covered without editing this file.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest


def _root():
  srcdir = os.environ.get("TEST_SRCDIR")
  if srcdir:
    return pathlib.Path(srcdir) / os.environ.get("TEST_WORKSPACE", "jaxworks")
  return pathlib.Path(__file__).resolve().parent.parent


def _stubs():
  return sorted(
    p
    for p in _root().glob("packages/*/jaxworks/*/*.pyi")
    if p.with_suffix(".so").exists() or any(p.parent.glob(p.stem + "*.so"))
  )


def _module(stub):
  return f"jaxworks.{stub.parent.name}.{stub.stem}"


def _stubtest(modules, env=None):
  return subprocess.run(
    [sys.executable, "-m", "mypy.stubtest", "--ignore-missing-stub", *modules],
    capture_output=True,
    text=True,
    env=env,
    cwd=os.environ.get("TEST_TMPDIR", "/tmp"),
  )


def test_every_extension_has_a_stub():
  names = {_module(s) for s in _stubs()}
  assert {
    "jaxworks.jit_cache._signature",
    "jaxworks.batched_transfer._grouping",
    "jaxworks.batched_transfer._checked_read",
  } <= names, names


@pytest.mark.parametrize("stub", _stubs(), ids=_module)
def test_stub_matches_the_built_extension(stub):
  out = _stubtest([_module(stub)])
  assert out.returncode == 0, out.stdout + out.stderr


def test_stubtest_reports_a_drifted_stub(tmp_path):
  """A stub that names a function the extension lacks fails the check (so the check can fail)."""
  stub = next(s for s in _stubs() if s.parent.name == "jit_cache")
  package = tmp_path / "jaxworks" / "jit_cache"
  package.mkdir(parents=True)
  (package / "__init__.py").write_text("")
  so = next(stub.parent.glob(stub.stem + "*.so"))
  shutil.copy(so, package / so.name)
  (package / stub.name).write_text(
    stub.read_text() + "\ndef not_in_the_extension(x: int) -> int: ...\n"
  )
  env = dict(os.environ, PYTHONPATH=str(tmp_path), MYPYPATH=str(tmp_path))
  out = _stubtest([_module(stub)], env=env)
  assert out.returncode != 0 and "not_in_the_extension" in out.stdout, (
    out.stdout + out.stderr
  )
