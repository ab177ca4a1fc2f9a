"""Minimum versions of jaxworks dependencies, and the jit used by trace()."""

import os
import types

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest

from jaxworks.stages_aot._src import dep_check
from jaxworks.stages_aot._src import deps
from jaxworks.stages_aot._src import entry


def test_check_version():
  dep_check.check_version(
    "jaxworks.stages_aot", "jaxworks.jit_cache", "0.1.0", "0.1.0"
  )
  dep_check.check_version(
    "jaxworks.stages_aot", "jaxworks.jit_cache", "0.10.0", "0.9.1"
  )
  dep_check.check_version(
    "jaxworks.stages_aot", "jaxworks.jit_cache", "1.0.0rc1", "0.1.0"
  )
  with pytest.raises(
    RuntimeError,
    match=r"jaxworks.stages_aot needs jaxworks.jit_cache >= 0.2.0, but 0.1.9 is installed; upgrade it \(pip install -U 'jaxworks-jit-cache>=0.2.0'\)",
  ):
    dep_check.check_version(
      "jaxworks.stages_aot", "jaxworks.jit_cache", "0.1.9", "0.2.0"
    )


def test_jit_cache_is_loaded_and_recent_enough():
  import jaxworks.jit_cache as jit_cache

  assert deps.load_jit_cache() is jit_cache
  dep_check.check_version(
    "jaxworks.stages_aot",
    "jaxworks.jit_cache",
    jit_cache.__version__,
    deps.MIN_JIT_CACHE_VERSION,
  )
  assert entry.default_jit() is jit_cache.jit


def test_incomplete_or_missing_dependency_is_actionable():
  fake = types.ModuleType("jaxworks.jit_cache")
  fake.__version__ = "0.3.0"
  with pytest.raises(
    RuntimeError,
    match=r"jaxworks.stages_aot: jaxworks.jit_cache found at \[\] is "
    r"incomplete \(no jit\); reinstall it \(pip install --force-reinstall "
    r"'jaxworks-jit-cache>=0.1.0'\)",
  ):
    dep_check.require("jaxworks.stages_aot", fake, "0.1.0", attrs=("jit",))
  fake.jit = object()
  assert (
    dep_check.require("jaxworks.stages_aot", fake, "0.1.0", ("jit",)) is fake
  )
  err = dep_check.missing(
    "jaxworks.stages_aot", "jaxworks.jit_cache", "0.1.0", ImportError("gone")
  )
  assert str(err) == (
    "jaxworks.stages_aot needs jaxworks.jit_cache >= 0.1.0, which could not "
    "be imported (gone); install it (pip install 'jaxworks-jit-cache>=0.1.0')"
  )
