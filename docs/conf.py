"""Sphinx configuration of the jaxworks API reference (built by build_docs.py).

build_docs.py writes one page per package (``.. public-api:: PACKAGE``, see
public_api.py) and passes the packages as ``public_api_packages``. The
docstrings are Google style (napoleon); ``[source]`` links come from
viewcode. Cross-references are checked (``nitpicky``): one to a jaxworks name
that the reference does not document is a warning, one to JAX, NumPy or the
standard library is not (the build is offline, without intersphinx).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

project = "jaxworks"
author = "the jaxworks authors"
copyright = "the jaxworks authors"  # noqa: A001  (Sphinx's config name)

extensions = [
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
  "public_api",
]

# Set by build_docs.py (-D public_api_packages=...).
public_api_packages: list[str] = []

# Classes with their documented public members in source order (and their
# bases, other than object: public_api.py); type hints in the signatures,
# names shown unqualified.
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

# Every reference to a jaxworks name must resolve. References to the names of
# other libraries and of private jaxworks modules (a type hint naming
# ``jaxworks.jit_cache._src...``) are not checked: there is nothing to link
# them to offline.
nitpicky = True
nitpick_ignore_regex = [
  (r"py:.*", r"(?!jaxworks\.)[A-Za-z_]\w*\..+"),
  (r"py:.*", r"jaxworks\.[a-z_]+\._src\..*"),
]

exclude_patterns: list[str] = []
templates_path: list[str] = []
html_theme = "alabaster"
html_static_path: list[str] = []
html_copy_source = False
html_show_sourcelink = False
