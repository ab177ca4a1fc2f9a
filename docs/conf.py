"""Sphinx configuration of the jaxworks API reference.

Build: ``python -m sphinx -W -b html docs out`` with the jaxworks wheels and
docs/requirements.txt installed (index.rst), or ``./tools/bazel build
//docs:api_reference``. ``-b coverage`` lists public names without an entry.

Each package has a page, api/<pkg>.rst: its docstring and the names of its
``__all__`` (``automodule`` with ``:members:``; a constant by ``autodata``).
Each public object is documented once, by the package that defines it, which
is the first of ``jaxworks_packages`` exporting it (a package re-exports only
names of the packages it depends on): its classes and functions get that
package as ``__module__``, so signatures, bases and ``-b coverage`` name
them as users import them; another package's page lists the name with a link.
"""

import importlib
import inspect
import os
import sys

from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging

# Before autodoc imports jax.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "jaxworks"
author = "the jaxworks authors"
copyright = "the jaxworks authors"  # noqa: A001  (Sphinx's config name)

extensions = [
  "sphinx.ext.autodoc",
  "sphinx.ext.coverage",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]

#: The documented packages, leaves first (packages.bzl's order).
jaxworks_packages = [
  "jaxworks.axis_names",
  "jaxworks.batched_transfer",
  "jaxworks.stages_aot",
  "jaxworks.jit_cache",
  "jaxworks.pmap_chunked",
]

# Classes with their documented public members in source order (public
# names in ``__all__`` order); type hints in the signatures.
autodoc_default_options = {"members": True}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
add_module_names = False
python_use_unqualified_type_names = True

# Google style only; each entry of an "Attributes:" section is an attribute
# entry of its class (``Exported.vjp_order``), so references to it resolve.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = False
napoleon_use_rtype = False

# -b coverage: each undocumented public class, function or method is a
# warning (with -q), so -W fails.
coverage_show_missing_items = True
coverage_statistics_to_stdout = False

# Every reference to a jaxworks name must resolve. References to other
# libraries' names and to private jaxworks modules are not checked: there is
# nothing to link them to offline.
nitpicky = True
nitpick_ignore_regex = [
  (r"py:.*", r"(?!jaxworks\.)[A-Za-z_]\w*\..+"),
  (r"py:.*", r"jaxworks\.[a-z_]+\._src\..*"),
]

html_theme = "alabaster"
html_copy_source = False
html_show_sourcelink = False

logger = logging.getLogger("jaxworks.docs")

#: ``[(object, package that defines it)]``, set at config-inited.
_owners: list[tuple[object, str]] = []
#: ``{"jaxworks.jit_cache.jit": "jaxworks.jit_cache._src.api"}``: where
#: viewcode finds the source of an object whose ``__module__`` was set.
_defined_in: dict[str, str] = {}


def _owner(value):
  return next((p for v, p in _owners if v is value), None)


def _own_modules(app, config):
  """Records each public object's package; sets ``__module__`` to it."""
  del app, config  # unused
  for package in jaxworks_packages:
    module = importlib.import_module(package)
    for name in module.__all__:
      value = getattr(module, name)
      if name == "__version__" or _owner(value):
        continue
      _owners.append((value, package))
      defined_in = getattr(value, "__module__", None) or ""
      if defined_in.startswith(package + ".") and (
        inspect.isclass(value) or inspect.isroutine(value)
      ):
        _defined_in[f"{package}.{name}"] = defined_in
        value.__module__ = package
        _copy_analysis(defined_in, package, value.__qualname__)


def _copy_analysis(source, target, qualname):
  """What autodoc reads from the source of ``source.qualname`` (overloaded
  signatures, ``#:`` comments, source order), as ``target``'s."""
  real, public = (ModuleAnalyzer.for_module(m) for m in (source, target))
  real.analyze()
  public.analyze()
  for field in ("overloads", "attr_docs", "tagorder"):
    found, into = getattr(real, field), getattr(public, field)
    for key, value in found.items():
      name = key if isinstance(key, str) else ".".join(filter(None, key))
      if name == qualname or name.startswith(qualname + "."):
        into.setdefault(key, value)


def _constant_doc(package, name, value):
  """A constant's ``#:`` comment where its package assigns it, or (an
  instance of a jaxworks class) its class's docstring."""
  for module_name in sorted(sys.modules):
    if module_name.startswith(package + ".") and (
      getattr(sys.modules[module_name], name, None) is value
    ):
      comment = ModuleAnalyzer.for_module(module_name).find_attr_docs()
      if ("", name) in comment:
        return list(comment["", name])
  if type(value).__module__.startswith(package + "."):
    return inspect.cleandoc(type(value).__doc__ or "").splitlines()
  return []


def _check_entry(app, what, name, obj, options, lines):
  """Warns for a full entry of a re-exported name; fills in a constant's
  documentation (autodoc reads only the page's module), before napoleon."""
  del app, options  # unused
  package, _, attr = name.rpartition(".")
  owner = _owner(obj)
  if package not in jaxworks_packages or not owner:
    return
  if owner != package:
    logger.warning(
      "%s is %s.%s: list it in :exclude-members: and link to it",
      name,
      owner,
      attr,
    )
  elif what == "data" and (not lines or lines == _type_doc(obj)):
    lines[:] = _constant_doc(package, attr, obj)


def _instance_attributes(app, what, name, obj, options, lines):
  """After napoleon: the attributes of an instance's class are the
  instance's (``jit_cache.config.cache_dir``)."""
  del app, obj, options  # unused
  if what == "data":
    attr = name.rpartition(".")[2]
    lines[:] = [
      line.replace(".. attribute:: ", f".. attribute:: {attr}.", 1)
      for line in lines
    ]


def _type_doc(value):
  return inspect.cleandoc(type(value).__doc__ or "").splitlines() + [""]


def _follow_imported(app, modname, attribute):
  del app  # unused
  return _defined_in.get(f"{modname}.{attribute}")


def setup(app):
  app.connect("config-inited", _own_modules)
  app.connect("autodoc-process-docstring", _check_entry, priority=400)
  app.connect("autodoc-process-docstring", _instance_attributes, priority=600)
  app.connect("viewcode-follow-imported", _follow_imported)
