"""The releases jaxworks.stages_aot needs, and the ones an artifact records.

``jax_internals`` calls ``check_jax`` before it imports any private JAX name;
``load_jit_cache`` imports the one jaxworks package this one uses (both
checked by ``dep_check``); ``written_by`` is the ``versions`` field of an
artifact's manifest, read with ``importlib.metadata``.
"""

from __future__ import annotations

from importlib import metadata
import platform

from ..version import __version__
from . import dep_check

_PACKAGE = "jaxworks.stages_aot"
#: The jax/jaxlib releases whose private internals this package is written for.
SUPPORTED_JAX = ">=0.10.2,<0.11"
#: The jaxworks packages this one needs, with the minimum of each (the
#: wheel's Requires-Dist is made from this declaration and ``SUPPORTED_JAX``).
MINIMUM_VERSIONS = {
  "jaxworks.jit_cache": "0.4.0",  # committed outputs of multi-platform compiles; the stages' entry, jit(f).trace(...)
}
MIN_JIT_CACHE_VERSION = MINIMUM_VERSIONS["jaxworks.jit_cache"]


def check_jax() -> None:
  """Raises ImportError unless the installed jax and jaxlib are supported."""
  dep_check.check_jax(_PACKAGE, SUPPORTED_JAX)


def load_jit_cache():
  """Imports jaxworks.jit_cache and checks its version.

  Returns:
    The ``jaxworks.jit_cache`` module.

  Raises:
    RuntimeError: jaxworks.jit_cache is missing, incomplete (no ``jit``) or
      older than :data:`MIN_JIT_CACHE_VERSION`.
  """
  name = "jaxworks.jit_cache"
  return dep_check.load(_PACKAGE, MINIMUM_VERSIONS, {name: ("jit",)})[name]


def written_by() -> dict[str, str]:
  """The releases that write an artifact (its manifest's ``versions``).

  jax, jaxlib and numpy as installed, the Python version, and the jaxworks
  packages as imported.
  """
  versions = {d: metadata.version(d) for d in ("jax", "jaxlib", "numpy")}
  versions["python"] = platform.python_version()
  versions["jaxworks.stages_aot"] = __version__
  versions["jaxworks.jit_cache"] = load_jit_cache().__version__
  return versions
