"""The trace cache keys on the sizes of the axis names a jaxpr uses."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks.jit_cache import jit


class Counting:
  def __init__(self, fn):
    self.fn, self.n = fn, 0

  def __call__(self, *args):
    self.n += 1
    return self.fn(*args)


def _vmapped(f, size):
  return jax.vmap(f, axis_name="i")(jnp.arange(size * 2.0).reshape(size, 2))


def test_used_axis_size_is_part_of_the_key():
  body = Counting(lambda x: jax.lax.psum(x, "i"))
  f = jit(body)
  ref = jax.jit(lambda x: jax.lax.psum(x, "i"))
  for size in (3, 5, 3):
    np.testing.assert_allclose(_vmapped(f, size), _vmapped(ref, size))
  assert body.n == 2  # sizes 3 and 5; the second 3 is a hit


def test_entry_shared_across_sizes_of_unused_axis():
  body = Counting(lambda x: jnp.sin(x) * 2)
  f = jit(body)
  for size in (3, 5, 7, 9):
    np.testing.assert_allclose(
      _vmapped(f, size),
      jnp.sin(jnp.arange(size * 2.0)).reshape(size, 2) * 2,
      rtol=1e-6,
    )
  # First trace, plus one check (traced again with only the used names bound)
  # before the entry is shared; sizes 7 and 9 are hits.
  assert body.n == 2
  assert f.cache_info().entries == 1


def test_axis_size_folded_to_a_literal_is_not_shared():
  body = Counting(lambda x: x * jax.lax.axis_size("i"))
  f = jit(body)
  ref = jax.jit(lambda x: x * jax.lax.axis_size("i"))
  for size in (3, 5, 3, 5):
    np.testing.assert_array_equal(_vmapped(f, size), _vmapped(ref, size))
  assert f.cache_info().entries == 2


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices")
def test_inner_jit_in_shard_map():
  mesh = jax.make_mesh((4,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  body = Counting(lambda x: jax.lax.psum(x, "d") + jax.lax.axis_index("d"))
  inner = jit(body)

  def run(f):
    return jax.jit(
      jax.shard_map(f, mesh=mesh, in_specs=jax.P("d"), out_specs=jax.P("d"))
    )(jnp.arange(8.0))

  ref = jax.jit(lambda x: jax.lax.psum(x, "d") + jax.lax.axis_index("d"))
  np.testing.assert_allclose(run(inner), run(ref))
  np.testing.assert_allclose(run(lambda x: inner(x)), run(ref))
  assert body.n == 1
