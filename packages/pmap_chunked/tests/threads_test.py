"""Several threads call pmaps (plain and nested) at once."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks.pmap_chunked import pmap

pytestmark = pytest.mark.skipif(
  jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS)"
)


def test_concurrent_calls_of_one_pmap_and_nested_pmaps():
  flat = pmap(lambda v: v + jax.lax.psum(v, "i"), "i")
  nested = pmap(
    lambda v: pmap(lambda a: a * jax.lax.axis_index("j"), "j")(v), "i"
  )

  def work(k):
    results = []
    for r in range(3):
      x = jnp.full((8, k + 1), float(k + r))
      results.append((np.asarray(flat(x)), 8 * (k + r) + (k + r)))
      y = jnp.ones((2, 4, k + 1))
      results.append(
        (
          np.asarray(nested(y)),
          np.broadcast_to(np.arange(4.0)[None, :, None], (2, 4, k + 1)),
        )
      )
    return results

  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    for results in pool.map(work, range(4)):
      for got, want in results:
        np.testing.assert_allclose(got, np.broadcast_to(want, got.shape))
  assert flat.cache_info().entries == 1  # one structure, several shapes
  assert nested.cache_info().entries == 1
