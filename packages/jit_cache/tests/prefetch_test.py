"""Warm-start prefetch (``_src/prefetch.py``): a function's first call in a
process deserializes its entry of JAX's persistent cache while it traces.

Each "new process" here is simulated in-process by clearing every in-memory
cache (jaxworks' and JAX's) and the record of call sites compiled; the
cross-process corpus (linalg, ``jax.random``, callbacks, key arguments) is in
``persistent_cache_test``. Every hint below that is wrong, planted or hostile
must leave results bit for bit like stock's, take nothing, and leave no
thread behind.
"""

import base64
import json
import os
import sys
import threading

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import child
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks import jit_cache
from jaxworks.jit_cache._src import hints
from jaxworks.jit_cache._src import jax_internals as ji
from jaxworks.jit_cache._src import prefetch


def step(w, x, lr):
  loss, g = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
  return w - lr * g, loss


def other(v):
  return jnp.cos(v) * 2.5 + 1.0


W = np.linspace(-1, 1, 64, dtype=np.float32).reshape(8, 8)
X = np.linspace(0, 2, 32, dtype=np.float32).reshape(4, 8)
ARGS = (W, X, np.float32(0.1))


def new_process() -> None:
  """What a new process starts without: every in-memory cache."""
  jax.clear_caches()
  jit_cache.clear_caches()
  prefetch.forget_sites()


def prefetched() -> int:
  return jit_cache.stats().persistent_prefetched


def no_prefetch_threads() -> bool:
  return not any(t.name == "jaxworks-prefetch" for t in threading.enumerate())


def call(fun=step, args=ARGS):
  new_process()
  f = jit_cache.jit(fun)
  return f, jax.tree.map(np.asarray, f(*args))


def same(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
    x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in zip(la, lb)
  )


@pytest.fixture
def cache(tmp_path):
  jit_cache.set_cache_dir(tmp_path / "cache")
  yield tmp_path / "cache"
  jit_cache.set_cache_dir(None)
  jit_cache.config.prefetch = True


@pytest.fixture(scope="module")
def stock():
  return jax.tree.map(np.asarray, jax.jit(step)(*ARGS))


@pytest.fixture(scope="module")
def stock_other():
  return np.asarray(jax.jit(other)(W))


def hint_path(cache, fun=step, args=ARGS):
  leaves, treedef = jax.tree.flatten((args, {}))
  short = lambda x: ji.shaped_abstractify(x).str_short()  # noqa: E731
  return (
    cache
    / hints.HINTS
    / (hints.site_digest(fun, leaves, treedef, (), short) + ".json")
  )


def test_warm_first_call_takes_the_prefetched_executable(cache, stock):
  _, cold = call()
  assert same(cold, stock)
  hint = json.loads(hint_path(cache).read_text())
  assert hint["key"].startswith("jit_step-") and hint["devices"] == [0]
  assert oct(os.stat(cache / hints.HINTS).st_mode & 0o777) == "0o700"
  before = prefetched()
  f, warm = call()
  assert same(warm, stock)
  assert prefetched() == before + 1
  assert "deserialized while the function traced" in f.explain_miss(*ARGS)
  assert no_prefetch_threads()
  # An unchanged hint is not written again.
  mtime = os.stat(hint_path(cache)).st_mtime_ns
  call()
  assert os.stat(hint_path(cache)).st_mtime_ns == mtime


def test_recreated_closures_prefetch_once(cache, monkeypatch):
  def make(scale):
    def scaled(v):
      return jnp.sin(v) * scale

    return scaled

  x = jnp.arange(4.0)
  new_process()
  jit_cache.jit(make(2.0))(x)  # cold: writes the hint
  new_process()
  started = []
  real = prefetch._Loader  # pylint: disable=protected-access

  class Counting(real):
    def __init__(self, reads, *rest):
      started.extend(r.key for r in reads)
      super().__init__(reads, *rest)

  monkeypatch.setattr(prefetch, "_Loader", Counting)
  digests = []
  real_digest = hints.site_digest
  monkeypatch.setattr(
    hints, "site_digest", lambda *a: digests.append(1) or real_digest(*a)
  )
  before = prefetched()
  for scale in (2.0, 2.0, 2.0):  # the step re-created per configuration
    out = jit_cache.jit(make(scale))(x)
    assert np.asarray(out).tobytes() == np.asarray(jnp.sin(x) * 2.0).tobytes()
  assert len(started) == 1 and prefetched() == before + 1
  # The site is known after the first: later misses skip its digest.
  assert len(digests) == 1
  jit_cache.jit(make(3.0))(jnp.arange(5.0))  # another site of the code
  assert len(digests) == 2
  prefetch.forget_sites()
  jit_cache.jit(make(4.0))(x)
  assert len(digests) == 3


def test_off_when_configured_off(cache, stock):
  jit_cache.config.prefetch = False
  call()
  before = prefetched()
  _, out = call()
  assert same(out, stock) and prefetched() == before
  assert not (cache / hints.HINTS).exists()
  with pytest.raises(TypeError, match="config.prefetch must be True or False"):
    jit_cache.config.prefetch = "yes"


def _planted_hints(cache, valid):
  """Hostile or wrong contents for the hint of ``step``."""
  other_key = json.loads(hint_path(cache, other, (W,)).read_text())["key"]
  return {
    "garbage": b"\x80\x00not json",
    "truncated": json.dumps(valid)[:40].encode(),
    "wrong format": json.dumps(dict(valid, format="other/1")).encode(),
    "path in key": json.dumps(dict(valid, key="../../etc/passwd")).encode(),
    "negative device": json.dumps(dict(valid, devices=[-1])).encode(),
    "unknown device": json.dumps(dict(valid, devices=[9999])).encode(),
    "another device": json.dumps(dict(valid, devices=[1])).encode(),
    "bad options": json.dumps(dict(valid, options="!!")).encode(),
    "options not a proto": json.dumps(dict(valid, options="AAEC")).encode(),
    "unknown platform": json.dumps(dict(valid, platform="nope")).encode(),
    "another program's entry": json.dumps(dict(valid, key=other_key)).encode(),
    "missing entry": json.dumps(
      dict(valid, key="jit_step-" + "0" * 64)
    ).encode(),
  }


def test_planted_hints_take_nothing_and_results_match(cache, stock):
  call(other, (W,))  # an entry of another program
  call()
  path = hint_path(cache)
  valid = json.loads(path.read_text())
  for what, data in _planted_hints(cache, valid).items():
    path.write_bytes(data)
    before = prefetched()
    _, out = call()
    assert same(out, stock), what
    assert prefetched() == before, what
    assert no_prefetch_threads(), what
    # The compile wrote a correct hint back.
    assert json.loads(path.read_text()) == valid, what


@pytest.mark.parametrize("kind", ["symlink", "fifo", "sparse", "directory"])
def test_hints_that_are_not_regular_files_are_not_read(cache, stock, kind):
  call()
  path = hint_path(cache)
  valid = path.read_bytes()
  path.unlink()
  if kind == "symlink":
    target = cache.parent / "elsewhere.json"
    target.write_bytes(valid)
    os.symlink(target, path)
  elif kind == "fifo":
    os.mkfifo(path)  # opened for reading without O_NONBLOCK, this blocks
  elif kind == "sparse":
    with open(path, "wb") as f:
      f.truncate(64 << 30)
  else:
    path.mkdir()
  assert hints.read_site(str(path)) is None
  before = prefetched()
  _, out = call()
  assert same(out, stock) and prefetched() == before
  assert no_prefetch_threads()


@pytest.mark.parametrize("who", ["another user", "group-writable"])
def test_hints_others_could_write_are_not_read(cache, stock, who, monkeypatch):
  call()
  path = hint_path(cache)
  if who == "another user":  # the file's owner is not who reads it
    uid = os.stat(path).st_uid
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
  else:
    os.chmod(path, 0o620)
  assert hints.read_site(str(path)) is None
  before = prefetched()
  _, out = call()
  assert same(out, stock) and prefetched() == before


@pytest.mark.parametrize("change", ["num_replicas", "profile_version"])
def test_a_hint_for_other_options_is_not_taken(cache, stock, change):
  call()
  path = hint_path(cache)
  valid = json.loads(path.read_text())
  # The same entry with other compile options than JAX asks with: refused
  # before deserializing (replicas) or deserialized and then refused.
  proto = ji.compile_options_from_bytes(base64.b64decode(valid["options"]))
  setattr(proto, change, getattr(proto, change) + 2)
  path.write_text(
    json.dumps(
      dict(valid, options=base64.b64encode(proto.SerializeAsString()).decode())
    )
  )
  before = prefetched()
  _, out = call()
  assert same(out, stock) and prefetched() == before
  assert no_prefetch_threads()


def test_cache_reads_of_other_compiles_pass_through(stock_other, cache):
  call()  # installs the read hook
  before = jit_cache.stats()
  new_process()
  out = jax.jit(other)(W)  # stock jit, no prefetch pending
  after = jit_cache.stats()
  assert np.asarray(out).tobytes() == stock_other.tobytes()
  assert after.persistent_prefetched == before.persistent_prefetched
  assert after.persistent_hits + after.persistent_misses > (
    before.persistent_hits + before.persistent_misses
  )


def _script(directory):
  """A process's start: eager ops and library jits, then the step."""
  new_process()
  jit_cache.set_cache_dir(directory)  # reads the process hint
  prefetch._PROCESS.begin()  # pylint: disable=protected-access  # as a first read does
  loader = prefetch._PROCESS.loader  # pylint: disable=protected-access
  if loader is not None:  # let it finish: every read can then be taken
    for item in loader.items:
      item.done.wait(30)
  a = jax.random.normal(jax.random.key(0), (8, 8))
  out = jit_cache.jit(step)(*ARGS)
  return jax.tree.map(np.asarray, (a, out))


def test_process_start_prefetches_what_the_last_run_read(tmp_path, monkeypatch):
  monkeypatch.setattr(sys, "argv", ["/somewhere/train.py", "--steps", "3"])
  d = tmp_path / "cache"
  before = prefetched()
  cold = _script(d)
  reads = len(prefetch._PROCESS.reads)  # pylint: disable=protected-access
  jit_cache.set_cache_dir(None)  # writes the process hint, as exit does
  assert prefetched() == before and reads >= 3
  (path,) = (d / hints.HINTS).glob("process-*.json")
  assert len(hints.read_process(str(path))) == reads
  warm = _script(d)
  assert same(warm, cold)
  assert prefetched() == before + reads  # every read, the step's included
  jit_cache.set_cache_dir(None)
  assert no_prefetch_threads() and not prefetch._PENDING  # pylint: disable=protected-access
  # Another command line has no process hint yet: only the step is
  # prefetched, from its call site's hint; then it has a hint of its own.
  monkeypatch.setattr(sys, "argv", ["/somewhere/eval.py"])
  _script(d)
  assert prefetched() == before + reads + 1
  jit_cache.set_cache_dir(None)
  assert len(list((d / hints.HINTS).glob("process-*.json"))) == 2


def test_what_a_process_does_not_ask_for_is_dropped(tmp_path, monkeypatch):
  monkeypatch.setattr(sys, "argv", ["/somewhere/train.py"])
  monkeypatch.setattr(prefetch, "LINGER_S", 0.2)
  d = tmp_path / "cache"
  _script(d)
  jit_cache.set_cache_dir(None)
  new_process()
  jit_cache.set_cache_dir(d)
  assert prefetch._PROCESS.loader is None  # pylint: disable=protected-access  # until a first read
  prefetch._PROCESS.begin()  # pylint: disable=protected-access
  loader = prefetch._PROCESS.loader  # pylint: disable=protected-access
  assert loader is not None and len(loader.items) >= 3
  loader.thread.join(30)  # the list done, then 0.2 s of nothing asked
  assert not loader.thread.is_alive()
  assert all(i.state == "dropped" and i.result is None for i in loader.items)
  assert not prefetch._PENDING  # pylint: disable=protected-access
  # Taking a later item drops the earlier ones that were not asked for.
  jit_cache.set_cache_dir(None)
  new_process()
  monkeypatch.setattr(prefetch, "LINGER_S", 30.0)
  jit_cache.set_cache_dir(d)
  prefetch._PROCESS.begin()  # pylint: disable=protected-access
  loader = prefetch._PROCESS.loader  # pylint: disable=protected-access
  for item in loader.items:
    item.done.wait(30)
  before = prefetched()
  out = jax.tree.map(np.asarray, jit_cache.jit(step)(*ARGS))  # no eager ops
  assert prefetched() == before + 1
  last = max(
    i.position for i in loader.items if i.read.key.startswith("jit_step")
  )
  assert all(i.state == "dropped" for i in loader.items[:last])
  jit_cache.set_cache_dir(None)  # stops it at once
  assert no_prefetch_threads() and not prefetch._PENDING  # pylint: disable=protected-access
  assert same(out, jax.tree.map(np.asarray, jax.jit(step)(*ARGS)))


_JOB = """
import json, sys, time
import jax, jax.numpy as jnp
from jaxworks import jit_cache
from jaxworks.jit_cache._src import jax_internals as ji

jit_cache.set_cache_dir(sys.argv[1])
time.sleep(0.3)
started = ji.initialized_backend("cpu") is not None
x = jnp.sin(jnp.arange(3.0)) * 2.0
y = jit_cache.jit(lambda v: jnp.cos(v) + 1.0)(x)
print(json.dumps({
  "started": started,
  "y": [float(v) for v in y],
  "prefetched": jit_cache.stats().persistent_prefetched,
}))
"""


def test_a_new_process_prefetch_starts_no_backend(tmp_path):
  # jax.distributed.initialize must come before any backend starts: the
  # prefetch waits for the process's first read of the cache.
  script = tmp_path / "job.py"
  script.write_text(_JOB)
  env = child.env(drop=("JAXWORKS_JIT_CACHE_DIR",))

  def run():
    proc = child.run(str(script), str(tmp_path / "cache"), child_env=env)
    return json.loads(proc.stdout.strip().splitlines()[-1])

  cold, warm = run(), run()
  assert not cold["started"] and not warm["started"]
  assert warm["y"] == cold["y"]
  assert cold["prefetched"] == 0 and warm["prefetched"] >= 2
