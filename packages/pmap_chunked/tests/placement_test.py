"""Zero-copy handoff, inputs that are not moved, device_put_replicated/sharded."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jaxworks_testing as jwt
import numpy as np
import pytest

# Private imports below: pmap makes its transfers through this binding; counting
# them means patching it.
from jaxworks.pmap_chunked import device_put_replicated
from jaxworks.pmap_chunked import device_put_sharded
from jaxworks.pmap_chunked import pmap
import jaxworks.pmap_chunked._src.deps as deps

# Every device present: 8 host devices on the CPU target, one TPU chip.
N = jax.device_count()


def _pointers(a):
  return {
    s.device: s.data.unsafe_buffer_pointer() for s in a.addressable_shards
  }


@pytest.fixture
def transfers(monkeypatch):
  """Counts the leaves pmap hands to jaxworks.batched_transfer.device_put."""
  moved = []
  real = deps.device_put

  def counting(tree, target):
    moved.extend(jax.tree.leaves(tree))
    return real(tree, target)

  monkeypatch.setattr(deps, "device_put", counting)
  return moved


def test_pmap_output_feeds_jit_without_copy():
  out = pmap(lambda v: v * 2, "i")(jnp.ones((N, 256)))
  before = _pointers(out)
  # Donating into jit: the result aliases the very input buffers, which only
  # happens when jit took them as they were (no copy, no reshard).
  after = jax.jit(lambda a: a + 1, donate_argnums=0)(out)
  assert _pointers(after) == before
  np.testing.assert_allclose(after, 3.0)
  # And jit compiles for pmap's layout as is.
  compiled = jax.jit(lambda a: a * 3).lower(after).compile()
  assert compiled.input_shardings[0][0] == after.sharding


def test_pmap_output_feeds_pmap_without_copy(transfers):
  f = pmap(lambda v: v * 2, "i")
  g = pmap(lambda v: v + 1, "j", donate_argnums=0)  # other axis name
  out = f(jnp.ones((N, 256)))
  moved_before = len(transfers)
  before = _pointers(out)
  again = g(out)
  assert len(transfers) == moved_before  # nothing moved
  assert _pointers(again) == before  # donated in place
  np.testing.assert_allclose(again, 3.0)


def test_inputs_already_laid_out_are_not_moved(transfers):
  mesh = Mesh(np.array(jax.devices()), ("k",))
  x = jax.device_put(
    np.arange(N * 4.0).reshape(N, 4), NamedSharding(mesh, P("k"))
  )
  w = jax.device_put(np.ones(4), NamedSharding(mesh, P()))
  out = pmap(lambda a, b: a + b, "i", in_axes=(0, None))(x, w)
  np.testing.assert_allclose(out, np.arange(N * 4.0).reshape(N, 4) + 1)
  assert transfers == []


def test_misplaced_inputs_move_in_one_batched_transfer(transfers, monkeypatch):
  jwt.require_devices(2)  # on one device two of the three are in place
  calls = []
  real = deps.device_put
  monkeypatch.setattr(
    deps,
    "device_put",
    lambda t, s: (calls.append(len(jax.tree.leaves(t))), real(t, s))[1],
  )
  args = (
    np.ones((N, 2)),
    jnp.ones((N, 2)),
    jax.device_put(jnp.ones((N, 2)), jwt.device(3)),
  )
  out = pmap(lambda a, b, c: a + b + c)(*args)
  np.testing.assert_allclose(out, 3.0)
  assert calls == [3]


def _check_like_jax(ours, rows, stacked_devices):
  """`ours` is what JAX 0.9's helpers returned for `rows` (one per device):
  the rows stacked on a new leading axis, with the dtype and weak type that
  ``jax.device_put`` gives a row, row k on device k as a [1, ...] shard."""
  rows = [jax.device_put(r) for r in rows]
  assert ours.shape == (len(rows),) + rows[0].shape
  assert ours.dtype == rows[0].dtype and ours.weak_type == rows[0].weak_type
  np.testing.assert_array_equal(np.asarray(ours), np.stack(rows))
  assert isinstance(ours.sharding, NamedSharding)
  assert list(ours.sharding.mesh.devices.flat) == list(stacked_devices)
  stacked = NamedSharding(Mesh(np.array(stacked_devices), ("k",)), P("k"))
  assert ours.sharding.is_equivalent_to(stacked, ours.ndim)
  row_on = dict(zip(stacked_devices, rows))
  for s in ours.addressable_shards:  # device k holds row k, as [1, ...]
    assert s.data.shape == (1,) + ours.shape[1:]
    np.testing.assert_array_equal(np.asarray(s.data)[0], row_on[s.device])


@pytest.mark.parametrize(
  "value",
  [
    1.0,
    3,
    True,
    np.arange(3, dtype=np.int32),
    np.float32(2.5),
    jnp.ones((2, 2), jnp.bfloat16),
    {"a": np.zeros(2), "b": (1.0, 2)},
  ],
)
def test_device_put_replicated_matches_jax_0_9(value):
  devices = jax.devices()
  out = device_put_replicated(value, devices)
  assert jax.tree.structure(out) == jax.tree.structure(value)
  jax.tree.map(lambda a, v: _check_like_jax(a, [v] * N, devices), out, value)
  jax.tree.map(
    lambda a, x: np.testing.assert_array_equal(
      np.asarray(a), np.stack([np.asarray(x)] * N)
    ),
    out,
    value,
  )


def test_device_put_sharded_matches_jax_0_9():
  devices = jwt.devices(6)[2:6]
  shards = [{"x": np.full((2, 3), i, np.float32), "n": i} for i in range(4)]
  out = device_put_sharded(shards, devices)
  assert jax.tree.structure(out) == jax.tree.structure(shards[0])
  jax.tree.map(lambda a, *r: _check_like_jax(a, r, devices), out, *shards)
  assert out["n"].weak_type  # Python ints stay weakly typed
  for key in ("x", "n"):
    np.testing.assert_array_equal(
      np.asarray(out[key]), np.stack([np.asarray(s[key]) for s in shards])
    )


def test_device_put_helpers_use_one_batched_transfer(monkeypatch):
  calls = []
  real = deps.device_put
  monkeypatch.setattr(
    deps,
    "device_put",
    lambda t, s: (calls.append(len(jax.tree.leaves(t))), real(t, s))[1],
  )
  devices = jwt.devices(4)
  tree = {"a": np.ones(3), "b": (2.0, np.arange(4))}
  device_put_replicated(tree, devices)
  assert calls == [3]  # every leaf in one call
  device_put_sharded([tree] * 4, devices)
  assert calls == [3, 12]  # every piece of every leaf


def test_device_put_outputs_feed_pmap_without_copy(transfers):
  devices = jax.devices()
  rep = device_put_replicated(np.ones(4, np.float32), devices)
  sh = device_put_sharded(
    [np.full(4, i, np.float32) for i in range(N)], devices
  )
  moved = len(transfers)
  out = pmap(lambda a, b: a * b, "i")(rep, sh)
  assert len(transfers) == moved  # taken as they are: nothing moved
  np.testing.assert_allclose(out, np.arange(N)[:, None] * np.ones((N, 4)))


def test_device_put_sharded_from_device_arrays():
  devices = jax.devices()
  shards = [jnp.arange(3) + i for i in range(N)]
  out = device_put_sharded(shards, devices)
  _check_like_jax(out, shards, devices)
  np.testing.assert_array_equal(out, np.stack([np.asarray(s) for s in shards]))


def test_device_put_helpers_validate_arguments():
  devs = jwt.devices(2)
  with pytest.raises(
    ValueError,
    match=r"len\(shards\) = 3 must equal "
    r"len\(devices\) = 2",
  ):
    device_put_sharded([1, 2, 3], devs)
  with pytest.raises(ValueError, match="agree in shape and dtype"):
    device_put_sharded([np.ones(2), np.ones(3)], devs)
  with pytest.raises(ValueError, match="same pytree structure"):
    device_put_sharded([(1, 2), [1, 2]], devs)
  with pytest.raises(TypeError, match="shards must be a sequence"):
    device_put_sharded(np.ones((2, 2)), devs)
  with pytest.raises(ValueError, match="non-empty"):
    device_put_replicated(1.0, [])
  with pytest.raises(ValueError, match="more than once"):
    device_put_replicated(1.0, [devs[0], devs[0]])
  with pytest.raises(TypeError, match="sequence of jax devices"):
    device_put_replicated(1.0, devs[0])


def test_device_put_helpers_with_prng_keys_feed_pmap():
  devices = jax.devices()
  keys = list(jax.random.split(jax.random.key(7), N))
  sharded = device_put_sharded(keys, devices)
  replicated = device_put_replicated(jax.random.key(3), devices)
  assert jax.dtypes.issubdtype(sharded.dtype, jax.dtypes.prng_key)
  assert sharded.shape == replicated.shape == (N,)
  for ours in (sharded, replicated):
    assert ours.dtype == keys[0].dtype
    assert [s.device for s in ours.addressable_shards] == devices
  np.testing.assert_array_equal(
    jax.random.key_data(sharded), jax.random.key_data(jnp.stack(keys))
  )
  np.testing.assert_array_equal(
    jax.random.key_data(replicated),
    np.stack([jax.random.key_data(jax.random.key(3))] * N),
  )
  out = pmap(lambda k: jax.random.normal(k, (2,)))(sharded)
  np.testing.assert_allclose(
    out, jax.vmap(lambda k: jax.random.normal(k, (2,)))(jnp.stack(keys))
  )
