"""What the caches keep alive: entries die with their function.

Upstream JAX's own leak checks hold (a dropped argument is freed, no jaxpr is
kept alive after its function dies), ``clear_caches()`` empties every cache of
the package, and ``stats()`` counts what is really held. Compiled programs
that hold no user object may outlive their functions in the bounded shared
executable cache (so that re-created closures still reuse them); nothing
else does.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import gc
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Private imports below: counts the live internal cache objects that stats()
# reports on.
from jaxworks import jit_cache
from jaxworks.jit_cache import jit
from jaxworks.jit_cache._src import cache
from jaxworks.jit_cache._src import executables
from jaxworks.jit_cache._src import fingerprint
from jaxworks.jit_cache._src import reaper

MIB = 1 << 20


def _live(cls, flush=True):
  if flush:  # evicted executables are freed on the reaper thread
    assert reaper.REAPER.flush(timeout=60)
  gc.collect()
  return [o for o in gc.get_objects() if type(o) is cls]  # pylint: disable=unidiomatic-typecheck


def _exercise(f, x):
  """Every path that creates entries: call, trace, grad, vmap, outer jit."""
  f(x)
  f.trace(x)
  jax.grad(lambda v: f(v).sum())(x)
  jax.vmap(f)(x[None])
  jax.jit(lambda v: f(v) * 2)(x)


def test_forty_deleted_functions_leave_no_entries_and_no_pinned_executables():
  jit_cache.clear_caches()
  x = jnp.ones(4)
  before_entries = len(_live(cache.Entry))  # pylint: disable=protected-access
  fs = []
  for k in range(40):
    big = jnp.full((32768,), float(k))  # 128 KiB: kept by identity (pins)
    fs.append(jit(lambda v, big=big: v + big[:4]))
    fs[-1](x)
  assert jit_cache.stats().executables == 40
  assert len(_live(executables.Executable)) == 40  # pylint: disable=protected-access
  del fs
  gc.collect()
  assert len(_live(executables.Executable)) == 0  # pylint: disable=protected-access
  assert len(_live(cache.Entry)) == before_entries  # pylint: disable=protected-access
  s = jit_cache.stats()
  assert s.executables == 0
  assert s.entries == len(cache.GLOBAL_ENTRIES)


def test_forty_deleted_plain_functions_only_keep_bounded_shared_programs():
  jit_cache.clear_caches()
  x = jnp.ones(4)
  fs = [jit(lambda v, k=k: v * float(k)) for k in range(40)]
  for f in fs:
    f(x)
  assert jit_cache.stats().executables == 40  # all live
  del fs, f
  gc.collect()
  assert len(cache.GLOBAL_ENTRIES) == 0
  held = len(_live(executables.Executable))  # pylint: disable=protected-access
  # Only the most recent few outlive their functions (for re-created
  # closures): the count bound.
  assert held == jit_cache.stats().executables
  assert held == cache.DEFAULT_EXECUTABLE_MAXSIZE
  jit_cache.set_global_maxsize(executables=8)
  try:
    assert len(_live(executables.Executable)) == 8  # pylint: disable=protected-access
  finally:
    jit_cache.set_global_maxsize(executables=cache.DEFAULT_EXECUTABLE_MAXSIZE)
  jit_cache.clear_caches()
  assert len(_live(executables.Executable)) == 0  # pylint: disable=protected-access
  assert jit_cache.stats().executables == 0


def test_kept_executables_are_bounded_by_bytes():
  jit_cache.clear_caches()
  per = executables.estimated_bytes
  x = jnp.ones(4)
  jit_cache.set_global_maxsize(executable_bytes=3 * (300 << 10))
  try:
    for k in range(10):
      jit(lambda v, k=k: v * float(k) + 2.0)(x)
    gc.collect()
    held = _live(executables.Executable)  # pylint: disable=protected-access
    assert 1 <= len(held) <= 3
    assert sum(per(e) for e in held) <= 3 * (300 << 10)
    assert cache.EXECUTABLES.nbytes == sum(per(e) for e in held)
  finally:
    jit_cache.set_global_maxsize(
      executable_bytes=cache.DEFAULT_EXECUTABLE_MAXBYTES
    )
    jit_cache.clear_caches()
  with pytest.raises(ValueError, match="executable_bytes must be an int"):
    jit_cache.set_global_maxsize(executable_bytes=0)


def _rss_mib() -> float:
  assert reaper.REAPER.flush(timeout=60)
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_dead_closures_cost_what_the_byte_bound_allows():
  # Executables of dead closures are bounded by bytes, not by count alone:
  # with a loose count bound (1024) and a byte bound of 8 MiB, 250 dead
  # closures (about 50 MiB of executables) may grow the process by 8 MiB
  # plus slack.
  jit_cache.clear_caches()
  x = jnp.ones(3)
  for k in range(20):  # warm up allocator and JAX's own caches
    jit(lambda v, k=k: v * float(-k) + 1.0)(x)
  jit_cache.set_global_maxsize(executables=1024, executable_bytes=8 << 20)
  try:
    gc.collect()
    before = _rss_mib()
    for k in range(250):
      jit(lambda v, k=k: v * float(k) + 1.0)(x)
    gc.collect()
    grown = _rss_mib() - before
    assert cache.EXECUTABLES.nbytes <= 8 << 20
    assert grown < 8 + 20, f"grew by {grown:.1f} MiB"
  finally:
    jit_cache.set_global_maxsize(
      executables=cache.DEFAULT_EXECUTABLE_MAXSIZE,
      executable_bytes=cache.DEFAULT_EXECUTABLE_MAXBYTES,
    )
    jit_cache.clear_caches()


def test_deleted_functions_constants_are_freed():
  for make in (
    lambda: np.ones(MIB // 4, np.float32),
    lambda: jnp.ones(MIB // 4, jnp.float32),
  ):
    const = make()
    ref = weakref.ref(const)
    f = jit(lambda v, c=const: v + c[:4].sum())
    _exercise(f, jnp.ones(4))
    del f, const
    gc.collect()
    assert ref() is None, "a dead function's 1 MiB constant is still alive"


def test_constant_freed_by_clear_caches_of_live_function():
  const = np.ones(MIB // 4, np.float32)
  ref = weakref.ref(const)
  f = jit(lambda v: v + 1)
  f(jnp.ones(4))
  g = jit(lambda v, c=const: v + c[:4])
  g(jnp.ones(4))
  del g, const
  gc.collect()
  assert ref() is None
  assert f.cache_info().entries == 1


def test_dropped_argument_is_freed():
  f = jit(lambda v: v * 2)
  x = jnp.ones(MIB // 4)
  ref = weakref.ref(x)
  _exercise(f, x)
  f.lower(x)
  del x
  gc.collect()
  assert ref() is None, "the cache keeps a dropped argument alive"


def test_no_jaxpr_kept_alive_after_the_function_dies():
  x = jnp.ones(4)
  body_refs = []

  def make():
    def body(v):
      return jnp.tanh(v) * 3.0

    body_refs.append(weakref.ref(body))
    return body

  f = jit(make())
  _exercise(f, x)
  jaxpr_ref = weakref.ref(f.trace(x).jaxpr)
  inner_ref = weakref.ref(f.trace(x).jaxpr.jaxpr)
  made = jit_cache.make_jaxpr(f)(x)
  made_ref = weakref.ref(made)
  del f, made
  gc.collect()
  assert body_refs[0]() is None
  assert jaxpr_ref() is None and inner_ref() is None and made_ref() is None
  assert all(k() is None for k in list(fingerprint._MEMO.keyrefs()))  # pylint: disable=protected-access


def test_entries_leave_the_global_order_with_their_function():
  jit_cache.clear_caches()
  f = jit(lambda v: v + 3)
  g = jit(lambda v: v - 3)
  f(jnp.ones(2))
  g(jnp.ones(2))
  g.trace(jnp.ones(3))
  assert len(cache.GLOBAL_ENTRIES) == 3 == jit_cache.stats().entries
  del g
  gc.collect()
  assert len(cache.GLOBAL_ENTRIES) == 1 == jit_cache.stats().entries


def test_clear_caches_empties_every_cache():
  f = jit(lambda v: jnp.sin(v) + 5)
  f(jnp.ones(2))
  jax.grad(lambda v: f(v).sum())(jnp.ones(2))
  fingerprint.fingerprint(jax.make_jaxpr(jnp.sin)(1.0))  # memoized: no numpy
  assert len(fingerprint._MEMO) > 0  # pylint: disable=protected-access
  jit_cache.clear_caches()
  s = jit_cache.stats()
  assert (s.entries, s.executables, s.dispatch_entries) == (0, 0, 0)
  assert len(cache.GLOBAL_ENTRIES) == 0 and len(cache.EXECUTABLES) == 0
  assert len(fingerprint._MEMO) == 0  # pylint: disable=protected-access
  # clear_caches waits for the reaper: nothing is left when it returns.
  assert len(_live(executables.Executable, flush=False)) == 0  # pylint: disable=protected-access
  np.testing.assert_array_equal(f(jnp.ones(2)), jnp.sin(jnp.ones(2)) + 5)


def test_evicted_executables_are_freed_on_the_reaper_thread():
  # The compile that evicts an executable hands it to the reaper thread
  # instead of freeing it on its own path.
  jit_cache.clear_caches()
  x = jnp.ones(4)
  freed_on = []
  jit_cache.set_global_maxsize(executables=2)
  try:
    f = jit(lambda v: v * 3.0 + 0.5)
    f(x)
    (exe,) = cache.EXECUTABLES.live()
    ref = weakref.ref(
      exe, lambda _: freed_on.append(threading.current_thread().name)
    )
    del exe, f
    gc.collect()
    assert ref() is not None  # kept for a re-created closure
    jit(lambda v: v * 4.0 + 0.5)(x)
    jit(lambda v: v * 5.0 + 0.5)(x)  # the third evicts the first
    assert reaper.REAPER.flush(timeout=60)
    assert ref() is None and freed_on == ["jaxworks-reaper"]
  finally:
    jit_cache.set_global_maxsize(executables=cache.DEFAULT_EXECUTABLE_MAXSIZE)
    jit_cache.clear_caches()


class _Freed:
  """Records the thread that frees it."""

  def __init__(self, log):
    self.log = log

  def __del__(self):
    self.log.append(threading.current_thread().name)


def test_reaper_frees_in_the_caller_once_closed_and_restarts_after_fork():
  log = []
  stage = reaper.Reaper()
  stage.drop([_Freed(log)])
  assert stage.flush(timeout=60) and log == ["jaxworks-reaper"]
  # A forked child has no reaper thread: it starts its own.
  stage.after_fork_in_child()
  assert stage.flush(timeout=0)  # nothing pending in the child
  stage.drop([_Freed(log)])
  assert stage.flush(timeout=60) and log == ["jaxworks-reaper"] * 2
  # At exit: pending values are freed, and later ones in the caller.
  stage.close()
  stage.drop([_Freed(log)])
  assert log[-1] == threading.current_thread().name
