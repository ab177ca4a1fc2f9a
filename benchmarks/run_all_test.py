"""//benchmarks:all --quick writes a report with a section per package, a summary of ratios and a PNG chart."""

import os
import pathlib
import re
import subprocess
import sys

PACKAGES = (
  "axis_names",
  "batched_transfer",
  "jit_cache",
  "stages_aot",
  "pmap_chunked",
)


def _runfiles():
  for var in ("RUNFILES_DIR", "TEST_SRCDIR"):
    path = os.environ.get(var)
    if path and pathlib.Path(path, "jaxworks").is_dir():
      return pathlib.Path(path)
  here = pathlib.Path(
    os.path.abspath(__file__)
  )  # runfiles are symlinks: do not resolve them
  return next(p for p in here.parents if p.name.endswith(".runfiles"))


def test_quick_report_and_chart(tmp_path):
  out_dir = pathlib.Path(os.environ.get("TEST_TMPDIR", tmp_path))
  report, chart = out_dir / "report.md", out_dir / "report.png"
  runfiles = _runfiles()
  binary = runfiles / "jaxworks" / "benchmarks" / "all"
  env = dict(os.environ, RUNFILES_DIR=str(runfiles))
  proc = subprocess.run(
    [sys.executable, str(binary), "--quick", str(report)],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert proc.returncode == 0, (
    f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
  )
  assert report.is_file() and chart.is_file()
  assert (
    chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    and chart.stat().st_size > 10_000
  )
  text = report.read_text()
  headings = re.findall(r"^## (\S+)$", text, re.MULTILINE)
  assert headings == ["Summary"] + list(PACKAGES)
  assert "FAILED" not in text
  assert "![jaxworks / reference, every ratio row](report.png)" in text
  # Every package contributes ratio rows to the summary, each with a positive normalized ratio.
  summary = text.split("## Summary", 1)[1].split(f"## {PACKAGES[0]}", 1)[0]
  rows = [
    line
    for line in summary.splitlines()
    if line.startswith("| ") and not line.startswith("| package")
  ]
  assert {row.split(" | ")[0].lstrip("| ") for row in rows} == set(PACKAGES)
  assert all(float(row.rstrip(" |").rsplit("| ", 1)[1]) > 0 for row in rows)
  # Each package's own tables are there verbatim (a table header line of each benchmark).
  for package in PACKAGES:
    section = text.split(f"## {package}\n", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"^\|.*\|$", section, re.MULTILINE), (
      f"no table under {package}"
    )
  assert "wrote " in proc.stdout


def test_ratio_parsing_and_orientation():
  sys.path.insert(0, str(_runfiles() / "jaxworks" / "benchmarks"))
  import run_all  # pylint: disable=import-outside-toplevel

  text = "\n".join(
    [
      "## speed",
      "",
      "| case | jax ms | ours ms | ratio (ours / jax) | loop / jaxworks | speedup |",
      "|---|---:|---:|---:|---:|---:|",
      "| a | 2.0 | 1.0 | 0.50x | 4.0x | 2.0x |",
      "| b | 1.0 | 3.0 | 3.00x | - | 1.5x faster |",
      "",
      "throughput",
      "",
      "| file | ours GB/s | numpy GB/s | restore / numpy |",
      "|---|---:|---:|---:|",
      "| f | 1.0 | 2.0 | 0.50x |",
    ]
  )
  rows = run_all.ratio_rows("pkg", text)
  got = {(r["case"], r["column"]): round(r["normalized"], 3) for r in rows}
  assert got == {
    ("a", "ratio (ours / jax)"): 0.5,  # jaxworks / reference as printed
    ("a", "loop / jaxworks"): 0.25,  # reference / jaxworks: inverted
    ("a", "speedup"): 0.5,
    ("b", "ratio (ours / jax)"): 3.0,
    ("b", "speedup"): 0.667,  # "faster": a speedup
    (
      "f",
      "restore / numpy",
    ): 2.0,  # a ratio of rates: half the throughput is twice the time
  }
  assert {r["table"] for r in rows} == {"speed", "throughput"}
