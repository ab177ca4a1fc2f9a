"""The releases jaxworks.stages_aot needs, and the ones an artifact records.

``jax_internals`` calls ``check_jax`` before it imports any private JAX name;
``load_jit_cache`` imports the one jaxworks package this one uses;
``written_by`` is the ``versions`` field of an artifact's manifest. Installed
distributions are read with ``importlib.metadata``, a jaxworks package's
release from the module that was imported, and versions are compared by
``packaging`` (PEP 440 order: ``0.10.0`` comes after ``0.9.1``).
"""

from __future__ import annotations

from importlib import metadata
import platform

from packaging.specifiers import SpecifierSet

from ..version import __version__

#: The jax/jaxlib releases whose private internals this package is written for.
SUPPORTED_JAX = ">=0.10.2,<0.11"
_JAX_RANGE = SpecifierSet(SUPPORTED_JAX, prereleases=True)  # nightlies too
#: jaxworks.jit_cache is the entry point of the stages (``jit(f).trace(...)``).
MIN_JIT_CACHE_VERSION = "0.1.0"


def check_jax() -> None:
  """Raises ImportError unless the installed jax and jaxlib are supported."""
  found = {d: metadata.version(d) for d in ("jax", "jaxlib")}
  if not all(v in _JAX_RANGE for v in found.values()):
    raise ImportError(
      f"jaxworks.stages_aot supports jax and jaxlib {SUPPORTED_JAX} (it uses "
      f"their private internals); found {found}. Install a supported "
      f"release: pip install 'jax{SUPPORTED_JAX}' 'jaxlib{SUPPORTED_JAX}'"
    )


def check_version(package: str, installed: str, minimum: str) -> None:
  """Raises an actionable RuntimeError when ``installed`` is older than ``minimum``.

  >>> check_version("jaxworks.jit_cache", "0.2.0", "0.1.0")
  >>> check_version("jaxworks.jit_cache", "0.0.9", "0.1.0")
  Traceback (most recent call last):
  ...
  RuntimeError: jaxworks.stages_aot needs jaxworks.jit_cache >= 0.1.0, but 0.0.9 is installed; upgrade it (pip install -U 'jaxworks-jit-cache>=0.1.0')
  """
  if installed not in SpecifierSet(f">={minimum}", prereleases=True):
    dist = package.replace(".", "-").replace("_", "-")
    raise RuntimeError(
      f"jaxworks.stages_aot needs {package} >= {minimum}, but {installed} is "
      f"installed; upgrade it (pip install -U '{dist}>={minimum}')"
    )


def load_jit_cache():
  """Imports jaxworks.jit_cache and checks its version.

  Returns:
    The ``jaxworks.jit_cache`` module.

  Raises:
    RuntimeError: jaxworks.jit_cache is missing or older than
      :data:`MIN_JIT_CACHE_VERSION`.
  """
  try:
    from jaxworks import jit_cache as module
  except ImportError as e:
    raise RuntimeError(
      "jaxworks.stages_aot needs jaxworks.jit_cache >= "
      f"{MIN_JIT_CACHE_VERSION} ({e}); install it (pip install "
      f"'jaxworks-jit-cache>={MIN_JIT_CACHE_VERSION}')"
    ) from e
  version = getattr(module, "__version__", None)
  if version is None or not hasattr(module, "jit"):
    where = list(getattr(module, "__path__", []))
    raise RuntimeError(
      f"jaxworks.stages_aot: jaxworks.jit_cache found at {where} is incomplete (no "
      "__version__ or jit); reinstall it (pip install --force-reinstall "
      f"'jaxworks-jit-cache>={MIN_JIT_CACHE_VERSION}')"
    )
  check_version("jaxworks.jit_cache", version, MIN_JIT_CACHE_VERSION)
  return module


def written_by() -> dict[str, str]:
  """The releases that write an artifact (its manifest's ``versions``).

  jax, jaxlib and numpy as installed, the Python version, and the jaxworks
  packages as imported.
  """
  versions = {d: metadata.version(d) for d in ("jax", "jaxlib", "numpy")}
  versions["python"] = platform.python_version()
  versions["jaxworks.stages_aot"] = __version__
  versions["jaxworks.jit_cache"] = load_jit_cache().__version__
  return versions
