"""Version checks shared by the jaxworks packages: one source, a copy in each.

Every package carries this file as ``jaxworks.<pkg>._src.dep_check`` (in the
repository a link to ``tools/py/dep_check.py``, in each wheel a copy), the way
both C++ extensions compile ``tools/cc/attr_reader.h``: the packages are
versioned separately and share no code at run time. What a package needs is
declared in its own ``_src/deps.py``.

Installed distributions are read with ``importlib.metadata``; a jaxworks
package's release is the ``__version__`` of the module that was imported (a
source checkout has no distribution metadata). Versions are compared in
PEP 440 order, pre-releases included: ``0.10.0rc1`` comes after ``0.9.1``
and before ``0.10.0``; a nightly of a supported jax passes. Plain release
numbers against plain clauses (``0.10.2`` in ``>=0.10.2,<0.11``: every
import of a released jaxworks with a released jax) are compared here;
anything else by ``packaging``, imported only then, since importing it is a
large part of what a jaxworks package adds to ``import jax``.

>>> check_version("jaxworks.stages_aot", "jaxworks.jit_cache", "0.10.0rc1", "0.9.1")
>>> check_version("jaxworks.stages_aot", "jaxworks.jit_cache", "0.0.9", "0.1.0")
Traceback (most recent call last):
...
RuntimeError: jaxworks.stages_aot needs jaxworks.jit_cache >= 0.1.0, but 0.0.9 is installed; upgrade it (pip install -U 'jaxworks-jit-cache>=0.1.0')
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from collections.abc import Sequence
import importlib
from importlib import metadata
import importlib.util
import itertools
import operator
import os
import re
from types import ModuleType

_RELEASE = re.compile(r"\d+(?:\.\d+)*")
_CLAUSE = re.compile(r"\s*(>=|<=|==|!=|<|>)\s*(\d+(?:\.\d+)*)\s*")
_COMPARE = {
  ">=": operator.ge,
  "<=": operator.le,
  "==": operator.eq,
  "!=": operator.ne,
  "<": operator.lt,
  ">": operator.gt,
}


def _release(version: str) -> tuple[int, ...]:
  return tuple(int(part) for part in version.split("."))


def contains(spec: str, version: str) -> bool:
  """``version in packaging.specifiers.SpecifierSet(spec, prereleases=True)``.

  Release numbers against clauses of release numbers are compared as
  PEP 440 does, padded with zeros (``0.11`` equals ``0.11.0``; neither side
  can be a pre-, post- or dev release, so no other rule applies); anything
  else goes to ``packaging``.
  """
  clauses = [_CLAUSE.fullmatch(c) for c in spec.split(",")]
  if _RELEASE.fullmatch(version) and all(clauses):
    mine = _release(version)
    for m in clauses:
      assert m is not None  # checked above
      theirs = _release(m[2])
      pairs = itertools.zip_longest(mine, theirs, fillvalue=0)
      a, b = zip(*pairs)
      if not _COMPARE[m[1]](a, b):
        return False
    return True
  from packaging.specifiers import SpecifierSet  # pylint: disable=g-import-not-at-top

  return version in SpecifierSet(spec, prereleases=True)


def _dist(module_name: str) -> str:
  """The distribution of a jaxworks module: ``jaxworks.jit_cache`` ->
  ``jaxworks-jit-cache``."""
  return module_name.replace(".", "-").replace("_", "-")


def check_jax(package: str, supported: str) -> None:
  """Raises ImportError unless the installed jax and jaxlib are ``supported``.

  ``package`` (``"jaxworks.jit_cache"``) is the one that uses their private
  internals; call this before importing any.
  """
  found = {d: metadata.version(d) for d in ("jax", "jaxlib")}
  if not all(contains(supported, v) for v in found.values()):
    raise ImportError(
      f"{package} supports jax and jaxlib {supported} (it uses their private "
      f"internals); found {found}. Install a supported release: "
      f"pip install 'jax{supported}' 'jaxlib{supported}'"
    )


def check_version(
  package: str, dependency: str, found: str, minimum: str
) -> None:
  """Raises an actionable RuntimeError when ``found`` < ``minimum``.

  ``package`` needs ``dependency`` (both module names) at ``minimum`` or
  later; an unreadable ``found`` counts as too old.
  """
  if not contains(f">={minimum}", found):
    raise RuntimeError(
      f"{package} needs {dependency} >= {minimum}, but {found} is installed; "
      f"upgrade it (pip install -U '{_dist(dependency)}>={minimum}')"
    )


def missing(
  package: str, dependency: str, minimum: str, error: Exception
) -> RuntimeError:
  """The RuntimeError for a dependency that could not be imported (raise it
  ``from error``)."""
  return RuntimeError(
    f"{package} needs {dependency} >= {minimum}, which could not be imported "
    f"({error}); install it (pip install '{_dist(dependency)}>={minimum}')"
  )


def require(
  package: str, module: ModuleType, minimum: str, attrs: Sequence[str] = ()
) -> ModuleType:
  """Returns ``module`` (an imported jaxworks dependency) once it has a
  ``__version__`` >= ``minimum`` and the attributes ``attrs``; raises an
  actionable RuntimeError otherwise (an incomplete install: reinstall)."""
  version = getattr(module, "__version__", None)
  absent = [a for a in attrs if not hasattr(module, a)]
  if version is None or absent:
    where = list(getattr(module, "__path__", []))
    raise RuntimeError(
      f"{package}: {module.__name__} found at {where} is incomplete (no "
      f"{', '.join(absent or ['__version__'])}); reinstall it (pip install "
      f"--force-reinstall '{_dist(module.__name__)}>={minimum}')"
    )
  check_version(package, module.__name__, version, minimum)
  return module


def _submodule_only(name: str, submodule: str) -> ModuleType:
  """``<name>.<submodule>`` (a module holding ``__version__ = "x.y.z"``)
  read without running ``<name>``'s ``__init__``: the package is found, not
  imported, and the submodule's one assignment is read as a literal."""
  spec = importlib.util.find_spec(name)
  if spec is None:
    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
  module = ModuleType(f"{name}.{submodule}")
  for location in spec.submodule_search_locations or ():
    path = os.path.join(location, f"{submodule}.py")
    if not os.path.isfile(path):
      continue
    with open(path, encoding="utf-8") as f:
      tree = ast.parse(f.read(1 << 16))
    for node in tree.body:
      if (
        isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
        and isinstance(node.value, ast.Constant)
      ):
        module.__version__ = str(node.value.value)  # type: ignore[attr-defined]
    module.__path__ = [location]  # type: ignore[attr-defined]
    break
  return module


def load(
  package: str,
  minimums: Mapping[str, str],
  attrs: Mapping[str, Sequence[str]] | None = None,
  *,
  submodule: str | None = None,
) -> dict[str, ModuleType]:
  """Imports every jaxworks dependency in ``minimums`` (module name ->
  minimum version) and checks each; returns them by module name.

  With ``submodule`` (``"version"``), only ``<dependency>.<submodule>`` is
  imported and checked (a cheap check at import time; the dependency itself
  is imported when first used).

  Every missing, too old or incomplete dependency is reported in one
  RuntimeError that ends with the one ``pip install`` command fixing them
  all. An ImportError raised inside a dependency for another reason (an
  unsupported jax, say) propagates unchanged.
  """
  modules: dict[str, ModuleType] = {}
  problems: list[str] = []
  fixes: list[str] = []
  for name, minimum in minimums.items():
    try:
      module = (
        importlib.import_module(name)
        if submodule is None
        else _submodule_only(name, submodule)
      )
    except ModuleNotFoundError as e:
      if e.name is None or not name.startswith(e.name):
        raise
      problems.append(f"{name} >= {minimum} is not installed")
      fixes.append(f"'{_dist(name)}>={minimum}'")
      continue
    except RuntimeError as e:
      # The dependency's own check failed; its message names its fix.
      problems.append(f"{name} could not be imported ({e})")
      fixes.append(f"'{_dist(name)}>={minimum}'")
      continue
    version = getattr(module, "__version__", None)
    absent = [a for a in (attrs or {}).get(name, ()) if not hasattr(module, a)]
    if version is None or absent:
      where = list(getattr(module, "__path__", []))
      problems.append(
        f"{name} found at {where} is incomplete (no "
        f"{', '.join(absent or ['__version__'])})"
      )
      fixes.insert(0, "--force-reinstall")
      fixes.append(f"'{_dist(name)}>={minimum}'")
    elif not contains(f">={minimum}", version):
      problems.append(
        f"{name} >= {minimum} is needed, but {version} is installed"
      )
      fixes.append(f"'{_dist(name)}>={minimum}'")
    else:
      modules[name] = module
  if problems:
    fix = " ".join(dict.fromkeys(fixes))
    raise RuntimeError(
      f"{package}: {'; '.join(problems)}. Fix: pip install -U {fix}"
    )
  return modules
