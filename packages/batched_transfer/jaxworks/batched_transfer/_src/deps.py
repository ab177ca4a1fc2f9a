"""The releases jaxworks.batched_transfer needs, checked when it is imported.

It depends on no other jaxworks package; ``jax_internals`` calls
``check_jax`` before it imports any private JAX name. The installed jax and
jaxlib releases are read with ``importlib.metadata`` and compared by
``packaging`` (PEP 440 order; nightlies of a supported release pass).
"""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet

#: The jax/jaxlib releases whose private internals this package is written for.
SUPPORTED_JAX = ">=0.10.2,<0.11"
_JAX_RANGE = SpecifierSet(SUPPORTED_JAX, prereleases=True)  # nightlies too


def check_jax() -> None:
  """Raises ImportError unless the installed jax and jaxlib are supported."""
  found = {d: metadata.version(d) for d in ("jax", "jaxlib")}
  if not all(v in _JAX_RANGE for v in found.values()):
    raise ImportError(
      f"jaxworks.batched_transfer supports jax and jaxlib {SUPPORTED_JAX} (it uses "
      f"their private internals); found {found}. Install a supported "
      f"release: pip install 'jax{SUPPORTED_JAX}' 'jaxlib{SUPPORTED_JAX}'"
    )
