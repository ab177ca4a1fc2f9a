"""Runs every package's benchmark and writes one markdown report plus a PNG chart of the ratios.

    ./tools/bazel run //benchmarks:all -- [--quick] OUTPUT.md [--chart CHART.png]

Each package's benchmark (//packages/<pkg>:<pkg>_bench) runs from this binary's
runfiles, one after another, each in its own process with 8 host CPU devices. The report holds

* a summary table: every ratio row of every benchmark, with the printed ratio normalized to one direction,
  "time with jaxworks / time with the reference" (stock JAX, or the naive way the benchmark names; < 1: jaxworks
  is faster);
* the chart of those normalized ratios (PNG, log scale), next to the report unless --chart says where;
* under one heading per package, the benchmark's own output verbatim (its markdown headings demoted below the
  package heading).

A benchmark that fails is reported with its exit status and the tail of its stderr; the report is still written,
and the exit status is then 1. Relative paths are taken from the directory `bazel run` was started in.
"""

import argparse
import datetime
import os
import pathlib
import platform
import re
import subprocess
import sys
import time

PACKAGES = (
  "axis_names",
  "batched_transfer",
  "jit_cache",
  "stages_aot",
  "pmap_chunked",
)
WORKSPACE = "jaxworks"
TIMEOUT_S = 600

# Words that name the jaxworks side or the reference side of an "A / B" ratio column header.
_OURS = {
  "ours",
  "jaxworks",
  "jit_cache",
  "stages_aot",
  "batched_transfer",
  "pmap_chunked",
  "axis_names",
  "repeated",
  "rename",
  "restore",
  "c++",
}
_REFERENCE = {
  "jax",
  "stock",
  "naive",
  "loop",
  "list",
  "full",
  "numpy",
  "reference",
  "python",
}
_RATIO_HEADER = re.compile(r"ratio|speedup|\s/\s", re.IGNORECASE)
_RATIO_VALUE = re.compile(
  r"^\s*([0-9][0-9,]*(?:\.[0-9]+)?)\s*x?\s*(faster|slower)?\s*$", re.IGNORECASE
)
_RATE_UNIT = re.compile(r"[A-Za-z]/s\b")


# ------------------------------------------------------------------------------------------- running


def runfiles_dir():
  """The runfiles tree of this binary (under bazel run and bazel test)."""
  candidates = []
  for var in ("RUNFILES_DIR", "RUNFILES_MANIFEST_FILE"):
    value = os.environ.get(var, "")
    # Bazel's Python stub may hand over the manifest (<dir>/MANIFEST or <dir>_manifest) instead of the tree.
    for suffix in ("/MANIFEST", "_manifest"):
      if value.endswith(suffix):
        value = value[: -len(suffix)]
    if value:
      candidates.append(pathlib.Path(value))
  # Runfiles are symlinks: look at this file's path as run, not where it resolves to.
  here = pathlib.Path(os.path.abspath(__file__))
  candidates += [p for p in here.parents if p.name.endswith(".runfiles")]
  candidates.append(pathlib.Path(os.path.abspath(sys.argv[0]) + ".runfiles"))
  for candidate in candidates:
    if (candidate / WORKSPACE / "benchmarks").is_dir():
      return candidate
  raise SystemExit(
    "benchmarks/run_all.py: no runfiles found (looked at "
    f"{', '.join(map(str, candidates)) or 'nothing'}); run it with "
    "`./tools/bazel run //benchmarks:all -- OUTPUT.md`"
  )


def bench_command(runfiles, package):
  """The command and environment that run //packages/<pkg>:<pkg>_bench from this binary's runfiles tree."""
  env = dict(os.environ)
  env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  env.setdefault("JAX_PLATFORMS", "cpu")
  env["RUNFILES_DIR"] = str(runfiles)
  binary = runfiles / WORKSPACE / "packages" / package / f"{package}_bench"
  if not binary.exists():
    raise SystemExit(
      f"benchmarks/run_all.py: {binary} is not in the runfiles; add "
      f"//packages/{package}:{package}_bench to the data of //benchmarks:all"
    )
  return [sys.executable, str(binary)], env


def run_benchmark(runfiles, package, quick):
  """Runs one benchmark; returns (exit status, stdout, stderr, seconds)."""
  cmd, env = bench_command(runfiles, package)
  cmd += ["--quick"] if quick else []
  start = time.perf_counter()
  try:
    proc = subprocess.run(
      cmd,
      env=env,
      capture_output=True,
      text=True,
      timeout=TIMEOUT_S,
      check=False,
    )
    result = proc.returncode, proc.stdout, proc.stderr
  except subprocess.TimeoutExpired as err:
    result = (
      124,
      err.stdout or "",
      f"timed out after {TIMEOUT_S} s\n{err.stderr or ''}",
    )
  return result + (time.perf_counter() - start,)


# ------------------------------------------------------------------------------------------- parsing


def _cells(line):
  return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_tables(text):
  """Markdown tables in `text`: [(caption, header cells, rows of cells)], caption = the line before."""
  tables, lines, i = [], text.splitlines(), 0
  while i < len(lines):
    if (
      lines[i].lstrip().startswith("|")
      and i + 1 < len(lines)
      and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1])
    ):
      caption = next(
        (
          l.strip()
          for l in reversed(lines[:i])
          if l.strip() and not l.lstrip().startswith("|")
        ),
        "",
      )
      header, rows, i = _cells(lines[i]), [], i + 2
      while i < len(lines) and lines[i].lstrip().startswith("|"):
        rows.append(_cells(lines[i]))
        i += 1
      tables.append((caption, header, rows))
    else:
      i += 1
  return tables


def _is(word, words, prefix):
  return word in words or word.startswith(prefix)


def orientation(header, value_text, table_headers):
  """+1 if a ratio column reads jaxworks / reference, -1 if reference / jaxworks."""
  sign = 1
  h = header.lower()
  if re.search(r"faster", value_text, re.IGNORECASE) or "speedup" in h:
    sign = -1
  else:
    m = re.search(r"([\w.+]+)\s/\s([\w.+]+)", h)
    if m:
      left, right = m.group(1), m.group(2)
      if _is(right, _OURS, "jaxworks.") or _is(left, _REFERENCE, "jax."):
        sign = -1
  if any(_RATE_UNIT.search(t) for t in table_headers + [value_text]):
    sign = -sign  # a ratio of rates (GB/s): the time ratio is its inverse
  return sign


def _caption(text):
  """A table's caption: its heading or the line before it, without goals; '' for a version banner."""
  text = text.lstrip("#").strip()
  if re.match(r"^(jax|jaxworks)[\w.]* \d", text):
    return ""
  return re.split(r"\s\(goal|\s\(", text)[0][:60].strip()


def ratio_rows(package, text):
  """Every ratio cell of every table: dicts with package, table, case, column, printed, normalized."""
  out = []
  for caption, header, rows in parse_tables(text):
    columns = [
      j for j, h in enumerate(header) if j > 0 and _RATIO_HEADER.search(h)
    ]
    firsts = [r[0] for r in rows if r]
    for row in rows:
      if len(row) != len(header):
        continue
      case = (
        row[0]
        if not re.fullmatch(r"[0-9,.]+", row[0])
        else f"{header[0]} {row[0]}"
      )
      if firsts.count(row[0]) > 1 and len(row) > 1:
        case += f" ({header[1]} {row[1]})"
      for j in columns:
        m = _RATIO_VALUE.match(row[j])
        if not m:
          continue
        value = float(m.group(1).replace(",", ""))
        if value <= 0:
          continue
        sign = orientation(header[j], row[j], header)
        out.append(
          {
            "package": package,
            "table": _caption(caption),
            "case": case,
            "column": header[j],
            "printed": row[j],
            "normalized": value if sign > 0 else 1.0 / value,
          }
        )
  return out


# ------------------------------------------------------------------------------------------- writing


def demote_headings(text, levels=2):
  return "\n".join(
    ("#" * levels + line) if re.match(r"^#{1,4}\s", line) else line
    for line in text.splitlines()
  )


def machine_line():
  cpu = platform.processor() or platform.machine()
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  try:
    from importlib import metadata

    jax_version = metadata.version("jax")
  except Exception:  # pylint: disable=broad-except
    jax_version = "unknown"
  devices = re.search(
    r"device_count=(\d+)",
    os.environ.get("XLA_FLAGS", "--xla_force_host_platform_device_count=8"),
  )
  load = (
    f", load average {os.getloadavg()[0]:.1f} at the start (a shared machine)"
    if hasattr(os, "getloadavg")
    else ""
  )
  return (
    f"{os.cpu_count()} cores ({cpu}), {devices.group(1) if devices else '?'} forced host CPU devices, "
    f"jax {jax_version}, Python {platform.python_version()}, {platform.system()} {platform.release()}, "
    f"{datetime.date.today().isoformat()}{load}"
  )


def write_chart(rows, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  labels = [
    f"{r['package']}: {r['case'][:60]}"
    + ("" if r["column"].lower().startswith("ratio") else f" [{r['column']}]")
    for r in rows
  ]
  values = [r["normalized"] for r in rows]
  colors_by_pkg = {p: plt.get_cmap("tab10")(i) for i, p in enumerate(PACKAGES)}
  fig, ax = plt.subplots(figsize=(11, 0.3 * len(rows) + 1.6))
  ypos = list(range(len(rows)))[::-1]
  # Bars grow from 1 (parity) towards the ratio: left of the line jaxworks is faster.
  ax.barh(
    ypos,
    [abs(v - 1.0) for v in values],
    left=[min(v, 1.0) for v in values],
    color=[colors_by_pkg.get(r["package"], "grey") for r in rows],
  )
  ax.set_xscale("log")
  ax.set_xlim(min(values + [1.0]) / 8, max(values + [1.0]) * 4)
  ax.axvline(1.0, color="black", linewidth=1)
  ax.set_yticks(ypos)
  ax.set_yticklabels(labels, fontsize=7)
  ax.set_xlabel(
    "time with jaxworks / time with the reference (log scale; < 1: jaxworks faster)"
  )
  ax.set_title(
    "jaxworks benchmarks: ratios against stock JAX and naive baselines"
  )
  for y, v in zip(ypos, values):
    ax.text(
      v,
      y,
      f" {v:.3g} " if v >= 1 else f" {v:.3g} ",
      va="center",
      fontsize=6,
      ha="left" if v >= 1 else "right",
    )
  handles = [
    plt.Rectangle((0, 0), 1, 1, color=c) for c in colors_by_pkg.values()
  ]
  ax.legend(handles, list(colors_by_pkg), fontsize=7, loc="upper right")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def write_report(results, out_path, chart_path, quick, command):
  rows = [
    r
    for package, (rc, stdout, _, _) in results.items()
    if rc == 0
    for r in ratio_rows(package, stdout)
  ]
  lines = [
    "# jaxworks benchmarks",
    "",
    f"Machine: {machine_line()}.",
    "",
    f"Generated by `./tools/bazel run //benchmarks:all -- {command}`: each package's benchmark (`//packages/<pkg>:<pkg>_bench`"
    f"{', --quick' if quick else ''}) in its own process, medians of repeats side by side with stock JAX.",
    "",
    "## Summary",
    "",
    "Every ratio the benchmarks print, normalized to **time with jaxworks / time with the reference** "
    "(stock JAX, or the naive way the benchmark names): below 1 jaxworks is faster. `as printed` is the "
    "benchmark's own cell (some print speedups, reference / jaxworks).",
    "",
    "| package | table | case | column | as printed | jaxworks / reference |",
    "|---|---|---|---|---:|---:|",
  ]
  for r in rows:
    lines.append(
      f"| {r['package']} | {r['table']} | {r['case']} | {r['column']} | {r['printed']} | "
      f"{r['normalized']:.3g} |"
    )
  if rows:
    write_chart(rows, chart_path)
    rel = os.path.relpath(chart_path, out_path.parent)
    lines += ["", f"![jaxworks / reference, every ratio row]({rel})"]
  for package, (rc, stdout, stderr, seconds) in results.items():
    lines += [
      "",
      f"## {package}",
      "",
      f"`./tools/bazel run //packages/{package}:{package}_bench{' -- --quick' if quick else ''}` "
      f"({seconds:.1f} s)",
      "",
    ]
    if rc == 0:
      lines.append(demote_headings(stdout.strip()))
    else:
      tail = "\n".join(stderr.strip().splitlines()[-25:])
      lines += [f"**FAILED** with exit status {rc}:", "", "```", tail, "```"]
  out_path.write_text("\n".join(lines) + "\n")
  return rows


def _resolve(path):
  p = pathlib.Path(path)
  if not p.is_absolute():
    p = pathlib.Path(os.environ.get("BUILD_WORKING_DIRECTORY", os.getcwd())) / p
  return p


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "output", help="the markdown report to write (e.g. BENCHMARKS.md)"
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help="pass --quick to every benchmark (small, fast)",
  )
  parser.add_argument(
    "--chart",
    default=None,
    help="the PNG chart (default: the report's path with .png)",
  )
  parser.add_argument(
    "--packages",
    default=",".join(PACKAGES),
    help="comma-separated subset to run",
  )
  args = parser.parse_args(argv)
  out_path = _resolve(args.output)
  chart_path = (
    _resolve(args.chart) if args.chart else out_path.with_suffix(".png")
  )
  packages = [p for p in args.packages.split(",") if p]
  unknown = sorted(set(packages) - set(PACKAGES))
  if unknown:
    parser.error(
      f"--packages: unknown {unknown}; choose from {', '.join(PACKAGES)}"
    )
  out_path.parent.mkdir(parents=True, exist_ok=True)
  chart_path.parent.mkdir(parents=True, exist_ok=True)

  runfiles = runfiles_dir()
  results = {}
  for package in packages:
    print(
      f"[{len(results) + 1}/{len(packages)}] {package}_bench{' --quick' if args.quick else ''} ...",
      end="",
      flush=True,
    )
    results[package] = run_benchmark(runfiles, package, args.quick)
    rc, _, _, seconds = results[package]
    print(
      f" {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {seconds:.1f} s",
      flush=True,
    )
  command = " ".join(sys.argv[1:] if argv is None else argv)
  rows = write_report(results, out_path, chart_path, args.quick, command)
  print(
    f"wrote {out_path} ({len(rows)} ratio rows)"
    + (f" and {chart_path}" if rows else "")
  )
  failed = [p for p, (rc, _, _, _) in results.items() if rc != 0]
  if failed:
    print(
      f"benchmarks failed: {', '.join(failed)} (see the report)",
      file=sys.stderr,
    )
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
