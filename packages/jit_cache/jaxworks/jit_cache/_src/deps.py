"""Minimum versions of the jaxworks packages jit_cache depends on."""

from __future__ import annotations

import re

#: jaxworks.axis_names provides ``used_axis_names(closed_jaxpr)`` since 0.1.0.
MIN_AXIS_NAMES = "0.1.0"


def _parse(version: str) -> tuple[int, ...]:
  return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def check_version(package: str, found: str, minimum: str) -> None:
  """Raises an actionable RuntimeError when ``found`` < ``minimum``."""
  if _parse(found) < _parse(minimum):
    raise RuntimeError(
      f"jaxworks.jit_cache needs {package} >= {minimum}, but {found} is "
      f"installed; upgrade it (pip install -U "
      f"'{package.replace('.', '-')}>={minimum}')."
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
