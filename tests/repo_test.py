"""Repository-wide rules that no single package test can see (DESIGN.md, "Conventions")."""

import ast
import glob
import os
import re

import pytest

PACKAGES = [
  "axis_names",
  "batched_transfer",
  "jit_cache",
  "stages_aot",
  "pmap_chunked",
]


def _files(pkg, pattern):
  return sorted(
    glob.glob(os.path.join("packages", pkg, pattern), recursive=True)
  )


def _imports(path):
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), filename=path)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      yield node.module
      yield from (f"{node.module}.{alias.name}" for alias in node.names)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_private_jax_only_in_jax_internals(pkg):
  sources = _files(pkg, "**/*.py")
  assert sources, f"no sources found for {pkg} (runfiles layout changed?)"
  offenders = []
  for path in sources:
    if path.endswith(os.path.join("_src", "jax_internals.py")):
      continue
    offenders += [
      f"{path}: {name}"
      for name in _imports(path)
      if name == "jax._src" or name.startswith("jax._src.")
    ]
  assert not offenders, (
    "private jax._src imports outside _src/jax_internals.py:\n"
    + "\n".join(offenders)
  )


@pytest.mark.parametrize("pkg", PACKAGES)
def test_no_other_package_internals(pkg):
  offenders = []
  for path in _files(pkg, "**/*.py"):
    for name in _imports(path):
      m = re.match(r"jaxworks\.(\w+)\._src", name)
      if m and m.group(1) != pkg:
        offenders.append(f"{path}: {name}")
  assert not offenders, "imports of another package's _src:\n" + "\n".join(
    offenders
  )


@pytest.mark.parametrize("pkg", PACKAGES)
def test_build_files_load_only_project_rules(pkg):
  with open(
    os.path.join("packages", pkg, "BUILD.bazel"), encoding="utf-8"
  ) as f:
    loads = re.findall(r'^load\("([^"]+)"', f.read(), re.M)
  bad = [
    l
    for l in loads
    if not (
      l.startswith("//tools/build_defs:") or l.startswith("@rules_python//")
    )
  ]
  assert not bad, f"packages/{pkg}/BUILD.bazel loads from {bad}"


@pytest.mark.parametrize("pkg", PACKAGES)
def test_anatomy_and_version(pkg):
  root = os.path.join("packages", pkg)
  for need in [
    "README.md",
    "CHANGELOG.md",
    f"jaxworks/{pkg}/version.py",
    f"jaxworks/{pkg}/__init__.py",
  ]:
    assert os.path.exists(os.path.join(root, need)), f"{root} has no {need}"
  assert not os.path.exists(os.path.join(root, "jaxworks", "__init__.py")), (
    "jaxworks must stay a namespace"
  )
  with open(
    os.path.join(root, f"jaxworks/{pkg}/version.py"), encoding="utf-8"
  ) as f:
    version = re.search(r'__version__ = "([^"]+)"', f.read()).group(1)
  with open(os.path.join(root, "CHANGELOG.md"), encoding="utf-8") as f:
    assert f"[{version}]" in f.read(), (
      f"{pkg}/CHANGELOG.md has no entry for {version}"
    )
  with open("README.md", encoding="utf-8") as f:
    row = re.search(rf"^\| \[`{pkg}`\][^|]*\| ([0-9.]+) \|", f.read(), re.M)
  assert row, f"README.md package map has no row for {pkg}"
  assert row.group(1) == version, (
    f"README.md says {pkg} {row.group(1)}, version.py says {version}"
  )
