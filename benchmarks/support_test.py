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
