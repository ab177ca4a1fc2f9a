"""Timing helpers and the result rows every jaxworks benchmark writes.

One module, standard library only (JAX is used when the benchmark imported
it), shared by every ``packages/*/benchmarks/*.py`` and ``examples/tour.py``.
Bazel: ``deps = ["//benchmarks:support"]`` (``jaxworks_benchmark`` adds it);
then ``import jaxworks_bench``.

Timing::

    per_call(fn, inner=100)            # seconds per call, last result awaited
    timed_call(fn)                     # (seconds, result) of one call
    median_time(fn, repeats=7, inner=100, setup=None)
    median_pair(ours, reference, repeats=7, inner=1, setup=None)
    median_interleaved({"a": fa, "b": fb, "c": fc}, repeats=7, inner=1)
    run_fresh(code)                    # a snippet in a new Python process

Rows (one schema, ``ROW_FIELDS``; ``speedup`` = reference / jaxworks, so
above 1 jaxworks is faster; ``goal`` is the minimum speedup asked for, an
overhead cap of 1.05x is the goal ``1 / 1.05``)::

    report = Report("jit_cache")
    parser = argparse.ArgumentParser(); add_arguments(parser)
    args = parser.parse_args()
    report.add("cached call, 1 array arg", ours, stock, "stock-jax", "jax.jit",
               goal=1 / 1.5)
    report.finish(args)     # prints the table; writes args.json if given
"""

import argparse
import ctypes
import datetime
import gc
import json
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

SCHEMA_VERSION = 1
REFERENCE_KINDS = ("stock-jax", "peer", "ablation", "naive")
ROW_FIELDS = (
  "package",
  "case",
  "jaxworks_s",
  "reference_s",
  "reference",
  "reference_name",
  "speedup",
  "goal",
  "met",
)
DOCUMENT_FIELDS = (
  "schema",
  "package",
  "benchmark",
  "quick",
  "machine",
  "rows",
  "notes",
)
# A row's speedup must equal reference_s / jaxworks_s to this relative error.
_SPEEDUP_RTOL = 1e-9


# ------------------------------------------------------------------- timing


def ready(value):
  """Waits for every JAX array in ``value`` (any pytree); returns it."""
  jax = sys.modules.get("jax")
  if jax is not None:
    jax.block_until_ready(value)
  return value


def per_call(fn, inner=1):
  """Seconds per call of ``inner`` back-to-back calls of ``fn()``.

  Only the last result is awaited (``ready``): the calls pipeline as in a
  training loop, and the time of the last one's computation is included.
  """
  if inner < 1:
    raise ValueError(f"per_call: inner={inner!r}; pass a count >= 1")
  start = time.perf_counter()
  for _ in range(inner - 1):
    fn()
  ready(fn())
  return (time.perf_counter() - start) / inner


def timed_call(fn):
  """``(seconds, result)`` of one call of ``fn()``, its result awaited."""
  start = time.perf_counter()
  result = ready(fn())
  return time.perf_counter() - start, result


class _GcOff:
  """Collects, then keeps the cyclic GC off (as ``timeit`` does)."""

  def __init__(self, enabled=True):
    self.enabled = enabled

  def __enter__(self):
    if self.enabled:
      gc.collect()
      self.was_enabled = gc.isenabled()
      gc.disable()

  def __exit__(self, *exc):
    if self.enabled and self.was_enabled:
      gc.enable()


def median_time(fn, repeats, inner=1, setup=None, gc_off=True):
  """Median over ``repeats`` of ``per_call(fn, inner)`` seconds.

  ``setup()`` runs before each repeat, outside the timer (e.g. clearing a
  cache to time a cold call). With ``gc_off`` garbage is collected before
  each repeat and the GC stays off while timing, so a collection of earlier
  garbage is not billed to whichever call triggers it.
  """
  times = []
  for _ in range(repeats):
    if setup is not None:
      setup()
    with _GcOff(gc_off):
      times.append(per_call(fn, inner))
  return statistics.median(times)


def release_memory():
  """Collects garbage and hands the C heap's free memory back to the system
  (glibc's ``malloc_trim``), so that the next call allocates fresh pages as
  a process doing it once does, not pages an earlier repeat freed."""
  gc.collect()
  try:
    ctypes.CDLL(None).malloc_trim(0)
  except (AttributeError, OSError):  # not glibc: nothing to hand back
    pass


def median_pair(
  ours, reference, repeats, inner=1, setup=None, gc_off=True, fresh=False
):
  """Medians ``(ours, reference)`` of seconds per call, interleaved.

  Each repeat times both, alternating which goes first, so both sides share
  the drift of a busy machine. ``setup()``, if given, runs before each
  repeat and returns ``(ours, reference)`` thunks for it (fresh functions
  per repeat); then ``ours`` and ``reference`` may be None. With ``fresh``,
  ``release_memory()`` runs before each timed call (outside the timer):
  for sides that allocate their results, so that neither reuses the other's
  or an earlier repeat's freed memory.
  """
  t_ours, t_ref = [], []
  for r in range(repeats):
    if setup is not None:
      ours, reference = setup()
    order = [(t_ours, ours), (t_ref, reference)]
    if r % 2:
      order.reverse()
    for sink, fn in order:
      if fresh:
        release_memory()
      with _GcOff(gc_off):
        sink.append(per_call(fn, inner))
  return statistics.median(t_ours), statistics.median(t_ref)


def median_interleaved(
  fns, repeats, inner=1, warmup=False, gc_off=True, rotate=None, settle=None
):
  """``{name: median seconds per call}`` of several thunks, interleaved.

  ``fns`` maps names to thunks. Each repeat times every thunk once
  (``per_call(fn, inner)``), the order rotated by one per repeat, so all
  share the drift of a busy machine and none is always first. With
  ``warmup`` each thunk runs once, untimed, before the first repeat. With
  ``rotate=k`` only the first ``k`` thunks rotate, back to back at the start
  of each repeat (the ones compared most closely share a slow spell of the
  machine alike); the others follow in their given order. ``settle``, if
  given, runs after every call, outside the timer: e.g. ``os.sync``, so that
  the writes one call left in the page cache are flushed before the next
  call, not during it (billed to whichever call came next).
  """
  names = list(fns)
  if warmup:
    for name in names:
      ready(fns[name]())
  times = {name: [] for name in names}
  head = names[:rotate] if rotate else names
  rest = names[len(head) :]
  for r in range(repeats):
    shift = r % len(head)
    for name in head[shift:] + head[:shift] + rest:
      with _GcOff(gc_off):
        times[name].append(per_call(fns[name], inner))
      if settle is not None:
        settle()
  return {name: statistics.median(t) for name, t in times.items()}


_PYCACHE: list[str] = []


def fresh_env(env=None) -> dict:
  """The environment of a new benchmark process: this process's, with its
  ``sys.path`` as ``PYTHONPATH`` and bytecode cached in a directory of this
  run (``PYTHONPYCACHEPREFIX``, ``PYTHONDONTWRITEBYTECODE`` dropped).

  Installed packages have their bytecode: pip compiles it at install, and
  JAX's is in site-packages. Bazel's runfiles have none, and with
  ``PYTHONDONTWRITEBYTECODE`` set every new process compiled jaxworks'
  modules from source (about 50 ms of a train step's time to first result
  here), which no installed jaxworks does. The first process of a run writes
  the cache for both sides; medians come from the runs after it.
  """
  if not _PYCACHE:
    _PYCACHE.append(tempfile.mkdtemp(prefix="jaxworks-bench-pycache-"))
  full_env = dict(os.environ)
  full_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
  full_env.pop("PYTHONDONTWRITEBYTECODE", None)
  full_env["PYTHONPYCACHEPREFIX"] = _PYCACHE[0]
  full_env.update(env or {})
  return full_env


def run_fresh(code, args=(), env=None, timeout=600):
  """Runs the Python snippet ``code`` in a new process; returns its result.

  The process gets this process's ``sys.path`` (so it imports what this one
  imports) and environment, updated with ``env`` (see ``fresh_env``). The snippet reports by
  printing one JSON value as its last line of stdout; ``run_fresh`` returns
  ``(wall seconds of the whole process, that value)``. A failing snippet
  raises RuntimeError with its stderr.
  """
  full_env = fresh_env(env)
  start = time.perf_counter()
  proc = subprocess.run(
    [sys.executable, "-c", code, *args],
    env=full_env,
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )
  wall = time.perf_counter() - start
  if proc.returncode != 0:
    raise RuntimeError(
      f"run_fresh: the snippet exited {proc.returncode}:\n"
      + proc.stderr[-3000:]
    )
  lines = proc.stdout.strip().splitlines()
  if not lines:
    raise RuntimeError(
      "run_fresh: the snippet printed nothing; print one JSON value "
      "(e.g. json.dumps(seconds)) as its last line"
    )
  return wall, json.loads(lines[-1])


def fmt_seconds(seconds):
  """``1.23 ms``-style text with 3 significant digits."""
  for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
    if seconds >= scale:
      return f"{_sig3(seconds / scale)} {unit}"
  return f"{_sig3(seconds / 1e-9)} ns"


def _sig3(value):
  if value >= 100:
    return f"{value:.0f}"
  if value >= 10:
    return f"{value:.1f}"
  return f"{value:.2f}"


def fmt_speedup(value):
  """``9.4x``-style text: 3 significant digits, thousands separated."""
  if value >= 1000:
    return f"{value:,.0f}x"
  return f"{value:.3g}x"


def fmt_goal(goal):
  if goal is None:
    return "-"
  if goal < 1:
    return f">= {fmt_speedup(goal)} (<= {1 / goal:.3g}x slower)"
  return f">= {fmt_speedup(goal)}"


def fmt_met(met):
  return {True: "yes", False: "no", None: "-"}[met]


# --------------------------------------------------------------------- rows


class SchemaError(ValueError):
  """A benchmark row or document that does not follow the schema."""


def make_row(
  package, case, jaxworks_s, reference_s, reference, reference_name, goal=None
):
  """A validated row: speedup = reference_s / jaxworks_s, met from goal."""
  speedup = reference_s / jaxworks_s if jaxworks_s > 0 else math.inf
  row = {
    "package": package,
    "case": case,
    "jaxworks_s": float(jaxworks_s),
    "reference_s": float(reference_s),
    "reference": reference,
    "reference_name": reference_name,
    "speedup": speedup,
    "goal": None if goal is None else float(goal),
    "met": None if goal is None else bool(speedup >= goal),
  }
  validate_row(row)
  return row


def _positive(value):
  return (
    isinstance(value, (int, float))
    and not isinstance(value, bool)
    and math.isfinite(value)
    and value > 0
  )


def validate_row(row, package=None):
  """Raises SchemaError unless ``row`` follows the schema; returns it."""
  if not isinstance(row, dict):
    raise SchemaError(f"a benchmark row must be a dict, got {row!r}")
  where = f"row {row.get('case')!r} of {row.get('package')!r}"
  missing = [f for f in ROW_FIELDS if f not in row]
  extra = sorted(set(row) - set(ROW_FIELDS))
  if missing or extra:
    raise SchemaError(
      f"{where}: missing fields {missing}, unknown fields {extra}; a row has "
      f"exactly {', '.join(ROW_FIELDS)}"
    )
  for field in ("package", "case", "reference_name"):
    if not isinstance(row[field], str) or not row[field].strip():
      raise SchemaError(
        f"{where}: {field}={row[field]!r}; give a non-empty string"
      )
  if package is not None and row["package"] != package:
    raise SchemaError(
      f"{where}: package {row['package']!r} in a document of {package!r}"
    )
  if row["reference"] not in REFERENCE_KINDS:
    raise SchemaError(
      f"{where}: reference={row['reference']!r}; use one of "
      f"{', '.join(REFERENCE_KINDS)} (a comparison with jaxworks' own "
      "pure-Python twin is 'ablation')"
    )
  for field in ("jaxworks_s", "reference_s", "speedup"):
    if not _positive(row[field]):
      raise SchemaError(
        f"{where}: {field}={row[field]!r}; give a finite time > 0 seconds"
      )
  expected = row["reference_s"] / row["jaxworks_s"]
  if not math.isclose(row["speedup"], expected, rel_tol=_SPEEDUP_RTOL):
    raise SchemaError(
      f"{where}: speedup={row['speedup']!r} but reference_s / jaxworks_s = "
      f"{expected!r}; speedup is always reference / jaxworks"
    )
  goal, met = row["goal"], row["met"]
  if goal is None:
    if met is not None:
      raise SchemaError(f"{where}: met={met!r} without a goal; use null")
  else:
    if not _positive(goal):
      raise SchemaError(f"{where}: goal={goal!r}; give a speedup > 0 or null")
    if met is not (row["speedup"] >= goal):
      raise SchemaError(
        f"{where}: met={met!r} but speedup {row['speedup']:.4g} vs goal "
        f"{goal:.4g}; met is speedup >= goal"
      )
  return row


def validate_document(doc):
  """Raises SchemaError unless ``doc`` is a benchmark's JSON output."""
  if not isinstance(doc, dict):
    raise SchemaError(f"a benchmark document must be a dict, got {doc!r}")
  missing = [f for f in DOCUMENT_FIELDS if f not in doc]
  extra = sorted(set(doc) - set(DOCUMENT_FIELDS))
  if missing or extra:
    raise SchemaError(
      f"benchmark document {doc.get('benchmark')!r}: missing fields "
      f"{missing}, unknown fields {extra}"
    )
  if doc["schema"] != SCHEMA_VERSION:
    raise SchemaError(
      f"benchmark document {doc['benchmark']!r}: schema {doc['schema']!r}, "
      f"expected {SCHEMA_VERSION}; re-run the benchmark"
    )
  if not isinstance(doc["rows"], list) or not doc["rows"]:
    raise SchemaError(f"benchmark document {doc['benchmark']!r}: no rows")
  cases = [validate_row(r, doc["package"])["case"] for r in doc["rows"]]
  dupes = sorted({c for c in cases if cases.count(c) > 1})
  if dupes:
    raise SchemaError(
      f"benchmark document {doc['benchmark']!r}: repeated cases {dupes}; "
      "name every case differently"
    )
  if not all(isinstance(n, str) for n in doc["notes"]):
    raise SchemaError(f"benchmark document {doc['benchmark']!r}: notes")
  return doc


def markdown_table(rows):
  """The rows as a markdown table, goals as yes/no."""
  lines = [
    "| case | jaxworks | reference | reference time | speedup | goal | met |",
    "|---|---:|---|---:|---:|---|---|",
  ]
  for r in rows:
    lines.append(
      f"| {r['case']} | {fmt_seconds(r['jaxworks_s'])} | "
      f"{r['reference']}: {r['reference_name']} | "
      f"{fmt_seconds(r['reference_s'])} | {fmt_speedup(r['speedup'])} | "
      f"{fmt_goal(r['goal'])} | {fmt_met(r['met'])} |"
    )
  return "\n".join(lines)


def machine():
  """Where the figures were measured (cores, CPU, load, versions, date)."""
  cpu = platform.processor() or platform.machine()
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  info = {
    "cores": os.cpu_count(),
    "cpu": cpu,
    "python": platform.python_version(),
    "date": datetime.date.today().isoformat(),
  }
  if hasattr(os, "getloadavg"):
    info["load_average"] = round(os.getloadavg()[0], 2)
  jax = sys.modules.get("jax")
  if jax is not None:
    info["jax"] = jax.__version__
    info["devices"] = f"{jax.device_count()} {jax.devices()[0].platform}"
  return info


def add_arguments(parser):
  """Adds ``--json PATH`` (and ``--quick`` unless the parser has it)."""
  if "--quick" not in parser._option_string_actions:  # pylint: disable=protected-access
    parser.add_argument(
      "--quick", action="store_true", help="small sizes, few repeats"
    )
  parser.add_argument(
    "--json",
    metavar="PATH",
    default=None,
    help="also write the rows as JSON (the schema of "
    "benchmarks/support/jaxworks_bench.py) to PATH",
  )
  return parser


class Report:
  """The rows of one benchmark binary: ``add`` them, then ``finish``."""

  def __init__(self, package, benchmark=None):
    self.package = package
    self.benchmark = benchmark or pathlib.Path(sys.argv[0]).stem
    self.rows = []
    self.notes = []

  def add(
    self, case, jaxworks_s, reference_s, reference, reference_name, goal=None
  ):
    """Adds (and returns) one row; see ``make_row``."""
    row = make_row(
      self.package,
      case,
      jaxworks_s,
      reference_s,
      reference,
      reference_name,
      goal,
    )
    if any(r["case"] == case for r in self.rows):
      raise SchemaError(f"Report.add: case {case!r} twice; rename one")
    self.rows.append(row)
    return row

  def note(self, text):
    """A line printed (and kept in the JSON) under the table."""
    self.notes.append(str(text))

  def document(self, quick=False):
    return validate_document(
      {
        "schema": SCHEMA_VERSION,
        "package": self.package,
        "benchmark": self.benchmark,
        "quick": bool(quick),
        "machine": machine(),
        "rows": self.rows,
        "notes": self.notes,
      }
    )

  def finish(self, args=None, json_path=None, quick=None, file=None):
    """Prints the table and notes; writes the JSON document if asked.

    ``args`` is the parsed namespace of ``add_arguments`` (its ``json`` and
    ``quick``); ``json_path``/``quick`` override it. A relative path is
    taken from the directory ``bazel run`` was started in (under ``bazel
    test``, from TEST_TMPDIR). The document is validated before it is
    written and again as read back.
    """
    if json_path is None and args is not None:
      json_path = getattr(args, "json", None)
    if quick is None:
      quick = bool(getattr(args, "quick", False))
    doc = self.document(quick)
    out = file or sys.stdout
    print(
      f"\n{self.package} ({self.benchmark}{', --quick' if quick else ''}); "
      "speedup = reference / jaxworks, > 1: jaxworks faster\n",
      file=out,
    )
    print(markdown_table(self.rows), file=out)
    for note in self.notes:
      print(f"\n{note}", file=out)
    if json_path:
      path = _output_path(json_path)
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(json.dumps(doc, indent=1) + "\n")
      validate_document(json.loads(path.read_text()))  # what readers get
      print(f"\nwrote {path}", file=out)
    return doc


def _output_path(name):
  """``name`` made absolute: relative to where ``bazel run`` was started,
  under ``bazel test`` to the test's TEST_TMPDIR, else to the cwd."""
  path = pathlib.Path(name)
  if path.is_absolute():
    return path
  for var in ("BUILD_WORKING_DIRECTORY", "TEST_TMPDIR"):
    if os.environ.get(var):
      return pathlib.Path(os.environ[var]) / path
  return path.resolve()


def main(argv=None):
  """``python jaxworks_bench.py FILE.json...``: validates and prints them."""
  parser = argparse.ArgumentParser(description=main.__doc__)
  parser.add_argument("files", nargs="+")
  for name in parser.parse_args(argv).files:
    doc = validate_document(json.loads(pathlib.Path(name).read_text()))
    print(f"{name}: {doc['package']}/{doc['benchmark']}, ok\n")
    print(markdown_table(doc["rows"]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
