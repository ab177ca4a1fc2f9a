"""The API reference builds without warnings and documents every public name.

Builds the reference of every jaxworks package as //docs:api_reference does
(Sphinx, warnings as errors) and reads the objects inventory of its HTML:
each name of each package's ``__all__`` has an entry there, and a docstring
(or, for a constant, a ``#:`` comment) in the package that defines it.
Planted modules show that a public name without a docstring fails the build
and that a re-exported name is described once.

The ``>>>`` examples of the docstrings run in the package doctest targets
(``//packages/<pkg>:doctest_cpu``: every module's docstrings, each module's
count of examples checked); here each public example is checked to sit in a
docstring those find.
"""

import ast
import doctest
import importlib
import inspect
import os
import re
import sys
import textwrap
import zipfile
import zlib

import build_docs
import public_api
import pytest

# Sphinx's napoleon reads autodoc's options through an interface Sphinx
# itself deprecates; nothing here to change.
pytestmark = pytest.mark.filterwarnings(
  "ignore:The mapping interface for autodoc options:PendingDeprecationWarning"
)

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# An objects.inv line: name, domain:role, priority, uri, display name.
_INVENTORY_LINE = re.compile(r"(.+?)\s+(\S+)\s+(-?\d+)\s+?(\S*)\s+(.*)")


def _packages_bzl() -> list[str]:
  with open(os.path.join(_ROOT, "packages.bzl"), encoding="utf-8") as f:
    text = f.read()
  found = re.search(r"^PACKAGES = (\[.*?\])", text, re.M | re.S)
  assert found, "packages.bzl has no PACKAGES list"
  return [f"jaxworks.{p}" for p in ast.literal_eval(found.group(1))]


def _inventory(zip_path) -> dict[str, str]:
  """``{name: "py:class", ...}`` from the zip's objects.inv."""
  with zipfile.ZipFile(zip_path) as zf:
    data = zf.read("objects.inv")
  assert data.startswith(b"# Sphinx inventory version 2"), data[:60]
  start = 0
  for _ in range(4):  # the header lines
    start = data.index(b"\n", start) + 1
  found = {}
  for line in zlib.decompress(data[start:]).decode().splitlines():
    match = _INVENTORY_LINE.match(line.rstrip())
    assert match, line
    found[match.group(1)] = match.group(2)
  return found


def _html(zip_path, page: str) -> str:
  with zipfile.ZipFile(zip_path) as zf:
    return zf.read(page).decode()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """(exit status, zip path) of the reference of every jaxworks package."""
  out = tmp_path_factory.mktemp("reference") / "api_reference.zip"
  return build_docs.build(public_api.packages(), str(out)), out


def test_documents_every_jaxworks_package():
  assert public_api.packages() == sorted(_packages_bzl())


def test_builds_without_warnings(reference):
  status, out = reference
  assert status == 0, (
    "the API reference does not build without warnings (they are printed "
    "above); fix the docstrings they name"
  )
  assert "index.html" in zipfile.ZipFile(out).namelist()


def test_every_public_name_has_an_entry(reference):
  status, out = reference
  assert status == 0, "the reference did not build (see the warnings above)"
  inventory = _inventory(out)
  packages = public_api.packages()
  missing = [
    name
    for package in packages
    for name in [package]
    + [f"{package}.{n}" for n in public_api.public_names(package)]
    if name not in inventory
  ]
  assert not missing, f"public names without an entry: {missing}"
  # A re-exported name links to the entry of the package defining it.
  for package in packages:
    for entry in public_api.entries(package, packages):
      assert f"{entry.owner}.{entry.name}" in inventory, entry


def test_every_public_name_has_a_docstring():
  missing = public_api.undocumented(public_api.packages())
  assert not missing, (
    f"public names without a docstring: {missing} (write one; for a "
    "constant, a #: comment above its assignment)"
  )


def _found_by_doctest(module_name: str, qualname: str) -> bool:
  """Whether doctest's finder (as the package doctest targets run it) finds
  the docstring of ``module_name.qualname``."""
  module = importlib.import_module(module_name)
  names = {t.name for t in doctest.DocTestFinder().find(module) if t.examples}
  return f"{module_name}.{qualname}" in names


def _examples_outside_doctests(packages: list[str]) -> list[str]:
  """Public docstrings with ``>>>`` examples that no package doctest runs."""
  missed = []
  for package in packages:
    for entry in public_api.entries(package, packages):
      if entry.owner != package or ">>>" not in entry.doc:
        continue
      value = entry.value
      if entry.kind == "data":
        cls_doc = type(value).__dict__.get("__doc__")
        if not cls_doc or entry.doc != inspect.cleandoc(cls_doc):
          missed.append(f"{entry.full_name} (a #: comment)")
          continue
        value = type(value)  # an instance documented by its class
      module = getattr(value, "__module__", "") or ""
      in_package = any(module.startswith(p + ".") for p in packages)
      if not in_package or not _found_by_doctest(module, value.__qualname__):
        missed.append(f"{entry.full_name} (defined in {module})")
  return missed


def test_public_examples_run_in_the_package_doctests():
  missed = _examples_outside_doctests(public_api.packages())
  assert not missed, (
    f"examples that //packages/<pkg>:doctest does not run: {missed}; move "
    "them into a docstring of a module of the package"
  )


@pytest.fixture
def plant(tmp_path, monkeypatch):
  """``plant(name, source)`` writes an importable module; dropped after."""
  monkeypatch.syspath_prepend(str(tmp_path))
  names = []

  def write(name: str, source: str) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    names.append(name)

  yield write
  for name in names:
    sys.modules.pop(name, None)


_PLANTED = '''
"""A planted package: two documented public names, two undocumented."""

__all__ = ["Undocumented", "documented", "LIMIT", "DOCUMENTED_LIMIT"]


def documented():
  """Has a docstring."""


class Undocumented:
  pass


LIMIT = 3

#: Has a doc comment.
DOCUMENTED_LIMIT = 4
'''


def test_a_public_name_without_docstring_fails_the_build(
  plant, tmp_path, capsys
):
  plant("planted_api", _PLANTED)
  assert public_api.undocumented(["planted_api"]) == [
    "planted_api.Undocumented",
    "planted_api.LIMIT",
  ]
  out = tmp_path / "planted.zip"
  assert build_docs.build(["planted_api"], str(out)) != 0
  assert not out.exists()
  warnings = capsys.readouterr().err
  assert "write one for planted_api.Undocumented" in warnings, warnings
  assert "write one for planted_api.LIMIT" in warnings, warnings
  assert "planted_api.documented" not in warnings, warnings
  assert "planted_api.DOCUMENTED_LIMIT" not in warnings, warnings


_CORE = '''
"""A planted package defining a class and a constant."""

__all__ = ["Thing", "LIMITS"]


class Thing:
  """The planted class docstring."""

  def helper(self):
    """A documented method, listed with its class."""


#: The planted constant comment.
LIMITS = (1, 2)
'''

_FRONT = '''
"""A planted package re-exporting planted_core's names."""

from planted_core import LIMITS
from planted_core import Thing

__all__ = ["LIMITS", "Thing"]
'''


def test_a_reexported_name_is_described_once_with_its_members(plant, tmp_path):
  plant("planted_core", _CORE)
  plant("planted_front", _FRONT)
  documented = ["planted_core", "planted_front"]
  owners = {
    e.full_name: e.owner
    for p in documented
    for e in public_api.entries(p, documented)
  }
  assert owners == {
    "planted_core.Thing": "planted_core",
    "planted_core.LIMITS": "planted_core",
    "planted_front.Thing": "planted_core",
    "planted_front.LIMITS": "planted_core",
  }
  out = tmp_path / "planted.zip"
  assert build_docs.build(documented, str(out)) == 0
  inventory = _inventory(out)
  for name in [*owners, "planted_core.Thing.helper"]:
    assert name in inventory, name
  core = _html(out, "api/planted_core.html")
  front = _html(out, "api/planted_front.html")
  for text in ("planted class docstring", "planted constant comment"):
    assert text in core and text not in front, text
  assert front.count("documented there") == 2, front


def test_examples_outside_package_doctests_are_reported(plant):
  plant(
    "planted_examples",
    '''
    """A planted package whose constant's comment holds an example."""

    __all__ = ["LIMIT"]

    #: The limit.
    #:
    #: >>> LIMIT
    #: 3
    LIMIT = 3
    ''',
  )
  assert _examples_outside_doctests(["planted_examples"]) == [
    "planted_examples.LIMIT (a #: comment)"
  ]
