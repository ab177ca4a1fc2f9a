"""//benchmarks:all runs a listed benchmark with --json and refuses unknown ones.

Every benchmark also runs alone with --quick --json as its own
`<name>_smoke_cpu` test (jaxworks_benchmark), which validates its rows; this
test covers the runner: one quick benchmark into TEST_TMPDIR, no rendering.
"""

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


RUNFILES = _runfiles()


def _run_all(*args):
  return subprocess.run(
    [sys.executable, str(RUNFILES / "jaxworks/benchmarks/all"), *args],
    env=dict(os.environ, RUNFILES_DIR=str(RUNFILES)),
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )


def test_every_benchmark_is_in_the_runfiles():
  listed = (RUNFILES / "jaxworks/benchmarks/benchmarks.txt").read_text().split()
  assert len(listed) >= 5, listed
  for entry in listed:
    package, name = entry.split(":")
    assert (RUNFILES / "jaxworks/packages" / package / name).exists(), entry


def test_one_benchmark_writes_valid_rows(tmp_path):
  out = _run_all(
    "--only",
    "axis_names_bench",
    "--quick",
    "--no-render",
    "--results",
    str(tmp_path),
  )
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
  assert "[1/1] axis_names:axis_names_bench ... ok" in out.stdout
  assert sorted(p.name for p in tmp_path.iterdir()) == ["axis_names_bench.json"]
  doc = jb.validate_document(
    json.loads((tmp_path / "axis_names_bench.json").read_text())
  )
  assert doc["package"] == "axis_names" and doc["quick"] is True
  kinds = {r["reference"] for r in doc["rows"]}
  assert kinds == {"stock-jax", "naive"}, kinds


def test_an_unknown_benchmark_is_refused(tmp_path):
  out = _run_all(
    "--only", "nope_bench", "--no-render", "--results", str(tmp_path)
  )
  assert out.returncode == 2
  assert "--only: unknown ['nope_bench']" in out.stderr


def test_a_platform_needs_no_bazel(tmp_path):
  out = _run_all("--platform", "tpu", "--no-render", "--results", str(tmp_path))
  assert out.returncode == 2
  assert "--platform and --budget-s go with --no-bazel" in out.stderr
