"""Runs the tests of every ``_tpu`` (or ``_gpu``) target without Bazel.

On a machine with an accelerator, Python >= 3.11, JAX and the jaxworks wheels
installed (and no Bazel), from a checkout of the repository::

  python3 tools/hardware_tests.py --backend tpu --out /tmp/hw

The targets are Bazel's: ``tools/hardware_targets.json`` holds what the
query ``//tools:hardware_targets_query`` says of every ``_gpu`` and ``_tpu``
test (its files, arguments, environment and size), checked in and kept fresh
by ``//tools:hardware_tests_test``; regenerate it with::

  ./tools/bazel build //tools:hardware_targets_query && python3 \
    tools/hardware_tests.py --update-targets bazel-bin/tools/hardware_targets_query
 The backend's targets run as Bazel runs
them (``tools/build_defs/pytest_main.py``, their environment, e.g.
``JAX_PLATFORMS=tpu,cpu``), all in one pytest process (opening a TPU costs
seconds, and one process at a time may hold it), each test counted for the
target that owns its file (pytest's JUnit XML). Should that process crash,
or print nothing for longer than the largest timeout of its targets (Bazel's
for their size), every target runs again in a process of its own under its
own timeout, so the failure lands on its target.

It prints one line per target, how long the run took, and the closing line
CI prints (``tools/test_summary.py``)::

  tests: N passed, N failed, N skipped

and writes ``results.md`` and ``results.json`` into ``--out`` (the chip, the
JAX, jaxlib and libtpu versions, the counts of every target, the skip
reasons, the failures, the date, the commit and the command), plus each
pytest process's log. It exits 1 when a test or a target failed or nothing
ran. ``--platforms cpu`` runs the targets on the host's CPU (one device): what
an accelerator with one device will see of them. ``--list`` prints the
targets and their files and runs nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
from importlib import metadata
import json
import os
import platform as platformlib
import re
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = "tools/hardware_targets.json"
PYTEST_MAIN = "tools/build_defs/pytest_main.py"
# The shared test helpers (jaxworks_testing.py), on every test's path.
SUPPORT_DIRS = ("tools/build_defs",)
# Bazel's default test timeouts by size.
TIMEOUTS = {"small": 60, "medium": 300, "large": 900, "enormous": 3600}
BACKENDS = ("gpu", "tpu")
# The distributions whose versions a run records.
VERSIONS = (
  "jax jaxlib libtpu libtpu-nightly jax-cuda12-plugin jax-cuda12-pjrt "
  "jax-cuda13-plugin jax-cuda13-pjrt numpy pytest hypothesis jaxworks "
  "jaxworks-axis-names jaxworks-batched-transfer jaxworks-jit-cache "
  "jaxworks-pmap-chunked jaxworks-stages-aot"
).split()


@dataclasses.dataclass
class Target:
  """One ``<name>_<backend>`` py_test, as Bazel's query lists it."""

  label: str
  files: list[str]  # what pytest is given, repository-relative
  args: list[str]  # the target's own arguments after its files
  env: dict[str, str]
  size: str
  tags: list[str]
  data: list[str]

  def timeout(self) -> int:
    return TIMEOUTS.get(self.size, 300)


def _path(label: str, package: str = "") -> str:
  """``//pkg:dir/file.py`` (or ``dir/file.py`` in ``pkg``) -> its path."""
  if label.startswith("//"):
    package, _, label = label[2:].partition(":")
  return f"{package}/{label.removeprefix(':')}" if package else label


def read_query(path: str) -> dict[str, dict]:
  """The test rules of Bazel's query output (``--output=xml``): label ->
  what the runner needs of each (``TARGETS`` holds this, as JSON)."""
  out = {}
  for rule in ET.parse(path).getroot().iter("rule"):
    a: dict = {}
    for child in rule:
      if child.tag == "list":
        a[child.get("name")] = [v.get("value") for v in child]
      elif child.tag == "dict":
        a[child.get("name")] = {
          p[0].get("value"): p[1].get("value") for p in child
        }
      elif child.tag in ("string", "label"):
        a[child.get("name")] = child.get("value")
    label = rule.get("name")
    package = label[2:].partition(":")[0]
    srcs = [_path(s) for s in a.get("srcs", []) if s != a.get("main")]
    args = [  # $(rootpath X) -> X's path
      re.sub(
        r"\$\((?:rootpath|location) ([^)]*)\)",
        lambda m: _path(m.group(1), package),
        arg,
      )
      for arg in a.get("args", [])
    ]
    out[label] = {
      "files": srcs,
      "args": args[len(srcs) :],
      "env": a.get("env", {}),
      "size": a.get("size", "medium"),
      "tags": a.get("tags", []),
      "data": [_path(d) for d in a.get("data", []) if d.startswith("//")],
    }
  return dict(sorted(out.items()))


def load_targets(path: str | None = None) -> list[Target]:
  """Every target of the checked-in list (``TARGETS``), by label."""
  with open(path or os.path.join(ROOT, TARGETS), encoding="utf-8") as f:
    return [Target(label, **t) for label, t in json.load(f).items()]


def write_targets(query: str, path: str | None = None) -> None:
  """Writes ``TARGETS`` from a fresh query output."""
  with open(path or os.path.join(ROOT, TARGETS), "w", encoding="utf-8") as f:
    rows = [
      f"{json.dumps(k)}: {json.dumps(v)}" for k, v in read_query(query).items()
    ]
    f.write("{\n" + ",\n".join(rows) + "\n}\n")  # one target a line


def select(
  targets: list[Target], backend: str, only: list[str] | None = None
) -> list[Target]:
  """The backend's targets that ``bazel test //... --config=<backend>``
  runs (``manual`` ones left out), or those whose label contains one of
  ``only``."""
  out = [
    t
    for t in targets
    if t.label.endswith(f"_{backend}") and "manual" not in t.tags
  ]
  if only:
    out = [t for t in out if any(o in t.label for o in only)]
  return out


# ---------------------------------------------------------------------------
# Running pytest.


@dataclasses.dataclass
class Result:
  target: Target
  passed: int = 0
  failed: int = 0
  skipped: int = 0
  seconds: float = 0.0
  problems: list[str] = dataclasses.field(default_factory=list)
  failures: list[str] = dataclasses.field(default_factory=list)
  skips: dict[str, int] = dataclasses.field(default_factory=dict)

  @property
  def status(self) -> str:
    return "failed" if self.failed or self.problems else "passed"

  def line(self) -> str:
    return (
      f"{self.status.upper():7} {self.target.label}: {self.passed} passed, "
      f"{self.failed} failed, {self.skipped} skipped in {self.seconds:.1f} s"
      + (f" ({'; '.join(self.problems)})" if self.problems else "")
    )


def _env(targets: list[Target], platforms: str | None, tmp: str) -> dict:
  env = dict(os.environ, **targets[0].env)
  if platforms:
    env["JAX_PLATFORMS"] = platforms
    env.pop("XLA_FLAGS", None)  # one device, as on a one-chip machine
  # The test files' own directories (sibling modules: tests/dtypes.py) and
  # the shared helpers, after what is installed.
  dirs: list[str] = []
  for t in targets:
    for f in t.files + t.data:
      d = os.path.join(ROOT, os.path.dirname(f))
      if f.endswith(".py") and d not in dirs:
        dirs.append(d)
  dirs += [os.path.join(ROOT, d) for d in SUPPORT_DIRS]
  path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
  env["PYTHONPATH"] = os.pathsep.join(path + dirs)
  env.update(TEST_TMPDIR=tmp, PYTHONUNBUFFERED="1", JAXWORKS_HARDWARE_TESTS="1")
  return env


def run_pytest(targets, platforms, directory, timeout, stall):
  """One pytest process over ``targets`` (same environment and arguments),
  as Bazel's test main runs them; its exit status, or None when it was
  stopped (past ``timeout`` seconds, or ``stall`` seconds without output)."""
  os.makedirs(os.path.join(directory, "tmp"), exist_ok=True)
  for name in ("junit.xml", "devices.json"):  # of an earlier run
    if os.path.exists(os.path.join(directory, name)):
      os.remove(os.path.join(directory, name))
  files = list(dict.fromkeys(f for t in targets for f in t.files))
  env = _env(targets, platforms, os.path.join(directory, "tmp"))
  env["XML_OUTPUT_FILE"] = os.path.join(directory, "junit.xml")
  env["JAXWORKS_DEVICES_FILE"] = os.path.join(directory, "devices.json")
  cmd = [sys.executable, os.path.join(ROOT, PYTEST_MAIN), *files]
  cmd += targets[0].args + ["--import-mode=importlib", f"--rootdir={ROOT}"]
  cmd += ["-o", "junit_family=xunit1", "--continue-on-collection-errors"]
  log_path = os.path.join(directory, "pytest.log")
  with open(log_path, "w", encoding="utf-8") as log:
    proc = subprocess.Popen(
      cmd,
      cwd=ROOT,
      env=env,
      stdout=log,
      stderr=subprocess.STDOUT,
      start_new_session=True,
    )
    start = last = time.monotonic()
    size = 0
    code = None
    while code is None:
      try:
        code = proc.wait(timeout=1)
      except subprocess.TimeoutExpired:
        now = time.monotonic()
        if os.path.getsize(log_path) != size:
          size, last = os.path.getsize(log_path), now
        if now - start > timeout or now - last > stall:
          break
  try:
    os.killpg(proc.pid, signal.SIGKILL)  # it, or what its tests left
  except ProcessLookupError:
    pass
  proc.wait()
  return code


def _module(path: str) -> str:
  return path.removesuffix(".py").replace("/", ".")


def count(junit: str, targets: list[Target], results: dict) -> None:
  """Adds each test case of a JUnit XML file to its target's result (the
  first target naming its file)."""
  owner: dict[str, str] = {}
  for t in targets:
    for f in t.files:
      owner.setdefault(_module(f), t.label)
  for case in ET.parse(junit).getroot().iter("testcase"):
    name = case.get("classname") or ""
    if case.get("file"):
      name = _module(case.get("file"))
    label = next(
      (
        owner[m]
        for m in sorted(owner, key=len, reverse=True)
        if name == m or name.startswith(m + ".")
      ),
      None,
    )
    if label is None:
      continue
    r = results[label]
    r.seconds += float(case.get("time") or 0)
    bad = case.find("failure")
    if bad is None:
      bad = case.find("error")
    skip = case.find("skipped")
    test = f"{case.get('classname')}::{case.get('name')}"
    if bad is not None:
      r.failed += 1
      text = (bad.text or bad.get("message") or "").strip().splitlines()
      r.failures.append("\n".join([test] + text[-12:]))
    elif skip is not None:
      r.skipped += 1
      reason = (skip.get("message") or "(no reason)").removeprefix("Skipped: ")
      r.skips[reason] = r.skips.get(reason, 0) + 1
    else:
      r.passed += 1


def _stopped(code: int | None, limit: float) -> str:
  if code is None:
    return f"stopped: no output for too long or past its timeout ({limit} s)"
  if code < 0:
    return f"the process ended by signal {signal.Signals(-code).name}"
  return f"pytest exited with status {code} and wrote no results"


# ---------------------------------------------------------------------------
# The whole run.


def run(args, targets: list[Target]) -> int:
  out = os.path.abspath(args.out)
  os.makedirs(out, exist_ok=True)
  start = time.time()
  results = {t.label: Result(t) for t in targets}
  groups: dict[tuple, list[Target]] = {}
  for t in targets:
    key = (tuple(sorted(t.env.items())), tuple(t.args))
    groups.setdefault(key, []).append(t)
  processes = 0
  devices: dict = {}
  pending = [] if args.isolate else list(groups.values())
  isolated = [[t] for t in targets] if args.isolate else []
  while pending or isolated:
    group = (pending or isolated).pop(0)
    processes += 1
    directory = os.path.join(out, f"process-{processes}")
    timeout = sum(t.timeout() for t in group)
    stall = max(t.timeout() for t in group)
    print(
      f"-- process {processes}: {len(group)} target(s), log "
      f"{os.path.relpath(directory)}/pytest.log",
      flush=True,
    )
    code = run_pytest(group, args.platforms, directory, timeout, stall)
    junit = os.path.join(directory, "junit.xml")
    if code == 1 and not os.path.exists(junit):
      # Bazel's test main stopped before pytest: no such device (one line).
      with open(os.path.join(directory, "pytest.log"), encoding="utf-8") as f:
        why = (f.read().strip().splitlines() or ["(no output)"])[-1]
      for t in group:
        results[t.label].problems.append(why)
      print(f"   {why}", flush=True)
      continue
    if code not in (0, 1, 5) or not os.path.exists(junit):
      why = _stopped(code, timeout)
      if len(group) > 1:  # each target again, in a process of its own
        print(f"   {why}: each target again on its own", flush=True)
        isolated += [[t] for t in group]
      else:
        results[group[0].label].problems.append(
          f"{why}; see {os.path.relpath(directory)}/pytest.log"
        )
      continue
    count(junit, group, results)
    try:
      with open(os.path.join(directory, "devices.json"), encoding="utf-8") as f:
        devices = devices or json.load(f)
    except OSError:
      pass
    for t in group:
      r = results[t.label]
      if not (r.passed or r.failed or r.skipped or r.problems):
        r.problems.append("no test collected (pytest exits 5 under Bazel)")
      print("   " + r.line(), flush=True)
  seconds = time.time() - start
  return report(args, results, devices, processes, seconds)


def _versions() -> dict[str, str]:
  out = {"python": platformlib.python_version()}
  for name in VERSIONS:
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      pass
  return out


def _git_commit() -> str | None:
  def git(*cmd):
    return subprocess.run(
      ["git", *cmd],
      cwd=ROOT,
      capture_output=True,
      text=True,
      check=True,
      timeout=10,
    ).stdout.strip()

  try:
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short=12", "HEAD") + (
      "+changes" if dirty else ""
    )
  except (OSError, subprocess.SubprocessError):
    return None


def report(args, results, devices, processes, seconds) -> int:
  total = {
    k: sum(
      getattr(r, k) + (k == "failed" and not r.failed and bool(r.problems))
      for r in results.values()
    )
    for k in ("passed", "failed", "skipped")
  }
  line = (
    f"tests: {total['passed']} passed, {total['failed']} failed, "
    f"{total['skipped']} skipped"
  )
  problems = [] if sum(total.values()) else ["no test ran"]
  if devices.get("error"):
    problems.append(f"the backend did not start: {devices['error']}")
  ok = not problems and all(r.status == "passed" for r in results.values())
  print()
  for r in results.values():
    print(r.line())
    for f in r.failures[:10]:
      print(f"FAILED in {r.target.label}: {f.splitlines()[0]}")
  for p in problems:
    print(f"hardware_tests: {p}")
  versions = _versions()
  command = "python3 tools/hardware_tests.py " + shlex.join(args.argv)
  date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
  commit = _git_commit()
  data = {
    "backend": args.backend,
    "platforms": args.platforms,
    **{
      k: devices.get(k)
      for k in ("device_kind", "device_count", "platform", "platform_version")
    },
    "versions": versions,
    "date": date,
    "command": command,
    "commit": commit,
    "seconds": round(seconds, 1),
    "processes": processes,
    "summary": line,
    "ok": ok,
    "problems": problems,
    "targets": [
      {
        "label": r.target.label,
        "status": r.status,
        **{k: getattr(r, k) for k in ("passed", "failed", "skipped")},
        "seconds": round(r.seconds, 1),
        "problems": r.problems,
        "failures": r.failures,
        "skips": r.skips,
      }
      for r in results.values()
    ],
  }
  out = os.path.abspath(args.out)
  with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
    json.dump(data, f, indent=1)
    f.write("\n")
  with open(os.path.join(out, "results.md"), "w", encoding="utf-8") as f:
    f.write(_markdown(data, results))
  print(f"results: {os.path.join(out, 'results.md')}")
  print(f"hardware_tests: {processes} pytest process(es) in {seconds:.0f} s")
  print(line)
  return 0 if ok else 1


def _markdown(data: dict, results: dict) -> str:
  v = data["versions"]
  theirs = [k for k in v if not k.startswith("jaxworks")]
  versions = ", ".join(f"{k} {v[k]}" for k in theirs[1:] + theirs[:1])
  ours = ", ".join(f"{k} {v[k]}" for k in v if k.startswith("jaxworks"))
  version = f"; {data['platform_version']}" if data["platform_version"] else ""
  commit = f"; commit {data['commit']}" if data["commit"] else ""
  md = [
    f"# Hardware test results: `_{data['backend']}` targets",
    "",
    f"- Device: {data['device_count']} x {data['device_kind']} "
    f"(platform {data['platform']}{version})",
    f"- Versions: {versions or 'unknown'}",
    f"- jaxworks: {ours or 'not installed as wheels (source tree)'}",
    f"- Date: {data['date']}{commit}",
    f"- Command: `{data['command']}` ({data['seconds']:.0f} s, "
    f"{data['processes']} pytest process(es))",
    f"- Result: `{data['summary']}`" + ("" if data["ok"] else " **(FAILED)**"),
    "",
    "| target | passed | failed | skipped | seconds | status |",
    "| --- | ---: | ---: | ---: | ---: | --- |",
  ]
  for r in results.values():
    problems = f": {'; '.join(r.problems)}" if r.problems else ""
    md.append(
      f"| `{r.target.label}` | {r.passed} | {r.failed} | {r.skipped} | "
      f"{r.seconds:.1f} | {r.status}{problems} |"
    )
  reasons: dict[str, int] = {}
  for r in results.values():
    for reason, n in r.skips.items():
      reasons[reason] = reasons.get(reason, 0) + n
  if reasons:
    md += ["", "## Skipped, by reason", ""]
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
      md.append(f"- {n} x {reason}")
  failures = [(r, f) for r in results.values() for f in r.failures]
  if failures or data["problems"]:
    md += ["", "## Failures", ""]
    md += [f"- {p}" for p in data["problems"]]
    for r, f in failures:
      md += [f"- `{r.target.label}`:", "", "```", f, "```", ""]
  return "\n".join(md).rstrip() + "\n"


def main(argv: list[str]) -> int:
  lines = __doc__.splitlines()
  parser = argparse.ArgumentParser(
    description=lines[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
    epilog="\n".join(lines[1:]),
  )
  parser.add_argument("--backend", choices=BACKENDS, default="tpu")
  parser.add_argument("--out", help="directory for results.md/.json, logs")
  parser.add_argument(
    "--targets",
    nargs="+",
    metavar="LABEL",
    help="only the targets whose label contains one of these",
  )
  parser.add_argument(
    "--platforms",
    help="JAX_PLATFORMS instead of the targets' (cpu: the host's CPU, one "
    "device, as a one-chip machine)",
  )
  parser.add_argument(
    "--isolate",
    action="store_true",
    help="one pytest process per target (as Bazel runs them)",
  )
  parser.add_argument(
    "--list", action="store_true", help="print the targets and files only"
  )
  parser.add_argument(
    "--update-targets",
    metavar="QUERY_XML",
    help=f"write {TARGETS} from the query's output, run nothing",
  )
  args = parser.parse_args(argv)
  args.argv = argv
  if args.update_targets:
    write_targets(args.update_targets)
    print(f"hardware_tests: wrote {TARGETS}")
    return 0
  targets = select(load_targets(), args.backend, args.targets)
  if args.list:
    for t in targets:
      print(f"{t.label} [{t.size}] {' '.join(t.files + t.args)}")
    print(f"{len(targets)} targets")
    return 0
  if not args.out:
    parser.error("--out DIR is required (or --list)")
  if not targets:
    print(f"hardware_tests: no {args.backend} target matches")
    return 1
  print(
    f"hardware_tests: {len(targets)} {args.backend} targets, JAX_PLATFORMS="
    f"{args.platforms or targets[0].env.get('JAX_PLATFORMS')}",
    flush=True,
  )
  return run(args, targets)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
