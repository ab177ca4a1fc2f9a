"""Tests of tools/test_summary.py: only this invocation's results count."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_summary  # noqa: E402

_XML = """<?xml version="1.0"?>
<testsuites><testsuite name="pytest">{}</testsuite></testsuites>"""


def _case(name, inner=""):
  return f'<testcase classname="t_test" name="{name}">{inner}</testcase>'


def _write(tmp_path, name, text):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def _bep(tmp_path, results):
  """results: (label, status, xml path or None)."""
  lines = [json.dumps({"id": {"started": {}}})]
  for label, status, xml in results:
    outputs = [{"name": "test.log", "uri": "file:///nowhere/test.log"}]
    if xml is not None:
      outputs.append({"name": "test.xml", "uri": "file://" + xml})
    lines.append(
      json.dumps(
        {
          "id": {"testResult": {"label": label, "run": 1}},
          "testResult": {"testActionOutput": outputs, "status": status},
        }
      )
    )
  return _write(tmp_path, "bep.json", "\n".join(lines) + "\n")


def test_counts_cases_of_reported_targets_only(tmp_path):
  good = _write(tmp_path, "a.xml", _XML.format(_case("a") + _case("b")))
  # A leftover JUnit file of another target, not reported by this run.
  _write(tmp_path, "stale.xml", _XML.format(_case("x", "<failure/>")))
  s = test_summary.summarize([_bep(tmp_path, [("//p:a", "PASSED", good)])], {})
  assert (s.passed, s.failed, s.skipped, s.problems) == (2, 0, 0, [])
  assert s.line() == "tests: 2 passed, 0 failed, 0 skipped"


def test_failure_and_error_cases_fail(tmp_path):
  xml = _write(
    tmp_path,
    "a.xml",
    _XML.format(_case("a", "<failure/>") + _case("b", "<error/>") + _case("c")),
  )
  s = test_summary.summarize([_bep(tmp_path, [("//p:a", "FAILED", xml)])], {})
  assert (s.passed, s.failed) == (1, 2)


def test_failed_target_without_junit_counts_as_failed(tmp_path):
  bep = _bep(tmp_path, [("//p:a", "TIMEOUT", None)])
  s = test_summary.summarize([bep], {})
  assert s.failed == 1
  assert any("TIMEOUT" in p for p in s.problems)


def test_skip_off_the_allowlist_is_a_problem(tmp_path):
  xml = _write(
    tmp_path,
    "a.xml",
    _XML.format(
      _case("a", '<skipped message="needs 8 devices"/>') + _case("b")
    ),
  )
  bep = _bep(tmp_path, [("//p:a", "PASSED", xml)])
  s = test_summary.summarize([bep], {})
  assert s.skipped == 1
  assert len(s.problems) == 1 and "t_test::a" in s.problems[0]
  assert test_summary.main([bep]) == 1


def test_allowlisted_skip_passes(tmp_path):
  xml = _write(
    tmp_path, "a.xml", _XML.format(_case("a", '<skipped message="gpu only"/>'))
  )
  bep = _bep(tmp_path, [("//p:a", "PASSED", xml)])
  allow = _write(
    tmp_path, "allow.txt", "# comment\n//p:a t_test::a  # GPU only\n"
  )
  assert test_summary.main([bep, "--allowlist", allow]) == 0
  star = _write(tmp_path, "star.txt", "//p:a *  # every case\n")
  assert test_summary.main([bep, "--allowlist", star]) == 0


def test_allowlist_entry_needs_a_reason(tmp_path):
  allow = _write(tmp_path, "allow.txt", "//p:a t_test::a\n")
  try:
    test_summary.read_allowlist(allow)
  except ValueError as e:
    assert "allow.txt:1" in str(e)
  else:
    raise AssertionError("an entry without a reason was accepted")


def test_no_test_ran_fails(tmp_path):
  bep = _bep(tmp_path, [])
  assert test_summary.main([bep]) == 1


def test_repository_allowlist_parses():
  root = os.environ.get("TEST_SRCDIR")
  path = None
  if root:
    candidate = os.path.join(
      root, os.environ.get("TEST_WORKSPACE", ""), "tests", "skip_allowlist.txt"
    )
    if os.path.exists(candidate):
      path = candidate
  if path is None:
    path = os.path.join(
      os.path.dirname(__file__), "..", "tests", "skip_allowlist.txt"
    )
  allowed = test_summary.read_allowlist(path)
  assert isinstance(allowed, dict)
