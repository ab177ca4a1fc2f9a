"""jaxworks_bench: the row schema refuses what it should, timing helpers time."""

import argparse
import io
import json
import math
import os
import re
import sys

import jaxworks_bench as jb
import pytest


def _row(**changes):
  row = jb.make_row(
    "jit_cache", "cached call", 1e-3, 2e-3, "stock-jax", "jax.jit", goal=1.5
  )
  row.update(changes)
  return row


def test_make_row_computes_speedup_and_met():
  row = _row()
  assert list(row) == list(jb.ROW_FIELDS)
  assert row["speedup"] == pytest.approx(2.0)
  assert row["met"] is True
  slower = jb.make_row(
    "p", "c", 2e-3, 1e-3, "peer", "equinox.filter_jit", goal=1 / 1.05
  )
  assert slower["speedup"] == pytest.approx(0.5) and slower["met"] is False
  no_goal = jb.make_row("p", "c", 1.0, 1.0, "naive", "a walk")
  assert no_goal["goal"] is None and no_goal["met"] is None


@pytest.mark.parametrize(
  "changes, message",
  [
    ({"reference": "stock"}, "reference='stock'"),
    ({"reference": "python twin"}, "ablation"),
    ({"speedup": 0.5}, "speedup is always reference / jaxworks"),
    ({"met": False}, "met is speedup >= goal"),
    ({"goal": None}, "without a goal"),
    ({"jaxworks_s": 0.0}, "jaxworks_s=0.0"),
    ({"reference_s": math.nan}, "reference_s=nan"),
    ({"reference_name": ""}, "reference_name=''"),
    ({"extra": 1}, "unknown fields ['extra']"),
  ],
)
def test_a_bad_row_is_refused(changes, message):
  with pytest.raises(jb.SchemaError, match=re.escape(message)):
    jb.validate_row(_row(**changes))


@pytest.mark.parametrize("field", jb.ROW_FIELDS)
def test_a_row_missing_a_field_is_refused(field):
  row = _row()
  del row[field]
  with pytest.raises(jb.SchemaError, match=f"missing fields \\['{field}'\\]"):
    jb.validate_row(row)


def test_make_row_refuses_an_unknown_reference_kind():
  with pytest.raises(
    jb.SchemaError, match="use one of stock-jax, peer, ablation, naive"
  ):
    jb.make_row("p", "c", 1.0, 2.0, "baseline", "x")


def test_report_writes_a_valid_document_and_prints_yes_no(tmp_path, capsys):
  parser = jb.add_arguments(argparse.ArgumentParser())
  path = tmp_path / "out" / "x.json"
  args = parser.parse_args(["--quick", "--json", str(path)])
  report = jb.Report("jit_cache", benchmark="x_bench")
  report.add("fast", 1e-6, 3e-6, "stock-jax", "jax.jit", goal=2.0)
  report.add("slow", 3e-6, 1e-6, "ablation", "Python twin", goal=2.0)
  report.note("a note")
  with pytest.raises(jb.SchemaError, match="twice"):
    report.add("fast", 1.0, 1.0, "naive", "x")
  report.finish(args)
  out = capsys.readouterr().out
  assert (
    "| fast | 1.00 us | stock-jax: jax.jit | 3.00 us | 3x | >= 2x | yes |"
    in out
  )
  assert (
    "| slow | 3.00 us | ablation: Python twin | 1.00 us | 0.333x | >= 2x | no |"
    in out
  )
  doc = jb.validate_document(json.loads(path.read_text()))
  assert doc["quick"] is True and doc["benchmark"] == "x_bench"
  assert [r["case"] for r in doc["rows"]] == ["fast", "slow"]
  assert doc["notes"] == ["a note"]


def test_a_document_with_a_foreign_or_repeated_row_is_refused():
  report = jb.Report("jit_cache", "b")
  report.add("a", 1.0, 1.0, "naive", "x")
  doc = report.document()
  doc["rows"].append(dict(doc["rows"][0]))
  with pytest.raises(jb.SchemaError, match="repeated cases"):
    jb.validate_document(doc)
  doc["rows"] = [dict(doc["rows"][0], package="axis_names")]
  with pytest.raises(jb.SchemaError, match="in a document of 'jit_cache'"):
    jb.validate_document(doc)
  with pytest.raises(jb.SchemaError, match="no rows"):
    jb.validate_document(dict(doc, rows=[]))


def test_timing_helpers():
  calls = []
  t = jb.per_call(lambda: calls.append(1), inner=5)
  assert len(calls) == 5 and t > 0
  calls.clear()
  jb.median_time(
    lambda: calls.append(1), repeats=3, inner=2, setup=lambda: calls.append(0)
  )
  assert calls == [0, 1, 1] * 3
  order = []
  jb.median_pair(
    lambda: order.append("o"), lambda: order.append("r"), repeats=2
  )
  assert order == ["o", "r", "r", "o"]  # alternating which goes first
  with pytest.raises(ValueError, match="inner=0"):
    jb.per_call(lambda: None, inner=0)


def test_run_fresh_returns_the_last_json_line():
  wall, value = jb.run_fresh(
    "import json, jaxworks_bench; print('x'); print(json.dumps([1, 2]))"
  )
  assert value == [1, 2] and wall > 0
  with pytest.raises(RuntimeError, match="exited 3"):
    jb.run_fresh("raise SystemExit(3)")


@pytest.mark.parametrize(
  "seconds, text",
  [
    (1.5, "1.50 s"),
    (0.0123, "12.3 ms"),
    (2.07e-4, "207 us"),
    (5e-9, "5.00 ns"),
  ],
)
def test_fmt_seconds(seconds, text):
  assert jb.fmt_seconds(seconds) == text


def test_a_relative_json_path_goes_to_test_tmpdir_under_bazel_test(
  tmp_path, monkeypatch
):
  monkeypatch.delenv("BUILD_WORKING_DIRECTORY", raising=False)
  monkeypatch.setenv("TEST_TMPDIR", str(tmp_path))
  report = jb.Report("p", "b")
  report.add("c", 1.0, 2.0, "stock-jax", "jax.jit")
  report.finish(json_path="rows.json", file=io.StringIO())
  assert jb.validate_document(json.loads((tmp_path / "rows.json").read_text()))
  monkeypatch.setenv("BUILD_WORKING_DIRECTORY", str(tmp_path / "ws"))
  report.finish(json_path="rows.json", file=io.StringIO())
  assert (tmp_path / "ws" / "rows.json").exists()


def test_timed_call_returns_the_result():
  seconds, value = jb.timed_call(lambda: [1, 2])
  assert value == [1, 2] and seconds >= 0


def test_median_interleaved_rotates_the_order():
  order = []
  fns = {k: (lambda k=k: order.append(k)) for k in "abc"}
  out = jb.median_interleaved(fns, repeats=3, warmup=True)
  assert sorted(out) == ["a", "b", "c"] and all(t > 0 for t in out.values())
  assert order == list("abc") + list("abc") + list("bca") + list("cab")


def test_median_interleaved_rotates_only_the_first_k():
  order = []
  fns = {k: (lambda k=k: order.append(k)) for k in "abcd"}
  out = jb.median_interleaved(fns, repeats=3, rotate=2)
  assert sorted(out) == list("abcd")
  assert order == list("abcd") + list("bacd") + list("abcd")


def test_median_interleaved_settles_after_each_timed_call():
  order = []
  fns = {k: (lambda k=k: order.append(k)) for k in "ab"}
  jb.median_interleaved(
    fns, repeats=2, warmup=True, settle=lambda: order.append("-")
  )
  assert order == list("ab") + list("a-b-") + list("b-a-")


def test_fresh_env_caches_bytecode_in_one_directory_per_run(monkeypatch):
  monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
  env = jb.fresh_env({"X_EXTRA": "1"})
  assert "PYTHONDONTWRITEBYTECODE" not in env
  assert os.path.isdir(env["PYTHONPYCACHEPREFIX"])
  assert jb.fresh_env()["PYTHONPYCACHEPREFIX"] == env["PYTHONPYCACHEPREFIX"]
  assert env["X_EXTRA"] == "1"
  assert env["PYTHONPATH"].split(os.pathsep)[0] == next(
    p for p in sys.path if p
  )
  _, written = jb.run_fresh(
    "import sys, json; print(json.dumps(sys.dont_write_bytecode))"
  )
  assert written is False


def test_median_pair_fresh_releases_memory_before_each_timed_call(
  monkeypatch,
):
  calls = []
  monkeypatch.setattr(jb, "release_memory", lambda: calls.append("release"))
  jb.median_pair(
    lambda: calls.append("ours"),
    lambda: calls.append("ref"),
    2,
    fresh=True,
  )
  # Alternating which side goes first, each timed call after a release.
  assert calls == ["release", "ours", "release", "ref"] + [
    "release",
    "ref",
    "release",
    "ours",
  ]
  calls.clear()
  jb.median_pair(lambda: None, lambda: None, 2)
  assert calls == []


def test_a_row_with_a_limit_keeps_the_fraction_reached(capsys):
  row = jb.make_row(
    "p", "put", 2.0, 3.0, "stock-jax", "jax.device_put", limit=("link", 1.5)
  )
  assert row["limit"] == "link" and row["limit_fraction"] == 0.75
  table = jb.markdown_table([row, _row()])
  assert table.splitlines()[0].endswith("| met | of its limit |")
  assert "| 75% (link) |" in table and table.endswith("| yes | - |")
  assert "of its limit" not in jb.markdown_table([_row()])  # as before
  for bad, message in [
    ({"limit_fraction": 0.5}, "come together"),
    ({"limit": "link", "limit_fraction": -1.0}, "limit_fraction=-1.0"),
    ({"limit": "", "limit_fraction": 0.5}, "limit=''"),
  ]:
    with pytest.raises(jb.SchemaError, match=re.escape(message)):
      jb.validate_row(_row(**bad))


def test_a_document_names_its_platform():
  report = jb.Report("jit_cache", "b", platform="tpu")
  report.add("a", 1.0, 1.0, "naive", "x")
  doc = report.document()
  assert doc["platform"] == "tpu" and jb.document_platform(doc) == "tpu"
  old = dict(doc)
  del old["platform"]  # documents written before platforms: cpu
  assert jb.document_platform(jb.validate_document(old)) == "cpu"
  with pytest.raises(jb.SchemaError, match="platform 'npu'"):
    jb.validate_document(dict(doc, platform="npu"))
  assert jb.results_name("b") == "b.json"
  assert jb.results_name("b", "tpu") == "b_tpu.json"


def test_the_platform_comes_from_the_arguments_or_the_parent(monkeypatch):
  monkeypatch.delenv("JAXWORKS_BENCH_PLATFORM", raising=False)
  assert jb.requested_platform([]) == "cpu"
  assert jb.requested_platform(["--quick", "--platform", "tpu"]) == "tpu"
  assert jb.requested_platform(["--platform=gpu"]) == "gpu"
  with pytest.raises(SystemExit, match="choose one of cpu, tpu, gpu"):
    jb.requested_platform(["--platform", "npu"])
  monkeypatch.setenv("JAXWORKS_BENCH_PLATFORM", "tpu")  # set by a parent
  assert jb.requested_platform([]) == "tpu"


def test_configure_devices_forces_host_devices_on_cpu_only(monkeypatch):
  for var in ("XLA_FLAGS", "JAX_PLATFORMS", "JAXWORKS_BENCH_PLATFORM"):
    monkeypatch.delenv(var, raising=False)
  assert jb.configure_devices(argv=["--platform", "tpu"]) == "tpu"
  assert "XLA_FLAGS" not in os.environ and "JAX_PLATFORMS" not in os.environ
  assert os.environ["JAXWORKS_BENCH_PLATFORM"] == "tpu"  # for its children
  monkeypatch.delenv("JAXWORKS_BENCH_PLATFORM")
  assert jb.configure_devices(host_devices=4, cpu_only=True, argv=[]) == "cpu"
  assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
  assert os.environ["JAX_PLATFORMS"] == "cpu"


def test_budget():
  assert jb.Budget().left() == math.inf and jb.Budget().until() is None
  import time  # pylint: disable=import-outside-toplevel

  budget = jb.Budget(10, start=time.monotonic() - 9)
  assert budget.fits(0.5) and not budget.fits(2)
  assert time.monotonic() < budget.until(0.5) < time.monotonic() + 0.6


def test_a_deadline_stops_the_repeats_after_the_minimum():
  calls = []
  fns = {k: (lambda k=k: calls.append(k)) for k in "ab"}
  jb.median_interleaved(fns, repeats=9, deadline=0.0, min_repeats=2)
  assert len(calls) == 4
  calls.clear()
  jb.median_pair(
    lambda: calls.append("o"), lambda: calls.append("r"), 9, deadline=0.0
  )
  assert len(calls) == 6  # min_repeats defaults to 3


def test_a_section_that_fails_or_does_not_fit_is_noted(capsys):
  report = jb.Report("p", "b")

  def broken():
    raise ValueError("no chip")

  assert report.section("broken", broken) is None
  assert report.section("ok", lambda x: x + 1, 1) == 2
  assert report.section("late", broken, budget=jb.Budget(0), min_s=5) is None
  assert report.notes == [
    "FAILED: broken: ValueError: no chip",
    "skipped: late (the time budget: 0 s left, it needs about 5 s)",
  ]
  assert report.exit_status() == 1
  assert "ValueError: no chip" in capsys.readouterr().err  # the traceback
  empty = jb.Report("p", "b")
  assert empty.finish(file=io.StringIO()) is None  # no rows: nothing written
  assert empty.exit_status() == 1


def test_a_budget_signal_writes_the_rows_measured(tmp_path):
  code = """
import os, signal, sys
import jaxworks_bench as jb
report = jb.Report("p", "b")
report.add("a", 1.0, 2.0, "naive", "x")
report.finish_on_signal(json_path=sys.argv[1])
os.kill(os.getpid(), signal.SIGTERM)
"""
  path = tmp_path / "rows.json"
  proc = jb.run_process(
    [sys.executable, "-c", code, str(path)], env=jb.fresh_env()
  )
  assert proc.returncode == 124, proc.stderr
  doc = jb.validate_document(json.loads(path.read_text()))
  assert [r["case"] for r in doc["rows"]] == ["a"]
  assert doc["notes"][0].startswith("stopped by signal 15")


def test_a_program_refused_the_device_is_started_again(tmp_path):
  code = """
import pathlib, sys
mark = pathlib.Path(sys.argv[1])
if not mark.exists():
  mark.write_text("1")
  sys.exit("RuntimeError: Internal error when accessing libtpu "
           "multi-process lockfile")
print("ran")
"""
  mark = tmp_path / "mark"
  cmd = [sys.executable, "-c", code, str(mark)]
  proc = jb.run_process(cmd, busy_wait_s=0)
  assert proc.returncode == 0 and proc.stdout == "ran\n"
  mark.unlink()
  assert jb.run_process(cmd, busy_retries=0).returncode == 1
  assert jb.device_busy("TPU is already in use") and not jb.device_busy("x")
