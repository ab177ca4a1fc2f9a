"""The releases jaxworks.stages_aot needs, and the ones an artifact records.

It depends on no other jaxworks package; ``jax_internals`` calls
``check_jax`` before it imports any private JAX name (checked by
``dep_check``); ``written_by`` is the ``versions`` field of an artifact's
manifest, read with ``importlib.metadata``.
"""

from __future__ import annotations

from importlib import metadata
import platform

from ..version import __version__
from . import dep_check

_PACKAGE = "jaxworks.stages_aot"
#: The jax/jaxlib releases whose private internals this package is written for.
SUPPORTED_JAX = ">=0.10.2,<0.11"
#: The jaxworks packages this one needs (none). The wheel's Requires-Dist is
#: made from this declaration and ``SUPPORTED_JAX`` (tools/build_defs).
MINIMUM_VERSIONS: dict[str, str] = {}


def check_jax() -> None:
  """Raises ImportError unless the installed jax and jaxlib are supported."""
  dep_check.check_jax(_PACKAGE, SUPPORTED_JAX)


def written_by() -> dict[str, str]:
  """The releases that write an artifact (its manifest's ``versions``).

  jax, jaxlib and numpy as installed, the Python version, and this package's
  version.
  """
  versions = {d: metadata.version(d) for d in ("jax", "jaxlib", "numpy")}
  versions["python"] = platform.python_version()
  versions["jaxworks.stages_aot"] = __version__
  return versions
