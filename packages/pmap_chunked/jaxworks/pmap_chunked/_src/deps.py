"""The releases jaxworks.pmap_chunked needs, and the one module that imports
the other jaxworks packages it uses.

``jax_internals`` calls ``check_jax`` before it imports any private JAX name.
Each jaxworks dependency is imported through its public API only and checked
(by ``dep_check``) against the minimum this package was written for, so an
outdated install fails at import with an error that says what to upgrade.
"""

from __future__ import annotations

from jaxworks import axis_names as _axis_names
from jaxworks import batched_transfer as _batched_transfer
from jaxworks import jit_cache as _jit_cache

from . import dep_check

_PACKAGE = "jaxworks.pmap_chunked"
#: The jax/jaxlib releases whose private internals this package is written for.
SUPPORTED_JAX = ">=0.10.2,<0.11"

# Minimum versions of the jaxworks packages this package needs.
MINIMUM_VERSIONS = {
  "jaxworks.jit_cache": "0.3.0",  # the stage family, CacheInfo, check_argnums
  "jaxworks.batched_transfer": "0.1.0",
  "jaxworks.axis_names": "0.1.0",
}


def check_jax() -> None:
  """Raises ImportError unless the installed jax and jaxlib are supported."""
  dep_check.check_jax(_PACKAGE, SUPPORTED_JAX)


for _module in (_jit_cache, _batched_transfer, _axis_names):
  dep_check.require(_PACKAGE, _module, MINIMUM_VERSIONS[_module.__name__])
del _module

# Bound at import: the jaxworks functions themselves, never ``jax.jit`` or
# ``jax.device_put`` looked up later (those may be swapped for these).
jit = _jit_cache.jit
device_put = _batched_transfer.device_put
check_axis_names = _axis_names.check_axis_names
AxisNameError = _axis_names.AxisNameError
