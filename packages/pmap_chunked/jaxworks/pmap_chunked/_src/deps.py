"""The releases jaxworks.pmap_chunked needs, and the one module that imports
the other jaxworks packages it uses.

``jax_internals`` calls ``check_jax`` before it imports any private JAX name.
Each jaxworks dependency is imported through its public API only and its
version is checked against the minimum this package was written for, so an
outdated install fails at import with an error that says what to upgrade.
Installed jax/jaxlib releases are read with ``importlib.metadata``, a jaxworks
package's from the module that was imported, and all are compared by
``packaging`` (PEP 440 order: ``0.10.0rc1`` comes after ``0.2.0``).
"""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet

from jaxworks import axis_names as _axis_names
from jaxworks import batched_transfer as _batched_transfer
from jaxworks import jit_cache as _jit_cache

#: The jax/jaxlib releases whose private internals this package is written for.
SUPPORTED_JAX = ">=0.10.2,<0.11"
_JAX_RANGE = SpecifierSet(SUPPORTED_JAX, prereleases=True)  # nightlies too

# Minimum versions of the jaxworks packages this package needs.
MINIMUM_VERSIONS = {
  "jaxworks.jit_cache": "0.1.0",
  "jaxworks.batched_transfer": "0.1.0",
  "jaxworks.axis_names": "0.1.0",
}


def check_jax() -> None:
  """Raises ImportError unless the installed jax and jaxlib are supported."""
  found = {d: metadata.version(d) for d in ("jax", "jaxlib")}
  if not all(v in _JAX_RANGE for v in found.values()):
    raise ImportError(
      f"jaxworks.pmap_chunked supports jax and jaxlib {SUPPORTED_JAX} (it "
      f"uses their private internals); found {found}. Install a supported "
      f"release: pip install 'jax{SUPPORTED_JAX}' 'jaxlib{SUPPORTED_JAX}'"
    )


def check_version(module_name: str, found: str, minimum: str) -> None:
  """Raises RuntimeError when ``found`` is older than ``minimum``."""
  if found not in SpecifierSet(f">={minimum}", prereleases=True):
    dist = module_name.replace(".", "-").replace("_", "-")
    raise RuntimeError(
      f"jaxworks.pmap_chunked needs {module_name} >= {minimum}, but "
      f"{found} is installed; upgrade it, e.g. `pip install -U {dist}`."
    )


for _module in (_jit_cache, _batched_transfer, _axis_names):
  check_version(
    _module.__name__,
    getattr(_module, "__version__", "0"),
    MINIMUM_VERSIONS[_module.__name__],
  )
del _module

# Bound at import: the jaxworks functions themselves, never ``jax.jit`` or
# ``jax.device_put`` looked up later (those may be swapped for these).
jit = _jit_cache.jit
device_put = _batched_transfer.device_put
check_axis_names = _axis_names.check_axis_names
AxisNameError = _axis_names.AxisNameError
