"""The trace cache keys on the whole axis environment, as stock jit does."""

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


def test_entry_is_per_axis_environment_as_in_stock():
  body = Counting(lambda x: jnp.sin(x) * 2)
  f = jit(body)
  for size in (3, 5, 3, 5):
    np.testing.assert_allclose(
      _vmapped(f, size),
      jnp.sin(jnp.arange(size * 2.0)).reshape(size, 2) * 2,
      rtol=1e-6,
    )
  assert body.n == 2  # one trace per environment; the repeats are hits
  assert f.cache_info().entries == 2


def _probe(x):
  try:
    return x + jax.lax.axis_size("j")
  except NameError:
    return x - 1.0


@pytest.mark.parametrize("first", ["unbound", "other-name"])
def test_axis_probe_sees_the_environment_of_each_call(first):
  # A function that probes an axis, first traced where the axis is unbound,
  # sees it bound later: the axis environment is in the key even when the
  # jaxpr uses no axis name.
  results = {}
  for name, jit_ in (("stock", jax.jit), ("jaxworks", jit)):
    f = jit_(_probe)
    xs = jnp.ones((3, 2))
    out = []
    if first == "unbound":
      out.append(f(jnp.ones(2)))
    else:
      out.append(jax.vmap(f, axis_name="i")(xs))
    out.append(jax.vmap(f, axis_name="j")(xs))
    out.append(
      jax.vmap(jax.vmap(f, axis_name="j"), axis_name="i")(jnp.ones((2, 3, 2)))
    )
    results[name] = [np.asarray(o) for o in out]
  for a, b in zip(results["stock"], results["jaxworks"]):
    np.testing.assert_array_equal(a, b)


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
