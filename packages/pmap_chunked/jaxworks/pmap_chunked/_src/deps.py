"""The one module that imports the other jaxworks packages pmap_chunked uses.

Each dependency is imported through its public API only and its version is
checked against the minimum this package was written for, so an outdated
install fails at import with an error that says what to upgrade.
"""

from __future__ import annotations

from jaxworks import axis_names as _axis_names
from jaxworks import batched_transfer as _batched_transfer
from jaxworks import jit_cache as _jit_cache

# Minimum versions of the jaxworks packages this package needs.
MINIMUM_VERSIONS = {
  "jaxworks.jit_cache": "0.1.0",
  "jaxworks.batched_transfer": "0.1.0",
  "jaxworks.axis_names": "0.1.0",
}


def _version_tuple(version: str) -> tuple[int, ...]:
  parts = []
  for piece in version.split("."):
    digits = ""
    for ch in piece:
      if not ch.isdigit():
        break
      digits += ch
    parts.append(int(digits) if digits else 0)
  return tuple(parts)


def check_version(module_name: str, found: str, minimum: str) -> None:
  """Raises RuntimeError when ``found`` is older than ``minimum``."""
  if _version_tuple(found) < _version_tuple(minimum):
    raise RuntimeError(
      f"jaxworks.pmap_chunked needs {module_name} >= {minimum}, but "
      f"{found} is installed; upgrade it, e.g. "
      f"`pip install -U {module_name.replace('.', '-').replace('_', '-')}`."
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
