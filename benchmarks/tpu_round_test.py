"""The TPU round, tried on one CPU device.

``run_all.py --no-bazel --platform tpu --quick`` runs every benchmark's
accelerator profile from the source tree, one process each, as the round on
a TPU machine does, where no TCP socket opens (the runner's probe says no, as
there). Every benchmark must finish within the budget and write valid rows
marked ``tpu``; the rendered report gets a section of its own for them while
the reference rows render as before.
"""

import contextlib
import io
import json
import os
import pathlib
import shutil

import jaxworks_bench as jb
import pytest
import render
import run_all

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
#: The benchmarks the round runs on a TPU machine (object_store_bench needs
#: a TCP socket: skipped there, and tested here by its skip).
ROUND = [
  "batched_transfer_bench",
  "jit_cache_bench",
  "train_step_bench",
  "pmap_chunked_bench",
  "stages_aot_bench",
  "axis_names_bench",
  "training_loop_bench",
]


def _runfiles_root():
  for var in ("RUNFILES_DIR", "TEST_SRCDIR"):
    path = os.environ.get(var)
    if path and pathlib.Path(path, "jaxworks", "benchmarks").is_dir():
      return pathlib.Path(path, "jaxworks")
  return ROOT


@pytest.fixture(scope="module")
def round_out(tmp_path_factory):
  """Runs the round once; (exit status, output, results directory)."""
  out = tmp_path_factory.mktemp("round")
  env = {
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
  }
  old = {k: os.environ.get(k) for k in env}
  sockets_work = run_all.sockets_work
  text = io.StringIO()
  try:
    run_all.sockets_work = lambda: False  # as on the TPU machine
    os.environ.update(env)
    with contextlib.redirect_stdout(text):
      rc = run_all.main(
        [
          "--no-bazel",
          "--platform",
          "tpu",
          "--quick",
          "--root",
          str(_runfiles_root()),
          "--out",
          str(out / "results"),
          "--budget-s",
          "900",
          "--log",
          str(out / "round.log"),
        ]
      )
  finally:
    run_all.sockets_work = sockets_work
    for k, v in old.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
  return rc, text.getvalue(), out / "results"


def test_the_round_completes_on_one_device(round_out):
  rc, text, results = round_out
  assert rc == 0, text[-6000:]
  names = sorted(p.name for p in results.glob("*.json"))
  assert names == sorted(f"{b}_tpu.json" for b in ROUND), text[-3000:]
  for name in names:
    doc = jb.validate_document(json.loads((results / name).read_text()))
    assert doc["platform"] == "tpu" and doc["quick"] is True
    assert doc["machine"]["devices"] == "1 cpu", doc["machine"]
  assert "object_store_bench skipped: it needs a TCP socket" in text
  assert "summary (speedup = reference / jaxworks" in text


def test_the_issue_rows_are_there_with_their_goals_and_limits(round_out):
  _, _, results = round_out

  def rows(name):
    doc = json.loads((results / f"{name}_tpu.json").read_text())
    return {r["case"]: r for r in doc["rows"]}, doc["notes"]

  bt, notes = rows("batched_transfer_bench")
  put, restore = "numpy -> the chip", "16 .npy files, 64 MiB -> the chip"
  save, get = "16 leaves, 64 MiB, from the chip", "jax.device_get"
  expected = {
    f"device_put 16 leaves of 4 MiB {put}": 1.0,
    f"device_put 16 leaves of 4 MiB {put} (vs one transfer of the same "
    "bytes)": 0.95,
    f"device_put 100 leaves of 4 KiB {put}": 1.5,
    f"restore {restore}": 1.05,
    f"restore {restore} (vs orbax)": 2.0,
    f"save {save} (vs {get} + numpy.save + fsync)": 1.2,
    f"save {save} (vs orbax)": 3.0,
  }
  assert {c: r["goal"] for c, r in bt.items() if r["goal"]} == expected
  for case in expected:
    assert bt[case]["limit_fraction"] > 0, bt[case]
  assert any(
    n.startswith("skipped: restore of a checkpoint two") for n in notes
  )
  jc, _ = rows("jit_cache_bench")
  for n in (1, 10, 100):
    assert jc[f"cached call, {n} array args"]["goal"] == 1.0
  ts, _ = rows("train_step_bench")
  warm = [c for c in ts if c.startswith("warm start of a new process")]
  sweep = [c for c in ts if c.startswith("sweep of 3 configurations")]
  assert warm and ts[warm[0]]["goal"] == 1.0
  assert sweep and ts[sweep[0]]["goal"] == 30.0


def test_the_report_gets_a_tpu_section(round_out, tmp_path):
  _, _, results = round_out
  src = _runfiles_root()
  for rel in ["README.md", "BENCHMARKS.md", "benchmarks/BUILD.bazel"] + [
    f"packages/{p}/README.md" for p in ("axis_names", "batched_transfer",
                                        "jit_cache", "pmap_chunked",
                                        "stages_aot")
  ]:  # fmt: skip
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / rel, tmp_path / rel)
  shutil.copytree(src / render.RESULTS, tmp_path / render.RESULTS)
  before = (tmp_path / "BENCHMARKS.md").read_text()
  for f in results.glob("*.json"):
    shutil.copy(f, tmp_path / render.RESULTS / f.name)
  packages = sorted({p for p, _ in render.listed_benchmarks(tmp_path)})
  render.render_all(tmp_path, packages, chart=False)
  after = (tmp_path / "BENCHMARKS.md").read_text()
  # The reference (CPU) part, before the checked-in TPU section if any.
  cpu_part = before.split("\n## On a TPU\n")[0].rstrip("\n")
  assert after.startswith(cpu_part), "the cpu part changed"
  tail = after[len(cpu_part) :]
  assert "\n## On a TPU\n" in tail
  assert "--platform tpu" in tail and "**not a tpu" in tail
  assert "of its limit" in tail
  readme = (tmp_path / "packages/jit_cache/README.md").read_text()
  assert "On a TPU (" in readme and "BENCHMARKS.md#on-a-tpu" in readme
  assert render.check(tmp_path, packages) == []
