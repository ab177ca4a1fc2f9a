"""Every private JAX name pmap_chunked uses (via _src/jax_internals.py)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxworks.pmap_chunked._src import jax_internals


def test_weak_array_from_shards_wraps_without_copy_and_keeps_weak_type():
  devices = jax.devices()[:2]
  pieces = [jax.device_put(jnp.asarray(1.5)[None], d) for d in devices]
  assert all(p.weak_type for p in pieces)
  sharding = NamedSharding(Mesh(np.array(devices), ("d",)), P("d"))
  out = jax_internals.weak_array_from_shards((2,), pieces[0].dtype, sharding,
                                             pieces)
  assert isinstance(out, jax.Array)
  assert out.weak_type and out.dtype == jnp.float32 and out.shape == (2,)
  assert out.sharding == sharding
  assert ([s.data.unsafe_buffer_pointer() for s in out.addressable_shards]
          == [p.unsafe_buffer_pointer() for p in pieces])
  np.testing.assert_array_equal(out, [1.5, 1.5])
  # Weak type behaves as for a Python scalar: it does not promote.
  assert (out + jnp.ones(2, jnp.bfloat16)).dtype == jnp.bfloat16
