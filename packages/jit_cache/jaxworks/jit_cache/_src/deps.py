"""The releases jaxworks.jit_cache needs, checked when it is imported.

``jax_internals`` calls ``check_jax`` before it imports any private JAX name;
``load_axis_names`` imports the one jaxworks package this one uses. Installed
jax/jaxlib releases are read with ``importlib.metadata``, a jaxworks package's
from the module that was imported, and all are compared by ``packaging``
(PEP 440 order: ``0.10.0rc1`` comes after ``0.9.1`` and before ``0.10.0``).
"""

from __future__ import annotations

from importlib import metadata

from packaging.specifiers import SpecifierSet

#: The jax/jaxlib releases whose private internals this package is written for.
SUPPORTED_JAX = ">=0.10.2,<0.11"
_JAX_RANGE = SpecifierSet(SUPPORTED_JAX, prereleases=True)  # nightlies too
#: jaxworks.axis_names provides ``used_axis_names(closed_jaxpr)`` since 0.1.0.
MIN_AXIS_NAMES = "0.1.0"


def check_jax() -> None:
  """Raises ImportError unless the installed jax and jaxlib are supported."""
  found = {d: metadata.version(d) for d in ("jax", "jaxlib")}
  if not all(v in _JAX_RANGE for v in found.values()):
    raise ImportError(
      f"jaxworks.jit_cache supports jax and jaxlib {SUPPORTED_JAX} (it uses "
      f"their private internals); found {found}. Install a supported "
      f"release: pip install 'jax{SUPPORTED_JAX}' 'jaxlib{SUPPORTED_JAX}'"
    )


def check_version(package: str, found: str, minimum: str) -> None:
  """Raises an actionable RuntimeError when ``found`` < ``minimum``.

  >>> check_version("jaxworks.axis_names", "0.10.0rc1", "0.9.1")
  >>> check_version("jaxworks.axis_names", "0.0.9", "0.1.0")
  Traceback (most recent call last):
  ...
  RuntimeError: jaxworks.jit_cache needs jaxworks.axis_names >= 0.1.0, but 0.0.9 is installed; upgrade it (pip install -U 'jaxworks-axis-names>=0.1.0').
  """
  if found not in SpecifierSet(f">={minimum}", prereleases=True):
    dist = package.replace(".", "-").replace("_", "-")
    raise RuntimeError(
      f"jaxworks.jit_cache needs {package} >= {minimum}, but {found} is "
      f"installed; upgrade it (pip install -U '{dist}>={minimum}')."
    )


def load_axis_names():
  """Imports jaxworks.axis_names, checking its version."""
  try:
    from jaxworks import axis_names  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise RuntimeError(
      "jaxworks.jit_cache needs jaxworks.axis_names >= "
      f"{MIN_AXIS_NAMES}, which could not be imported ({e}); install it "
      f"(pip install 'jaxworks-axis-names>={MIN_AXIS_NAMES}')."
    ) from e
  check_version("jaxworks.axis_names", axis_names.__version__, MIN_AXIS_NAMES)
  return axis_names
