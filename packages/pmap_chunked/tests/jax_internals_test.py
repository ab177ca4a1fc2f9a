"""Every private JAX name pmap_chunked uses (via _src/jax_internals.py)."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from jaxworks.pmap_chunked._src import jax_internals

# Any number of devices will do (these also run on a single accelerator).
N = min(4, jax.device_count())


def some_devices():
  return jax.devices()[:N]


def test_weak_array_from_shards_wraps_without_copy_and_keeps_weak_type():
  devices = some_devices()
  pieces = [jax.device_put(jnp.asarray(1.5)[None], d) for d in devices]
  assert all(p.weak_type for p in pieces)
  sharding = NamedSharding(Mesh(np.array(devices), ("d",)), P("d"))
  out = jax_internals.weak_array_from_shards(
    (N,), pieces[0].dtype, sharding, pieces
  )
  assert isinstance(out, jax.Array)
  assert out.weak_type and out.dtype == jnp.float32 and out.shape == (N,)
  assert out.sharding == sharding
  assert [s.data.unsafe_buffer_pointer() for s in out.addressable_shards] == [
    p.unsafe_buffer_pointer() for p in pieces
  ]
  np.testing.assert_array_equal(out, [1.5] * N)
  # Weak type behaves as for a Python scalar: it does not promote.
  assert (out + jnp.ones(N, jnp.bfloat16)).dtype == jnp.bfloat16


def test_arg_info_has_the_arguments_own_aval():
  info = jax_internals.arg_info(jnp.ones((2, 3), jnp.bfloat16), True)
  assert isinstance(info, jax.stages.ArgInfo)
  assert info.donated
  assert (info.shape, info.dtype) == ((2, 3), jnp.bfloat16)
  scalar = jax_internals.arg_info(2.0, False)
  assert (scalar.shape, scalar.dtype, scalar.donated) == (
    (),
    jnp.float32,
    False,
  )


def test_uncommitted_view_shares_buffers_and_is_uncommitted():
  sharding = NamedSharding(Mesh(np.array(some_devices()), ("d",)), P("d"))
  x = jax.device_put(np.arange(N, dtype=np.float32), sharding)
  assert x.committed
  view = jax_internals.uncommitted_view(x)
  assert isinstance(view, jax.Array) and not view.committed
  assert view.sharding == sharding and view.dtype == x.dtype
  assert [s.data.unsafe_buffer_pointer() for s in view.addressable_shards] == [
    s.data.unsafe_buffer_pointer() for s in x.addressable_shards
  ]
  np.testing.assert_array_equal(view, np.arange(N))
  # jit moves an uncommitted array to the devices it needs (a committed one
  # elsewhere is refused).
  one = jax.device_put(np.arange(N, dtype=np.float32), some_devices()[1])
  with pytest.raises(ValueError):
    jax.jit(lambda v: v, in_shardings=sharding)(one)
  out = jax.jit(lambda v: v, in_shardings=sharding)(
    jax_internals.uncommitted_view(one)
  )
  assert out.sharding == sharding
