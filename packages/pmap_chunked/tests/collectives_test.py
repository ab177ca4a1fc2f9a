"""Collectives over the pmap axis, compared with stock jax.pmap and jax.vmap."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import jaxworks_testing as jwt
import numpy as np
import pytest

from jaxworks.pmap_chunked import pmap

# Every device present: 8 host devices on the CPU target, one TPU chip.
N = jax.device_count()

X = jnp.arange(N * 4, dtype=jnp.float32).reshape(N, 4) - 7.0

PERM = [(i, (i + 3) % N) for i in range(N)]

CASES = {
  "psum": lambda v: jax.lax.psum(v, "i"),
  "pmean": lambda v: jax.lax.pmean(v, "i"),
  "pmax": lambda v: jax.lax.pmax(v, "i"),
  "all_gather": lambda v: jax.lax.all_gather(v, "i"),
  "all_gather_tiled": lambda v: jax.lax.all_gather(v, "i", tiled=True),
  "ppermute": lambda v: jax.lax.ppermute(v, "i", PERM),
  "all_to_all": lambda v: jax.lax.all_to_all(
    jnp.tile(v[:1], N), "i", 0, 0, tiled=True
  ),
  "axis_index": lambda v: v * jax.lax.axis_index("i"),
  "psum_tuple_and_pmin": lambda v: (
    jax.lax.psum((v, 2 * v), "i"),
    jax.lax.pmin(v, "i"),
  ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_collective_matches_stock_pmap_and_vmap(name):
  fun = CASES[name]
  out = pmap(fun, axis_name="i")(X)
  expected_pmap = jax.pmap(fun, axis_name="i")(X)
  expected_vmap = jax.vmap(fun, axis_name="i")(X)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), out, expected_pmap
  )
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), out, expected_vmap
  )
  for leaf in jax.tree.leaves(out):
    assert {s.data.shape[0] for s in leaf.addressable_shards} == {1}


def test_collectives_in_chunked_mode():
  def f(v):  # v: [1, 4]
    total = jax.lax.psum(v, "i")
    gathered = jax.lax.all_gather(v, "i", tiled=True)  # [N, 4]
    return total + gathered.max() + jax.lax.axis_index("i")

  out = pmap(f, "i", chunked=True)(X)
  expected = X.sum(0) + X.max() + jnp.arange(N)[:, None]
  np.testing.assert_allclose(out, expected)


def test_collective_with_named_tuple_axis_and_subset_of_devices():
  jwt.require_devices(8)  # 4 rows on devices 4..7
  fun = lambda v: jax.lax.psum(v, "data") / jax.lax.psum(1, "data")
  x = X[:4]
  out = pmap(fun, axis_name="data", devices=jax.devices()[4:])(x)
  np.testing.assert_allclose(out, jnp.broadcast_to(x.mean(0), x.shape))
