"""The public API of the jaxworks packages, as the API reference documents it.

A package's public names are its ``__all__`` less ``__version__``, read from
the imported package. Each public object is documented once, on the page of
the package that defines it; a package that re-exports it (``pmap_chunked``'s
``CacheInfo`` is ``jit_cache``'s) gets a short entry linking there.

Used by the Sphinx extension below (``setup``; conf.py loads it): the
``.. public-api:: PACKAGE`` directive writes a package's page and warns for
each public name without a docstring, so ``-W`` fails the build. The
reference's test (api_reference_test.py) uses the same functions.
"""

import ast
import dataclasses
import functools
import importlib
import inspect
import pkgutil
import sys
from typing import Any

from sphinx.application import Sphinx
from sphinx.ext.napoleon.docstring import GoogleDocstring
from sphinx.pycode import ModuleAnalyzer
from sphinx.pycode import PycodeError
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

#: The Python domain's role linking to each kind of entry.
_ROLES = {
  "class": "class",
  "exception": "exc",
  "function": "func",
  "data": "data",
}
_NOUNS = {
  "class": "class",
  "exception": "exception",
  "function": "function",
  "data": "object",
}

#: Values shown with their ``repr`` in the reference.
_PLAIN = (bool, int, float, str, tuple, frozenset, type(None))


def packages() -> list[str]:
  """The jaxworks packages importable here (``jaxworks.<pkg>``), sorted."""
  namespace = importlib.import_module("jaxworks")
  return sorted(
    f"jaxworks.{info.name}"
    for info in pkgutil.iter_modules(namespace.__path__)
    if info.ispkg and not info.name.startswith("_")
  )


def public_names(package: str) -> list[str]:
  """``package.__all__`` less ``__version__``, in its order."""
  module = importlib.import_module(package)
  return [n for n in getattr(module, "__all__", ()) if n != "__version__"]


@dataclasses.dataclass(frozen=True)
class Entry:
  """One public name of a package.

  Attributes:
    package: the package exporting it (``jaxworks.jit_cache``).
    name: the name in its ``__all__``.
    value: the object.
    kind: ``class``, ``exception``, ``function`` or ``data``.
    owner: the package whose page documents it: the one defining it where it
      exports it too, else ``package``.
    doc: what the reference shows for it ("" where nothing).
  """

  package: str
  name: str
  value: Any
  kind: str
  owner: str
  doc: str

  @property
  def full_name(self) -> str:
    return f"{self.package}.{self.name}"


def _kind(value: Any) -> str:
  if inspect.isclass(value):
    return "exception" if issubclass(value, BaseException) else "class"
  if inspect.isroutine(value):
    return "function"
  return "data"


@functools.cache
def _assigned(module_name: str) -> frozenset[str]:
  """The names a module's source binds by top-level assignments."""
  try:
    tree = ast.parse(inspect.getsource(sys.modules[module_name]))
  except (OSError, TypeError, SyntaxError):
    return frozenset()
  names = set()
  for node in tree.body:
    if isinstance(node, ast.Assign):
      targets = node.targets
    elif isinstance(node, ast.AnnAssign):
      targets = [node.target]
    else:
      continue
    names.update(t.id for t in targets if isinstance(t, ast.Name))
  return frozenset(names)


def _submodules(package: str) -> list[str]:
  """``package`` and its imported modules (the ones getting a name loaded)."""
  return sorted(
    m for m in list(sys.modules) if m == package or m.startswith(package + ".")
  )


def _defining_module(value: Any, name: str, candidates: list[str]) -> str:
  """The module that defines ``value`` ("" where none is found).

  A class or function names it (``__module__``); a constant is found as the
  module of one of ``candidates`` that assigns ``name`` to this very object.
  """
  if _kind(value) != "data":
    return getattr(value, "__module__", None) or ""
  for package in candidates:
    for module_name in _submodules(package):
      module = sys.modules[module_name]
      if getattr(module, name, None) is value and name in _assigned(
        module_name
      ):
        return module_name
  return ""


def _comment(module_name: str, name: str) -> str:
  """The ``#:`` comment (or string after it) documenting ``name = ...``."""
  if not module_name:
    return ""
  try:
    docs = ModuleAnalyzer.for_module(module_name).find_attr_docs()
  except PycodeError:
    return ""
  return "\n".join(docs.get(("", name), [])).strip()


def _own_doc(value: Any, kind: str, module_name: str, name: str) -> str:
  """The docstring ``value`` carries itself: never one it inherits.

  A constant is documented by its ``#:`` comment where it is defined; an
  instance of a jaxworks class (``jit_cache.config``) otherwise by its class's
  docstring.
  """
  if kind in ("class", "exception"):
    doc = value.__dict__.get("__doc__")
  elif kind == "function":
    doc = getattr(value, "__doc__", None)
  else:
    doc = _comment(module_name, name)
    cls = type(value)
    if not doc and (cls.__module__ or "").startswith("jaxworks."):
      doc = cls.__dict__.get("__doc__")
  return inspect.cleandoc(doc) if isinstance(doc, str) else ""


def entries(package: str, documented: list[str]) -> list[Entry]:
  """The public names of ``package``, each with the package documenting it.

  ``documented`` are the packages the reference has pages for: a name
  another of them exports too (the same object) is documented by the one
  whose modules define it.
  """
  module = importlib.import_module(package)
  found = []
  for name in public_names(package):
    value = getattr(module, name)
    kind = _kind(value)
    candidates = [package] + [
      p
      for p in documented
      if p != package
      and name in public_names(p)
      and getattr(importlib.import_module(p), name) is value
    ]
    defined_in = _defining_module(value, name, candidates)
    owner = next(
      (
        p
        for p in candidates
        if defined_in == p or defined_in.startswith(p + ".")
      ),
      package,
    )
    doc = _own_doc(value, kind, defined_in, name)
    found.append(Entry(package, name, value, kind, owner, doc))
  return found


def undocumented(documented: list[str]) -> list[str]:
  """The public names (``package.name``) of ``documented`` without a docstring.

  Includes a package whose own docstring is empty, by its name.
  """
  missing = []
  for package in documented:
    if not inspect.getdoc(importlib.import_module(package)):
      missing.append(package)
    missing.extend(
      e.full_name
      for e in entries(package, documented)
      if e.owner == package and not e.doc
    )
  return missing


def _indent(lines: list[str], prefix: str = "   ") -> list[str]:
  return [prefix + line if line.strip() else "" for line in lines]


class PublicApiDirective(SphinxDirective):
  """``.. public-api:: PACKAGE``: the package's docstring and public names.

  Classes, exceptions and functions are documented by autodoc (a class with
  its documented public members); constants by their ``#:`` comment where
  they are defined; re-exported names by an entry linking to the package
  that documents them. Each public name without a docstring is a warning.
  """

  required_arguments = 1

  def run(self):
    package = self.arguments[0]
    documented = list(self.config.public_api_packages)
    if not inspect.getdoc(importlib.import_module(package)):
      logger.warning(
        "%s has no docstring: write one saying what the package does",
        package,
        location=self.get_location(),
        type="public_api",
      )
    found = entries(package, documented)
    own = [e for e in found if e.owner == package]
    order = {"class": 0, "exception": 1, "function": 2, "data": 3}
    lines = [f".. automodule:: {package}", "   :no-members:", ""]
    for entry in sorted(own, key=lambda e: order[e.kind]):
      if not entry.doc:
        logger.warning(
          "%s.__all__ lists %r, which has no docstring: write one for %s%s",
          package,
          entry.name,
          entry.full_name,
          " (a #: comment above its assignment)"
          if entry.kind == "data"
          else "",
          location=self.get_location(),
          type="public_api",
        )
      lines += self._entry(entry)
    others = [e for e in found if e.owner != package]
    if others:
      lines += [
        ".. rubric:: Documented with the package that defines them",
        "",
      ]
      for entry in others:
        role = _ROLES[entry.kind]
        lines += [
          f".. py:{entry.kind}:: {entry.name}{_signature(entry)}",
          f"   :module: {package}",
          "   :no-index-entry:",
          "",
          f"   The same {_NOUNS[entry.kind]} as "
          f":{role}:`{entry.owner}.{entry.name}`, documented there.",
          "",
        ]
    return self.parse_text_to_nodes("\n".join(lines))

  def _entry(self, entry: Entry) -> list[str]:
    if entry.kind != "data":
      directive = {"class": "autoclass", "exception": "autoexception"}.get(
        entry.kind, "autofunction"
      )
      lines = [f".. {directive}:: {entry.full_name}"]
      if entry.kind != "function" and entry.value.__bases__ != (object,):
        lines.append("   :show-inheritance:")
      return lines + [""]
    lines = [f".. py:data:: {entry.name}", f"   :module: {entry.package}"]
    if isinstance(entry.value, _PLAIN):
      lines.append(f"   :value: {entry.value!r}")
    lines.append("")
    docstring = GoogleDocstring(
      entry.doc,
      self.config,
      what="data",
      name=entry.full_name,
      obj=entry.value,
    )
    # The attributes its class documents are the instance's:
    # ``jit_cache.config.cache_dir``.
    body = [
      line.replace(".. attribute:: ", f".. attribute:: {entry.name}.", 1)
      for line in str(docstring).splitlines()
    ]
    return lines + _indent(body) + [""]


def _signature(entry: Entry) -> str:
  """The parameters of a function entry, without annotations ("" if none)."""
  if entry.kind != "function":
    return ""
  try:
    sig = inspect.signature(entry.value)
  except (TypeError, ValueError):
    return "(...)"
  empty = inspect.Parameter.empty
  return str(
    sig.replace(
      parameters=[p.replace(annotation=empty) for p in sig.parameters.values()],
      return_annotation=empty,
    )
  )


def _public_path(cls: type) -> str:
  """Where a class is public: ``jax.stages.Traced``, ``jaxworks.stages_aot.Lowered``.

  The first of its module less a ``._src`` part and the package above
  ``._src`` that exports it under its name, else its module.
  """
  module = cls.__module__
  for public in (module.replace("._src", "", 1), module.split("._src")[0]):
    try:
      if getattr(importlib.import_module(public), cls.__name__, None) is cls:
        return f"{public}.{cls.__qualname__}"
    except ImportError:
      pass
  return f"{module}.{cls.__qualname__}"


def _process_bases(app, name, obj, options, bases):
  """A class's bases as its entry names them: without ``object``, each by
  its public path, so a jaxworks base links to its entry."""
  del app, name, obj, options  # unused
  bases[:] = [
    f":py:class:`{_public_path(b)}`"
    if inspect.isclass(b) and b.__module__ != "builtins"
    else b
    for b in bases
    if b is not object
  ]


def setup(app: Sphinx) -> dict[str, Any]:
  """Registers the ``public-api`` directive and its config value."""
  app.setup_extension("sphinx.ext.autodoc")
  app.setup_extension("sphinx.ext.napoleon")
  app.add_config_value("public_api_packages", [], "env", types=[list])
  app.add_directive("public-api", PublicApiDirective)
  app.connect("autodoc-process-bases", _process_bases)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
