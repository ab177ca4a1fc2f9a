"""//benchmarks:all --quick --no-render runs every listed benchmark; each writes a valid JSON document."""

import json
import os
import pathlib
import subprocess
import sys

import jaxworks_bench as jb


def _runfiles():
  for var in ("RUNFILES_DIR", "TEST_SRCDIR"):
    path = os.environ.get(var)
    if path and pathlib.Path(path, "jaxworks").is_dir():
      return pathlib.Path(path)
  here = pathlib.Path(os.path.abspath(__file__))  # runfiles are symlinks
  return next(p for p in here.parents if p.name.endswith(".runfiles"))


def test_every_benchmark_writes_valid_rows(tmp_path):
  runfiles = _runfiles()
  listed = [
    tuple(line.split(":"))
    for line in (runfiles / "jaxworks/benchmarks/benchmarks.txt")
    .read_text()
    .split()
  ]
  env = dict(os.environ, RUNFILES_DIR=str(runfiles))
  out = subprocess.run(
    [
      sys.executable,
      str(runfiles / "jaxworks/benchmarks/all"),
      "--quick",
      "--no-render",
      "--results",
      str(tmp_path),
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=900,
    check=False,
  )
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
  for package, name in listed:
    path = tmp_path / f"{name}.json"
    assert path.exists(), f"{name} wrote no {path.name}:\n{out.stdout[-3000:]}"
    doc = jb.validate_document(json.loads(path.read_text()))
    assert doc["package"] == package and doc["benchmark"] == name
    assert doc["quick"] is True
