"""The releases jaxworks.jit_cache needs (checked at import by ``dep_check``).

``jax_internals`` calls ``check_jax`` before it imports any private JAX name;
``check_versions`` checks the jaxworks packages this one uses (axis_names,
imported at the first axis-name error by ``load_axis_names``; stages_aot,
whose stage family the trace cache builds).
"""

from __future__ import annotations

from . import dep_check

_PACKAGE = "jaxworks.jit_cache"
#: The jax/jaxlib releases whose private internals this package is written for.
SUPPORTED_JAX = ">=0.10.2,<0.11"
#: The jaxworks packages this one needs, with the minimum of each (the
#: wheel's Requires-Dist is made from this declaration and ``SUPPORTED_JAX``).
MINIMUM_VERSIONS = {
  # diagnose (axis-name errors at the entry points)
  "jaxworks.axis_names": "0.3.0",
  # the stage family (Traced, Lowered, Compiled) and export
  "jaxworks.stages_aot": "0.4.0",
}


#: Set once ``check_jax`` passed: the package's ``__init__`` and
#: ``jax_internals`` both call it, and each check reads the jax and jaxlib
#: distributions' metadata (about a millisecond apiece in a new process).
_JAX_CHECKED: list[bool] = []


def check_jax() -> None:
  """Raises ImportError unless the installed jax and jaxlib are supported
  (checked once per process: the installed versions do not change)."""
  if _JAX_CHECKED:
    return
  dep_check.check_jax(_PACKAGE, SUPPORTED_JAX)
  _JAX_CHECKED.append(True)


def check_versions() -> None:
  """Checks the jaxworks packages this one needs by their version modules
  (without importing them: that happens at first use)."""
  dep_check.load(_PACKAGE, MINIMUM_VERSIONS, submodule="version")


def load_axis_names():
  """Imports jaxworks.axis_names, checking its version."""
  return dep_check.load(_PACKAGE, MINIMUM_VERSIONS)["jaxworks.axis_names"]
