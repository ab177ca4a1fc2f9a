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

Platforms (``--platform``, ``configure_devices`` before ``import jax``):
``cpu`` (the default) is the reference machine's profile, 8 host CPU devices;
``tpu``/``gpu`` run on the devices JAX picks (a TPU v5e machine has one chip)
with rows and sizes chosen for it, and the document says so (``platform``;
written as ``<benchmark>_<platform>.json``). ``--budget-s`` bounds a run:
``Budget``, ``Report.section`` (a part that does not fit, or fails, is
skipped with its reason), ``deadline=`` of the interleaving helpers.
"""

import argparse
import contextlib
import ctypes
import datetime
import gc
import json
import math
import os
import pathlib
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

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
#: Optional row fields: a row measured against a limit of the machine
#: measured in the same run (the host-to-device link, the disk) names it
#: (``limit``, short text) and the fraction of it jaxworks reached
#: (``limit_fraction``: the limit's time / jaxworks' time).
OPTIONAL_ROW_FIELDS = ("limit", "limit_fraction")
DOCUMENT_FIELDS = (
  "schema",
  "package",
  "benchmark",
  "quick",
  "machine",
  "rows",
  "notes",
)
#: Optional document fields: ``platform``, the profile the rows were
#: measured with (absent: ``cpu``).
OPTIONAL_DOCUMENT_FIELDS = ("platform",)
#: The profiles of ``--platform``: ``cpu`` is 8 host CPU devices (the
#: reference machine's rows); the others run on the devices JAX picks.
PLATFORMS = ("cpu", "tpu", "gpu")
_PLATFORM_ENV = "JAXWORKS_BENCH_PLATFORM"
#: About when this process started (this module is imported first).
_START = time.monotonic()
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
  ours,
  reference,
  repeats,
  inner=1,
  setup=None,
  gc_off=True,
  fresh=False,
  deadline=None,
  min_repeats=3,
):
  """Medians ``(ours, reference)`` of seconds per call, interleaved.

  Each repeat times both, alternating which goes first, so both sides share
  the drift of a busy machine. ``setup()``, if given, runs before each
  repeat and returns ``(ours, reference)`` thunks for it (fresh functions
  per repeat); then ``ours`` and ``reference`` may be None. With ``fresh``,
  ``release_memory()`` runs before each timed call (outside the timer):
  for sides that allocate their results, so that neither reuses the other's
  or an earlier repeat's freed memory. With ``deadline`` (a
  ``time.monotonic()`` value, e.g. ``Budget.until``) no repeat starts after
  it once ``min_repeats`` are done.
  """
  t_ours, t_ref = [], []
  for r in range(repeats):
    if r >= min_repeats and _past(deadline):
      break
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
  fns,
  repeats,
  inner=1,
  warmup=False,
  gc_off=True,
  rotate=None,
  settle=None,
  deadline=None,
  min_repeats=3,
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
  call, not during it (billed to whichever call came next). With
  ``deadline`` no repeat starts after it once ``min_repeats`` are done.
  """
  names = list(fns)
  if warmup:
    for name in names:
      ready(fns[name]())
  times = {name: [] for name in names}
  head = names[:rotate] if rotate else names
  rest = names[len(head) :]
  for r in range(repeats):
    if r >= min_repeats and _past(deadline):
      break
    shift = r % len(head)
    for name in head[shift:] + head[:shift] + rest:
      with _GcOff(gc_off):
        times[name].append(per_call(fns[name], inner))
      if settle is not None:
        settle()
  return {name: statistics.median(t) for name, t in times.items()}


def _past(deadline):
  return deadline is not None and time.monotonic() >= deadline


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
  proc = run_process(
    [sys.executable, "-c", code, *args], env=full_env, timeout=timeout
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


#: What a program prints when another one holds the accelerator (libtpu's
#: lock file: one program at a time can hold a TPU chip).
_BUSY = (
  "libtpu multi-process lockfile",
  "TPU is already in use",
  "The TPU is already in use",
)


def device_busy(text):
  """Whether a program's output says another program holds the device."""
  return any(b in (text or "") for b in _BUSY)


def run_process(cmd, env=None, timeout=600, busy_retries=1, busy_wait_s=5.0):
  """``subprocess.run`` of ``cmd``, output captured as text, not checked.

  A program that finds the device held by another one (on a TPU, one
  program at a time holds the chip, and one started just after another
  ended can be refused) is started again after ``busy_wait_s``, up to
  ``busy_retries`` times.
  """
  for attempt in range(busy_retries + 1):
    proc = subprocess.run(
      cmd,
      env=env,
      capture_output=True,
      text=True,
      timeout=timeout,
      check=False,
    )
    if proc.returncode == 0 or not device_busy(proc.stderr):
      return proc
    if attempt < busy_retries:
      time.sleep(busy_wait_s)
  return proc


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
  package,
  case,
  jaxworks_s,
  reference_s,
  reference,
  reference_name,
  goal=None,
  limit=None,
):
  """A validated row: speedup = reference_s / jaxworks_s, met from goal.

  ``limit``: ``(text, seconds)``, a limit of the machine measured in the
  same run (e.g. ``("link 6.3 GB/s", 0.17)``: what the bytes take at the
  host-to-device link's bandwidth); the row keeps the text and the fraction
  of it jaxworks reached (``seconds / jaxworks_s``).
  """
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
  if limit is not None:
    text, seconds = limit
    row["limit"] = text
    row["limit_fraction"] = float(seconds) / float(jaxworks_s)
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
  extra = sorted(set(row) - set(ROW_FIELDS) - set(OPTIONAL_ROW_FIELDS))
  if missing or extra:
    raise SchemaError(
      f"{where}: missing fields {missing}, unknown fields {extra}; a row has "
      f"exactly {', '.join(ROW_FIELDS)} (and optionally "
      f"{', '.join(OPTIONAL_ROW_FIELDS)})"
    )
  if ("limit" in row) != ("limit_fraction" in row):
    raise SchemaError(
      f"{where}: limit and limit_fraction come together (the limit's text "
      "and the fraction of it reached); give both or neither"
    )
  if "limit" in row:
    if not isinstance(row["limit"], str) or not row["limit"].strip():
      raise SchemaError(
        f"{where}: limit={row['limit']!r}; give a non-empty string"
      )
    if not _positive(row["limit_fraction"]):
      raise SchemaError(
        f"{where}: limit_fraction={row['limit_fraction']!r}; give a "
        "finite fraction > 0"
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
  extra = sorted(
    set(doc) - set(DOCUMENT_FIELDS) - set(OPTIONAL_DOCUMENT_FIELDS)
  )
  if missing or extra:
    raise SchemaError(
      f"benchmark document {doc.get('benchmark')!r}: missing fields "
      f"{missing}, unknown fields {extra}"
    )
  if doc.get("platform", "cpu") not in PLATFORMS:
    raise SchemaError(
      f"benchmark document {doc['benchmark']!r}: platform "
      f"{doc['platform']!r}; use one of {', '.join(PLATFORMS)}"
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


def document_platform(doc):
  """The profile of a document's rows (``cpu`` where it names none)."""
  return doc.get("platform", "cpu")


def results_name(benchmark, platform="cpu"):
  """The results file of a benchmark's rows on ``platform``:
  ``<benchmark>.json`` for ``cpu``, ``<benchmark>_<platform>.json`` else."""
  if platform == "cpu":
    return f"{benchmark}.json"
  return f"{benchmark}_{platform}.json"


def ceiling(row):
  """The most speedup a row's limit allows (reference time / the limit's
  time), or None for a row with no limit."""
  if "limit" not in row:
    return None
  return row["reference_s"] / (row["limit_fraction"] * row["jaxworks_s"])


def fmt_ceiling(row):
  """``1.07x``: the most speedup a row's limit allows; "-" with no limit."""
  top = ceiling(row)
  return "-" if top is None else f"{fmt_speedup(top)}"


def fmt_limit(row):
  """``93% (link 6.3 GB/s)``: the fraction of its limit a row reached."""
  if "limit" not in row:
    return "-"
  return f"{100 * row['limit_fraction']:.0f}% ({row['limit']})"


def markdown_table(rows):
  """The rows as a markdown table, goals as yes/no; a column of the
  fraction of its measured limit where a row has one."""
  limits = any("limit" in r for r in rows)
  head = (
    "| case | jaxworks | reference | reference time | speedup | goal | met |"
  )
  rule = "|---|---:|---|---:|---:|---|---|"
  if limits:
    head += " of its limit |"
    rule += "---|"
  lines = [head, rule]
  for r in rows:
    line = (
      f"| {r['case']} | {fmt_seconds(r['jaxworks_s'])} | "
      f"{r['reference']}: {r['reference_name']} | "
      f"{fmt_seconds(r['reference_s'])} | {fmt_speedup(r['speedup'])} | "
      f"{fmt_goal(r['goal'])} | {fmt_met(r['met'])} |"
    )
    if limits:
      line += f" {fmt_limit(r)} |"
    lines.append(line)
  return "\n".join(lines)


def machine(open_backend=True):
  """Where the figures were measured (cores, CPU, load, versions, date, and
  the devices: count and platform; an accelerator's kind, runtime, memory).

  Without ``open_backend`` the devices are read only where this process
  has its backend up already: opening a TPU costs ~15 s, and fails while
  another process holds the chip.
  """
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
  if jax is not None and (open_backend or _backend_up()):
    device = jax.devices()[0]
    info["devices"] = f"{jax.device_count()} {device.platform}"
    if device.platform != "cpu":
      info.update(_accelerator(device))
  return info


def _backend_up():
  """Whether this process has brought JAX's backends up."""
  try:
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel

    return bool(xla_bridge.backends_are_initialized())
  except Exception:  # pylint: disable=broad-except
    return True  # cannot tell: as before


def _accelerator(device):
  """The device kind, runtime and memory of an accelerator (the chip)."""
  from importlib import metadata  # pylint: disable=import-outside-toplevel

  info = {"device_kind": str(getattr(device, "device_kind", "?"))}
  try:
    version = str(device.client.platform_version).strip()
    info["platform_version"] = "; ".join(version.splitlines())
  except Exception:  # pylint: disable=broad-except
    pass
  for dist in ("libtpu", "libtpu-nightly", "jaxlib"):
    try:
      info[dist] = metadata.version(dist)
    except metadata.PackageNotFoundError:
      pass
  try:
    limit = (device.memory_stats() or {}).get("bytes_limit")
    if limit:
      info["memory_gib"] = round(limit / 2**30, 1)
  except Exception:  # pylint: disable=broad-except
    pass
  return info


def add_arguments(parser):
  """Adds ``--json PATH``, ``--platform``, ``--budget-s`` (and ``--quick``
  unless the parser has it)."""
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
  parser.add_argument(
    "--platform",
    choices=PLATFORMS,
    default=None,
    help="the profile: cpu (default: 8 host CPU devices, the reference "
    "rows) or an accelerator's (the devices JAX picks, e.g. one TPU chip; "
    "rows and sizes for it)",
  )
  parser.add_argument(
    "--budget-s",
    type=float,
    default=None,
    metavar="SECONDS",
    help="time budget of this process from its start: parts that do not "
    "fit are skipped, and say so",
  )
  return parser


# ---------------------------------------------------------------- platforms


def requested_platform(argv=None):
  """The profile asked for: ``--platform`` in ``argv`` (default: this
  process's arguments), else the one a parent benchmark asked for
  (``JAXWORKS_BENCH_PLATFORM``), else ``cpu``."""
  argv = sys.argv[1:] if argv is None else list(argv)
  value = None
  for i, arg in enumerate(argv):
    if arg == "--platform" and i + 1 < len(argv):
      value = argv[i + 1]
    elif arg.startswith("--platform="):
      value = arg.split("=", 1)[1]
  if value is None:
    value = os.environ.get(_PLATFORM_ENV) or "cpu"
  if value not in PLATFORMS:
    raise SystemExit(
      f"--platform {value!r}: choose one of {', '.join(PLATFORMS)}"
    )
  return value


def configure_devices(host_devices=8, cpu_only=False, argv=None):
  """Sets up the devices of the profile asked for; call before importing jax.

  ``cpu``: ``host_devices`` host CPU devices (XLA_FLAGS, unless set), and
  with ``cpu_only`` JAX_PLATFORMS=cpu (unless set). An accelerator profile
  leaves both alone: the rows run on the devices JAX picks (a TPU v5e
  machine has one chip). New processes the benchmark starts inherit the
  profile (``JAXWORKS_BENCH_PLATFORM``). Returns the profile.
  """
  profile = requested_platform(argv)
  os.environ[_PLATFORM_ENV] = profile
  if profile == "cpu":
    os.environ.setdefault(
      "XLA_FLAGS", f"--xla_force_host_platform_device_count={host_devices}"
    )
    if cpu_only:
      os.environ.setdefault("JAX_PLATFORMS", "cpu")
  return profile


def on_accelerator_profile():
  """Whether this process runs an accelerator profile (``--platform tpu``)."""
  return requested_platform() != "cpu"


def devices_or_skip(report, what, needed):
  """``jax.devices()`` when at least ``needed`` are present; else None, and
  ``report`` says that ``what`` was skipped and why."""
  import jax  # pylint: disable=import-outside-toplevel

  devices = jax.devices()
  if len(devices) >= needed:
    return devices
  report.skip(
    what,
    f"needs {needed} devices, {len(devices)} {devices[0].platform} present",
  )
  return None


class Budget:
  """The time a benchmark process may take (``--budget-s``), from its start.

  ``left()`` is the time left (infinite without a budget); ``until(share)``
  a deadline for the next part: ``share`` of what is left from now (for the
  ``deadline=`` of ``median_pair``/``median_interleaved``).
  """

  def __init__(self, seconds=None, start=None):
    self.seconds = None if seconds is None else float(seconds)
    self.start = _START if start is None else start

  def left(self):
    if self.seconds is None:
      return math.inf
    return self.start + self.seconds - time.monotonic()

  def fits(self, seconds):
    return self.left() >= seconds

  def until(self, share=1.0):
    """A ``time.monotonic()`` deadline: ``share`` of the time left, from
    now; None without a budget."""
    if self.seconds is None:
      return None
    return time.monotonic() + max(0.0, self.left()) * share

  def __repr__(self):
    if self.seconds is None:
      return "Budget(none)"
    return f"Budget({self.seconds:.0f} s, {self.left():.0f} s left)"


class Report:
  """The rows of one benchmark binary: ``add`` them, then ``finish``.

  ``platform``: the profile of the rows (default: ``requested_platform()``,
  i.e. ``--platform``).
  """

  def __init__(self, package, benchmark=None, platform=None):
    self.package = package
    self.benchmark = benchmark or pathlib.Path(sys.argv[0]).stem
    self.platform = platform
    self.rows = []
    self.notes = []
    self.failed = []
    #: The devices (``machine()``'s keys) as a process this benchmark
    #: started saw them: the document's where this one never opened its
    #: own (an accelerator's profile opens no backend just to name it).
    self.devices = {}

  def add(
    self,
    case,
    jaxworks_s,
    reference_s,
    reference,
    reference_name,
    goal=None,
    limit=None,
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
      limit,
    )
    if any(r["case"] == case for r in self.rows):
      raise SchemaError(f"Report.add: case {case!r} twice; rename one")
    self.rows.append(row)
    return row

  def note(self, text):
    """A line printed (and kept in the JSON) under the table."""
    self.notes.append(str(text))

  def skip(self, what, reason):
    """Notes (and prints at once) that ``what`` was not measured, and why."""
    text = f"skipped: {what} ({reason})"
    print(text, flush=True)
    self.note(text)

  def section(self, name, fn, *args, budget=None, min_s=0.0, **kwargs):
    """Runs one part of the benchmark, ``fn(*args, **kwargs)``; returns its
    result, or None when it was skipped or failed.

    With ``budget`` it is skipped (and says so) when less than ``min_s``
    seconds are left. An exception is printed with its traceback and noted
    (``FAILED: ...``), the rows of the other parts are kept, and
    ``exit_status()`` becomes 1: one broken part costs a run on a scarce
    machine no more than its own rows.
    """
    if budget is not None and not budget.fits(min_s):
      self.skip(
        name,
        f"the time budget: {max(0.0, budget.left()):.0f} s left, it needs "
        f"about {min_s:.0f} s",
      )
      return None
    start = time.monotonic()
    print(f"[{name}] ...", flush=True)
    try:
      result = fn(*args, **kwargs)
    except Exception as err:  # pylint: disable=broad-except
      traceback.print_exc()
      self.failed.append(name)
      self.note(f"FAILED: {name}: {type(err).__name__}: {err}"[:2000])
      print(f"[{name}] FAILED: {type(err).__name__}: {err}", flush=True)
      return None
    print(f"[{name}] done in {time.monotonic() - start:.1f} s", flush=True)
    return result

  def exit_status(self):
    """1 if a part failed (``section``), else 0."""
    return 1 if self.failed else 0

  def finish_on_signal(self, args=None, json_path=None, signum=signal.SIGTERM):
    """On ``signum`` (what a runner sends at the end of a time budget),
    writes the rows measured so far (``finish(args, json_path)``), noted as
    cut short, and exits 124."""

    def handler(received, _frame):
      self.note(
        f"stopped by signal {received} (the runner's time budget) before "
        "every part ran"
      )
      with contextlib.suppress(SchemaError):
        self.finish(args, json_path=json_path)
      sys.stdout.flush()
      os._exit(124)  # pylint: disable=protected-access

    signal.signal(signum, handler)

  def document(self, quick=False):
    platform = self.platform or requested_platform()
    info = machine(open_backend=platform == "cpu")
    if "devices" not in info:
      info.update(self.devices)
    return validate_document(
      {
        "schema": SCHEMA_VERSION,
        "package": self.package,
        "benchmark": self.benchmark,
        "quick": bool(quick),
        "platform": platform,
        "machine": info,
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
    out = file or sys.stdout
    if not self.rows:  # every part skipped or failed: nothing to write
      for note in self.notes:
        print(f"\n{note}", file=out)
      print(f"\n{self.package} ({self.benchmark}): no rows", file=out)
      self.failed.append("no rows")
      return None
    doc = self.document(quick)
    on = "" if doc["platform"] == "cpu" else f", --platform {doc['platform']}"
    print(
      f"\n{self.package} ({self.benchmark}{', --quick' if quick else ''}"
      f"{on}); speedup = reference / jaxworks, > 1: jaxworks faster\n",
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
