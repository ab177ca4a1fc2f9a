"""Minimum versions of the jaxworks packages this package depends on."""

from __future__ import annotations

#: jaxworks.jit_cache is the entry point of the stages (``jit(f).trace(...)``).
MIN_JIT_CACHE_VERSION = "0.1.0"


def _version_tuple(version: str) -> tuple[int, ...]:
  parts = []
  for piece in version.split("."):
    digits = "".join(ch for ch in piece if ch.isdigit())
    if not digits:
      break
    parts.append(int(digits))
    if digits != piece:
      break
  return tuple(parts)


def check_version(package: str, installed: str, minimum: str) -> None:
  """Raises an actionable RuntimeError when ``installed`` is older than ``minimum``.

  >>> check_version("jaxworks.jit_cache", "0.2.0", "0.1.0")
  >>> check_version("jaxworks.jit_cache", "0.0.9", "0.1.0")
  Traceback (most recent call last):
  ...
  RuntimeError: jaxworks.stages_aot needs jaxworks.jit_cache >= 0.1.0, but 0.0.9 is installed; upgrade it (pip install -U 'jaxworks-jit-cache>=0.1.0')
  """
  if _version_tuple(installed) < _version_tuple(minimum):
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
