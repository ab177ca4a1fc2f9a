"""The minimum-version check of the jaxworks dependencies."""

import pytest

from jaxworks.pmap_chunked._src import dep_check
from jaxworks.pmap_chunked._src import deps


def test_dependencies_are_the_real_packages():
  import jaxworks.axis_names
  import jaxworks.batched_transfer
  import jaxworks.jit_cache

  assert deps.jit is jaxworks.jit_cache.jit
  assert deps.device_put is jaxworks.batched_transfer.device_put
  assert deps.check_axis_names is jaxworks.axis_names.check_axis_names
  assert deps.AxisNameError is jaxworks.axis_names.AxisNameError


def test_too_old_dependency_is_an_actionable_error():
  with pytest.raises(
    RuntimeError,
    match=r"jaxworks.pmap_chunked needs jaxworks.jit_cache >= 0.1.0, "
    r"but 0.0.9 is installed; upgrade it",
  ):
    dep_check.check_version(
      "jaxworks.pmap_chunked", "jaxworks.jit_cache", "0.0.9", "0.1.0"
    )
  dep_check.check_version(
    "jaxworks.pmap_chunked", "jaxworks.jit_cache", "0.1.0", "0.1.0"
  )
  dep_check.check_version(
    "jaxworks.pmap_chunked", "jaxworks.jit_cache", "0.10.0rc1", "0.2.0"
  )
  with pytest.raises(RuntimeError):
    dep_check.check_version(
      "jaxworks.pmap_chunked", "jaxworks.jit_cache", "0.1.0", "0.1.1"
    )
