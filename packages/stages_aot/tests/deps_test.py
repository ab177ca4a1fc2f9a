"""Minimum versions of jaxworks dependencies, and the jit used by trace()."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest

from jaxworks.stages_aot._src import deps
from jaxworks.stages_aot._src import entry


def test_check_version():
  deps.check_version("jaxworks.jit_cache", "0.1.0", "0.1.0")
  deps.check_version("jaxworks.jit_cache", "0.10.0", "0.9.1")
  deps.check_version("jaxworks.jit_cache", "1.0.0rc1", "0.1.0")
  with pytest.raises(
    RuntimeError,
    match=r"needs jaxworks.jit_cache >= 0.2.0, but 0.1.9 is installed; upgrade it \(pip install -U 'jaxworks-jit-cache>=0.2.0'\)",
  ):
    deps.check_version("jaxworks.jit_cache", "0.1.9", "0.2.0")


def test_missing_attributes_of_entry_objects():
  assert entry.missing_attributes(object()) == list(entry.TRACED_ATTRIBUTES)


def test_jit_cache_is_loaded_and_recent_enough():
  import jaxworks.jit_cache as jit_cache

  assert deps.load_jit_cache() is jit_cache
  deps.check_version(
    "jaxworks.jit_cache", jit_cache.__version__, deps.MIN_JIT_CACHE_VERSION
  )
  assert entry.default_jit() is jit_cache.jit
