"""Doctests of one jaxworks package: every module's docstrings and the package README.

Run through pytest by the `doctest_<backend>` targets that jaxworks_package makes; each module and the README is its
own test case, and a failing example fails it with doctest's report.
"""

import ast
import doctest
import importlib
import inspect
import pkgutil
import re


def _modules(package_name):
  package = importlib.import_module(package_name)
  names = [package_name]
  for info in pkgutil.walk_packages(
    package.__path__, prefix=package_name + "."
  ):
    if info.name.endswith("__main__"):
      continue
    names.append(info.name)
  return sorted(names)


def pytest_generate_tests(metafunc):
  if "module_name" in metafunc.fixturenames:
    metafunc.parametrize(
      "module_name", _modules(metafunc.config.getoption("jaxworks_package"))
    )
  if "readme" in metafunc.fixturenames:
    readme = metafunc.config.getoption("jaxworks_readme")
    metafunc.parametrize("readme", [readme] if readme else [])


_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


_PROMPT = re.compile(r"^\s*>>>", re.MULTILINE)


def _written_examples(module):
  """How many `>>>` examples the module's docstrings hold, nested functions and classes included."""
  try:
    source = inspect.getsource(module)
  except (OSError, TypeError):
    return 0
  count = 0
  for node in ast.walk(ast.parse(source)):
    if isinstance(
      node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    ):
      doc = ast.get_docstring(node, clean=False)
      if doc:
        count += len(_PROMPT.findall(doc))
  return count


def test_module_docstrings(module_name):
  module = importlib.import_module(module_name)
  result = doctest.testmod(module, optionflags=_FLAGS, verbose=False)
  assert result.failed == 0, (
    f"{result.failed} doctest example(s) failed in {module_name} (see the report above)"
  )
  written = _written_examples(module)
  assert result.attempted >= written, (
    f"{module_name}: its docstrings hold {written} example(s) but only {result.attempted} ran; doctest does not "
    "collect docstrings of nested functions or of objects it cannot find from the module: move the examples "
    "to a docstring it collects"
  )


def test_readme(readme):
  result = doctest.testfile(
    readme, module_relative=False, optionflags=_FLAGS, verbose=False
  )
  assert result.failed == 0, (
    f"{result.failed} example(s) failed in {readme} (see the report above)"
  )
  assert result.attempted > 0, f"{readme} has no >>> examples"
