"""Import layering, package by package and between packages.

Each package's ``pyproject.toml`` lists the layers of its modules under
``[tool.importlinter]`` (one exhaustive ``layers`` contract per subpackage of
``_src``): a module imports only modules of lower layers, function-level
imports included, so no module cycle can hide. Between packages, the
``deps`` of each ``jaxworks_package`` in the BUILD files are the only
allowed direction. import-linter (grimp) reads the imports; the checks run in
a subprocess with only the packages under test on the path, so the planted
cases below run against copies of the real packages.
"""

import ast
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib

import pytest

with open("packages.bzl", encoding="utf-8") as _f:
  PACKAGES = ast.literal_eval(
    re.search(r"^PACKAGES = (\[.*?\])", _f.read(), re.M | re.S).group(1)
  )


def _lint(config, paths):
  """Runs import-linter on ``config``; returns (ok, report)."""
  run = subprocess.run(
    [
      sys.executable,
      "-c",
      "import sys; from importlinter.cli import lint_imports; "
      "sys.exit(lint_imports(config_filename=sys.argv[1], no_cache=True, "
      "no_logo=True))",
      config,
    ],
    env=dict(os.environ, PYTHONPATH=os.pathsep.join(paths)),
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert run.returncode in (0, 1), run.stdout + run.stderr
  return run.returncode == 0, run.stdout + run.stderr


def _contracts(pkg_dir):
  with open(os.path.join(pkg_dir, "pyproject.toml"), "rb") as f:
    return tomllib.load(f).get("tool", {}).get("importlinter", {})


def _subpackages(pkg_dir, pkg):
  """Dotted names of ``_src`` and every package below it."""
  src = os.path.join(pkg_dir, "jaxworks", pkg, "_src")
  found = []
  for root, _, files in os.walk(src):
    if "__init__.py" in files and "__pycache__" not in root:
      rel = os.path.relpath(root, pkg_dir)
      found.append(rel.replace(os.sep, "."))
  return sorted(found)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_every_subpackage_has_exhaustive_layers(pkg):
  pkg_dir = os.path.join("packages", pkg)
  config = _contracts(pkg_dir)
  assert config.get("root_package") == f"jaxworks.{pkg}", (
    f"packages/{pkg}/pyproject.toml: [tool.importlinter] root_package must "
    f"be jaxworks.{pkg}"
  )
  layered = {
    container
    for contract in config.get("contracts", [])
    if contract.get("type") == "layers" and contract.get("exhaustive")
    for container in contract.get("containers", [])
  }
  missing = set(_subpackages(pkg_dir, pkg)) - layered
  assert not missing, (
    f"packages/{pkg}/pyproject.toml: no exhaustive layers contract for "
    f"{sorted(missing)}; list their modules' layers"
  )


@pytest.mark.parametrize("pkg", PACKAGES)
def test_package_layers_hold(pkg):
  pkg_dir = os.path.join("packages", pkg)
  ok, report = _lint(os.path.join(pkg_dir, "pyproject.toml"), [pkg_dir])
  assert ok, report


def _build_deps():
  """``{pkg: {direct dependency packages}}`` from the BUILD files."""
  deps = {}
  for pkg in PACKAGES:
    with open(
      os.path.join("packages", pkg, "BUILD.bazel"), encoding="utf-8"
    ) as f:
      build = f.read()
    call = re.search(r"jaxworks_package\((.*?)\n\)", build, re.S)
    assert call, f"packages/{pkg}/BUILD.bazel has no jaxworks_package"
    listed = re.search(r"\bdeps = \[(.*?)\]", call.group(1), re.S)
    deps[pkg] = set(
      re.findall(r'"//packages/(\w+)"', listed.group(1)) if listed else ()
    )
  return deps


def _closure(deps, pkg):
  seen, todo = set(), list(deps[pkg])
  while todo:
    dep = todo.pop()
    if dep not in seen:
      seen.add(dep)
      todo.extend(deps[dep])
  return seen


def _package_edges_config(tmp_path, deps):
  lines = [
    "[importlinter]",
    "root_packages =",
    *(f"    jaxworks.{p}" for p in PACKAGES),
    "",
  ]
  for pkg in PACKAGES:
    forbidden = sorted(set(PACKAGES) - {pkg} - _closure(deps, pkg))
    if not forbidden:
      continue
    lines += [
      f"[importlinter:contract:{pkg}]",
      f"name = jaxworks.{pkg} imports only its BUILD deps",
      "type = forbidden",
      f"source_modules = jaxworks.{pkg}",
      "forbidden_modules =",
      *(f"    jaxworks.{p}" for p in forbidden),
      "",
    ]
  path = tmp_path / "packages.ini"
  path.write_text("\n".join(lines))
  return str(path)


def test_packages_import_only_their_build_deps(tmp_path):
  deps = _build_deps()
  for pkg in PACKAGES:
    assert pkg not in _closure(deps, pkg), f"package cycle through {pkg}"
  config = _package_edges_config(tmp_path, deps)
  ok, report = _lint(config, [os.path.join("packages", p) for p in PACKAGES])
  assert ok, report


def _copy(tmp_path, pkg):
  dst = tmp_path / pkg
  shutil.copytree(
    os.path.join("packages", pkg),
    dst,
    ignore=shutil.ignore_patterns("__pycache__", "*.so", "tests"),
  )
  return dst


def _bottom_module(pkg_dir, pkg):
  """The first module of the lowest layer of ``_src``."""
  for contract in _contracts(pkg_dir)["contracts"]:
    if contract["containers"] == [f"jaxworks.{pkg}._src"]:
      return re.split(r"[|:]", contract["layers"][-1])[0].strip()
  raise AssertionError(f"{pkg}: no layers contract for _src")


def _plant(pkg_dir, pkg, module, code):
  path = pkg_dir / "jaxworks" / pkg / "_src" / f"{module}.py"
  with open(path, "a", encoding="utf-8") as f:
    f.write(textwrap.dedent(code))


def test_a_planted_cycle_fails(tmp_path):
  pkg = "axis_names"
  pkg_dir = _copy(tmp_path, pkg)
  bottom = _bottom_module(pkg_dir, pkg)
  ok, report = _lint(str(pkg_dir / "pyproject.toml"), [str(pkg_dir)])
  assert ok, report
  # A function-level import from the bottom layer up to the top: a cycle
  # (api imports, indirectly, the bottom module).
  _plant(pkg_dir, pkg, bottom, "\n\ndef _late():\n  from . import api\n")
  ok, report = _lint(str(pkg_dir / "pyproject.toml"), [str(pkg_dir)])
  assert not ok, report
  assert "BROKEN" in report and f"_src.{bottom}" in report, report


def test_an_unlisted_module_fails(tmp_path):
  pkg = "axis_names"
  pkg_dir = _copy(tmp_path, pkg)
  (pkg_dir / "jaxworks" / pkg / "_src" / "stray.py").write_text("X = 1\n")
  ok, report = _lint(str(pkg_dir / "pyproject.toml"), [str(pkg_dir)])
  assert not ok, report
  assert "stray" in report, report


def test_a_planted_package_edge_fails(tmp_path):
  deps = _build_deps()
  leaf = next(p for p in PACKAGES if not deps[p])
  upper = next(p for p in PACKAGES if leaf in _closure(deps, p))
  paths = [os.path.join("packages", p) for p in PACKAGES if p != leaf]
  pkg_dir = _copy(tmp_path, leaf)
  _plant(
    pkg_dir,
    leaf,
    _bottom_module(pkg_dir, leaf),
    f"\n\ndef _late():\n  import jaxworks.{upper}\n",
  )
  config = _package_edges_config(tmp_path, deps)
  ok, report = _lint(config, [str(pkg_dir), *paths])
  assert not ok, report
  assert f"jaxworks.{leaf} imports only its BUILD deps BROKEN" in report, report
