"""Tests of tools/hardware_tests.py: Bazel's targets, and runs on the CPU.

The runner reads the ``jaxworks_test`` calls of the BUILD files; Bazel's own
view of the ``_gpu`` and ``_tpu`` targets (the genquery
``//tools:hardware_targets_query``) must be the same, attribute for
attribute. A made-up repository's targets then run on one CPU device: passes,
skips naming the devices they need, a failure, a crash, a timeout and a
collection error, each counted for its own target.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import hardware_tests  # noqa: E402

ROOT = hardware_tests.ROOT
# The packages whose test suites //tools:hardware_targets_query asks about.
QUERIED = {
  *(f"packages/{p}" for p in ("axis_names", "batched_transfer")),
  *(f"packages/{p}" for p in ("jit_cache", "pmap_chunked", "stages_aot")),
  "tests",
  "tests/integration",
}


def _label_path(label):
  pkg, _, name = label[2:].partition(":")
  return f"{pkg}/{name}" if pkg else name


def _bazel_targets():
  """label -> attributes of each test rule genquery found."""
  path = os.environ.get("HARDWARE_TARGETS_QUERY")
  if not path:
    pytest.skip("runs under Bazel (//tools:hardware_tests_test_cpu)")
  out = {}
  for rule in ET.parse(path).getroot().iter("rule"):
    attrs = {}
    for child in rule:
      name = child.get("name")
      if child.tag == "list":
        attrs[name] = [v.get("value") for v in child]
      elif child.tag == "dict":
        attrs[name] = {
          pair[0].get("value"): pair[1].get("value") for pair in child
        }
      elif child.tag in ("string", "label"):
        attrs[name] = child.get("value")
    out[rule.get("name")] = attrs
  return out


def _runner_targets():
  targets = hardware_tests.load_targets()
  return {
    t.label: t
    for backend in ("gpu", "tpu")
    for t in hardware_tests.select(targets, backend)
  }


def test_the_runners_targets_are_bazels():
  bazel, ours = _bazel_targets(), _runner_targets()
  assert bazel, "the query found no _gpu/_tpu target"
  assert sorted(ours) == sorted(bazel)
  main = "//tools/build_defs:pytest_main.py"
  for label, t in ours.items():
    b = bazel[label]
    srcs = [_label_path(s) for s in b["srcs"] if s != main]
    assert t.srcs == srcs, label
    assert t.args == b["args"], label
    assert t.env == b["env"], label
    assert sorted(t.tags) == sorted(b["tags"]), label
    assert t.size == b.get("size", "medium"), label
    data = sorted(_label_path(d) for d in b["data"] if d.startswith("//"))
    assert sorted(d for d in t.data if not d.startswith("@")) == data, label
    pypi = {
      d.split("//")[1].split(":")[0]
      for d in b["deps"]
      if d.startswith("@pypi_dev//")
    }
    assert {p.lower().replace("-", "_") for p in t.pypi} == pypi - {"pytest"}, (
      label
    )


def test_accelerator_targets_are_only_in_queried_packages():
  outside = [
    label for label, t in _runner_targets().items() if t.package not in QUERIED
  ]
  assert not outside, (
    f"{outside}: add their packages' gpu/tpu suites to _HARDWARE_SUITES in "
    "tools/BUILD.bazel and to QUERIED here"
  )


def test_every_build_file_reads():
  files = hardware_tests.build_files()
  assert "tools/BUILD.bazel" in files
  targets = hardware_tests.load_targets()
  labels = {t.label for t in targets}
  assert "//tools:hardware_tests_test_cpu" in labels
  assert "//packages/jit_cache:api_test_tpu" in labels
  api = next(t for t in targets if t.label.endswith("jit_cache:api_test_tpu"))
  assert api.env == {"JAX_PLATFORMS": "tpu,cpu"}
  assert api.files() == ["packages/jit_cache/tests/api_test.py"]


# -- runs on the CPU -------------------------------------------------------

_BUILD = """\
load("//tools/build_defs:defs.bzl", "jaxworks_test")

jaxworks_test(name = "a_test", srcs = ["tests/a_test.py"])
jaxworks_test(name = "b_test", srcs = ["tests/b_test.py", "tests/helper.py"])
jaxworks_test(name = "host_test", srcs = ["tests/host_test.py"], backends = ["cpu"])
"""

_TESTS = {
  "a_test.py": """
    import jax
    import jaxworks_testing as jwt

    def test_one():
      assert jax.device_count() == 1

    def test_two():
      assert jwt.on_accelerator() is False

    def test_eight():
      jwt.require_devices(8)
  """,
  "b_test.py": """
    import helper  # a sibling module, as tests/dtypes.py

    def test_helper():
      assert helper.VALUE == 3
  """,
  "helper.py": "VALUE = 3\n",
  "host_test.py": "def test_host():\n  pass\n",
}

_BROKEN_BUILD = """\
load("//tools/build_defs:defs.bzl", "jaxworks_test")

jaxworks_test(name = "a_test", srcs = ["tests/a_test.py"])
jaxworks_test(name = "crash_test", srcs = ["tests/crash_test.py"])
jaxworks_test(name = "c_test", srcs = ["tests/c_test.py"])
jaxworks_test(name = "slow_test", srcs = ["tests/slow_test.py"], size = "small")
jaxworks_test(name = "fail_test", srcs = ["tests/fail_test.py"])
jaxworks_test(name = "import_test", srcs = ["tests/import_test.py"])
"""

_BROKEN_TESTS = {
  # The same basename as pkg/tests/a_test.py: imported as its own module.
  "a_test.py": "def test_other_a():\n  pass\n",
  "crash_test.py": "import os\n\ndef test_crash():\n  os.abort()\n",
  "c_test.py": "def test_c():\n  pass\n",
  "slow_test.py": "import time\n\ndef test_slow():\n  time.sleep(120)\n",
  "fail_test.py": "def test_ok():\n  pass\n\ndef test_bad():\n  assert 1 == 2\n",
  "import_test.py": "import no_such_module_here\n",
}


def _repo(tmp_path, packages):
  """A repository with the runner, tools/build_defs and ``packages``:
  {directory: (BUILD text, {test file: text})}."""
  root = tmp_path / "repo"
  (root / "tools" / "build_defs").mkdir(parents=True)
  shutil.copy(os.path.join(HERE, "hardware_tests.py"), root / "tools")
  for name in ("defs.bzl", "pytest_main.py", "jaxworks_testing.py"):
    shutil.copy(
      os.path.join(ROOT, "tools", "build_defs", name),
      root / "tools" / "build_defs",
    )
  for pkg, (build, tests) in packages.items():
    (root / pkg / "tests").mkdir(parents=True)
    (root / pkg / "BUILD.bazel").write_text(build)
    for name, text in tests.items():
      (root / pkg / "tests" / name).write_text(textwrap.dedent(text))
  return root


def _run(root, out, *args):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
  for name in ("JAX_PLATFORMS", "XLA_FLAGS", "TEST_TMPDIR"):
    env.pop(name, None)
  return subprocess.run(
    [
      sys.executable,
      str(root / "tools" / "hardware_tests.py"),
      "--backend",
      "tpu",
      "--platforms",
      "cpu",
      "--out",
      str(out),
      *args,
    ],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )


def _results(out):
  with open(out / "results.json", encoding="utf-8") as f:
    data = json.load(f)
  return data, {t["label"]: t for t in data["targets"]}


def test_runs_every_target_in_one_process_and_counts_each(tmp_path):
  root = _repo(tmp_path, {"pkg": (_BUILD, _TESTS)})
  out = tmp_path / "out"
  listed = subprocess.run(
    [sys.executable, str(root / "tools" / "hardware_tests.py"), "--list"],
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  assert "//pkg:a_test_tpu" in listed and "host_test" not in listed
  proc = _run(root, out)
  assert proc.returncode == 0, proc.stdout + proc.stderr
  lines = proc.stdout.strip().splitlines()
  assert lines[-1] == "tests: 3 passed, 0 failed, 1 skipped", proc.stdout
  data, by = _results(out)
  assert data["processes"] == 1 and data["ok"]
  assert data["device_kind"] == "cpu" and data["device_count"] == 1
  assert data["versions"]["jax"] and data["command"].startswith(
    "python3 tools/hardware_tests.py --backend tpu"
  )
  a, b = by["//pkg:a_test_tpu"], by["//pkg:b_test_tpu"]
  assert (a["passed"], a["failed"], a["skipped"]) == (2, 0, 1)
  assert (b["passed"], b["failed"], b["skipped"]) == (1, 0, 0)
  (reason,) = a["skips"]
  assert reason.startswith("needs 8 devices; cpu has 1")
  md = (out / "results.md").read_text()
  assert "| `//pkg:a_test_tpu` | 2 | 0 | 1 |" in md
  assert "tests: 3 passed, 0 failed, 1 skipped" in md
  assert "Device: 1 x cpu" in md


def test_a_crash_a_timeout_and_failures_fail_their_own_targets(tmp_path):
  root = _repo(
    tmp_path, {"pkg": (_BUILD, _TESTS), "other": (_BROKEN_BUILD, _BROKEN_TESTS)}
  )
  out = tmp_path / "out"
  # Timeouts: 60 s x 0.05 for the small target, 300 s x 0.05 for the others.
  proc = _run(root, out, "--timeout-scale", "0.05")
  assert proc.returncode == 1, proc.stdout + proc.stderr
  data, by = _results(out)
  counts = {
    label: (t["passed"], t["failed"], t["skipped"], t["status"])
    for label, t in by.items()
  }
  assert counts == {
    "//other:a_test_tpu": (1, 0, 0, "passed"),  # a basename pkg has too
    "//other:c_test_tpu": (1, 0, 0, "passed"),
    "//other:crash_test_tpu": (0, 1, 0, "failed"),
    "//other:fail_test_tpu": (1, 1, 0, "failed"),  # run after the crash
    "//other:import_test_tpu": (0, 1, 0, "failed"),
    "//other:slow_test_tpu": (0, 1, 0, "failed"),
    "//pkg:a_test_tpu": (2, 0, 1, "passed"),  # run after the timeout
    "//pkg:b_test_tpu": (1, 0, 0, "passed"),
  }
  crash = by["//other:crash_test_tpu"]["problems"][0]
  assert "SIGABRT" in crash and "test_crash" in crash
  slow = by["//other:slow_test_tpu"]["problems"][0]
  assert slow.startswith("timed out after") and "(timeout 3 s)" in slow
  assert "no_such_module_here" in by["//other:import_test_tpu"]["failures"][0]
  assert data["processes"] == 3  # started again after the crash, the timeout
  assert proc.stdout.strip().splitlines()[-1] == (
    "tests: 6 passed, 4 failed, 1 skipped"
  )
  assert "FAILED in //other:fail_test_tpu" in proc.stdout
