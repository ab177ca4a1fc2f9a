"""A consumer of one jaxworks package, with its own `@pypi`: it builds and runs against batched_transfer alone."""

import importlib.util
import os
import re
import sys

import jax
import numpy as np
import pytest


def _freeze(env):
  with open(os.environ[env], encoding="utf-8") as f:
    return {
      re.split(r"[=@ ]", line)[0].lower().replace("_", "-")
      for line in f
      if line.strip() and not line.startswith("#")
    }


def test_uses_the_package_and_its_extension():
  from jaxworks import batched_transfer

  tree = {
    "w": np.arange(6.0, dtype=np.float32).reshape(2, 3),
    "b": np.ones(3, np.float32),
  }
  device = jax.devices()[3]
  placed = batched_transfer.device_put(tree, device)
  expected = jax.device_put(tree, device)
  for key in tree:
    assert placed[key].devices() == {device}
    np.testing.assert_array_equal(placed[key], expected[key])
  plan = batched_transfer.plan(tree, device)
  assert "group" in str(plan).lower()


def test_only_that_package_is_present():
  assert jax.device_count() == 8
  for other in ["jit_cache", "stages_aot", "pmap_chunked", "axis_names"]:
    assert importlib.util.find_spec(f"jaxworks.{other}") is None, other


def test_jaxworks_brings_its_runtime_lock_only():
  """@jaxworks_pypi holds jax, jaxlib, numpy, ml_dtypes and their needs: none
  of jaxworks' test, benchmark or build tools."""
  installed = _freeze("JAXWORKS_FREEZE")
  assert {"jax", "jaxlib", "numpy", "ml-dtypes"} <= installed, installed
  dev_only = {
    "pytest",
    "mypy",
    "ruff",
    "clang-format",
    "orbax-checkpoint",
    "tensorstore",
    "matplotlib",
    "hypothesis",
    "pybind11",
    "auditwheel",
  }
  assert not installed & dev_only, installed & dev_only


def test_pypi_is_this_workspaces_own():
  """`@pypi//pytest` resolved in this workspace's hub, which jaxworks' runtime
  lock lacks, and this test runs on its interpreter."""
  assert "pytest" in _freeze("CONSUMER_FREEZE")
  assert "pytest" not in _freeze("JAXWORKS_FREEZE")
  consumer_venv = os.path.dirname(
    os.path.realpath(os.environ["CONSUMER_FREEZE"])
  )
  assert os.path.realpath(sys.prefix).startswith(consumer_venv), (
    sys.prefix,
    consumer_venv,
  )


if __name__ == "__main__":
  sys.exit(pytest.main([__file__, "-p", "no:cacheprovider", "-q"]))
