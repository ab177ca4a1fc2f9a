"""Tests of tools/hardware_tests.py: its target list is Bazel's, kept fresh.

``tools/hardware_targets.json`` must be what ``//tools:hardware_targets_query``
says now (the figures_test pattern: a checked-in output of the build,
compared with a fresh one); the runner reads every accelerator target from it
and counts pytest's JUnit results for the target that owns each file.
"""

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import hardware_tests  # noqa: E402

REGENERATE = (
  "./tools/bazel build //tools:hardware_targets_query && python3 "
  "tools/hardware_tests.py --update-targets "
  "bazel-bin/tools/hardware_targets_query"
)


def test_the_checked_in_targets_are_what_bazel_queries_now(tmp_path):
  fresh = os.environ.get("HARDWARE_TARGETS_QUERY")
  if not fresh:
    pytest.skip("runs under Bazel (//tools:hardware_tests_test_cpu)")
  hardware_tests.write_targets(fresh, str(tmp_path / "fresh.json"))
  want = (tmp_path / "fresh.json").read_text()
  path = os.path.join(hardware_tests.ROOT, hardware_tests.TARGETS)
  with open(path, encoding="utf-8") as f:
    have = f.read()
  assert have == want, (
    f"{hardware_tests.TARGETS} differs from Bazel's query of the gpu/tpu "
    f"targets (a test target changed): run `{REGENERATE}` and check it in"
  )


def test_every_accelerator_target_is_read_with_its_files():
  targets = hardware_tests.load_targets()
  for backend in hardware_tests.BACKENDS:
    chosen = hardware_tests.select(targets, backend)
    assert len(chosen) >= 30, (backend, len(chosen))
    for t in chosen:
      assert t.files, t.label
      for f in t.files + t.data:
        assert os.path.isfile(os.path.join(hardware_tests.ROOT, f)), (t, f)
  by = {t.label: t for t in targets}
  api = by["//packages/jit_cache:api_test_tpu"]
  assert api.env == {"JAX_PLATFORMS": "tpu,cpu"}
  assert api.files == ["packages/jit_cache/tests/api_test.py"]
  assert (api.args, api.size, api.timeout()) == ([], "medium", 300)
  assert by["//packages/jit_cache:api_test_gpu"].env == {
    "JAX_PLATFORMS": "cuda,cpu"
  }
  assert not any(t.label.endswith("_cpu") for t in targets)


_JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="pkg.tests.a_test" name="test_one" file="pkg/tests/a_test.py"
  time="0.5"/>
<testcase classname="pkg.tests.a_test.TestKind" name="test_two[x]"
  file="pkg/tests/a_test.py" time="0.25">
  <skipped type="pytest.skip" message="needs 8 devices; cpu has 1">why</skipped>
</testcase>
<testcase classname="pkg.tests.a_test_more" name="test_other"
  file="pkg/tests/a_test_more.py" time="1">
  <failure message="assert 1 == 2">def test_other():
&gt;   assert 1 == 2
E   assert 1 == 2</failure>
</testcase>
<testcase classname="other.tests.c_test" name="other.tests.c_test" time="0">
  <error message="collection failure">ImportError: no_such_module_here</error>
</testcase>
</testsuite></testsuites>
"""


def test_results_are_counted_for_the_target_owning_each_file(tmp_path):
  def target(label, *files):
    return hardware_tests.Target(label, list(files), [], {}, "small", [], [])

  targets = [
    target("//pkg:a_test_tpu", "pkg/tests/a_test.py", "pkg/tests/helper.py"),
    target("//pkg:more_test_tpu", "pkg/tests/a_test_more.py"),
    target("//pkg:helper_test_tpu", "pkg/tests/helper.py"),
    target("//other:c_test_tpu", "other/tests/c_test.py"),
  ]
  junit = tmp_path / "junit.xml"
  junit.write_text(_JUNIT)
  results = {t.label: hardware_tests.Result(t) for t in targets}
  hardware_tests.count(str(junit), targets, results)
  counts = {
    label: (r.passed, r.failed, r.skipped, r.status)
    for label, r in results.items()
  }
  assert counts == {
    "//pkg:a_test_tpu": (1, 0, 1, "passed"),
    "//pkg:more_test_tpu": (0, 1, 0, "failed"),
    "//pkg:helper_test_tpu": (0, 0, 0, "passed"),
    "//other:c_test_tpu": (0, 1, 0, "failed"),
  }
  a = results["//pkg:a_test_tpu"]
  assert a.skips == {"needs 8 devices; cpu has 1": 1}
  assert a.seconds == 0.75
  more = results["//pkg:more_test_tpu"].failures[0]
  assert more.startswith("pkg.tests.a_test_more::test_other\n")
  assert more.endswith("E   assert 1 == 2")
  assert "no_such_module_here" in results["//other:c_test_tpu"].failures[0]
