"""Runs the tests of every ``_tpu`` (or ``_gpu``) target without Bazel.

On a machine with an accelerator, Python >= 3.11, JAX and the jaxworks wheels
installed (and no Bazel), from a checkout of the repository::

  python3 tools/hardware_tests.py --backend tpu --out /tmp/hw

It reads the ``jaxworks_test(...)`` targets of every BUILD file (the same
macro calls Bazel evaluates; ``//tools:hardware_tests_test`` checks the list
against Bazel's own), runs the test files of the backend's targets with the
targets' environment (``JAX_PLATFORMS=tpu``) in as few pytest processes as it
can (opening a TPU costs seconds, and one process at a time may hold it), and
counts each test case for the target that owns its file. A crash or a target
past its timeout (Bazel's for its size) fails that target, and the targets not
yet run go on in a new process. It prints one line per target and the closing
line CI prints (``tools/test_summary.py``)::

  tests: N passed, N failed, N skipped

and writes ``results.md`` and ``results.json`` into ``--out`` (the chip, the
JAX, jaxlib and libtpu versions, the counts of every target, the skip reasons,
the date and the command), plus each pytest process's log. It exits 1 when a
test or a target failed or nothing ran.

``--platforms cpu`` runs the same targets on the host's CPU (one device unless
XLA_FLAGS says more): what an accelerator with one device will see of them.
``--list`` prints the targets and their files and runs nothing.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import glob as globlib
import json
import os
import platform as platformlib
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFS = "tools/build_defs/defs.bzl"
PYTEST_MAIN = "tools/build_defs/pytest_main.py"
# Directories whose modules every test may import (jaxworks_testing.py).
SUPPORT_DIRS = ("tools/build_defs",)
# Bazel's default test timeouts by size.
TIMEOUTS = {"small": 60, "medium": 300, "large": 900, "enormous": 3600}
PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}


# ---------------------------------------------------------------------------
# The targets, from the BUILD files.


@dataclasses.dataclass
class Target:
  """One ``<name>_<backend>`` py_test made by jaxworks_test."""

  label: str
  package: str
  backend: str
  srcs: list[str]  # repository-relative paths, in order
  data: list[str]
  args: list[str]  # as Bazel stores them ($(rootpath ...) unexpanded)
  env: dict[str, str]  # likewise
  tags: list[str]
  size: str
  pypi: list[str]
  deps: list[str]

  def files(self) -> list[str]:
    """The files pytest is given (the srcs, as ``$(rootpath src)``)."""
    return list(self.srcs)

  def extra_args(self) -> list[str]:
    """The target's own arguments after its files, expanded."""
    return [_expand(a, self.package) for a in self.args[len(self.srcs) :]]

  def expanded_env(self) -> dict[str, str]:
    return {k: _expand(v, self.package) for k, v in self.env.items()}

  def timeout(self) -> int:
    return TIMEOUTS.get(self.size, 300)


def _path_of(label: str, package: str) -> str:
  """A source label (``tests/x.py``, ``:x.py``, ``//pkg:x.py``) -> path."""
  if label.startswith("@"):
    raise ValueError(f"external label {label!r} has no path here")
  if label.startswith("//"):
    pkg, _, name = label[2:].partition(":")
    if not name:
      name = pkg.rsplit("/", 1)[-1]
    return os.path.join(pkg, name) if pkg else name
  name = label[1:] if label.startswith(":") else label
  return os.path.join(package, name) if package else name


def _expand(value: str, package: str) -> str:
  """``$(rootpath X)`` / ``$(location X)`` / ``$(rootpaths X)`` -> path."""

  def one(m: re.Match) -> str:
    return _path_of(m.group(2).strip(), package)

  return re.sub(
    r"\$\((rootpath|rootpaths|location|locations|execpath)\s+([^)]*)\)",
    one,
    value,
  )


def _bzl_constants(path: str) -> dict[str, object]:
  """The literal top-level assignments of a .bzl file."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  out: dict[str, object] = {}
  for node in tree.body:
    if (
      isinstance(node, ast.Assign)
      and len(node.targets) == 1
      and isinstance(node.targets[0], ast.Name)
    ):
      try:
        out[node.targets[0].id] = ast.literal_eval(node.value)
      except ValueError:
        pass
  return out


def _bzl_defaults(path: str, function: str, constants: dict) -> dict:
  """The default values of a macro's parameters in a .bzl file."""
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  for node in tree.body:
    if isinstance(node, ast.FunctionDef) and node.name == function:
      args = node.args.args
      defaults = node.args.defaults
      out = {}
      for arg, default in zip(args[len(args) - len(defaults) :], defaults):
        if isinstance(default, ast.Name):
          out[arg.arg] = constants[default.id]
        else:
          out[arg.arg] = ast.literal_eval(default)
      return out
  raise ValueError(f"{path} defines no {function}")


class _Anything:
  """What a rule or symbol this reader does not model evaluates to."""

  def __call__(self, *args, **kwargs):
    return "@unmodelled//:value"


def _ignored_dirs(root: str) -> list[str]:
  try:
    with open(os.path.join(root, ".bazelignore"), encoding="utf-8") as f:
      return [ln.strip().rstrip("/") for ln in f if ln.strip()]
  except OSError:
    return []


def build_files(root: str | None = None) -> list[str]:
  """Repository-relative paths of the BUILD files Bazel reads (sorted)."""
  root = root or ROOT
  ignored = set(_ignored_dirs(root))
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    rel = os.path.relpath(dirpath, root)
    rel = "" if rel == "." else rel
    dirnames[:] = sorted(
      d
      for d in dirnames
      if not d.startswith((".", "bazel-"))
      and d != "third_party"
      and os.path.join(rel, d) not in ignored
    )
    for name in ("BUILD.bazel", "BUILD"):
      if name in filenames:
        out.append(os.path.join(rel, name))
        break
  return sorted(out)


def load_targets(root: str | None = None) -> list[Target]:
  """Every py_test that jaxworks_test makes in the repository's BUILD files.

  The BUILD files are Starlark, which for them is Python: each is executed
  with jaxworks_test and jaxworks_package modelled on tools/build_defs/defs.bzl
  (their defaults read from it) and every other rule a no-op.
  """
  root = root or ROOT
  defs_path = os.path.join(root, DEFS)
  constants = _bzl_constants(defs_path)
  test_defaults = _bzl_defaults(defs_path, "jaxworks_test", constants)
  package_defaults = _bzl_defaults(defs_path, "jaxworks_package", constants)
  jax_platforms = constants["_JAX_PLATFORMS"]
  targets: list[Target] = []

  for build in build_files(root):
    package = os.path.dirname(build)

    def glob(include, exclude=(), package=package, **_):
      base = os.path.join(root, package)
      found = set()
      for pattern in include:
        for p in globlib.glob(os.path.join(base, pattern), recursive=True):
          if os.path.isfile(p):
            found.add(os.path.relpath(p, base))
      for pattern in exclude:
        for p in globlib.glob(os.path.join(base, pattern), recursive=True):
          found.discard(os.path.relpath(p, base))
      return sorted(found)

    def jaxworks_test(name, srcs, package=package, **kw):
      params = dict(test_defaults, **kw)
      tags = list(params.pop("tags", []))
      for backend in params["backends"]:
        env = dict(params["env"])
        env["JAX_PLATFORMS"] = jax_platforms[backend]
        if backend == "cpu":
          env["XLA_FLAGS"] = (
            f"--xla_force_host_platform_device_count={params['devices']}"
          )
        targets.append(
          Target(
            label=f"//{package}:{name}_{backend}",
            package=package,
            backend=backend,
            srcs=[_path_of(s, package) for s in srcs],
            data=[
              d if d.startswith("@") else _path_of(d, package)
              for d in params["data"]
            ],
            args=[f"$(rootpath {s})" for s in srcs] + list(params["args"]),
            env=env,
            tags=tags + [backend],
            size=params["size"],
            pypi=list(params["pypi"]),
            deps=list(params["deps"]),
          )
        )

    def jaxworks_package(name, glob=glob, jaxworks_test=jaxworks_test, **kw):
      params = dict(package_defaults, **kw)
      readme = glob(["README.md"])
      jaxworks_test(
        name="doctest",
        srcs=["//tools/build_defs:doctest_test.py"],
        deps=[":" + name],
        args=["--jaxworks-package=jaxworks." + name]
        + (["--jaxworks-readme=$(rootpath README.md)"] if readme else []),
        data=readme,
        backends=params["doctest_backends"],
      )

    env: dict[str, object] = {}

    def load(label, *symbols, env=env, **aliases):
      path = None
      if label.startswith("//"):
        path = os.path.join(root, _path_of(label, ""))
      values = _bzl_constants(path) if path else {}
      names = {s: s for s in symbols}
      names.update({alias: s for alias, s in aliases.items()})
      for local, symbol in names.items():
        if path == defs_path and symbol == "jaxworks_test":
          env[local] = jaxworks_test
        elif path == defs_path and symbol == "jaxworks_package":
          env[local] = jaxworks_package
        elif symbol in values:
          env[local] = values[symbol]
        else:
          env[local] = _Anything()

    env.update({"load": load, "glob": glob, "__builtins__": __builtins__})
    for native in (
      "alias",
      "cc_binary",
      "cc_library",
      "config_setting",
      "constraint_setting",
      "constraint_value",
      "exports_files",
      "filegroup",
      "genquery",
      "genrule",
      "licenses",
      "package",
      "platform",
      "py_binary",
      "py_library",
      "py_test",
      "sh_binary",
      "sh_test",
      "test_suite",
      "toolchain",
    ):
      env[native] = _Anything()
    path = os.path.join(root, build)
    with open(path, encoding="utf-8") as f:
      code = compile(f.read(), path, "exec")
    try:
      exec(code, env)
    except Exception as e:
      raise RuntimeError(
        f"tools/hardware_tests.py could not read {build}: "
        f"{type(e).__name__}: {e}"
      ) from e
  return targets


def select(
  targets: list[Target], backend: str, only: list[str] | None = None
) -> list[Target]:
  """The backend's targets that `bazel test //... --config=<backend>` runs."""
  out = [t for t in targets if t.backend == backend and "manual" not in t.tags]
  if only:
    out = [t for t in out if any(o == t.label or o in t.label for o in only)]
  return sorted(out, key=lambda t: t.label)


# ---------------------------------------------------------------------------
# Inside each pytest process: a plugin that streams results to a file.


class _Recorder:
  """Writes one JSON line per event: the session's devices, each test's
  start and result, collection errors, each target's end; stops the process
  when the target in progress runs past its timeout."""

  def __init__(self, plan: dict):
    self.owner = plan["owner"]  # absolute file -> target label
    self.timeouts = plan["timeouts"]  # label -> seconds
    self.expect = plan["expect_platform"]
    self.events = open(plan["events"], "a", encoding="utf-8")  # noqa: SIM115
    self.lock = threading.Lock()
    self.current: str | None = None
    self.started_at: dict[str, float] = {}
    self.counts: dict[str, dict[str, int]] = {}
    self.outcome: dict[str, str] = {}
    self.reasons: dict[str, str] = {}
    self.messages: dict[str, str] = {}
    self.nodeid: str | None = None

  def emit(self, **event) -> None:
    with self.lock:
      self.events.write(json.dumps(event) + "\n")
      self.events.flush()

  def target_of(self, path) -> str | None:
    return self.owner.get(os.path.realpath(str(path)))

  def pytest_sessionstart(self, session):
    # Open the backend before any test module is imported, and say what it is.
    try:
      import jax

      devices = jax.devices()
      info = {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "platform_version": " ".join(
          str(getattr(devices[0].client, "platform_version", "")).split()
        ),
      }
    except Exception as e:  # noqa: BLE001 - reported, then the run stops
      self.emit(event="backend_error", error=f"{type(e).__name__}: {e}")
      raise SystemExit(4) from e
    info.update(_versions())
    self.emit(event="session", **info)
    if self.expect and info["platform"] != self.expect:
      self.emit(
        event="backend_error",
        error=f"JAX's devices are {info['platform']}, not {self.expect}",
      )
      raise SystemExit(4)
    threading.Thread(target=self._watchdog, daemon=True).start()

  def pytest_collectreport(self, report):
    if report.failed:
      path = getattr(report, "fspath", None) or report.nodeid.split("::")[0]
      self.emit(
        event="collect_error",
        target=self.target_of(os.path.join(str(_rootdir()), path)),
        nodeid=report.nodeid,
        message=_short(report.longreprtext),
      )

  def pytest_collection_finish(self, session):
    per: dict[str, int] = {}
    for item in session.items:
      t = self.target_of(item.path)
      if t:
        per[t] = per.get(t, 0) + 1
    self.emit(event="collected", items=per)

  def pytest_runtest_logstart(self, nodeid, location):
    target = self.owner.get(
      os.path.realpath(os.path.join(str(_rootdir()), location[0]))
    )
    if target != self.current:
      self._end_target()
      self.current = target
      self.started_at.setdefault(target, time.monotonic())
    self.nodeid = nodeid
    self.emit(event="start", nodeid=nodeid, target=target)

  def pytest_runtest_logreport(self, report):
    key = report.nodeid
    if report.failed:
      self.outcome[key] = "failed"
      self.messages.setdefault(key, _short(report.longreprtext or ""))
    elif report.skipped and self.outcome.get(key) != "failed":
      self.outcome[key] = "skipped"
      if isinstance(report.longrepr, tuple):
        reason = str(report.longrepr[2])
        self.reasons[key] = reason.removeprefix("Skipped: ")
    elif report.when == "call" and key not in self.outcome:
      self.outcome[key] = "passed"
    if report.when != "teardown":
      return
    outcome = self.outcome.pop(key, "passed")
    self.emit(
      event="result",
      nodeid=key,
      target=self.current,
      outcome=outcome,
      reason=self.reasons.pop(key, "") if outcome == "skipped" else "",
      message=self.messages.pop(key, "") if outcome == "failed" else "",
    )
    self.reasons.pop(key, None)
    self.messages.pop(key, None)
    counts = self.counts.setdefault(
      self.current or "?", {"passed": 0, "failed": 0, "skipped": 0}
    )
    counts[outcome] += 1
    self.nodeid = None

  def _end_target(self):
    if self.current is not None:
      self.emit(
        event="target_end",
        target=self.current,
        seconds=time.monotonic() - self.started_at[self.current],
        **self.counts.get(
          self.current, {"passed": 0, "failed": 0, "skipped": 0}
        ),
      )

  def pytest_sessionfinish(self, session, exitstatus):
    self._end_target()
    self.current = None
    self.emit(event="session_end", exitstatus=int(exitstatus))

  def _watchdog(self):
    import faulthandler

    while True:
      time.sleep(1)
      target = self.current
      if target is None:
        continue
      elapsed = time.monotonic() - self.started_at.get(target, time.monotonic())
      if elapsed > self.timeouts.get(target, 300):
        self.emit(
          event="timeout",
          target=target,
          nodeid=self.nodeid,
          seconds=elapsed,
        )
        sys.stderr.write(
          f"\n{target} ran past its timeout of "
          f"{self.timeouts.get(target)} s in {self.nodeid}; stacks:\n"
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(124)


def _rootdir():
  return ROOT


def _short(text: str, lines: int = 12) -> str:
  parts = text.strip().splitlines()
  return "\n".join(parts[-lines:])


def _versions() -> dict[str, str]:
  from importlib import metadata

  out = {"python": platformlib.python_version()}
  for name in (
    "jax",
    "jaxlib",
    "libtpu",
    "libtpu-nightly",
    "jax-cuda12-plugin",
    "jax-cuda12-pjrt",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "numpy",
    "pytest",
    "hypothesis",
  ):
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      pass
  for dist in (
    "jaxworks",
    "jaxworks-axis-names",
    "jaxworks-batched-transfer",
    "jaxworks-jit-cache",
    "jaxworks-pmap-chunked",
    "jaxworks-stages-aot",
  ):
    try:
      out[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
      pass
  return out


def _child(plan_path: str) -> int:
  """The pytest process: ``python -P tools/hardware_tests.py --child PLAN``."""
  global ROOT
  with open(plan_path, encoding="utf-8") as f:
    plan = json.load(f)
  ROOT = plan["root"]
  import importlib.util

  import pytest

  spec = importlib.util.spec_from_file_location(
    "jaxworks_pytest_main", os.path.join(ROOT, PYTEST_MAIN)
  )
  pytest_main = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(pytest_main)
  os.chdir(ROOT)
  return int(
    pytest.main(
      plan["args"],
      plugins=[_Recorder(plan), pytest_main._JaxworksOptions()],
    )
  )


# ---------------------------------------------------------------------------
# The runner.


@dataclasses.dataclass
class Result:
  target: Target
  passed: int = 0
  failed: int = 0
  skipped: int = 0
  seconds: float = 0.0
  status: str = "not run"  # passed | failed | not run
  problems: list[str] = dataclasses.field(default_factory=list)
  failures: list[str] = dataclasses.field(default_factory=list)
  skips: dict[str, int] = dataclasses.field(default_factory=dict)
  collected: int | None = None
  results: int = 0

  def line(self) -> str:
    return (
      f"{self.status.upper():7} {self.target.label}: {self.passed} passed, "
      f"{self.failed} failed, {self.skipped} skipped in {self.seconds:.1f} s"
      + (f" ({'; '.join(self.problems)})" if self.problems else "")
    )


def _groups(targets: list[Target]) -> list[list[Target]]:
  """Targets that can share one pytest process: same environment and
  options. Files may repeat (helpers such as tests/child.py); pytest collects
  a repeated file once, for the first target naming it."""
  groups: dict[tuple, list[Target]] = {}
  for t in targets:
    key = (tuple(sorted(t.expanded_env().items())), tuple(t.extra_args()))
    groups.setdefault(key, []).append(t)
  return list(groups.values())


class Runner:
  def __init__(self, args):
    self.args = args
    self.out = os.path.abspath(args.out)
    os.makedirs(self.out, exist_ok=True)
    self.session: dict | None = None
    self.processes = 0
    self.problems: list[str] = []

  def env_for(self, group: list[Target], plan_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(group[0].expanded_env())
    if self.args.platforms:
      env["JAX_PLATFORMS"] = self.args.platforms
      if self.args.platforms != "cpu" or group[0].backend != "cpu":
        # The CPU target's device count is not the accelerator's.
        if group[0].backend != "cpu":
          env.pop("XLA_FLAGS", None)
    if self.args.xla_flags is not None:
      env["XLA_FLAGS"] = self.args.xla_flags
    # Sibling modules of the test files (tests/dtypes.py, tests/child.py) and
    # the shared test helpers, after what is installed.
    dirs = []
    for t in group:
      for f in t.files() + t.data:
        if f.endswith(".py"):
          d = os.path.join(ROOT, os.path.dirname(f))
          if d not in dirs:
            dirs.append(d)
    dirs += [os.path.join(ROOT, d) for d in SUPPORT_DIRS]
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(path + [d for d in dirs if d])
    tmp = tempfile.mkdtemp(prefix="tmp-", dir=plan_dir)
    env["TEST_TMPDIR"] = tmp
    env["HYPOTHESIS_STORAGE_DIRECTORY"] = os.path.join(tmp, ".hypothesis")
    env["PYTHONUNBUFFERED"] = "1"
    env["JAXWORKS_HARDWARE_TESTS"] = "1"
    return env

  def run_group(self, group: list[Target], results: dict[str, Result]):
    pending = list(group)
    while pending:
      self.processes += 1
      n = self.processes
      plan_dir = os.path.join(self.out, f"process-{n}")
      os.makedirs(plan_dir, exist_ok=True)
      events = os.path.join(plan_dir, "events.jsonl")
      owner: dict[str, str] = {}
      files: list[str] = []
      for t in pending:
        for f in t.files():
          owner.setdefault(os.path.realpath(os.path.join(ROOT, f)), t.label)
          if f not in files:
            files.append(f)
      extra = pending[0].extra_args()
      args = (
        files
        + extra
        + [
          "-p",
          "no:cacheprovider",
          "-q",
          "-rfE",
          "--import-mode=importlib",
          "--continue-on-collection-errors",
          f"--rootdir={ROOT}",
          "-o",
          "junit_family=xunit1",
          f"--junitxml={os.path.join(plan_dir, 'junit.xml')}",
        ]
      )
      if self.args.pytest_args:
        args += shlex.split(self.args.pytest_args)
      expect = None
      if not self.args.platforms:
        expect = {"tpu": "tpu", "gpu": "gpu", "cpu": "cpu"}[pending[0].backend]
      plan = {
        "owner": owner,
        "timeouts": {
          t.label: round(t.timeout() * self.args.timeout_scale, 3)
          for t in pending
        },
        "events": events,
        "args": args,
        "expect_platform": expect,
        "root": ROOT,
      }
      plan_path = os.path.join(plan_dir, "plan.json")
      with open(plan_path, "w", encoding="utf-8") as f:
        json.dump(plan, f, indent=1)
      log_path = os.path.join(plan_dir, "pytest.log")
      budget = sum(plan["timeouts"].values()) + 300
      cmd = [sys.executable, "-P", os.path.abspath(__file__), "--child"]
      cmd.append(plan_path)
      print(
        f"-- process {n}: {len(pending)} target(s), {len(files)} file(s); "
        f"log {_shown(log_path)}",
        flush=True,
      )
      with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(
          cmd,
          cwd=ROOT,
          env=self.env_for(pending, plan_dir),
          stdout=log,
          stderr=subprocess.STDOUT,
          start_new_session=True,
        )
        seen = 0
        start = time.monotonic()
        killed = False
        while True:
          try:
            code = proc.wait(timeout=1)
            break
          except subprocess.TimeoutExpired:
            pass
          seen = self._progress(events, seen, results)
          if time.monotonic() - start > budget:
            killed = True
            os.killpg(proc.pid, signal.SIGKILL)
        seen = self._progress(events, seen, results)
      try:
        os.killpg(proc.pid, signal.SIGKILL)  # what the tests left running
      except ProcessLookupError:
        pass
      pending = self._account(events, pending, results, code, killed, log_path)

  def _progress(self, events, seen, results) -> int:
    """Prints the targets that ended since the last call."""
    try:
      with open(events, encoding="utf-8") as f:
        lines = f.readlines()
    except OSError:
      return seen
    for raw in lines[seen:]:
      if not raw.endswith("\n"):
        break
      seen += 1
      e = json.loads(raw)
      if e["event"] == "session" and self.session is None:
        self.session = e
        print(
          f"-- devices: {e['device_count']} x {e['device_kind']} "
          f"({e['platform']}); jax {e.get('jax')}, jaxlib "
          f"{e.get('jaxlib')}"
          + (f", libtpu {e['libtpu']}" if e.get("libtpu") else ""),
          flush=True,
        )
      elif e["event"] == "target_end" and e["target"] in results:
        r = results[e["target"]]
        print(
          f"   {e['target']}: {e['passed']} passed, {e['failed']} failed, "
          f"{e['skipped']} skipped in {e['seconds']:.1f} s",
          flush=True,
        )
        del r  # the full account comes at the end of the process
    return seen

  def _account(self, events, pending, results, code, killed, log_path):
    """Counts the process's results; returns the targets still to run."""
    try:
      with open(events, encoding="utf-8") as f:
        lines = [json.loads(x) for x in f if x.endswith("\n")]
    except OSError:
      lines = []
    started: set[str] = set()
    ended: set[str] = set()
    collected: dict[str, int] | None = None
    in_progress = None
    stopped = None
    backend_error = None
    finished = False
    for e in lines:
      kind = e["event"]
      if kind == "backend_error":
        backend_error = e["error"]
      elif kind == "collected":
        collected = e["items"]
      elif kind == "collect_error":
        label = e.get("target")
        if label in results:
          r = results[label]
          r.failed += 1
          r.failures.append(f"{e['nodeid']} (collection)\n{e['message']}")
          started.add(label)
      elif kind == "start":
        started.add(e["target"])
        in_progress = (e["target"], e["nodeid"])
      elif kind == "result":
        label = e["target"]
        if label in results:
          r = results[label]
          r.results += 1
          setattr(r, e["outcome"], getattr(r, e["outcome"]) + 1)
          if e["outcome"] == "failed":
            r.failures.append(f"{e['nodeid']}\n{e['message']}")
          elif e["outcome"] == "skipped":
            reason = e["reason"] or "(no reason)"
            r.skips[reason] = r.skips.get(reason, 0) + 1
        in_progress = None
      elif kind == "target_end":
        ended.add(e["target"])
        if e["target"] in results:
          results[e["target"]].seconds += e["seconds"]
      elif kind == "timeout":
        stopped = (e["target"], e["nodeid"], "timeout", e["seconds"])
      elif kind == "session_end":
        finished = True
    if collected is not None:
      for t in pending:
        results[t.label].collected = collected.get(t.label, 0)

    log_hint = f"see {_shown(log_path)}"
    if backend_error is not None:
      message = (
        f"the backend did not start: {backend_error}; the {pending[0].backend}"
        " targets need a machine with that device (or --platforms cpu)"
      )
      self.problems.append(message)
      for t in pending:
        results[t.label].status = "failed"
        results[t.label].problems.append("backend did not start")
      return []
    if finished and code in (0, 1, 2, 5):
      for t in pending:
        self._close(results[t.label])
      return []
    # A crash, a timeout or a kill: the target in progress fails, the ones
    # that have not started run again in a new process.
    if stopped is not None:
      label, nodeid, _, seconds = stopped
      limit = results[label].target.timeout() * self.args.timeout_scale
      why = f"timed out after {seconds:.0f} s (timeout {limit:g} s) in {nodeid}"
    elif in_progress is not None:
      label, nodeid = in_progress
      why = (
        f"the process ended ({_exit_text(code, killed)}) in {nodeid}; "
        f"{log_hint}"
      )
    elif finished:
      label = None
      why = f"pytest exited with status {code}; {log_hint}"
    else:
      label = None
      why = (
        f"the process ended ({_exit_text(code, killed)}) before a test ran; "
        f"{log_hint}"
      )
    if label is None:
      for t in pending:
        r = results[t.label]
        if t.label not in ended:
          r.problems.append(why)
          r.status = "failed"
        else:
          self._close(r)
      if not finished:
        self.problems.append(why)
      return []
    r = results[label]
    r.problems.append(why)
    r.failed += 1
    r.failures.append(f"{why}")
    r.status = "failed"
    rest = []
    for t in pending:
      if t.label == label:
        continue
      if t.label in ended or t.label in started:
        self._close(results[t.label])
      else:
        rest.append(t)
    return rest

  def _close(self, r: Result) -> None:
    if r.collected == 0 and r.failed == 0 and r.results == 0:
      r.problems.append("no test collected (pytest exits 5 under Bazel)")
    r.status = "failed" if (r.failed or r.problems) else "passed"

  # The whole run.
  def run(self, targets: list[Target]) -> int:
    started = time.time()
    results = {t.label: Result(t) for t in targets}
    groups = [[t] for t in targets] if self.args.isolate else _groups(targets)
    for group in groups:
      self.run_group(group, results)
    seconds = time.time() - started
    total = {"passed": 0, "failed": 0, "skipped": 0}
    for r in results.values():
      if r.status == "not run":
        r.status = "failed"
        r.problems.append("not run")
      if r.status == "failed" and r.failed == 0:
        # A target that failed without a failing case (crash, timeout, no
        # tests) counts once, as tools/test_summary.py counts it.
        r.failed = 1
      for k in total:
        total[k] += getattr(r, k)
    line = (
      f"tests: {total['passed']} passed, {total['failed']} failed, "
      f"{total['skipped']} skipped"
    )
    print()
    for r in results.values():
      print(r.line())
    failing = [r for r in results.values() if r.status != "passed"]
    for r in failing:
      for f in r.failures[:10]:
        print(f"FAILED in {r.target.label}: {f.splitlines()[0]}")
    ok = not failing and not self.problems and total["passed"] > 0
    if total["passed"] + total["failed"] + total["skipped"] == 0:
      self.problems.append("no test ran")
    for p in self.problems:
      print(f"hardware_tests: {p}")
    self._write(results, total, line, seconds, ok)
    print(f"results: {os.path.join(self.out, 'results.md')}")
    print(line)
    return 0 if ok else 1

  def _write(self, results, total, line, seconds, ok):
    s = self.session or {}
    command = "python3 tools/hardware_tests.py " + " ".join(
      shlex.quote(a) for a in self.args.argv
    )
    date = datetime.datetime.now(datetime.UTC)
    commit = _git_commit()
    data = {
      "backend": self.args.backend,
      "platforms": self.args.platforms,
      "device_kind": s.get("device_kind"),
      "device_count": s.get("device_count"),
      "platform": s.get("platform"),
      "platform_version": s.get("platform_version"),
      "versions": {
        k: v
        for k, v in s.items()
        if k
        not in (
          "event",
          "platform",
          "device_kind",
          "device_count",
          "platform_version",
        )
      },
      "date": date.isoformat(timespec="seconds"),
      "command": command,
      "commit": commit,
      "seconds": round(seconds, 1),
      "processes": self.processes,
      "summary": line,
      "ok": ok,
      "problems": self.problems,
      "targets": [
        {
          "label": r.target.label,
          "status": r.status,
          "passed": r.passed,
          "failed": r.failed,
          "skipped": r.skipped,
          "seconds": round(r.seconds, 1),
          "problems": r.problems,
          "failures": r.failures,
          "skips": r.skips,
        }
        for r in results.values()
      ],
    }
    with open(os.path.join(self.out, "results.json"), "w") as f:
      json.dump(data, f, indent=1)
      f.write("\n")
    v = data["versions"]
    versions = ", ".join(
      f"{k} {v[k]}"
      for k in (
        "jax",
        "jaxlib",
        "libtpu",
        "libtpu-nightly",
        "jax-cuda12-plugin",
        "jax-cuda13-plugin",
        "numpy",
        "python",
        "pytest",
        "hypothesis",
      )
      if k in v
    )
    ours = ", ".join(f"{k} {v[k]}" for k in sorted(v) if k.startswith("jaxw"))
    md = [
      f"# Hardware test results: `_{self.args.backend}` targets",
      "",
      f"- Device: {s.get('device_count')} x {s.get('device_kind')} "
      f"(platform {s.get('platform')}"
      + (f"; {s['platform_version']}" if s.get("platform_version") else "")
      + ")",
      f"- Versions: {versions or 'unknown'}",
      f"- jaxworks: {ours or 'not installed as wheels (source tree)'}",
      f"- Date: {data['date']}" + (f"; commit {commit}" if commit else ""),
      f"- Command: `{command}` ({seconds:.0f} s, "
      f"{self.processes} pytest process(es))",
      f"- Result: `{line}`" + ("" if ok else " **(FAILED)**"),
      "",
      "| target | passed | failed | skipped | seconds | status |",
      "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in results.values():
      md.append(
        f"| `{r.target.label}` | {r.passed} | {r.failed} | {r.skipped} | "
        f"{r.seconds:.1f} | {r.status}"
        + (f": {'; '.join(r.problems)}" if r.problems else "")
        + " |"
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
    if failures or self.problems:
      md += ["", "## Failures", ""]
      for p in self.problems:
        md.append(f"- {p}")
      for r, f in failures:
        md += [f"- `{r.target.label}`:", "", "```", f, "```", ""]
    with open(os.path.join(self.out, "results.md"), "w") as f:
      f.write("\n".join(md).rstrip() + "\n")


def _shown(path: str) -> str:
  rel = os.path.relpath(path)
  return path if rel.startswith("..") else rel


def _exit_text(code: int, killed: bool) -> str:
  if killed:
    return "killed after the process's time budget"
  if code is not None and code < 0:
    try:
      return f"signal {signal.Signals(-code).name}"
    except ValueError:
      return f"signal {-code}"
  return f"exit status {code}"


def _git_commit() -> str | None:
  try:
    out = subprocess.run(
      ["git", "rev-parse", "--short=12", "HEAD"],
      cwd=ROOT,
      capture_output=True,
      text=True,
      check=True,
      timeout=10,
    ).stdout.strip()
    dirty = subprocess.run(
      ["git", "status", "--porcelain", "--untracked-files=no"],
      cwd=ROOT,
      capture_output=True,
      text=True,
      check=True,
      timeout=10,
    ).stdout.strip()
    return out + ("+changes" if dirty else "")
  except (OSError, subprocess.SubprocessError):
    return None


def main(argv: list[str]) -> int:
  if argv[:1] == ["--child"]:
    return _child(argv[1])
  parser = argparse.ArgumentParser(
    description=__doc__.splitlines()[0],
    formatter_class=argparse.RawDescriptionHelpFormatter,
    epilog="\n".join(__doc__.splitlines()[1:]),
  )
  parser.add_argument("--backend", choices=sorted(PLATFORMS), default="tpu")
  parser.add_argument("--out", help="directory for results.md/.json, logs")
  parser.add_argument(
    "--targets",
    nargs="+",
    metavar="LABEL",
    help="only these targets (a label or a part of one)",
  )
  parser.add_argument(
    "--platforms",
    help="JAX_PLATFORMS for the run instead of the backend's (cpu: simulate "
    "a one-device accelerator on the host)",
  )
  parser.add_argument(
    "--xla-flags",
    default=None,
    help="XLA_FLAGS for the tests (default: as the targets set them)",
  )
  parser.add_argument(
    "--timeout-scale",
    type=float,
    default=1.0,
    help="multiplies each target's timeout (Bazel's for its size)",
  )
  parser.add_argument(
    "--isolate",
    action="store_true",
    help="one pytest process per target (as Bazel runs them)",
  )
  parser.add_argument(
    "--pytest-args", default="", help="more pytest options, one string"
  )
  parser.add_argument(
    "--list", action="store_true", help="print the targets and files only"
  )
  parser.add_argument(
    "--root",
    default=None,
    help="the repository (default: the one this file is in)",
  )
  args = parser.parse_args(argv)
  args.argv = argv
  if args.root:
    global ROOT
    ROOT = os.path.abspath(args.root)
  targets = select(load_targets(), args.backend, args.targets)
  if args.list:
    for t in targets:
      extra = " ".join(t.extra_args())
      print(f"{t.label} [{t.size}] {' '.join(t.files())} {extra}".rstrip())
    print(f"{len(targets)} targets")
    return 0
  if not args.out:
    parser.error("--out DIR is required (or --list)")
  if not targets:
    print(f"hardware_tests: no {args.backend} target matches")
    return 1
  runner = Runner(args)
  print(
    f"hardware_tests: {len(targets)} {args.backend} targets, "
    f"JAX_PLATFORMS={args.platforms or PLATFORMS[args.backend]}",
    flush=True,
  )
  return runner.run(targets)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
