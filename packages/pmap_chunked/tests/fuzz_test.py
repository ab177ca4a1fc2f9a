"""Property test: pmap agrees with jax.vmap for random shapes, axes and modes."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks.pmap_chunked import pmap

pytestmark = pytest.mark.skipif(
  jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS)"
)


@st.composite
def cases(draw):
  n = draw(st.sampled_from([1, 2, 4, 8]))
  rank = draw(st.integers(1, 3))
  shape = [draw(st.integers(1, 3)) for _ in range(rank - 1)]
  in_axis = draw(st.integers(-rank, rank - 1))
  out_rank = rank  # f keeps the (global) rank
  out_axis = draw(st.one_of(st.integers(-out_rank, out_rank - 1)))
  chunked = draw(st.booleans())
  collective = draw(st.sampled_from(["none", "psum", "axis_index", "pmax"]))
  shape.insert(in_axis % rank, n)
  return n, tuple(shape), in_axis, out_axis, chunked, collective


def _body(collective):
  def f(x, c):
    y = x * 2 + c
    if collective == "psum":
      y = y + jax.lax.psum(x, "i")
    elif collective == "axis_index":
      y = y * (jax.lax.axis_index("i") + 1)
    elif collective == "pmax":
      y = y - jax.lax.pmax(x, "i")
    return y, c * 3

  return f


@settings(
  max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(cases())
def test_matches_vmap(case):
  n, shape, in_axis, out_axis, chunked, collective = case
  x = jnp.asarray(np.random.RandomState(0).randn(*shape), jnp.float32)
  c = jnp.float32(0.5)
  f = _body(collective)
  ref = jax.vmap(
    f, in_axes=(in_axis, None), out_axes=(out_axis, None), axis_name="i"
  )(x, c)
  g = f
  if chunked:
    # The body sees the chunk [.., 1, ..] at in_axis and must return it at
    # out_axis: move it there (collectives act elementwise, so the values
    # are the same as in the vmap reference).
    def g(x, c):
      y, d = f(x, c)
      return jnp.moveaxis(y, in_axis % len(shape), out_axis % len(shape)), d

  out = pmap(
    g, "i", in_axes=(in_axis, None), out_axes=(out_axis, None), chunked=chunked
  )(x, c)
  np.testing.assert_allclose(out[0], ref[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out[1], ref[1])
  shards = {s.data.shape for s in out[0].addressable_shards}
  expected = list(ref[0].shape)
  expected[out_axis % len(expected)] = 1
  assert shards == {tuple(expected)}
