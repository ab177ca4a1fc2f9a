"""The releases jaxworks.jit_cache needs (checked at import by ``dep_check``).

``jax_internals`` calls ``check_jax`` before it imports any private JAX name;
``load_axis_names`` imports the one jaxworks package this one uses.
"""

from __future__ import annotations

from . import dep_check

_PACKAGE = "jaxworks.jit_cache"
#: The jax/jaxlib releases whose private internals this package is written for.
SUPPORTED_JAX = ">=0.10.2,<0.11"
#: jaxworks.axis_names provides ``used_axis_names(closed_jaxpr)`` since 0.1.0.
MIN_AXIS_NAMES = "0.1.0"


def check_jax() -> None:
  """Raises ImportError unless the installed jax and jaxlib are supported."""
  dep_check.check_jax(_PACKAGE, SUPPORTED_JAX)


def load_axis_names():
  """Imports jaxworks.axis_names, checking its version."""
  try:
    from jaxworks import axis_names  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    name = "jaxworks.axis_names"
    raise dep_check.missing(_PACKAGE, name, MIN_AXIS_NAMES, e) from e
  return dep_check.require(_PACKAGE, axis_names, MIN_AXIS_NAMES)
