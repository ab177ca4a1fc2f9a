"""Nested pmap over two axis names runs on one 2-D mesh."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

# Private imports below: pmap makes its transfers through this binding; counting
# them means patching it.
from jaxworks.pmap_chunked import pmap
import jaxworks.pmap_chunked._src.deps as deps

# 2 x 4 meshes throughout: on fewer devices (one TPU chip) every case skips.
pytestmark = pytest.mark.skipif(
  jax.device_count() < 8,
  reason="needs 8 devices (2 x 4 meshes; the _cpu target runs it on 8 host "
  "devices)",
)


def body(v):
  return (
    jax.lax.psum(v, "j") * 10
    + jax.lax.psum(v, "i")
    + jax.lax.axis_index("i") * 1000
    + jax.lax.axis_index("j") * 100
  )


# Stock jax.pmap 0.10.2 cannot nest (the inner shard_map rejects the outer
# one's context mesh), so the reference for a nested pmap over "i" then "j" is
# stock jax.pmap over "i" of jax.vmap over "j": the same collectives and axis
# indices, with the inner axis run on one device. Nested vmap is checked too.


def _stock(inner, outer_kwargs=None, inner_kwargs=None):
  return jax.pmap(
    jax.vmap(inner, axis_name="j", **(inner_kwargs or {})),
    axis_name="i",
    **(outer_kwargs or {}),
  )


def test_nested_pmap_on_2d_mesh_matches_stock_pmap_of_vmap(monkeypatch):
  outer_traces = []

  def outer(v):
    outer_traces.append(v.shape)
    return pmap(body, axis_name="j")(v)

  f = pmap(outer, axis_name="i")
  x = jnp.arange(2 * 4 * 3.0).reshape(2, 4, 3)
  out = f(x)
  expected = _stock(body)(x)
  np.testing.assert_allclose(out, expected)
  np.testing.assert_allclose(
    out, jax.vmap(jax.vmap(body, axis_name="j"), axis_name="i")(x)
  )
  mesh = out.sharding.mesh
  assert mesh.axis_names == ("i", "j") and mesh.devices.shape == (2, 4)
  assert list(mesh.devices.flat) == jax.devices()
  assert out.sharding.spec == P("i", "j")
  assert {s.data.shape for s in out.addressable_shards} == {(1, 1, 3)}
  # The first call discovers the inner axis (one extra outer trace).
  assert outer_traces == [(4, 3), (4, 3)]

  # Fed back: no retrace, and the input is used where it is (nothing handed
  # to batched_transfer).
  moved = []
  real_put = deps.device_put
  monkeypatch.setattr(
    deps, "device_put", lambda t, s: (moved.append(t), real_put(t, s))[1]
  )
  again = f(out)
  assert moved == []
  np.testing.assert_allclose(again, _stock(body)(expected))
  assert outer_traces == [(4, 3), (4, 3)]
  assert f.cache_info().entries == 1 and f.cache_info().hits == 1


def test_nested_with_inner_in_axes_and_broadcast_argument():
  def outer(v, w):
    inner = pmap(
      lambda a, b: a * b + jax.lax.psum(a, "i"),
      "j",
      in_axes=(1, None),
      out_axes=1,
    )
    return inner(v, w)

  x = jnp.arange(2 * 3 * 4.0).reshape(2, 3, 4)
  w = jnp.float32(2.0)
  out = pmap(outer, "i", in_axes=(0, None))(x, w)
  ref = _stock(
    lambda a, b: a * b + jax.lax.psum(a, "i"),
    outer_kwargs=dict(in_axes=(0, None)),
    inner_kwargs=dict(in_axes=(1, None), out_axes=1),
  )(x, w)
  np.testing.assert_allclose(out, ref)
  assert out.sharding.mesh.devices.shape == (2, 4)


def test_nested_reusing_the_outer_axis_name_is_an_error():
  f = pmap(lambda v: pmap(lambda a: a, "i")(v), "i")
  with pytest.raises(ValueError, match="reuses axis name 'i'"):
    f(jnp.ones((2, 4)))


def test_nested_needing_too_many_devices_is_an_error():
  f = pmap(lambda v: pmap(lambda a: a, "j")(v), "i")
  with pytest.raises(ValueError, match="needs 12 devices but only 8"):
    f(jnp.ones((3, 4)))


def test_nested_pmaps_without_axis_names():
  x = jnp.arange(2 * 4 * 2.0).reshape(2, 4, 2)
  fun = lambda a: a * 2 + a.sum()
  out = pmap(pmap(fun))(x)
  np.testing.assert_allclose(out, jax.pmap(jax.vmap(fun))(x))
  assert out.sharding.mesh.devices.shape == (2, 4)
  assert {s.data.shape for s in out.addressable_shards} == {(1, 1, 2)}


def test_nested_inner_size_changes_between_calls():
  f = pmap(lambda v: pmap(lambda a: a + jax.lax.axis_index("j"), "j")(v), "i")
  a = f(jnp.zeros((2, 4)))
  b = f(jnp.zeros((2, 2)))  # same outer size, inner 4 -> 2
  stock = _stock(lambda a: a + jax.lax.axis_index("j"))
  np.testing.assert_allclose(a, stock(jnp.zeros((2, 4))))
  np.testing.assert_allclose(b, stock(jnp.zeros((2, 2))))
  assert b.sharding.mesh.devices.shape == (2, 2)


def test_nested_inner_with_two_sizes_in_one_call_is_an_error():
  inner = pmap(lambda a: a, "j")
  f = pmap(lambda v, w: (inner(v), inner(w)), "i")
  with pytest.raises(
    ValueError, match="axis 'j' with sizes 4 and 2 in one call"
  ):
    f(jnp.zeros((2, 4)), jnp.zeros((2, 2)))
  assert f.cache_info().entries == 0
