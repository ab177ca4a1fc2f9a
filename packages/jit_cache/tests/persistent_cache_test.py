"""jit_cache across processes, on JAX's persistent compilation cache.

Cross-process tests start ``persistent_cache_worker.py`` with this
interpreter and ``PYTHONPATH`` and compare its results with a stock run
(``jax.jit``, no cache) bit for bit.
"""

import json
import os
import pickle
import stat
import time

import child
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks import jit_cache

# The documented environment variable that turns the persistent cache on.
ENV_VAR = "JAXWORKS_JIT_CACHE_DIR"

WORKER = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), "persistent_cache_worker.py"
)


def _env(extra=None):
  drop = (ENV_VAR, "JAX_COMPILATION_CACHE_DIR")
  return child.env(drop, **(extra or {}))


def _worker(mode, directory, out, timeout=180):
  proc = child.run(
    WORKER, mode, str(directory), str(out), child_env=_env(), timeout=timeout
  )
  stats = json.loads(proc.stdout.strip().splitlines()[-1])
  with np.load(out) as f:
    return {k: f[k] for k in f.files}, stats


def _assert_bitwise(results, reference):
  assert sorted(results) == sorted(reference)
  for name, want in reference.items():
    got = results[name]
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert got.tobytes() == want.tobytes(), name


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
  d = tmp_path_factory.mktemp("stock")
  return _worker("stock", "-", d / "stock.npz")[0]


@pytest.fixture
def cache_off():
  yield
  jit_cache.set_cache_dir(None)
  jit_cache.config.min_compile_time_secs = 0.0
  jit_cache.config.min_entry_size_bytes = 0


def test_warm_process_runs_linalg_random_and_keys_like_stock(tmp_path, stock):
  # jaxworks' old disk cache segfaulted here on every warm process (LAPACK
  # kernels not registered when loading without lowering) and raised
  # AttributeError on a typed PRNG key argument.
  d = tmp_path / "cache"
  out = tmp_path / "out.npz"  # the same command line twice
  cold, cold_stats = _worker("jaxworks", d, out)
  warm, warm_stats = _worker("jaxworks", d, out)
  _assert_bitwise(cold, stock)
  _assert_bitwise(warm, stock)
  assert cold_stats["persistent_hits"] == 0
  assert cold_stats["persistent_misses"] >= 10
  assert warm_stats["persistent_hits"] >= 10  # every cacheable compile
  assert warm_stats["persistent_misses"] == 0
  assert warm_stats["persistent_load_s"] > 0
  assert warm_stats["compiles"] == cold_stats["compiles"]  # counted, loaded
  # Entries were deserialized before JAX asked (prefetch.py): at least each
  # jit_cache function's (the callback program has no entry), and those of
  # eager operations the process prefetch reached first.
  assert cold_stats["persistent_prefetched"] == 0
  assert (
    8 <= warm_stats["persistent_prefetched"] <= warm_stats["persistent_hits"]
  )
  hints = os.listdir(d / "jaxworks-hints")
  assert len(hints) >= 9 and all(h.endswith(".json") for h in hints)
  assert sum(h.startswith("process-") for h in hints) == 1
  assert any(n.endswith("-cache") for n in os.listdir(d))


def test_typed_key_argument_with_cache_on(tmp_path, cache_off):
  jit_cache.set_cache_dir(tmp_path)

  def draw(key, n):
    return jax.random.normal(key, (n,))

  key = jax.random.key(11)
  got = jit_cache.jit(draw, static_argnums=1)(key, 3)
  want = jax.jit(draw, static_argnums=1)(key, 3)
  assert got.tobytes() == np.asarray(want).tobytes()
  split = jit_cache.jit(jax.random.split)(key)
  assert jax.random.key_data(split).tolist() == (
    jax.random.key_data(jax.random.split(key)).tolist()
  )


class _Bomb:
  """Unpickling it creates the file named ``path``."""

  def __init__(self, path):
    self.path = path

  def __reduce__(self):
    return (open, (self.path, "w"))


def _fifo(path):
  os.mkfifo(path)


def _sparse(path):
  with open(path, "wb") as f:
    f.truncate(64 << 30)  # 64 GiB, no blocks


def _pickle(path, marker):
  with open(path, "wb") as f:
    pickle.dump(_Bomb(str(marker)), f)


def _is_jax_entry(name):
  return name.endswith("-cache") or name.endswith("-atime")


@pytest.mark.parametrize("plant", ["pickle", "fifo", "sparse"])
def test_planted_files_neither_hang_execute_nor_crash(tmp_path, stock, plant):
  d = tmp_path / "cache"
  _worker("jaxworks", d, tmp_path / "cold.npz")
  marker = tmp_path / "pwned"
  # Replace what the cold process wrote. Pickles replace every file, JAX's
  # entries too (they are not pickles: JAX rejects them and compiles). A FIFO
  # or a 64 GiB sparse file replaces every file that is not JAX's: JAX reads
  # no other name (jaxworks' old cache hung on a FIFO and raised MemoryError
  # on a huge file in place of its own entries).
  hints = d / "jaxworks-hints"
  assert any(hints.iterdir())
  for path in [*d.iterdir(), *hints.iterdir()]:
    name = path.name
    if name == ".lockfile" or not path.is_file():
      continue
    if plant == "pickle":
      _pickle(path, marker)
    elif not _is_jax_entry(name):
      path.unlink()
      (_fifo if plant == "fifo" else _sparse)(path)
  # And foreign names next to the entries, under the old cache's names too.
  for name in ("planted.jwx", "planted.pkl", "0" * 64 + ".jwx", "x-cache.tmp"):
    if plant == "pickle":
      _pickle(d / name, marker)
    else:
      (_fifo if plant == "fifo" else _sparse)(d / name)
  other_tmp = d / ".tmp-someone-else"
  other_tmp.write_bytes(b"not ours")
  two_hours_ago = time.time() - 7200
  os.utime(other_tmp, (two_hours_ago, two_hours_ago))

  warm, warm_stats = _worker("jaxworks", d, tmp_path / "warm.npz", timeout=300)
  _assert_bitwise(warm, stock)
  assert warm_stats["persistent_prefetched"] == 0  # no hint was usable
  assert not marker.exists()  # nothing was unpickled
  assert other_tmp.read_bytes() == b"not ours"  # never deleted
  assert (d / "planted.jwx").exists()


def test_set_cache_dir_after_a_compile_takes_effect(tmp_path, cache_off):
  # JAX decides at the first compile of a process whether its cache is used;
  # this process compiled long before (other tests, the import).
  jax.jit(lambda v: v + 0.5)(1.0).block_until_ready()
  jit_cache.set_cache_dir(tmp_path)
  before = jit_cache.stats()

  def make():
    return jit_cache.jit(lambda v: jnp.tanh(v) * 0.3125 + 7.0)

  f = make()
  x = jnp.arange(5.0)
  want = f(x)
  assert any(n.endswith("-cache") for n in os.listdir(tmp_path))
  assert "written to JAX's persistent compilation cache" in f.explain_miss(x)
  assert jit_cache.stats().persistent_misses > before.persistent_misses
  assert f.cache_info().persistent_misses == 1
  # Forget every in-memory executable: the next compile loads the entry.
  del f
  jit_cache.clear_caches()
  jax.clear_caches()
  g = make()
  assert g(x).tobytes() == want.tobytes()
  assert g.cache_info().persistent_hits == 1
  assert g.cache_info().persistent_load_s > 0
  assert "loaded from JAX's persistent compilation cache" in g.explain_miss(x)
  assert jit_cache.stats().persistent_hits > before.persistent_hits


def test_explain_miss_says_why_not_cacheable(tmp_path, cache_off):
  x = jnp.arange(3.0)
  f = jit_cache.jit(lambda v: v * 1.75 - 0.5)
  f(x)
  assert "persistent compilation cache is off" in f.explain_miss(x)

  jit_cache.set_cache_dir(tmp_path)

  def noisy(v):
    jax.debug.print("v={v}", v=v)
    return v * 3.25

  g = jit_cache.jit(noisy)
  g(x)
  assert "host callbacks" in g.explain_miss(x)
  jit_cache.config.min_compile_time_secs = 1000.0
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 1000.0
  h = jit_cache.jit(lambda v: v * 9.5 + 0.25)
  h(x)
  assert "jax_persistent_cache_min_compile_time_secs=1000.0" in (
    h.explain_miss(x)
  )
  k = jit_cache.jit(lambda v: v * 9.5 + 0.25)  # same program, new closure
  k(x)
  assert "reused an executable compiled in this process" in k.explain_miss(x)


def test_turns_on_jax_settings_and_off(tmp_path, cache_off):
  jit_cache.set_cache_dir(tmp_path)
  assert jit_cache.config.cache_dir == str(tmp_path)
  assert jax.config.jax_compilation_cache_dir == str(tmp_path)
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
  assert jax.config.jax_persistent_cache_min_entry_size_bytes == 0
  jit_cache.config.min_entry_size_bytes = 4096
  assert jax.config.jax_persistent_cache_min_entry_size_bytes == 4096
  jit_cache.set_cache_dir(None)
  assert jit_cache.config.cache_dir is None
  assert jax.config.jax_compilation_cache_dir is None


def test_bad_settings_raise_stock_classes():
  with pytest.raises(TypeError, match="set_cache_dir: path must be"):
    jit_cache.set_cache_dir(3)
  with pytest.raises(TypeError, match="min_compile_time_secs"):
    jit_cache.config.min_compile_time_secs = "1"
  with pytest.raises(ValueError, match="min_entry_size_bytes must be >= 0"):
    jit_cache.config.min_entry_size_bytes = -1
  with pytest.raises(ValueError, match="max_bytes must be positive"):
    jit_cache.set_cache_dir(None, max_bytes=0)


def test_directories_created_0700_and_unsafe_ones_warned(tmp_path, cache_off):
  d = tmp_path / "a" / "b"
  jit_cache.set_cache_dir(d)
  for p in (tmp_path / "a", d):
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o700, p
  shared = tmp_path / "shared"
  shared.mkdir()
  os.chmod(shared, 0o777)
  with pytest.warns(UserWarning, match="writable by its group and others"):
    jit_cache.set_cache_dir(shared)
  os.chmod(shared, 0o700)
  with pytest.warns(UserWarning) as record:
    jit_cache.set_cache_dir(shared)
    import warnings  # pylint: disable=g-import-not-at-top

    warnings.warn("sentinel", UserWarning)
  assert [str(w.message) for w in record] == ["sentinel"]
  afile = tmp_path / "file"
  afile.write_text("")
  with pytest.raises(NotADirectoryError, match="not a directory"):
    jit_cache.set_cache_dir(afile)


def test_environment_variable_turns_the_cache_on(tmp_path):
  d = tmp_path / "env"
  code = (
    "import jax\n"
    "from jaxworks import jit_cache\n"
    "print(jit_cache.config.cache_dir, jax.config.jax_compilation_cache_dir)"
  )
  out = child.run("-c", code, child_env=_env({ENV_VAR: str(d)})).stdout.split()
  assert out == [str(d), str(d)]
  assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


_FAST_MATH = (
  "--xla_cpu_enable_fast_math=true --xla_cpu_fast_math_honor_nans=false "
  "--xla_cpu_fast_math_honor_infs=false"
)
_FLAGS_SCRIPT = """
import os, sys
import numpy as np
mode, directory, out, flags = sys.argv[1:]
if mode == "write":  # the backend starts with the flags
  os.environ["XLA_FLAGS"] = flags
else:
  os.environ.pop("XLA_FLAGS", None)
import jax, jax.numpy as jnp
from jaxworks import jit_cache
jax.devices()  # the backend starts: its flags are fixed from here on
if mode == "read":  # changed after the start: not the flags in effect
  os.environ["XLA_FLAGS"] = flags
jit = jax.jit
if mode != "stock":
  jit_cache.set_cache_dir(directory)
  jit = jit_cache.jit
x = jnp.array([1.0, float("nan"), float("inf"), 0.0, -2.5], jnp.float32)
f = jit(lambda x: (jnp.isnan(x), jnp.isinf(x), x / x, jnp.exp(x * 3.3)))
np.savez(out, *[np.asarray(a) for a in f(x)])
"""


def test_xla_flags_changed_after_the_backend_started_do_not_pick_entries(
  tmp_path,
):
  """The key must follow the flags the backend compiles with, not the
  environment variable: an entry compiled with fast math by a process that
  started with it is not loaded by one that set the variable later."""

  def run(mode):
    out = tmp_path / f"{mode}.npz"
    child.run(
      "-c", _FLAGS_SCRIPT, mode, str(tmp_path / "c"), str(out), _FAST_MATH,
      child_env=_env(),
    )  # fmt: skip
    with np.load(out) as f:
      return {k: f[k] for k in f.files}

  written = run("write")
  stock = run("stock")
  assert written["arr_0"].tolist() != stock["arr_0"].tolist()  # fast math
  _assert_bitwise(run("read"), stock)
