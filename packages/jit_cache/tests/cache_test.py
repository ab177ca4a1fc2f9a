"""Bounds, weak references, statistics and explanations of the caches."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks import jit_cache
from jaxworks.jit_cache import jit


def test_per_function_lru_bound_and_evictions():
  calls = []

  def body(x):
    calls.append(x.shape)
    return x + 1

  f = jit(body, maxsize=2)
  for n in (1, 2, 3):
    f.trace(jnp.ones(n))
  info = f.cache_info()
  assert (info.entries, info.evictions, info.maxsize) == (2, 1, 2)
  assert calls == [(1,), (2,), (3,)]
  f.trace(jnp.ones(3))  # still cached
  assert f.cache_info().misses == 3
  f.trace(jnp.ones(1))  # evicted: a miss again
  assert f.cache_info().misses == 4 and f.cache_info().entries == 2


def test_lru_order_follows_use():
  f = jit(lambda x: x * 2, maxsize=2)
  f.trace(jnp.ones(1))
  f.trace(jnp.ones(2))
  f.trace(jnp.ones(1))  # touch shape (1,)
  f.trace(jnp.ones(3))  # evicts (2,), the least recently used
  before = f.cache_info().misses
  f.trace(jnp.ones(1))
  assert f.cache_info().misses == before
  f.trace(jnp.ones(2))
  assert f.cache_info().misses == before + 1


def test_global_bound_across_functions():
  jit_cache.set_global_maxsize(entries=3)
  try:
    fs = [jit(lambda x, k=k: x + k) for k in range(3)]
    for f in fs:
      f.trace(jnp.ones(2))
    g = jit(lambda x: x - 1)
    g.trace(jnp.ones(2))
    entries = [f.cache_info().entries for f in fs]
    assert sum(entries) + g.cache_info().entries <= 3
    assert entries[0] == 0  # the oldest entry went first
    assert fs[0].cache_info().evictions == 1
  finally:
    jit_cache.set_global_maxsize(entries=4096)
  with pytest.raises(ValueError, match="entries must be an int >= 1"):
    jit_cache.set_global_maxsize(entries=0)


def test_functions_are_held_weakly():
  def make():
    def body(x):
      return x * 3

    return body

  body = make()
  ref = weakref.ref(body)
  f = jit(body)
  f(jnp.ones(3))
  jax.make_jaxpr(lambda x: f(x))(jnp.ones(3))  # noqa: F821 (deleted below)
  jit_cache.eval_shape(body, jnp.ones(2))  # implicit wrapper, held weakly
  wrapper_ref = weakref.ref(f)
  del body, f
  gc.collect()
  assert ref() is None and wrapper_ref() is None


def test_no_tracer_kept_alive_by_the_caches():
  refs = []
  inner = jit(lambda x: jnp.tanh(x) * 2)

  def outer(x):
    refs.append(weakref.ref(x))
    y = inner(x)
    refs.append(weakref.ref(y))
    return inner(y)

  jax.jit(outer)(jnp.ones(4))
  jax.grad(lambda v: outer(v).sum())(jnp.ones(4))
  jax.vmap(outer)(jnp.ones((2, 4)))
  jit_cache.eval_shape(outer, jnp.ones(4))
  gc.collect()
  assert refs and all(r() is None for r in refs)
  assert inner.cache_info().entries == 1


def test_stats_counters_and_reset():
  jit_cache.reset_stats()
  f = jit(lambda x: x + 2)
  f(jnp.ones(2))
  f(jnp.ones(2))  # served by the C++ dispatcher: no Python, no counter
  jax.make_jaxpr(lambda v: f(v))(jnp.ones(2))  # trace-cache hit
  g = jit(lambda x: x + 2)  # same program, fresh wrapper
  g(jnp.ones(2))
  s = jit_cache.stats()
  assert s.traces == 2 and s.misses == 2 and s.hits == 1
  assert s.compiles == 1 and s.executable_reuses == 1
  assert s.time_saved_s > 0
  assert s.entries >= 2 and s.dispatch_entries >= 2 and s.executables >= 1
  info = f.cache_info()
  assert info.dispatch_entries == 1 and info.executables == 1
  assert isinstance(info, jit_cache.CacheInfo)
  jit_cache.reset_stats()
  assert jit_cache.stats().traces == 0 and f.cache_info().hits == 0


def test_clear_caches_forces_retrace():
  calls = []
  f = jit(lambda x: calls.append(1) or x * 2)
  f(jnp.ones(2))
  jit_cache.clear_caches()
  assert f.cache_info().entries == 0 and f.cache_info().dispatch_entries == 0
  np.testing.assert_array_equal(f(jnp.ones(2)), jnp.full(2, 2.0))
  assert len(calls) == 2
  f.clear_cache()
  assert f.cache_info().entries == 0


def test_explain_miss_names_path_and_property():
  f = jit(lambda x, n: x["w"] * n, static_argnums=1)
  x = {"w": jnp.ones(3, jnp.float32)}
  assert "nothing is cached" in f.explain_miss(x, 2)
  f(x, 2)
  assert f.explain_miss(x, 2).startswith("<lambda>: hit")
  text = f.explain_miss({"w": jnp.ones(3, jnp.int32)}, 2)
  assert text.startswith("<lambda>: miss")
  assert "x['w']: dtype float32 -> int32" in text
  assert "x['w']: shape (3,) -> (4,)" in f.explain_miss({"w": jnp.ones(4)}, 2)
  assert "static argument n: 2 -> 3" in f.explain_miss(x, 3)
  assert "argument structure" in f.explain_miss({"w": x["w"], "b": 1.0}, 2)


def test_explain_miss_x64_and_placement():
  f = jit(lambda x: x + 1)
  f(jnp.ones(3))
  text = f.explain_miss(np.ones(3, np.float32))
  assert "hit" in text and "kind jax_array -> ndarray" in text
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", True)
  try:
    text = f.explain_miss(jnp.ones(3, jnp.float32))
  finally:
    jax.config.update("jax_enable_x64", prev)
  assert "config jax_enable_x64: False -> True" in text
  if len(jax.devices()) > 1:
    moved = jax.device_put(jnp.ones(3), jax.devices()[1])
    text = f.explain_miss(moved)
    assert "sharding" in text and "committed False -> True" in text


def test_explain_miss_weak_type():
  f = jit(lambda x: x + 1)
  f(jnp.float32(1.0))
  assert "x: weak_type False -> True" in f.explain_miss(jnp.asarray(1.0) * 1)
