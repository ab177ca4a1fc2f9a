"""The API reference builds without warnings and documents every public name.

Builds it as //docs:api_reference does (build_docs.build: ``python -m sphinx
-W``): the HTML, and ``-b coverage`` (sphinx.ext.coverage: a public class,
function or method without an entry is a warning). Every name of each
package's ``__all__`` has an entry in the HTML's objects.inv. Planted
packages show an undocumented name and a re-export described twice failing.
The docstrings' ``>>>`` examples run in the package doctest targets
(``//packages/<pkg>:doctest_cpu``).
"""

import ast
import importlib
import os
import posixpath
import re
import shutil
import sys
import textwrap

import build_docs
import pytest
from sphinx.util.inventory import InventoryFile

_ROOT = os.path.dirname(build_docs.DOCS)


def _conf():
  namespace: dict = {}
  with open(os.path.join(build_docs.DOCS, "conf.py"), encoding="utf-8") as f:
    exec(f.read(), namespace)  # noqa: S102  (our own conf.py)
  return namespace


def _inventory(out) -> set[str]:
  with open(os.path.join(out, "objects.inv"), "rb") as f:
    inventory = InventoryFile.load(f, "", posixpath.join)
  return {name for kind in inventory.values() for name in kind}


@pytest.fixture(scope="module")
def html(tmp_path_factory):
  out = str(tmp_path_factory.mktemp("html"))
  return build_docs.build("html", out), out


def test_documents_the_packages_of_packages_bzl():
  with open(os.path.join(_ROOT, "packages.bzl"), encoding="utf-8") as f:
    found = re.search(r"^PACKAGES = (\[.*?\])", f.read(), re.M | re.S)
  packages = [f"jaxworks.{p}" for p in ast.literal_eval(found.group(1))]
  assert _conf()["jaxworks_packages"] == packages
  pages = sorted(os.listdir(os.path.join(build_docs.DOCS, "api")))
  assert pages == sorted(p.removeprefix("jaxworks.") + ".rst" for p in packages)


def test_builds_without_warnings(html):
  status, out = html
  assert status == 0, "Sphinx warned (above): fix what the warnings name"
  assert os.path.exists(os.path.join(out, "index.html"))


def test_every_public_name_has_an_entry(html):
  status, out = html
  assert status == 0, "the reference did not build (see the warnings above)"
  inventory = _inventory(out)
  missing = [
    name
    for package in _conf()["jaxworks_packages"]
    for name in [package]
    + [
      f"{package}.{n}"
      for n in importlib.import_module(package).__all__
      if n != "__version__"
    ]
    if name not in inventory
  ]
  assert not missing, (
    f"public names without an entry: {missing} (write a docstring; for a "
    "constant, a #: comment and an autodata entry on its package's page)"
  )


def test_no_public_class_function_or_method_lacks_an_entry(tmp_path):
  assert build_docs.build("coverage", str(tmp_path)) == 0, (
    "undocumented names (above): write their docstrings"
  )


_CORE = '''
"""A planted package."""

__all__ = ["Thing", "undocumented"]


class Thing:
  """The planted class."""


def undocumented():
  pass
'''

_FRONT = '''
"""A planted package re-exporting planted_core.Thing."""

from planted_core import Thing

__all__ = ["Thing"]
'''


@pytest.fixture
def planted(tmp_path):
  """A Sphinx project over two planted packages, with this conf.py."""
  src = tmp_path / "src"
  (src / "api").mkdir(parents=True)
  shutil.copy(os.path.join(build_docs.DOCS, "index.rst"), src)
  conf = os.path.join(build_docs.DOCS, "conf.py")
  (src / "conf.py").write_text(
    f"exec(open({conf!r}).read())\n"
    'jaxworks_packages = ["planted_core", "planted_front"]\n'
  )
  for name, source in (("planted_core", _CORE), ("planted_front", _FRONT)):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    (src / "api" / f"{name}.rst").write_text(
      f"{name}\n{'=' * len(name)}\n\n.. automodule:: {name}\n"
    )
  sys.path.insert(0, str(tmp_path))
  yield src
  sys.path.remove(str(tmp_path))


def test_planted_problems_fail_the_build(planted, tmp_path, capfd):
  assert build_docs.build("coverage", str(tmp_path / "cov"), str(planted))
  assert "undocumented python function: planted_core :: undocumented" in (
    capfd.readouterr().err
  )
  assert build_docs.build("html", str(tmp_path / "html"), str(planted))
  assert "planted_front.Thing is planted_core.Thing" in capfd.readouterr().err
