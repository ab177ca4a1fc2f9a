"""One enforced style: ruff (format and lint, JAX's settings), clang-format for cc/, mypy over the packages.

Each check runs on the repository's files as the Bazel test's runfiles hold them (every package's files, tests/,
tools/, examples/, benchmarks/), with the configuration checked in at the root (ruff.toml, .clang-format, mypy.ini).
Fix what they report with ./tools/format (formatting and fixable lint) and by hand (types).
"""

import os
import pathlib
import shutil
import subprocess
import sys


def _root():
  srcdir = os.environ.get("TEST_SRCDIR")
  if srcdir:
    return pathlib.Path(srcdir) / os.environ.get("TEST_WORKSPACE", "jaxworks")
  return pathlib.Path(__file__).resolve().parents[2]


ROOT = _root()


def _tool(name):
  """A console script of the lock's package, next to this interpreter."""
  path = pathlib.Path(sys.executable).parent / name
  return str(path) if path.exists() else shutil.which(name)


_SKIP = ("external", "third_party", "bazel-")


def _python_files():
  return sorted(
    str(p.relative_to(ROOT))
    for p in ROOT.rglob("*.py")
    if not any(part.startswith(_SKIP) for part in p.relative_to(ROOT).parts)
  )


def _run(args):
  return subprocess.run(args, cwd=ROOT, capture_output=True, text=True)


def test_sees_the_whole_repository():
  files = _python_files()
  for expected in (
    "examples/tour.py",
    "tools/test_summary.py",
    "tests/wheel_install_test.py",
    "packages/jit_cache/jaxworks/jit_cache/_src/api.py",
    "benchmarks/run_all.py",
    "tests/integration/jit_cache_pmap_test.py",
    "tools/style/style_test.py",
  ):
    assert expected in files, (
      f"{expected} is not among the checked files (missing from the test's data?)"
    )


def test_ruff_format():
  out = _run(
    [
      _tool("ruff"),
      "format",
      "--check",
      "--config",
      "ruff.toml",
      *_python_files(),
    ]
  )
  assert out.returncode == 0, (
    "run ./tools/format\n" + out.stdout[-4000:] + out.stderr[-2000:]
  )


def test_ruff_lint():
  out = _run(
    [
      _tool("ruff"),
      "check",
      "--no-cache",
      "--config",
      "ruff.toml",
      *_python_files(),
    ]
  )
  assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


def test_clang_format():
  sources = sorted(
    str(p.relative_to(ROOT))
    for p in [*ROOT.glob("packages/*/cc/*"), *ROOT.glob("tools/cc/*")]
    if p.suffix in (".h", ".cc")
  )
  assert len(sources) >= 7, sources
  out = _run(
    [_tool("clang-format"), "--dry-run", "--Werror", "--style=file", *sources]
  )
  assert out.returncode == 0, "run ./tools/format\n" + out.stderr[-6000:]


def test_mypy():
  packages = sorted(
    p.name
    for p in ROOT.glob("packages/*/jaxworks/*")
    if (p / "__init__.py").exists()
  )
  assert len(packages) == 5, packages
  env = dict(
    os.environ,
    MYPYPATH=os.pathsep.join(sorted(str(p) for p in ROOT.glob("packages/*"))),
  )
  out = subprocess.run(
    [
      _tool("mypy"),
      "--config-file",
      "mypy.ini",
      "--cache-dir",
      os.path.join(os.environ.get("TEST_TMPDIR", "/tmp"), "mypy_cache"),
      *[a for p in packages for a in ("-p", f"jaxworks.{p}")],
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    env=env,
  )
  assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
