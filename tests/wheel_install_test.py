"""Installs the built wheels with pip into fresh virtualenvs and uses them from a neutral directory.

The per-package wheels go into one venv, the combined `jaxworks` metapackage (which requires each of them at its exact
version) into another, resolved by pip from the built wheels alone (--no-index --find-links). jax/jaxlib/numpy come
from the build's own virtualenv through a .pth file, so that jaxworks can only be found in what the wheels installed.
From a temporary working directory, every module is imported and each C++ extension is called once for real. The
METADATA an index needs, the manylinux tag that auditwheel verifies, py.typed, the `jaxworks-aot` console script and
the install/uninstall sequences of combined and per-package wheels are checked too.
"""

import glob
import json
import os
import pathlib
import re
import subprocess
import sys
import sysconfig
import zipfile

from auditwheel.architecture import Architecture
from auditwheel.libc import Libc
from auditwheel.wheel_abi import analyze_wheel_abi
from install_smoke import clean_env
import pytest

# One real call into each extension, by module name; an extension without an entry fails the test.
EXTENSION_CALLS = {
  "jaxworks.batched_transfer._grouping": (
    "import numpy as np\n"
    "class Dst:\n    devices = ('d0',)\n    memory_kind = 'device'\n"
    "leaves = [np.zeros(3, np.float32), np.ones(2, np.int8), 'x']\n"
    "gs = m.group_leaves(leaves, [None] * 3, {np.ndarray: (1, None, -1)}, Dst(), 'devices')\n"
    "got = [(g.kind, g.indices, g.nbytes) for g in gs]\n"
    "assert got == [(1, [0, 1], 14), (m.OTHER_KIND, [2], 0)], got"
  ),
  "jaxworks.batched_transfer._checked_read": (
    "import os, tempfile\n"
    "assert m.crc32c(b'123456789') == 0xE3069283\n"
    "data = os.urandom(3000)\n"
    "assert m.crc32c(data) == m.crc32c(data[300:], m.crc32c(data[:300]))\n"
    "fd, path = tempfile.mkstemp()\n"
    "os.write(fd, data)\n"
    "buf = bytearray(3000)\n"
    "assert m.read_crc32c(fd, [buf], 0, 1024) == (3000, m.crc32c(data)) and bytes(buf) == data\n"
    "os.close(fd)\n"
    "os.remove(path)"
  ),
  "jaxworks.jit_cache._signature": (
    "import numpy as np\n"
    "b = m.SignatureBuilder(array_types=(), tracer_type=None, ndarray_type=np.ndarray,"
    " numpy_generic_type=np.generic, fallback=None)\n"
    "s1 = b([np.zeros((2, 3), np.float32)], extra='k')\n"
    "s2 = b([np.ones((2, 3), np.float32)], extra='k')\n"
    "s3 = b([np.zeros((2, 3), np.float64)], extra='k')\n"
    "assert s1 == s2 and hash(s1) == hash(s2) and s1 != s3 and len(s1) == 1"
  ),
}

_ALLOWED = re.compile(
  r"^(jaxworks/[A-Za-z0-9_]+/(.*\.(py|pyi|so)|py\.typed)"
  r"|[A-Za-z0-9_]+-[0-9.]+\.dist-info/(METADATA|WHEEL|RECORD|entry_points\.txt|licenses/LICENSE))$"
)


def _wheels(kind):
  directory = os.environ["JAXWORKS_WHEEL_DIRS"]
  found = []
  for d in directory.split():
    found += glob.glob(os.path.join(d, "*.whl"))
  combined = [w for w in found if os.path.basename(w).startswith("jaxworks-")]
  per_package = [w for w in found if w not in combined]
  return combined if kind == "combined" else per_package


def _wheel_dirs():
  return sorted(
    {os.path.dirname(w) for w in _wheels("combined") + _wheels("per_package")}
  )


def _pip_install(python, *args):
  find_links = [a for d in _wheel_dirs() for a in ("--find-links", d)]
  subprocess.run(
    [
      python,
      "-m",
      "pip",
      "install",
      "--no-index",
      *find_links,
      "--disable-pip-version-check",
      "-q",
      *args,
    ],
    check=True,
    env=clean_env(),
  )


def _make_venv(root):
  subprocess.run(
    [sys.executable, "-m", "venv", root], check=True, env=clean_env()
  )
  python = os.path.join(root, "bin", "python")
  site = subprocess.run(
    [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
    check=True,
    capture_output=True,
    text=True,
    env=clean_env(),
  ).stdout.strip()
  # jax, jaxlib and numpy from the build's virtualenv; jaxworks only from the wheels.
  with open(os.path.join(site, "_build_venv.pth"), "w") as f:
    f.write(sysconfig.get_paths()["purelib"] + "\n")
  return python


_PROBE = r"""
import importlib, json, os, pkgutil, sys
import jaxworks
calls = json.loads(sys.argv[1])
imported, called = [], []
for path in jaxworks.__path__:
    assert "site-packages" in path, f"jaxworks found outside the installed wheel: {path}"
for info in pkgutil.walk_packages(jaxworks.__path__, prefix="jaxworks."):
    if info.name.endswith("__main__"):
        continue
    m = importlib.import_module(info.name)
    imported.append(info.name)
    if getattr(m, "__file__", "").endswith(".so"):
        assert info.name in calls, f"no real call registered for extension {info.name} in wheel_install_test.py"
        exec(calls[info.name], {"m": m})
        called.append(info.name)
print(json.dumps({"imported": imported, "called": called}))
"""


_VENVS = {}


def _installed_python(kind, tmp_path_factory):
  """A fresh venv with the `kind` wheels installed (made once per kind)."""
  if kind not in _VENVS:
    root = tmp_path_factory.mktemp(f"venv_{kind}")
    python = _make_venv(str(root / "venv"))
    # The metapackage's Requires-Dist pulls in every per-package wheel; jax comes from the build venv.
    _pip_install(
      python, *(["jaxworks"] if kind == "combined" else _wheels(kind))
    )
    _VENVS[kind] = python
  return _VENVS[kind]


def _install_and_probe(kind, tmp_path_factory, tmp_path):
  python = _installed_python(kind, tmp_path_factory)
  out = subprocess.run(
    [python, "-c", _PROBE, json.dumps(EXTENSION_CALLS)],
    cwd=str(tmp_path),
    check=True,
    capture_output=True,
    text=True,
    env=clean_env(),
  )
  return json.loads(out.stdout.strip().splitlines()[-1])


def _expected_extensions(wheels):
  names = set()
  for w in wheels:
    with zipfile.ZipFile(w) as zf:
      names |= {
        n[:-3].replace("/", ".") for n in zf.namelist() if n.endswith(".so")
      }
  return names


def _metadata(wheel):
  with zipfile.ZipFile(wheel) as zf:
    return zf.read(
      next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    ).decode()


@pytest.mark.parametrize("kind", ["per_package", "combined"])
def test_wheels_contain_only_jaxworks_files(kind):
  wheels = _wheels(kind)
  assert wheels, (
    f"no {kind} wheels found in {os.environ['JAXWORKS_WHEEL_DIRS']}"
  )
  for w in wheels:
    with zipfile.ZipFile(w) as zf:
      names = zf.namelist()
      stray = [n for n in names if not _ALLOWED.match(n)]
      assert not stray, f"{os.path.basename(w)} holds unexpected files: {stray}"
      assert all(i.date_time == (1980, 1, 1, 0, 0, 0) for i in zf.infolist()), (
        "timestamps are not fixed"
      )
      has_so = any(n.endswith(".so") for n in names)
      assert ("-cp311-cp311-manylinux_" in w) == has_so, (
        f"wrong platform tag for {os.path.basename(w)}"
      )
      assert has_so or w.endswith("-py3-none-any.whl"), os.path.basename(w)
      if kind == "combined":
        # A metapackage: it owns no file, so per-package wheels can come and go beside it.
        assert all(".dist-info/" in n for n in names), names
      else:
        packages = {n.split("/")[1] for n in names if n.startswith("jaxworks/")}
        assert len(packages) == 1, packages
        assert f"jaxworks/{packages.pop()}/py.typed" in names, (
          "no PEP 561 py.typed marker"
        )


# Reference implementations that only tests and benchmarks use: they live beside the tests, never in a wheel.
_TEST_ONLY_DEFINITIONS = re.compile(
  rb"^(def|class) (group_leaves_py|group_leaves_python|PyGroup|py_signature|PySignature)\b",
  re.M,
)


def test_wheels_ship_no_test_only_twins():
  for w in _wheels("per_package"):
    with zipfile.ZipFile(w) as zf:
      for n in zf.namelist():
        if n.endswith(".py"):
          found = _TEST_ONLY_DEFINITIONS.search(zf.read(n))
          assert found is None, (
            f"{os.path.basename(w)}: {n} defines {found.group(0).decode()}, used only by tests"
          )


@pytest.mark.parametrize("kind", ["per_package", "combined"])
def test_metadata_is_complete(kind):
  for w in _wheels(kind):
    metadata = _metadata(w)
    header, _, description = metadata.partition("\n\n")
    fields = {}
    for line in header.splitlines():
      key, _, value = line.partition(": ")
      fields.setdefault(key, []).append(value)
    name = os.path.basename(w)
    assert fields["Metadata-Version"] == ["2.4"], name
    assert fields["License-Expression"] == ["Apache-2.0"], name
    assert fields["License-File"] == ["LICENSE"], name
    assert fields["Requires-Python"][0].startswith(">=3.11"), name
    assert "Typing :: Typed" in fields["Classifier"], name
    assert any(
      u.startswith("Source, https://") for u in fields["Project-URL"]
    ), name
    assert fields["Description-Content-Type"] == ["text/markdown"], name
    assert description.lstrip().startswith("# jaxworks"), name
    # Read on an index: absolute links, pip commands, no Bazel.
    assert "bazel" not in description.lower(), name
    links = re.findall(r"\]\(([^)\s]+)\)", description)
    assert links and all(u.startswith(("https://", "#")) for u in links), [
      u for u in links if not u.startswith(("https://", "#"))
    ]
    assert "pip install jaxworks" in description, name
    assert (
      "add-ons for JAX" not in fields["Summary"][0] or kind == "combined"
    ), f"{name}: generic Summary"
    with zipfile.ZipFile(w) as zf:
      assert any(
        n.endswith(".dist-info/licenses/LICENSE") for n in zf.namelist()
      ), name
    if kind == "per_package":
      # Private jax._src internals of 0.10 are used: the range is bounded above.
      assert "jax>=0.10.2,<0.11" in fields["Requires-Dist"], name
      assert "jaxlib>=0.10.2,<0.11" in fields["Requires-Dist"], name
    else:
      pins = sorted(r for r in fields["Requires-Dist"])
      assert len(pins) == len(_wheels("per_package")) and all(
        "==" in r for r in pins
      ), pins


def test_manylinux_tag_is_the_one_auditwheel_verifies():
  checked = 0
  for w in _wheels("per_package") + _wheels("combined"):
    tag = os.path.basename(w)[:-4].split("-")[-1]
    if tag == "any":
      continue
    info = analyze_wheel_abi(
      Libc.GLIBC,
      Architecture.x86_64,
      pathlib.Path(w),
      frozenset(),
      disable_isa_ext_check=False,
      allow_graft=False,
    )
    assert info.overall_policy.name == tag, (
      f"{os.path.basename(w)}: auditwheel says {info.overall_policy.name}"
    )
    checked += 1
  assert checked == 2, (
    "expected the jit_cache and batched_transfer wheels to carry extensions"
  )


def _version(text):
  return tuple(int(p) for p in text.split("."))


def test_per_package_requires_dist_names_jaxworks_dependencies():
  for w in _wheels("per_package"):
    with zipfile.ZipFile(w) as zf:
      metadata = zf.read(
        next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
      ).decode()
    for dep in re.findall(
      r"^Requires-Dist: (jaxworks-[a-z-]+)>=([0-9.]+)$", metadata, re.M
    ):
      built = [
        os.path.basename(o).split("-")[1]
        for o in _wheels("per_package")
        if os.path.basename(o).startswith(dep[0].replace("-", "_") + "-")
      ]
      assert len(built) == 1 and _version(built[0]) >= _version(dep[1]), (
        f"{os.path.basename(w)} requires {dep}; built: {built}"
      )


@pytest.mark.parametrize("kind", ["per_package", "combined"])
def test_install_import_and_call_extensions(kind, tmp_path_factory, tmp_path):
  result = _install_and_probe(kind, tmp_path_factory, tmp_path)
  assert set(result["called"]) == _expected_extensions(_wheels("per_package"))
  packages = {n.split(".")[1] for n in result["imported"]}
  assert packages == {
    os.path.basename(w).split("-")[0].removeprefix("jaxworks_")
    for w in _wheels("per_package")
  }


def test_extensions_export_only_their_init_function(tmp_path):
  for w in _wheels("per_package"):
    with zipfile.ZipFile(w) as zf:
      for name in (n for n in zf.namelist() if n.endswith(".so")):
        path = zf.extract(name, str(tmp_path))
        out = subprocess.run(
          ["nm", "-D", "--defined-only", path],
          check=True,
          capture_output=True,
          text=True,
        )
        exported = {
          line.split()[-1]
          for line in out.stdout.splitlines()
          if len(line.split()) == 3 and line.split()[1].isupper()
        }
        module = os.path.basename(name)[:-3]
        assert exported == {f"PyInit_{module}"}, (
          f"{name} exports {sorted(exported)}"
        )


def test_combined_wheel_runs_the_tour(tmp_path_factory, tmp_path):
  """The tour, copied out of the repository, runs against the installed
  combined wheel alone, as the README's command runs it: no JAX_PLATFORMS,
  so JAX picks the backend, and on a machine without an accelerator (CI)
  the tour falls back to 8 host CPU devices."""
  python = _installed_python("combined", tmp_path_factory)
  tour = tmp_path / "tour.py"
  with open(os.environ["JAXWORKS_TOUR"], encoding="utf-8") as f:
    tour.write_text(f.read())
  env = clean_env()
  del env["JAX_PLATFORMS"]
  out = subprocess.run(
    [python, str(tour)],
    cwd=str(tmp_path),
    capture_output=True,
    text=True,
    env=env,
    timeout=600,
  )
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "All checks passed" in out.stdout
  assert ", 8 cpu devices" in out.stdout, out.stdout[:2000]


def test_console_script_runs_after_pip_install(tmp_path_factory, tmp_path):
  python = _installed_python("combined", tmp_path_factory)
  script = os.path.join(os.path.dirname(python), "jaxworks-aot")
  out = subprocess.run(
    [script, "--help"],
    cwd=str(tmp_path),
    capture_output=True,
    text=True,
    env=clean_env(),
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.startswith("usage: jaxworks-aot "), out.stdout
  assert "export" in out.stdout and "bazel" not in out.stdout.lower()


_IMPORT_STATE = r"""
import importlib, json, sys
state = {}
for pkg in ["axis_names", "batched_transfer", "jit_cache", "stages_aot", "pmap_chunked"]:
    try:
        importlib.import_module("jaxworks." + pkg)
        state[pkg] = "ok"
    except ModuleNotFoundError as e:
        state[pkg] = "absent" if e.name == "jaxworks." + pkg else "broken: " + str(e)
    except Exception as e:
        state[pkg] = "broken: " + repr(e)
print(json.dumps(state))
"""


def _import_state(python, cwd):
  out = subprocess.run(
    [python, "-c", _IMPORT_STATE],
    cwd=str(cwd),
    check=True,
    capture_output=True,
    text=True,
    env=clean_env(),
  )
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("remove", ["jaxworks", "jaxworks-jit-cache"])
def test_combined_then_per_package_then_uninstall_either(remove, tmp_path):
  """Install the combined wheel, then a per-package wheel over it, then uninstall one of the two."""
  python = _make_venv(str(tmp_path / "venv"))
  _pip_install(python, "jaxworks")
  jit_cache_wheel = next(
    w for w in _wheels("per_package") if "jit_cache" in os.path.basename(w)
  )
  _pip_install(python, "--force-reinstall", "--no-deps", jit_cache_wheel)
  assert set(_import_state(python, tmp_path).values()) == {"ok"}
  subprocess.run(
    [python, "-m", "pip", "uninstall", "-y", "-q", remove],
    check=True,
    env=clean_env(),
  )
  state = _import_state(python, tmp_path)
  site = subprocess.run(
    [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
    check=True,
    capture_output=True,
    text=True,
    env=clean_env(),
  ).stdout.strip()
  if remove == "jaxworks":
    # The metapackage owned no file: every package stays, whole.
    assert set(state.values()) == {"ok"}, state
  else:
    # jit_cache is gone without a trace; the packages that do not need it still work.
    assert state["jit_cache"] == "absent", state
    assert not os.path.exists(os.path.join(site, "jaxworks", "jit_cache")), (
      "files of jit_cache left behind"
    )
    assert state["axis_names"] == state["batched_transfer"] == "ok", state
    check = subprocess.run(
      [python, "-m", "pip", "check"],
      capture_output=True,
      text=True,
      env=clean_env(),
    )
    assert check.returncode != 0 and "jaxworks-jit-cache" in check.stdout, (
      check.stdout
    )


def _requires_dist(wheel):
  return dict(
    re.findall(
      r"^Requires-Dist: (jaxworks-[a-z-]+)>=([0-9.]+)$", _metadata(wheel), re.M
    )
  )


@pytest.mark.parametrize("breakage", ["missing", "too_old"])
def test_import_check_asks_for_the_metadata_minimum(breakage, tmp_path):
  """With axis_names uninstalled (or older than required), every package that
  needs it fails at import with a RuntimeError naming the minimum its METADATA
  requires and the pip command that fixes it."""
  python = _make_venv(str(tmp_path / "venv"))
  _pip_install(python, *_wheels("per_package"))
  if breakage == "missing":
    subprocess.run(
      [python, "-m", "pip", "uninstall", "-y", "-q", "jaxworks-axis-names"],
      check=True,
      env=clean_env(),
    )
  else:
    version_py = subprocess.run(
      [
        python,
        "-c",
        "import jaxworks.axis_names.version as v; print(v.__file__)",
      ],
      check=True,
      capture_output=True,
      text=True,
      env=clean_env(),
    ).stdout.strip()
    pathlib.Path(version_py).write_text('__version__ = "0.0.1"\n')
  checked = 0
  for w in _wheels("per_package"):
    minimum = _requires_dist(w).get("jaxworks-axis-names")
    if minimum is None:
      continue
    package = os.path.basename(w).split("-")[0].removeprefix("jaxworks_")
    out = subprocess.run(
      [python, "-c", f"import jaxworks.{package}"],
      cwd=str(tmp_path),
      capture_output=True,
      text=True,
      env=clean_env(),
    )
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"RuntimeError: jaxworks.{package}: "), out.stderr
    assert f"jaxworks.axis_names >= {minimum} " in last, last
    fix = last.rpartition("Fix: ")[2]
    assert fix.startswith("pip install -U ") and (
      f"'jaxworks-axis-names>={minimum}'" in fix
    ), last
    checked += 1
  assert checked == 2, "jit_cache and pmap_chunked require axis_names"
