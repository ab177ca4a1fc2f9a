"""jaxworks.jit_cache under jaxworks.pmap_chunked: inner-jit hits, program reuse, executable reuse.

pmap_chunked traces and caches its program through jit_cache.jit; these tests count what that buys against stock
jax.pmap (whose results every test compares to).
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxworks import jit_cache
from jaxworks import pmap_chunked

# Every device present: 8 host devices on the CPU target, one TPU chip.
N = jax.device_count()


def _x(cols=16, seed=0):
  return np.random.default_rng(seed).normal(size=(N, cols)).astype(np.float32)


def _counted(fun, counter):
  def wrapper(*args):
    counter.append(1)
    return fun(*args)

  return wrapper


def _layer(v):
  return jnp.tanh(v * 1.5 + 0.25)


def _body(layer):
  def body(v):
    for _ in range(3):
      v = layer(v)
    return v / jax.lax.psum(jnp.abs(v).sum(), "i")

  return body


def test_inner_jit_traced_once_per_pmap_trace_then_hits():
  runs = []
  layer = jit_cache.jit(_counted(_layer, runs))
  f = pmap_chunked.pmap(_body(layer), "i")
  x = _x()
  out = f(x)
  info = layer.cache_info()
  assert (info.misses, info.hits, info.traces) == (1, 2, 1)
  assert len(runs) == 1  # the Python function ran once for three inner calls
  np.testing.assert_allclose(
    out, jax.pmap(_body(jax.jit(_layer)), "i")(x), rtol=1e-6
  )

  # A second call is a hit of pmap_chunked's program cache and of jit_cache's dispatch: nothing is traced.
  before = jit_cache.stats()
  out2 = f(x + 1)
  after = jit_cache.stats()
  info = f.cache_info()
  assert type(info) is jit_cache.CacheInfo  # one cache-info type
  assert (info.hits, info.misses, info.entries) == (1, 1, 1)
  assert (after.traces, after.compiles) == (before.traces, before.compiles)
  assert layer.cache_info().traces == 1 and len(runs) == 1
  np.testing.assert_allclose(
    out2, jax.pmap(_body(jax.jit(_layer)), "i")(x + 1), rtol=1e-6
  )


def test_new_shape_is_a_new_trace_of_the_same_pmap_entry():
  layer = jit_cache.jit(_layer)
  f = pmap_chunked.pmap(_body(layer), "i")
  f(_x(16))
  before = jit_cache.stats()
  f(_x(32))
  # pmap_chunked's entry is keyed by structure and mapped size (8), not by shape: it is reused, and its
  # jit_cache program traces the new shape, where the inner jit misses once and hits twice.
  info = f.cache_info()
  assert type(info) is jit_cache.CacheInfo  # one cache-info type
  assert (info.hits, info.misses, info.entries) == (1, 1, 1)
  assert jit_cache.stats().compiles == before.compiles + 1
  info = layer.cache_info()
  assert (info.misses, info.hits, info.traces, info.entries) == (2, 4, 2, 2)
  np.testing.assert_allclose(
    f(_x(32, seed=3)), jax.pmap(_body(_layer), "i")(_x(32, seed=3)), rtol=1e-6
  )


def test_recreated_pmap_reuses_the_compiled_executable():
  def make(scale):
    # a new closure each time, with the same code and constants
    return pmap_chunked.pmap(
      lambda v: jnp.sin(v) * scale + jax.lax.pmean(v, "i"), "i"
    )

  x = _x(64)
  first = make(2.0)(x)
  before = jit_cache.stats()
  again = make(2.0)
  out = again(x)
  after = jit_cache.stats()
  assert after.executable_reuses == before.executable_reuses + 1
  assert after.compiles == before.compiles
  assert (
    again.cache_info().misses == 1
  )  # a new pmap object builds its program entry ...
  np.testing.assert_array_equal(
    out, first
  )  # ... and runs the executable compiled for the first one
  stock = jax.pmap(lambda v: jnp.sin(v) * 2.0 + jax.lax.pmean(v, "i"), "i")(x)
  np.testing.assert_allclose(out, stock, rtol=1e-6)

  # Other constants: a different program, compiled.
  before = jit_cache.stats()
  other = make(3.0)(x)
  assert jit_cache.stats().compiles == before.compiles + 1
  assert not np.allclose(other, first)


def test_pmap_inside_jit_cache_jit():
  layer = jit_cache.jit(_layer)
  inner = pmap_chunked.pmap(_body(layer), "i")
  outer = jit_cache.jit(lambda v: inner(v) * 2.0 + 1.0)
  x = _x()
  out = outer(x)
  outer(x + 1)
  info = outer.cache_info()
  # traced once; the second call is served by the C++ dispatcher without Python
  assert (info.traces, info.compiles, info.dispatch_entries) == (1, 1, 1)
  assert inner.cache_info().misses == 1
  stock = jax.jit(
    lambda v: jax.pmap(_body(jax.jit(_layer)), "i")(v) * 2.0 + 1.0
  )(x)
  np.testing.assert_allclose(out, stock, rtol=1e-6)
  assert out.sharding.num_devices == N


def test_grad_through_pmap_with_inner_jit_cache():
  layer = jit_cache.jit(_layer)

  def loss(w, v, pm):
    return pm(lambda c: jax.lax.psum(jnp.sum(layer(c * w) ** 2), "i"), "i")(
      v
    ).sum()

  x = _x()
  w = jnp.float32(0.7)
  ours = jax.grad(loss)(w, x, pmap_chunked.pmap)
  stock = jax.grad(loss)(w, x, jax.pmap)
  np.testing.assert_allclose(ours, stock, rtol=1e-5)
  assert layer.cache_info().traces >= 1
