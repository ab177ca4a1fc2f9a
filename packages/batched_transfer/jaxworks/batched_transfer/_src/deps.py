"""The releases jaxworks.batched_transfer needs (checked at import by ``dep_check``).

It depends on no other jaxworks package; ``jax_internals`` calls
``check_jax`` before it imports any private JAX name.
"""

from __future__ import annotations

from . import dep_check

#: The jax/jaxlib releases whose private internals this package is written for.
SUPPORTED_JAX = ">=0.10.2,<0.11"
#: The jaxworks packages this one needs (none). The wheel's Requires-Dist is
#: made from this declaration and ``SUPPORTED_JAX`` (tools/build_defs).
MINIMUM_VERSIONS: dict[str, str] = {}


def check_jax() -> None:
  """Raises ImportError unless the installed jax and jaxlib are supported."""
  dep_check.check_jax("jaxworks.batched_transfer", SUPPORTED_JAX)
