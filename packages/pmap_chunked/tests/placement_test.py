"""Zero-copy handoff, inputs that are not moved, device_put_replicated/sharded."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import jaxworks.pmap_chunked._src.deps as deps
from jaxworks.pmap_chunked import device_put_replicated, device_put_sharded
from jaxworks.pmap_chunked import pmap

# JAX 0.9's helpers, still kept privately in JAX 0.10.2: the reference for
# "contents equal to what the old helpers returned". Every test also checks
# against np.stack, so the tests keep their meaning if JAX drops them.
from jax._src import api as _jax_api  # pylint: disable=g-bad-import-order

LEGACY_REPLICATED = getattr(_jax_api, "device_put_replicated", None)
LEGACY_SHARDED = getattr(_jax_api, "device_put_sharded", None)

N = 8
pytestmark = pytest.mark.skipif(jax.device_count() < N,
                                reason="needs 8 devices (XLA_FLAGS)")


def _pointers(a):
  return {s.device: s.data.unsafe_buffer_pointer() for s in a.addressable_shards}


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
  g = pmap(lambda v: v + 1, "j", donate_argnums=0)   # other axis name
  out = f(jnp.ones((N, 256)))
  moved_before = len(transfers)
  before = _pointers(out)
  again = g(out)
  assert len(transfers) == moved_before               # nothing moved
  assert _pointers(again) == before                   # donated in place
  np.testing.assert_allclose(again, 3.0)


def test_inputs_already_laid_out_are_not_moved(transfers):
  mesh = Mesh(np.array(jax.devices()), ("k",))
  x = jax.device_put(np.arange(N * 4.0).reshape(N, 4),
                     NamedSharding(mesh, P("k")))
  w = jax.device_put(np.ones(4), NamedSharding(mesh, P()))
  out = pmap(lambda a, b: a + b, "i", in_axes=(0, None))(x, w)
  np.testing.assert_allclose(out, np.arange(N * 4.0).reshape(N, 4) + 1)
  assert transfers == []


def test_misplaced_inputs_move_in_one_batched_transfer(transfers, monkeypatch):
  calls = []
  real = deps.device_put
  monkeypatch.setattr(deps, "device_put",
                      lambda t, s: (calls.append(len(jax.tree.leaves(t))),
                                    real(t, s))[1])
  args = (np.ones((N, 2)), jnp.ones((N, 2)), jax.device_put(jnp.ones((N, 2)),
                                                            jax.devices()[3]))
  out = pmap(lambda a, b, c: a + b + c)(*args)
  np.testing.assert_allclose(out, 3.0)
  assert calls == [3]


@pytest.mark.parametrize("value", [
    1.0, 3, True, np.arange(3, dtype=np.int32), np.float32(2.5),
    jnp.ones((2, 2), jnp.bfloat16), {"a": np.zeros(2), "b": (1.0, 2)}])
def test_device_put_replicated_matches_jax_0_9(value):
  devices = jax.devices()
  out = device_put_replicated(value, devices)
  ref = (LEGACY_REPLICATED(value, devices) if LEGACY_REPLICATED
         else jax.tree.map(lambda v: np.stack([v] * N), value))

  def check(a, r, x):
    assert a.shape == r.shape == (N,) + np.shape(x)
    assert a.dtype == r.dtype
    assert a.weak_type == getattr(r, "weak_type", a.weak_type)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
    np.testing.assert_array_equal(np.asarray(a), np.stack([np.asarray(x)] * N))
    assert {s.data.shape for s in a.addressable_shards} == {(1,) + np.shape(x)}
    assert isinstance(a.sharding, NamedSharding)
    assert list(a.sharding.mesh.devices.flat) == devices

  jax.tree.map(check, out, ref, value)


def test_device_put_sharded_matches_jax_0_9():
  devices = jax.devices()[2:6]
  shards = [{"x": np.full((2, 3), i, np.float32), "n": i} for i in range(4)]
  out = device_put_sharded(shards, devices)
  ref = (LEGACY_SHARDED(shards, devices) if LEGACY_SHARDED
         else jax.tree.map(lambda *v: np.stack(v), *shards))
  for key in ("x", "n"):
    a, r = out[key], ref[key]
    assert a.shape == r.shape and a.dtype == r.dtype
    assert a.weak_type == getattr(r, "weak_type", a.weak_type)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
    np.testing.assert_array_equal(
        np.asarray(a), np.stack([np.asarray(s[key]) for s in shards]))
    for s in a.addressable_shards:
      i = devices.index(s.device)
      np.testing.assert_array_equal(np.asarray(s.data)[0],
                                    np.asarray(shards[i][key]))


def test_device_put_outputs_feed_pmap_without_copy(transfers):
  devices = jax.devices()
  rep = device_put_replicated(np.ones(4, np.float32), devices)
  sh = device_put_sharded([np.full(4, i, np.float32) for i in range(N)],
                          devices)
  moved = len(transfers)
  out = pmap(lambda a, b: a * b, "i")(rep, sh)
  assert len(transfers) == moved          # taken as they are: nothing moved
  np.testing.assert_allclose(out, np.arange(N)[:, None] * np.ones((N, 4)))


def test_device_put_sharded_from_device_arrays():
  devices = jax.devices()
  shards = [jnp.arange(3) + i for i in range(N)]
  out = device_put_sharded(shards, devices)
  np.testing.assert_array_equal(out, np.stack([np.asarray(s) for s in shards]))
  assert [s.device for s in out.addressable_shards] == devices


def test_device_put_helpers_validate_arguments():
  devs = jax.devices()[:2]
  with pytest.raises(ValueError, match=r"len\(shards\) = 3 must equal "
                     r"len\(devices\) = 2"):
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
  np.testing.assert_array_equal(jax.random.key_data(sharded),
                                jax.random.key_data(jnp.stack(keys)))
  np.testing.assert_array_equal(
      jax.random.key_data(replicated),
      np.stack([jax.random.key_data(jax.random.key(3))] * N))
  out = pmap(lambda k: jax.random.normal(k, (2,)))(sharded)
  np.testing.assert_allclose(
      out, jax.vmap(lambda k: jax.random.normal(k, (2,)))(jnp.stack(keys)))
