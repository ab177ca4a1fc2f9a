"""8 threads with the same new signature trace (and compile) once."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxworks.jit_cache import jit

N_THREADS = 8


def _run_threads(target):
  barrier = threading.Barrier(N_THREADS)
  results = [None] * N_THREADS
  errors = []

  def worker(i):
    try:
      barrier.wait()
      results[i] = target(i)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [
    threading.Thread(target=worker, args=(i,)) for i in range(N_THREADS)
  ]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=60)
  assert not errors, errors
  return results


def _slow_body(calls):
  def body(x, y):
    calls.append(threading.get_ident())
    time.sleep(0.05)  # widen the race window
    return jnp.tanh(x) * y

  return body


def test_single_flight_trace():
  calls = []
  f = jit(_slow_body(calls))
  x = jnp.linspace(0, 1, 16)
  traced = _run_threads(lambda i: f.trace(x, 2.0))
  assert len(calls) == 1
  assert all(str(t.jaxpr) == str(traced[0].jaxpr) for t in traced)
  assert f.cache_info().misses == 1 and f.cache_info().hits == N_THREADS - 1


def test_single_flight_call_and_compile():
  calls = []
  f = jit(_slow_body(calls))
  x = jnp.linspace(0, 1, 32)
  outs = _run_threads(lambda i: f(x, 3.0))
  want = jax.jit(lambda a, b: jnp.tanh(a) * b)(x, 3.0)
  for out in outs:
    np.testing.assert_allclose(out, want, rtol=1e-6)
  assert len(calls) == 1
  assert f.cache_info().compiles + f.cache_info().executable_reuses == 1


def test_threads_with_distinct_signatures():
  calls = []
  f = jit(_slow_body(calls))
  outs = _run_threads(lambda i: f(jnp.ones(i + 1), float(i)))
  for i, out in enumerate(outs):
    np.testing.assert_allclose(out, np.tanh(1.0) * i, rtol=1e-6)
  assert len(calls) == N_THREADS


def test_threads_inner_calls_under_traces():
  calls = []
  inner = jit(_slow_body(calls))

  def make_outer(i):
    def outer(x):
      return inner(x, 2.0) + i

    return outer

  x = jnp.ones(8)
  outs = _run_threads(lambda i: jax.jit(make_outer(i))(x))
  for i, out in enumerate(outs):
    np.testing.assert_allclose(out, np.tanh(1.0) * 2 + i, rtol=1e-6)
  assert len(calls) == 1
