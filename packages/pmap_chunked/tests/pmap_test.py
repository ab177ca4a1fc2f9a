"""pmap semantics on 8 host devices, compared with stock jax.pmap / jax.vmap."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxworks.jit_cache
from jaxworks.pmap_chunked import PmapCacheInfo, pmap

N = 8
pytestmark = pytest.mark.skipif(jax.device_count() < N,
                                reason="needs 8 devices (XLA_FLAGS)")


def _shard_shapes(a):
  return sorted({s.data.shape for s in a.addressable_shards})


def test_classic_semantics_rank_preserving_shards():
  x = jnp.arange(N * 100.0).reshape(N, 100)
  seen = []

  def f(v):
    seen.append(v.shape)
    return jnp.sin(v) * 2

  out = pmap(f, axis_name="i")(x)
  np.testing.assert_allclose(out, jax.pmap(lambda v: jnp.sin(v) * 2)(x),
                             rtol=1e-6)
  assert seen == [(100,)]                      # mapped axis removed inside
  assert out.shape == (N, 100)
  assert _shard_shapes(out) == [(1, 100)]      # [1, 100] per device
  assert isinstance(out.sharding, NamedSharding)
  assert out.sharding.spec == P("i")
  assert out.sharding.mesh.axis_names == ("i",)
  assert out.sharding.mesh.axis_types == (jax.sharding.AxisType.Auto,)
  assert list(out.sharding.mesh.devices.flat) == jax.devices()[:N]
  for shard in out.addressable_shards:         # device k holds row k
    k = jax.devices().index(shard.device)
    np.testing.assert_allclose(shard.data[0], np.sin(np.asarray(x[k])) * 2,
                               rtol=1e-6)


def test_chunked_body_sees_size_one_axis():
  x = jnp.arange(N * 6.0).reshape(N, 2, 3)
  seen = []

  def f(v):
    seen.append(v.shape)
    return v * jax.lax.axis_index("i")

  out = pmap(f, "i", chunked=True)(x)
  assert seen == [(1, 2, 3)]
  expected = x * jnp.arange(N)[:, None, None]
  np.testing.assert_allclose(out, expected)
  assert _shard_shapes(out) == [(1, 2, 3)]
  # Same global arrays as chunked=False.
  classic = pmap(lambda v: v * jax.lax.axis_index("i"), "i")(x)
  np.testing.assert_allclose(out, classic)
  assert out.sharding == classic.sharding


def test_chunked_with_other_axes():
  x = jnp.arange(3 * N * 2.0).reshape(3, N, 2)
  seen = []

  def f(v, w):
    seen.append((v.shape, w.shape))
    return v + w.sum()

  out = pmap(f, "i", in_axes=(1, None), out_axes=1, chunked=True)(x, 10.0)
  assert seen == [((3, 1, 2), ())]
  np.testing.assert_allclose(out, x + 10.0)
  assert out.sharding.spec == P(None, "i")
  assert _shard_shapes(out) == [(3, 1, 2)]


def test_fewer_devices_than_available_uses_a_prefix():
  x = jnp.arange(3 * 4.0).reshape(3, 4)
  out = pmap(lambda v: v + 1)(x)
  np.testing.assert_allclose(out, x + 1)
  assert list(out.sharding.mesh.devices.flat) == jax.devices()[:3]


def test_devices_argument_picks_and_orders_devices():
  devs = jax.devices()[::-1][:4]
  x = jnp.arange(4.0)
  out = pmap(lambda v: v * 10, "i", devices=devs)(x)
  np.testing.assert_allclose(out, x * 10)
  assert list(out.sharding.mesh.devices.flat) == devs
  by_device = {s.device: float(s.data[0]) for s in out.addressable_shards}
  assert [by_device[d] for d in devs] == [0.0, 10.0, 20.0, 30.0]


def test_in_axes_none_nonzero_negative_and_pytrees():
  a = jnp.arange(3 * N * 1.0).reshape(3, N)
  b = {"w": jnp.arange(N * 2.0).reshape(2, N), "s": jnp.float32(0.5)}
  c = jnp.arange(4.0)

  def f(a, b, c):
    return a * b["s"] + b["w"].sum() + c.sum()

  in_axes = (1, {"w": -1, "s": None}, None)
  out = pmap(f, "i", in_axes=in_axes)(a, b, c)
  expected = jax.vmap(f, in_axes=in_axes)(a, b, c)
  np.testing.assert_allclose(out, expected)
  # Lists count as tuples, like vmap.
  out2 = pmap(f, "i", in_axes=[1, {"w": 1, "s": None}, None])(a, b, c)
  np.testing.assert_allclose(out2, expected)


def test_out_axes_none_nonzero_negative_and_pytrees():
  x = jnp.arange(N * 6.0).reshape(N, 2, 3)

  def f(v):
    return {"a": v, "b": (v.sum(0), jax.lax.psum(v.sum(), "i"))}

  out_axes = {"a": -1, "b": (1, None)}
  out = pmap(f, "i", out_axes=out_axes)(x)
  expected = jax.vmap(f, out_axes=out_axes, axis_name="i")(x)
  jax.tree.map(np.testing.assert_allclose, out, expected)
  assert out["a"].shape == (2, 3, N) and out["a"].sharding.spec == P(None,
                                                                     None, "i")
  assert out["b"][0].shape == (3, N)
  assert out["b"][1].shape == ()               # out_axes None: unmapped
  assert _shard_shapes(out["a"]) == [(2, 3, 1)]


def test_chunked_negative_out_axes():
  x = jnp.arange(2 * N * 1.0).reshape(2, N)
  out = pmap(lambda v: v * 2, "i", in_axes=-1, out_axes=-1, chunked=True)(x)
  np.testing.assert_allclose(out, x * 2)
  assert out.sharding.spec == P(None, "i")


def test_keyword_arguments_are_mapped_over_axis_zero():
  x = jnp.arange(N * 2.0).reshape(N, 2)
  y = jnp.arange(N * 1.0)
  out = pmap(lambda a, *, b: a.sum() + b, "i", in_axes=None)(
      jnp.ones(3), b=y)
  np.testing.assert_allclose(out, y + 3)
  out2 = pmap(lambda a, b: a * b[0])(x, b=x)
  np.testing.assert_allclose(out2, x * x[:, :1])


def test_static_broadcasted_argnums():
  x = jnp.arange(N * 1.0)
  traces = []

  def f(power, v, name):
    traces.append((power, name))
    return v ** power

  g = pmap(f, "i", in_axes=(None, 0, None), static_broadcasted_argnums=(0, 2))
  np.testing.assert_allclose(g(2, x, "a"), x ** 2)
  np.testing.assert_allclose(g(2, x, "a"), x ** 2)
  np.testing.assert_allclose(g(3, x, "a"), x ** 3)
  assert traces == [(2, "a"), (3, "a")]        # new static value: new trace
  np.testing.assert_allclose(
      jax.pmap(f, static_broadcasted_argnums=(0, 2))(3, x, "a"), x ** 3)
  # An int works as well as a tuple.
  h = pmap(lambda v, k: v + k, static_broadcasted_argnums=1)
  np.testing.assert_allclose(h(x, 5), x + 5)


def test_donate_argnums_consumes_the_buffer():
  x = pmap(lambda v: v)(jnp.arange(N * 4.0).reshape(N, 4))
  keep = pmap(lambda v: v)(jnp.ones((N, 4)))
  f = pmap(lambda a, b: a + b, donate_argnums=0)
  out = f(x, keep)
  np.testing.assert_allclose(out, np.arange(N * 4.0).reshape(N, 4) + 1)
  assert x.is_deleted()
  assert not keep.is_deleted()
  # Same as stock pmap.
  y = jax.pmap(lambda v: v)(jnp.ones((N, 4)))
  jax.pmap(lambda a: a + 1, donate_argnums=0)(y)
  assert y.is_deleted()


def test_donated_input_that_needed_moving_is_released():
  x = jnp.arange(N * 2.0).reshape(N, 2)       # on one device: must move
  out = pmap(lambda v: v * 2, donate_argnums=(0,))(x)
  np.testing.assert_allclose(out, np.arange(N * 2.0).reshape(N, 2) * 2)
  assert x.is_deleted()


def test_cache_hits_and_trace_count():
  traces = []

  def f(v):
    traces.append(v.shape)
    return v + 1

  g = pmap(f)
  x = jnp.zeros((N, 3))
  for _ in range(3):
    x = g(x)
  np.testing.assert_allclose(x, 3.0)
  assert traces == [(3,)]
  assert g.cache_info() == PmapCacheInfo(hits=2, misses=1, entries=1)
  g(jnp.zeros((N, 5)))                         # new shape: same entry, retrace
  assert traces == [(3,), (5,)]
  g(jnp.zeros((4, 5)))                         # new size: new entry
  assert g.cache_info().entries == 2


def test_axis_size_without_mapped_arguments():
  out = pmap(lambda c: c + jax.lax.axis_index("i"), "i", in_axes=None,
             axis_size=4)(jnp.float32(1.0))
  np.testing.assert_allclose(out, [1.0, 2.0, 3.0, 4.0])


def test_lower_and_trace():
  f = pmap(lambda v: jax.lax.psum(v, "i"), "i")
  x = jnp.ones((N, 2))
  lowered = f.lower(x)
  text = lowered.as_text()
  assert "all-reduce" in text or "all_reduce" in text
  compiled = lowered.compile()
  arg = jax.device_put(x, NamedSharding(
      jax.sharding.Mesh(np.array(jax.devices()), ("i",)), P("i")))
  np.testing.assert_allclose(compiled(arg), np.full((N, 2), 8.0))
  traced = f.trace(jax.ShapeDtypeStruct((N, 2), jnp.float32))
  assert traced.jaxpr is not None


def test_inside_jit_and_grad():
  f = pmap(lambda v: jnp.sin(v) * jax.lax.psum(v, "i"), "i")
  x = jnp.arange(N * 1.0)
  out = jax.jit(lambda a: f(a) + 1)(x)
  np.testing.assert_allclose(out, np.sin(x) * x.sum() + 1, rtol=1e-5)
  g = jax.grad(lambda a: f(a).sum())(x)
  ref = jax.grad(lambda a: jax.pmap(
      lambda v: jnp.sin(v) * jax.lax.psum(v, "i"), "i")(a).sum())(x)
  np.testing.assert_allclose(g, ref, rtol=1e-5)


def test_decorator_form_and_metadata():
  @pmap
  def double(v):
    """Doubles."""
    return v * 2

  assert double.__name__ == "double" and double.__doc__ == "Doubles."
  np.testing.assert_allclose(double(jnp.ones(N)), 2.0)
  assert "double" in repr(double)


def test_program_is_traced_and_cached_by_jit_cache():
  f = pmap(lambda v: v * 3, "i")
  x = jnp.ones((N, 7))
  before = jaxworks.jit_cache.stats().traces
  f(x)
  assert jaxworks.jit_cache.stats().traces == before + 1
  f(x)
  f(x)
  assert jaxworks.jit_cache.stats().traces == before + 1
  assert isinstance(f._entries[next(iter(f._entries))].jitted,
                    jaxworks.jit_cache.JitFunction)
