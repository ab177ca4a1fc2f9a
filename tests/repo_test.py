"""Repository-wide rules that no single package test can see (DESIGN.md, "Conventions")."""

import ast
import glob
import os
import re
import warnings

import pytest

# The package list Bazel uses (packages.bzl), so a new package is checked too.
with open("packages.bzl", encoding="utf-8") as _f:
  PACKAGES = ast.literal_eval(
    re.search(r"^PACKAGES = (\[.*?\])", _f.read(), re.M | re.S).group(1)
  )

#: Source files under packages/*/jaxworks past this many lines are reported
#: as a warning (split them by responsibility when next touched). What the cap
#: stood for, modules in one direction, is //tests:layering_test's.
WARN_LINES = 600

#: A reference to an issue number (a tracker outside the repository): code,
#: comments and docs say what and why, not which ticket.
ISSUE_REFERENCE = re.compile(
  r"\b(?:issues?|bugs?|tickets?)\s*#?\d+(?:\.\d+)?\b|(?<![\w&/\[])#\d{1,4}\b",
  re.I,
)


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


@pytest.mark.parametrize("pkg", PACKAGES)
def test_changelog_speaks_to_users(pkg):
  """A CHANGELOG says what changed for users, not which private module moved."""
  with open(
    os.path.join("packages", pkg, "CHANGELOG.md"), encoding="utf-8"
  ) as f:
    private = [
      f"line {n}: {line.strip()}"
      for n, line in enumerate(f, 1)
      if re.search(r"\b_src\b", line)
    ]
  assert not private, (
    f"{pkg}/CHANGELOG.md names private modules:\n" + "\n".join(private)
  )


def test_package_list_is_complete():
  on_disk = sorted(
    d
    for d in os.listdir("packages")
    if os.path.exists(os.path.join("packages", d, "BUILD.bazel"))
  )
  assert sorted(PACKAGES) == on_disk, (on_disk, PACKAGES)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_long_source_files_are_reported(pkg):
  sources = _files(pkg, "jaxworks/**/*.py")
  assert sources, f"no sources found for {pkg}"
  long = {}
  for path in sources:
    with open(path, encoding="utf-8") as f:
      n = sum(1 for _ in f)
    if n > WARN_LINES:
      long[path] = n
  if long:
    warnings.warn(
      f"files over {WARN_LINES} lines (split them by responsibility): {long}",
      stacklevel=1,
    )


def _tracked_text_files():
  """Every file of the repository that is text (what git would commit)."""
  skip_dirs = {".git", "__pycache__", ".hypothesis", ".pytest_cache"}
  for root, dirs, files in os.walk("."):
    dirs[:] = [
      d for d in dirs if d not in skip_dirs and not d.startswith("bazel-")
    ]
    for name in files:
      path = os.path.join(root, name)
      if name.endswith((".so", ".png", ".npz", ".npy", ".bin", ".pyc")):
        continue
      if re.search(r"_(cpu|gpu|tpu)$", name):  # Bazel's test launchers
        continue
      try:
        with open(path, encoding="utf-8") as f:
          yield path, f.read()
      except (UnicodeDecodeError, OSError):
        continue


def test_no_issue_number_references():
  found = [
    f"{path}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
    for path, text in _tracked_text_files()
    for m in ISSUE_REFERENCE.finditer(text)
  ]
  assert not found, (
    "references to issue numbers (say what the code does and why instead): "
    + "; ".join(found)
  )


def test_the_issue_reference_rule_can_fail():
  # Built from pieces so that this file passes its own rule.
  for number in ("21)", "11.6a:", "16, 22"):
    for word in ("(issue ", "Issue ", "issues "):
      assert ISSUE_REFERENCE.search(word + number), word + number
  for text in ("see #" + "12",):
    assert ISSUE_REFERENCE.search(text), text
  for text in ("issue a warning", "x = d[#]", "&#39;", "f32[#4]"):
    assert not ISSUE_REFERENCE.search(text), text


def _sections(path):
  """``{"## heading": body}`` of a Markdown file (level-2 headings; a line
  starting with ``## `` inside a fenced code block is not a heading)."""
  with open(path, encoding="utf-8") as f:
    lines = f.read().splitlines()
  sections, heading, fenced = {}, None, False
  for line in lines:
    if line.startswith("```"):
      fenced = not fenced
    if line.startswith("## ") and not fenced:
      heading = line.strip()
      sections[heading] = ""
    elif heading is not None:
      sections[heading] += line + "\n"
  return sections


def _layout(pkg):
  return _sections(os.path.join("packages", pkg, "README.md")).get("## Layout")


@pytest.mark.parametrize("pkg", PACKAGES)
def test_readme_explains_how_it_works_and_the_layout(pkg):
  sections = _sections(os.path.join("packages", pkg, "README.md"))
  for heading in ("## How it works", "## Layout"):
    assert heading in sections, (
      f"packages/{pkg}/README.md has no '{heading}' section"
    )
    assert sections[heading].strip(), f"{pkg}: '{heading}' is empty"


@pytest.mark.parametrize("pkg", PACKAGES)
def test_layout_names_exactly_the_modules_there_are(pkg):
  layout = _layout(pkg)
  assert layout is not None, f"packages/{pkg}/README.md has no Layout"
  src = os.path.join("packages", pkg, "jaxworks", pkg, "_src")
  modules = {
    f"_src/{name}"
    for name in os.listdir(src)
    if name.endswith(".py") and name != "__init__.py"
  }
  named = set(re.findall(r"\b_src/\w+\.py\b", layout))
  assert not modules - named, (
    f"packages/{pkg}/README.md Layout does not list {sorted(modules - named)}"
  )
  assert not named - modules, (
    f"packages/{pkg}/README.md Layout lists {sorted(named - modules)}, "
    "which do not exist"
  )


def _package_map():
  """``{pkg: {column: cell}}`` of the root README's package map."""
  with open("README.md", encoding="utf-8") as f:
    text = f.read()
  m = re.search(
    r"^## Package map\n+(\|.*?\n)(\|[-| ]+\|\n)((?:\|.*\n)+)", text, re.M
  )
  assert m, "README.md has no package map table under '## Package map'"
  columns = [c.strip() for c in m.group(1).strip().strip("|").split("|")]
  rows = {}
  for line in m.group(3).splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    name = re.match(r"\[`(\w+)`\]", cells[0])
    if name:
      rows[name.group(1)] = dict(zip(columns, cells))
  return columns, rows


def test_package_map_names_each_entry_module():
  columns, rows = _package_map()
  assert "entry module" in columns, f"package map columns: {columns}"
  assert sorted(rows) == sorted(PACKAGES), sorted(rows)
  for pkg, row in rows.items():
    cells = re.findall(r"`([^`]+)`", row["entry module"])
    assert cells, f"README.md package map: {pkg} names no entry module"
    for cell in cells:
      assert re.fullmatch(rf"jaxworks/{pkg}/[\w/]+\.py", cell), (
        f"README.md package map: {pkg}'s entry module {cell!r} is not a "
        f"module path like jaxworks/{pkg}/_src/api.py"
      )
      assert os.path.exists(os.path.join("packages", pkg, cell)), (
        f"README.md package map: {pkg}'s entry module {cell} does not exist"
      )
