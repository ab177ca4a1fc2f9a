"""The wheels on every CPython jaxworks builds for, as a user installs them.

For CPython 3.11, 3.12 and 3.13 (the interpreters of @jaxworks_cpython_*): a
fresh virtualenv of that Python gets jax and jaxlib 0.10.2 from the package
index and the combined ``jaxworks`` wheel with the per-package wheels from the
build (``--find-links``), pip choosing the extension wheels by their own tags;
the smoke test runs there, and on 3.12 and 3.13 the tour too. Every extension
wheel carries the manylinux tag auditwheel computes for it, no newer than
jaxlib's manylinux_2_27. The five sdists build with pip on 3.12 and 3.13 and
pass the smoke test (3.11: //tests:sdist_test). Slow (virtualenvs with
jaxlib): a manual target that .ci/run runs.
"""

import glob
import os
import pathlib
import re
import subprocess
import zipfile

from auditwheel.architecture import Architecture
from auditwheel.libc import Libc
from auditwheel.wheel_abi import analyze_wheel_abi
from install_smoke import SMOKE
from install_smoke import clean_env
import pytest

VERSIONS = ["3.11", "3.12", "3.13"]
BASELINE = (2, 27)  # jaxlib 0.10.2's own wheels: manylinux_2_27_x86_64


def _wheels():
  found = []
  for d in os.environ["JAXWORKS_WHEEL_DIRS"].split():
    found += glob.glob(os.path.join(d, "*.whl"))
  return sorted(set(found))


def _interpreter(version):
  for item in os.environ["JAXWORKS_PYTHONS"].split():
    v, path = item.split("=", 1)
    if v == version:
      return pathlib.Path(path).read_text().strip()
  raise AssertionError(f"no CPython {version} given")


def _run(args, **kwargs):
  out = subprocess.run(
    args, capture_output=True, text=True, env=clean_env(), **kwargs
  )
  assert out.returncode == 0, (args, out.stdout[-3000:], out.stderr[-3000:])
  return out.stdout


def test_every_extension_wheel_is_tagged_manylinux_2_27_or_older():
  tags = {}
  for w in _wheels():
    with zipfile.ZipFile(w) as zf:
      if not any(n.endswith(".so") for n in zf.namelist()):
        continue
    platform = os.path.basename(w)[:-4].split("-")[-1]
    info = analyze_wheel_abi(
      Libc.GLIBC,
      Architecture.x86_64,
      pathlib.Path(w),
      frozenset(),
      disable_isa_ext_check=False,
      allow_graft=False,
    )
    assert info.overall_policy.name == platform, (w, info.overall_policy.name)
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", platform)
    assert m and (int(m.group(1)), int(m.group(2))) <= BASELINE, w
    tags[os.path.basename(w).split("-")[0], w.split("-")[-3]] = platform
  # jit_cache and batched_transfer, for cp311, cp312 and cp313.
  assert len(tags) == 6, tags


_VENVS = {}


def _venv(version, tmp_path_factory):
  if version not in _VENVS:
    root = tmp_path_factory.mktemp("py" + version.replace(".", ""))
    _run([_interpreter(version), "-m", "venv", str(root / "venv")])
    python = str(root / "venv" / "bin" / "python")
    links = [
      a
      for d in sorted({os.path.dirname(w) for w in _wheels()})
      for a in ("--find-links", d)
    ]
    _run(
      [
        python,
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-cache-dir",
        "-q",
        *links,
        "jax==0.10.2",
        "jaxlib==0.10.2",
        "jaxworks",
      ],
      timeout=1800,
    )
    _VENVS[version] = python
  return _VENVS[version]


@pytest.mark.parametrize("version", VERSIONS)
def test_wheels_install_and_pass_the_smoke_test(
  version, tmp_path_factory, tmp_path
):
  python = _venv(version, tmp_path_factory)
  out = _run([python, "-c", SMOKE], cwd=str(tmp_path))
  assert f"smoke ok ({version.replace('.', ', ')})" in out, out
  tag = "cp" + version.replace(".", "")
  wheel_tags = _run(
    [
      python,
      "-c",
      "import importlib.metadata as m\n"
      "for d in ('jaxworks-jit-cache', 'jaxworks-batched-transfer'):\n"
      "  print(m.distribution(d).read_text('WHEEL'))",
    ]
  )
  found = re.findall(r"^Tag: (\S+)$", wheel_tags, re.M)
  assert len(found) == 2 and all(
    t.startswith(f"{tag}-{tag}-manylinux_") for t in found
  ), found


@pytest.mark.parametrize("version", ["3.12", "3.13"])
def test_tour_runs_from_the_combined_wheel(version, tmp_path_factory, tmp_path):
  python = _venv(version, tmp_path_factory)
  tour = pathlib.Path(os.environ["JAXWORKS_TOUR"]).read_text()
  (tmp_path / "tour.py").write_text(tour)
  out = _run(
    [python, str(tmp_path / "tour.py")], cwd=str(tmp_path), timeout=1200
  )
  assert "All checks passed" in out, out[-3000:]


@pytest.mark.parametrize("version", ["3.12", "3.13"])
def test_sdists_build_with_pip_and_pass_the_smoke_test(version, tmp_path):
  # On 3.11 //tests:sdist_test does the same (and compares files with the
  # wheels): here the two extensions compile from source for 3.12 and 3.13.
  _run([_interpreter(version), "-m", "venv", str(tmp_path / "venv")])
  python = str(tmp_path / "venv" / "bin" / "python")
  pip = [
    python,
    "-m",
    "pip",
    "install",
    "--disable-pip-version-check",
    "--no-cache-dir",
    "-q",
  ]
  # The runtime requirements of the five (pip check below), from the index.
  _run(
    [
      *pip,
      "jax==0.10.2",
      "jaxlib==0.10.2",
      "packaging",
      "flatbuffers",
      "fastcrc",
    ],
    timeout=1800,
  )
  sdists = []
  for d in os.environ["JAXWORKS_SDIST_DIRS"].split():
    sdists += glob.glob(os.path.join(d, "*.tar.gz"))
  assert len(sdists) == 5, sdists
  names = ",".join(
    os.path.basename(s).split("-")[0].replace("_", "-") for s in sdists
  )
  out = subprocess.run(
    [*pip, "--no-deps", "--no-binary", names, *sorted(sdists)],
    capture_output=True,
    text=True,
    env=clean_env(),
    timeout=1800,
  )
  assert out.returncode == 0, "\n".join(
    (out.stdout + out.stderr).splitlines()[-60:]
  )
  out = _run([python, "-c", SMOKE], cwd=str(tmp_path))
  assert f"smoke ok ({version.replace('.', ', ')})" in out, out
  _run([python, "-m", "pip", "check"])
