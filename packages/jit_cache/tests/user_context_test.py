"""jit under transformations with jax.make_user_context() contexts active.

``jax.make_user_context()`` appends an element to JAX's trace context for the
rest of the process; jit_cache must keep working (it once read the axis
environment as the context's last element), and a user context's value must
change the cache key exactly as it does for stock ``jax.jit``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Private imports below: the layout of JAX's trace context, which no public API
# exposes.
from jaxworks import jit_cache
from jaxworks.jit_cache import jit
from jaxworks.jit_cache._src import jax_internals as ji

# Created at import, as libraries do: every test below runs with it.
USER = jax.make_user_context(default_value=None)
OTHER = jax.make_user_context(default_value="x")


class Counting:
  def __init__(self, fn):
    self.fn, self.n = fn, 0

  def __call__(self, *args):
    self.n += 1
    return self.fn(*args)


def test_trace_context_no_longer_ends_with_the_axis_env():
  env = ji.axis_env_in(ji.trace_context())
  assert type(env).__name__ == "AxisEnv"
  assert type(ji.trace_context()[-1]) is not type(env)


def test_grad_after_make_user_context():
  f = jit(lambda x: 2 * x)
  assert jax.grad(f)(1.0) == jax.grad(jax.jit(lambda x: 2 * x))(1.0) == 2.0


@pytest.mark.parametrize(
  "transform", ["grad", "vmap", "jit", "jvp", "vmap_named"]
)
def test_transformations_match_stock_with_contexts_active(transform):
  body = lambda x: jnp.sin(x) * 3.0 + x**2
  ours, stock = jit(body), jax.jit(body)
  x = jnp.linspace(0.1, 1.0, 4)

  def run(f):
    if transform == "grad":
      return jax.grad(lambda v: f(v).sum())(x)
    if transform == "vmap":
      return jax.vmap(f)(x.reshape(2, 2))
    if transform == "jit":
      return jax.jit(lambda v: f(v) + 1)(x)
    if transform == "jvp":
      return jax.jvp(f, (x,), (jnp.ones_like(x),))[1]
    return jax.vmap(lambda v: jax.lax.psum(f(v), "i"), axis_name="i")(x)

  with USER(3), OTHER("y"):
    want = run(stock)
    got = run(ours)
  np.testing.assert_array_equal(got, want)
  assert got.dtype == want.dtype


def test_user_context_value_changes_the_key_like_stock():
  ours_body, stock_body = Counting(lambda x: x * 2), Counting(lambda x: x * 2)
  ours, stock = jit(ours_body), jax.jit(stock_body)
  x = jnp.ones(3)
  for value in (1, 2, 1, None, 2):
    with USER(value):
      np.testing.assert_array_equal(ours(x), stock(x))
      np.testing.assert_array_equal(
        jax.grad(lambda v: ours(v).sum())(x),
        jax.grad(lambda v: stock(v).sum())(x),
      )
  # 1, 2 and None are three keys for both; the repeats are hits.
  assert ours_body.n == 3
  assert stock_body.n >= 3


def test_user_context_read_by_the_traced_function():
  """A function that reads the context while tracing: each value gives its own
  trace and program, never a stale one."""

  def body(x):
    return x * (USER.value or 0)

  ours = jit(body)
  x = jnp.ones(2)
  for value in (1, 2, 3, 2):
    with USER(value):
      np.testing.assert_array_equal(ours(x), jax.jit(body)(x))
      np.testing.assert_array_equal(
        jax.vmap(ours)(x[:, None]), jax.vmap(jax.jit(body))(x[:, None])
      )


def test_axis_env_and_user_context_both_key_the_trace():
  body = Counting(lambda x: jnp.sin(x) * 2)
  f = jit(body)
  for size, user in ((3, 1), (5, 1), (3, 1), (3, 0)):
    with USER(user):
      out = jax.vmap(f, axis_name="i")(jnp.ones((size, 2)))
    np.testing.assert_allclose(out, jnp.sin(jnp.ones((size, 2))) * 2)
  # One trace per (axis environment, user context), as stock jit: (3, 1),
  # (5, 1) and (3, 0); the repeated (3, 1) is a hit.
  assert body.n == 3


def test_explain_miss_names_the_user_context():
  f = jit(lambda x: x + 1)
  with USER("a"):
    f(jnp.ones(2))
  with USER("b"):
    text = f.explain_miss(jnp.ones(2))
  assert text.startswith("<lambda>: miss") and "user_context" in text


def test_cache_info_after_user_context_calls():
  jit_cache.reset_stats()
  f = jit(lambda x: x - 1)
  with USER(1):
    f(jnp.ones(2))
    jax.grad(lambda v: f(v).sum())(jnp.ones(2))
  info = f.cache_info()
  assert info.traces == 1 and info.hits == 1


def test_user_context_objects_keep_executables_out_of_the_shared_lru():
  """An executable keyed on a user context holding an arbitrary object lives
  only as long as its function; with plain values it is shared after the
  function dies, as any other program."""

  class Setting:
    pass

  jit_cache.clear_caches()
  with USER(Setting()):
    f = jit(lambda x: x * 4)
    np.testing.assert_array_equal(f(jnp.ones(2)), jnp.full(2, 4.0))
  assert jit_cache.stats().executables == 1
  del f
  gc.collect()
  assert jit_cache.stats().executables == 0
  with USER(2):
    jit(lambda x: x * 5)(jnp.ones(2))  # dies at once
    gc.collect()
    g = jit(lambda x: x * 5)
    np.testing.assert_array_equal(g(jnp.ones(2)), jnp.full(2, 5.0))
  assert g.cache_info().executable_reuses == 1
