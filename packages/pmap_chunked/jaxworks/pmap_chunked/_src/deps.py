"""The releases jaxworks.pmap_chunked needs, and the one module that imports
the other jaxworks packages it uses.

``jax_internals`` calls ``check_jax`` before it imports any private JAX name.
Each jaxworks dependency is imported through its public API only and checked
(by ``dep_check``) against the minimum this package was written for, so an
outdated install fails at import with an error that says what to upgrade.
"""

from __future__ import annotations

from . import dep_check

_PACKAGE = "jaxworks.pmap_chunked"
#: The jax/jaxlib releases whose private internals this package is written for.
SUPPORTED_JAX = ">=0.10.2,<0.11"

#: The jaxworks packages this one needs, with the minimum of each (the
#: wheel's Requires-Dist is made from this declaration and ``SUPPORTED_JAX``).
MINIMUM_VERSIONS = {
  "jaxworks.axis_names": "0.2.0",
  "jaxworks.batched_transfer": "0.2.0",
  "jaxworks.jit_cache": "0.4.0",  # stages_aot's stage family re-exported, CacheInfo, AxisNameError at entry points
}


def check_jax() -> None:
  """Raises ImportError unless the installed jax and jaxlib are supported."""
  dep_check.check_jax(_PACKAGE, SUPPORTED_JAX)


# Every missing or outdated one is named in one error, with its pip command.
_modules = dep_check.load(_PACKAGE, MINIMUM_VERSIONS)
_axis_names = _modules["jaxworks.axis_names"]
_batched_transfer = _modules["jaxworks.batched_transfer"]
_jit_cache = _modules["jaxworks.jit_cache"]
del _modules

# Bound at import: the jaxworks functions themselves, never ``jax.jit`` or
# ``jax.device_put`` looked up later (those may be swapped for these).
jit = _jit_cache.jit
device_put = _batched_transfer.device_put
check_axis_names = _axis_names.check_axis_names
AxisNameError = _axis_names.AxisNameError
