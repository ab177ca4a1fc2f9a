"""Errors about the user's input end at the user's call, in every package.

JAX filters its own frames out of the traceback of an error raised below
one of its API boundaries (``jax_traceback_filtering``, default ``auto``).
Every public entry point of jaxworks is such a boundary and every package's
directory is hidden as JAX's is: the filtered traceback of a bad argument
holds no jaxworks frame, its last frame is the user's, and with filtering
off (``JAX_TRACEBACK_FILTERING=off``) the library's frames are all there.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import importlib
import importlib.util
import tempfile
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks import axis_names
from jaxworks import batched_transfer
from jaxworks import jit_cache
from jaxworks import pmap_chunked
from jaxworks import stages_aot


def two(x, y):
  return x + y


def uses_a_misspelled_axis(x):
  return jax.lax.psum(x, "batchh")


def mesh():
  return jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))


#: A call with a bad argument for each entry point, and the class raised.
CASES = {
  "jit static_argnums": (
    lambda: jit_cache.jit(two, static_argnums=5),
    ValueError,
  ),
  "jit unhashable static": (
    lambda: jit_cache.jit(two, static_argnums=1)(jnp.ones(2), [1]),
    ValueError,
  ),
  "jit_cache.eval_shape": (
    lambda: jit_cache.eval_shape(two, jnp.ones(2), jnp.ones(3)),
    TypeError,
  ),
  "pmap axis_size": (
    lambda: pmap_chunked.pmap(jnp.sin, axis_size=3)(jnp.ones((8, 2))),
    ValueError,
  ),
  "device_put_sharded": (
    lambda: pmap_chunked.device_put_sharded([1.0], [None]),
    TypeError,
  ),
  "device_put spec rank": (
    lambda: batched_transfer.device_put(
      np.ones(4),
      jax.sharding.NamedSharding(mesh(), jax.sharding.PartitionSpec(None, "x")),
    ),
    ValueError,
  ),
  "stages_aot.trace": (
    lambda: stages_aot.trace(two, jnp.ones(2), jnp.ones(3)),
    TypeError,
  ),
  "stages_aot.deserialize": (
    lambda: stages_aot.deserialize(b"not a program"),
    ValueError,
  ),
  "stages_aot.load_artifact": (
    lambda: stages_aot.load_artifact(tempfile.mkdtemp()),
    stages_aot.ArtifactError,
  ),
  "check_axis_names": (
    lambda: axis_names.check_axis_names(uses_a_misspelled_axis, jnp.ones(2)),
    axis_names.AxisNameError,
  ),
}


def _frames(call, error, filtering):
  before = jax.config.jax_traceback_filtering
  jax.config.update("jax_traceback_filtering", filtering)
  try:
    with pytest.raises(error) as info:
      call()
  finally:
    jax.config.update("jax_traceback_filtering", before)
  return traceback.extract_tb(info.value.__traceback__)


PACKAGE_DIRS = tuple(
  os.path.dirname(os.path.abspath(p.__file__)) + os.sep
  for p in (axis_names, batched_transfer, jit_cache, pmap_chunked, stages_aot)
)


def _ours(frames):
  return [
    f for f in frames if os.path.abspath(f.filename).startswith(PACKAGE_DIRS)
  ]


@pytest.mark.parametrize("name", sorted(CASES))
def test_filtered_traceback_ends_at_the_users_call(name):
  call, error = CASES[name]
  frames = _frames(call, error, "remove_frames")
  assert not _ours(frames), [(f.filename, f.name) for f in _ours(frames)]
  # The user's frame is the last but JAX's own (as under stock JAX: an error
  # raised inside jax.numpy keeps jax.numpy's public frames).
  jax_dir = os.path.dirname(jax.__file__) + os.sep
  mine = [f for f in frames if not f.filename.startswith(jax_dir)]
  assert mine[-1].filename == __file__, [(f.filename, f.name) for f in frames]
  unfiltered = _frames(call, error, "off")
  assert _ours(unfiltered), "with filtering off the library frames are kept"


INTERNALS = {
  p.__name__.split(".")[-1]: importlib.import_module(
    f"{p.__name__}._src.jax_internals"
  )
  for p in (axis_names, batched_transfer, jit_cache, pmap_chunked, stages_aot)
}


@pytest.mark.parametrize("package", sorted(INTERNALS))
def test_each_packages_api_boundary_and_hide_frames_of(package, tmp_path):
  """Each package's private JAX names for traceback filtering (in its
  ``_src/jax_internals.py``): a boundary filters what is raised below it,
  and a hidden directory's frames are left out, as JAX's own."""
  ji = INTERNALS[package]
  helper = tmp_path / f"helper_of_{package}.py"
  helper.write_text("def helper(v):\n  raise ValueError('boom')\n")
  spec = importlib.util.spec_from_file_location(helper.stem, helper)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  entry = ji.api_boundary(lambda v: module.helper(v))

  def frames():
    before = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "remove_frames")
    try:
      entry(1.0)
    except ValueError as e:
      return [f.filename for f in traceback.extract_tb(e.__traceback__)]
    finally:
      jax.config.update("jax_traceback_filtering", before)
    raise AssertionError("no error")

  assert str(helper) in frames()
  ji.hide_frames_of(str(tmp_path))
  assert str(helper) not in frames()
