"""The figures in BENCHMARKS.md and every README are what the checked-in JSON renders to."""

import json
import os
import pathlib
import re

import jaxworks_bench as jb
import pytest
import render


def _root():
  for var in ("RUNFILES_DIR", "TEST_SRCDIR"):
    path = os.environ.get(var)
    if path and pathlib.Path(path, "jaxworks", "benchmarks").is_dir():
      return pathlib.Path(path, "jaxworks")
  return pathlib.Path(__file__).resolve().parents[1]  # the dev runner


ROOT = _root()


LISTED = render.listed_benchmarks(ROOT)
PACKAGES = sorted({p for p, _ in LISTED})


def test_generated_figures_match_the_json():
  stale = render.check(ROOT, PACKAGES)
  assert not stale, (
    f"{stale} differ from what benchmarks/results/*.json renders to; run "
    "`./tools/bazel run //benchmarks:all -- --render-only` (and do not edit "
    "figures between the figures markers by hand)"
  )


def test_every_results_file_is_valid_and_listed():
  docs = render.load_results(ROOT)  # validates every document
  names = {b for _, b in LISTED}
  leftovers = sorted(
    d["benchmark"] for d in docs if d["benchmark"] not in names
  )
  assert not leftovers, f"results of unlisted benchmarks: {leftovers}"
  for doc in docs:
    assert (doc["package"], doc["benchmark"]) in LISTED, doc["benchmark"]


def test_every_listed_benchmark_has_results():
  have = {d["benchmark"] for d in render.load_results(ROOT)}
  missing = sorted(b for _, b in LISTED if b not in have)
  assert not missing, (
    f"no benchmarks/results/<name>.json for {missing}: run `./tools/bazel "
    f"run //benchmarks:all -- --only {','.join(missing)}` and check it in"
  )


def test_every_jaxworks_benchmark_is_listed():
  declared = set()
  for build in sorted(ROOT.glob("packages/*/BUILD.bazel")):
    for name in re.findall(
      r'jaxworks_benchmark\(\s*name\s*=\s*"(\w+)"', build.read_text()
    ):
      declared.add((build.parent.name, name))
  assert declared, "no jaxworks_benchmark found in packages/*/BUILD.bazel"
  missing = sorted(declared - set(LISTED))
  assert not missing, (
    f"{missing} are not in _BENCHMARKS of benchmarks/BUILD.bazel, so "
    "//benchmarks:all does not run them; add them there"
  )


def test_a_changed_figure_is_caught(tmp_path):
  """The check fails when a README's block or BENCHMARKS.md drifts from the JSON."""
  for rel in ["README.md", "BENCHMARKS.md", render.RESULTS] + [
    f"packages/{p}/README.md" for p in PACKAGES
  ]:
    src = ROOT / rel
    dst = tmp_path / rel
    if src.is_dir():
      dst.mkdir(parents=True)
      for f in src.glob("*.json"):
        (dst / f.name).write_text(f.read_text())
    else:
      dst.parent.mkdir(parents=True, exist_ok=True)
      dst.write_text(src.read_text())
  assert render.check(tmp_path, PACKAGES) == []
  docs = sorted((tmp_path / render.RESULTS).glob("*.json"))
  if not docs:
    pytest.skip("no results checked in yet")
  doc = json.loads(docs[0].read_text())
  row = doc["rows"][0]
  row["jaxworks_s"] *= 2  # a re-run that changed one figure
  row["speedup"] = row["reference_s"] / row["jaxworks_s"]
  if row["goal"] is not None:
    row["met"] = row["speedup"] >= row["goal"]
  docs[0].write_text(json.dumps(doc))
  stale = render.check(tmp_path, PACKAGES)
  assert "BENCHMARKS.md" in stale
  assert f"packages/{doc['package']}/README.md" in stale
  # And a block edited by hand, with the JSON back as it was.
  render.render_all(tmp_path, PACKAGES, chart=False)
  assert render.check(tmp_path, PACKAGES) == []
  readme = tmp_path / "packages" / doc["package"] / "README.md"
  text = readme.read_text()
  shown = jb.fmt_seconds(row["jaxworks_s"])
  assert shown in text
  readme.write_text(text.replace(shown, "1.00 ns", 1))
  assert render.check(tmp_path, PACKAGES) == [
    f"packages/{doc['package']}/README.md"
  ]


def test_a_readme_without_markers_is_refused():
  with pytest.raises(ValueError, match="figures:begin"):
    render.replace_block("# x\nno markers\n", "block", "x/README.md")
  text = f"a\n{render.BEGIN}\nold 7.7x\n{render.END}\nb\n"
  assert render.replace_block(text, "new", "r") == (
    f"a\n{render.BEGIN}\nnew\n{render.END}\nb\n"
  )


def _copy_tree(tmp_path):
  """The generated files, their inputs and the benchmark list (the BUILD
  file in a source tree, its generated benchmarks.txt under Bazel)."""
  listed = [
    rel
    for rel in ("benchmarks/benchmarks.txt", "benchmarks/BUILD.bazel")
    if (ROOT / rel).is_file()
  ]
  for rel in ["README.md", "BENCHMARKS.md", listed[0]] + [
    f"packages/{p}/README.md" for p in PACKAGES
  ]:
    (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rel).write_text((ROOT / rel).read_text())
  (tmp_path / render.RESULTS).mkdir(parents=True)
  for f in (ROOT / render.RESULTS).glob("*.json"):
    (tmp_path / render.RESULTS / f.name).write_text(f.read_text())


def test_tpu_rows_render_in_a_section_of_their_own(tmp_path):
  """Rows measured on a TPU (<benchmark>_tpu.json) get BENCHMARKS.md's
  "On a TPU" section, a line in their package's block and a table in the
  root README's; the reference rows, the chart's input and the summary
  stay as they were."""
  _copy_tree(tmp_path)
  for f in (tmp_path / render.RESULTS).glob("*_tpu.json"):  # checked-in ones
    f.unlink()
  cpu = [
    d for d in render.load_results(tmp_path) if d["package"] == "jit_cache"
  ][0]
  before = {
    rel: text
    for rel, text in render.targets(
      tmp_path, render.load_results(tmp_path), PACKAGES
    ).items()
  }
  doc = json.loads(json.dumps(cpu))
  doc["platform"] = "tpu"
  doc["machine"].update(devices="1 tpu", device_kind="TPU v5 lite")
  row = doc["rows"][0]
  row.update(limit="link 6.30 GB/s", limit_fraction=0.93)
  name = jb.results_name(doc["benchmark"], "tpu")
  (tmp_path / render.RESULTS / name).write_text(json.dumps(doc))
  docs = render.load_results(tmp_path)
  assert render.reference_docs(docs) == render.reference_docs(
    render.load_results(ROOT)
  )
  after = render.targets(tmp_path, docs, PACKAGES)
  report = after["BENCHMARKS.md"]
  assert report.startswith(before["BENCHMARKS.md"].rstrip("\n"))
  section = report[len(before["BENCHMARKS.md"].rstrip("\n")) :]
  assert "\n## On a TPU\n" in section and "TPU v5 lite" in section
  assert f"--platform tpu --only {doc['benchmark']}" in section
  assert "| of its limit |" in section and "| 93% (link 6.30 GB/s) |" in section
  assert "not a tpu" not in section
  block = after["packages/jit_cache/README.md"]
  assert "On a TPU (TPU v5 lite" in block
  assert "(../../BENCHMARKS.md#on-a-tpu)" in block
  assert (
    after["packages/axis_names/README.md"]
    == (before["packages/axis_names/README.md"])
  )
  assert "On a TPU (TPU v5 lite" in after["README.md"]
  # A TPU document under the reference rows' name is refused.
  (tmp_path / render.RESULTS / name).unlink()
  (tmp_path / render.RESULTS / f"{doc['benchmark']}.json").write_text(
    json.dumps(doc)
  )
  with pytest.raises(jb.SchemaError, match=re.escape(f"name the file {name}")):
    render.load_results(tmp_path)


def test_a_trial_off_the_platform_says_so(tmp_path):
  _copy_tree(tmp_path)
  cpu = render.load_results(tmp_path)[0]
  doc = dict(cpu, platform="tpu")  # a trial of the TPU round on a CPU
  line = render._machine_line(doc)  # pylint: disable=protected-access
  assert "(**not a tpu: a trial of the tpu round**)" in line
