"""The persistent executable cache on disk, across real processes.

Each cross-process test starts ``disk_cache_worker.py`` with this interpreter
and ``PYTHONPATH``; the worker counts lowerings and compilations with jax's
monitoring events and compares results with stock ``jax.jit`` bit for bit.
"""

import json
import os
import struct
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

from jaxworks import jit_cache
from jaxworks.jit_cache._src import disk_cache
from jaxworks.jit_cache._src import disk_key
from jaxworks.jit_cache._src import fingerprint

WORKER = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), "disk_cache_worker.py"
)


def _env(extra=None):
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(sys.path)
  env.pop(disk_cache.ENV_VAR, None)
  env.update(extra or {})
  return env


def _start(directory, programs, max_bytes=None, env=None):
  argv = [sys.executable, WORKER, str(directory), programs]
  if max_bytes is not None:
    argv.append(str(max_bytes))
  return subprocess.Popen(
    argv,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    env=_env(env),
    text=True,
  )


def _finish(proc):
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err[-3000:]
  result = json.loads(out.strip().splitlines()[-1])
  assert result["results"] == result["stock"]  # bit for bit
  return result


def _run(directory, programs, max_bytes=None, env=None):
  return _finish(_start(directory, programs, max_bytes, env))


def _entries(directory):
  return sorted(
    n for n in os.listdir(directory) if n.endswith(disk_cache.SUFFIX)
  )


@pytest.fixture
def cache_off():
  yield
  jit_cache.set_cache_dir(None)
  disk_cache.config._dir = disk_cache._UNSET
  disk_cache.config.max_bytes = disk_cache.DEFAULT_MAX_BYTES


def test_second_process_loads_without_lowering_or_compiling(tmp_path):
  # chain1: one device; sharded: 8 devices, NamedSharding, donated input.
  first = _run(tmp_path, "chain1,sharded")
  assert first["lowered"] == [1, 1] and first["compiled"] == [1, 1]
  assert first["stats"]["disk_misses"] == 2
  assert first["stats"]["disk_bytes_written"] > 0
  assert len(_entries(tmp_path)) == 2
  second = _run(tmp_path, "chain1,sharded")
  assert second["lowered"] == [0, 0] and second["compiled"] == [0, 0]
  assert second["stats"]["disk_hits"] == 2
  assert second["stats"]["compiles"] == 0
  assert second["stats"]["disk_bytes_read"] > 0
  assert 0 < second["stats"]["disk_load_s"] < 60
  assert first["stats"]["disk_load_s"] == 0
  assert "disk cache: loaded" in second["explain"][0]
  assert second["results"] == first["results"]
  assert "P('i'" in second["results"][1][2]
  assert second["results"][1][3] is True  # the donated input was consumed
  # x64 is part of the key: the same program under x64 compiles anew.
  x64 = _run(tmp_path, "chain1", env={"JAX_ENABLE_X64": "1"})
  assert x64["stats"]["disk_hits"] == 0 and x64["lowered"] == [1]
  assert len(_entries(tmp_path)) == 3


def test_three_processes_racing_on_one_entry(tmp_path):
  procs = [_start(tmp_path, "chain2") for _ in range(3)]
  results = [_finish(p) for p in procs]
  assert len({json.dumps(r["results"]) for r in results}) == 1
  assert len(_entries(tmp_path)) == 1
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
  after = _run(tmp_path, "chain2")
  assert after["stats"]["disk_hits"] == 1 and after["lowered"] == [0]


def _damage_and_reload(directory, damage, expect, heal=False):
  _run(directory, "chain3")
  (name,) = _entries(directory)
  path = os.path.join(directory, name)
  with open(path, "rb") as f:
    data = bytearray(f.read())
  with open(path, "wb") as f:
    f.write(damage(data))
  again = _run(directory, "chain3")
  assert again["stats"]["disk_hits"] == 0
  assert again["stats"]["disk_rejected"] == 1
  assert again["lowered"] == [1] and again["compiled"] == [1]
  assert expect in again["explain"][0], again["explain"][0]
  assert "rejected" in again["explain"][0]
  if heal:
    healed = _run(directory, "chain3")  # rewritten: valid again
    assert healed["stats"]["disk_hits"] == 1 and healed["lowered"] == [0]
  else:
    (name,) = _entries(directory)
    _assert_valid(os.path.join(directory, name))
  return again


def _assert_valid(path):
  """The entry was rewritten whole: intact header, key of this jaxlib and
  platform, payload checksum."""
  import hashlib  # pylint: disable=g-import-not-at-top

  with open(path, "rb") as f:
    data = f.read()
  head = len(disk_cache.MAGIC) + disk_cache.HEADER.size
  assert data.startswith(disk_cache.MAGIC)
  fmt, key_len, payload_len, sha = disk_cache.HEADER.unpack_from(
    data, len(disk_cache.MAGIC)
  )
  assert fmt == disk_cache.FORMAT_VERSION
  assert len(data) == head + key_len + payload_len
  key = json.loads(data[head : head + key_len])
  assert key["jaxlib"] == jaxlib.__version__
  assert key["backends"][0]["platform"] == "cpu"
  assert hashlib.sha256(data[head + key_len :]).digest() == sha


def test_truncated_entry_is_rejected_and_rewritten(tmp_path):
  _damage_and_reload(
    tmp_path, lambda d: d[: len(d) // 2], "truncated", heal=True
  )


def test_flipped_payload_byte_is_rejected_and_rewritten(tmp_path):
  def flip(d):
    d[-100] ^= 0x40
    return d

  _damage_and_reload(tmp_path, flip, "checksum")


def _rewrite_key(data, change):
  head = len(disk_cache.MAGIC) + disk_cache.HEADER.size
  fmt, key_len, payload_len, sha = disk_cache.HEADER.unpack_from(
    bytes(data), len(disk_cache.MAGIC)
  )
  key = json.loads(bytes(data[head : head + key_len]))
  change(key)
  new_key = disk_key.key_bytes(key)
  return (
    disk_cache.MAGIC
    + disk_cache.HEADER.pack(fmt, len(new_key), payload_len, sha)
    + new_key
    + bytes(data[head + key_len :])
  )


def test_entry_from_another_jaxlib_is_rejected(tmp_path):
  def other_jaxlib(key):
    key["jaxlib"] = "0.0.1"

  _damage_and_reload(
    tmp_path,
    lambda d: _rewrite_key(d, other_jaxlib),
    "version mismatch: jaxlib",
  )


def test_entry_from_another_platform_is_rejected(tmp_path):
  def other_platform(key):
    key["backends"][0]["platform"] = "tpu"
    key["backends"][0]["platform_version"] = "libtpu 1"

  _damage_and_reload(
    tmp_path, lambda d: _rewrite_key(d, other_platform), "different machine"
  )


def test_lru_eviction_at_the_size_limit(tmp_path):
  first = _run(tmp_path, "chain4,chain5")
  assert len(_entries(tmp_path)) == 2
  size = max(
    os.path.getsize(os.path.join(tmp_path, n)) for n in _entries(tmp_path)
  )
  a, b = (os.path.join(tmp_path, n) for n in _names(first))
  old = time.time() - 100
  os.utime(a, (old, old))
  os.utime(b, (old + 1, old + 1))
  # Room for two entries: hitting chain4 touches it, so writing chain6 evicts
  # chain5 (the least recently used), not chain4.
  limit = 2 * size + size // 2
  run = _run(tmp_path, "chain4,chain6", max_bytes=limit)
  assert run["stats"]["disk_hits"] == 1
  names = _entries(tmp_path)
  assert os.path.basename(a) in names
  assert os.path.basename(b) not in names
  assert len(names) == 2
  assert sum(os.path.getsize(os.path.join(tmp_path, n)) for n in names) <= limit


def _names(result):
  return [
    line.split("disk cache: no entry ")[1].split()[0]
    for line in result["explain"]
  ]


def test_background_write_is_flushed_at_exit(tmp_path):
  run = _run(tmp_path, "chain9", env={"WORKER_NO_FLUSH": "1"})
  assert run["stats"]["disk_misses"] == 1
  (name,) = _entries(tmp_path)  # written by the exit handler at the latest
  _assert_valid(os.path.join(tmp_path, name))
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
  again = _run(tmp_path, "chain9")
  assert again["stats"]["disk_hits"] == 1 and again["lowered"] == [0]


def test_keys_do_not_depend_on_the_hash_seed(tmp_path):
  # Sets and dicts in a key are encoded sorted: another PYTHONHASHSEED (str
  # hashes, set order) gives the same key, so the entry is found.
  _run(tmp_path, "chain10,sharded", env={"PYTHONHASHSEED": "1"})
  again = _run(tmp_path, "chain10,sharded", env={"PYTHONHASHSEED": "2"})
  assert again["stats"]["disk_hits"] == 2, again["explain"]
  assert again["lowered"] == [0, 0]


def test_off_by_default(tmp_path):
  run = _run("-", "chain7", env={"HOME": str(tmp_path)})
  assert run["cache_dir"] is None
  assert run["stats"]["disk_misses"] == 0
  assert run["stats"]["disk_bytes_written"] == 0
  assert "disk cache" not in run["explain"][0]


def test_environment_variable_turns_it_on(tmp_path):
  env = {disk_cache.ENV_VAR: str(tmp_path)}
  run = _run("-", "chain8", env=env)
  assert run["cache_dir"] == str(tmp_path)
  assert len(_entries(tmp_path)) == 1
  assert run["stats"]["disk_misses"] == 1


def test_program_with_a_callback_is_never_persisted(tmp_path):
  run = _run(tmp_path, "callback")
  assert _entries(tmp_path) == []
  assert run["stats"]["disk_misses"] == 0
  assert run["lowered"] == [1] and run["stats"]["disk_hits"] == 0


# ------------------------------------------------------------ in one process


def test_set_cache_dir_and_config(tmp_path, cache_off, monkeypatch):
  monkeypatch.delenv(disk_cache.ENV_VAR, raising=False)
  assert jit_cache.config.cache_dir is None
  monkeypatch.setenv(disk_cache.ENV_VAR, str(tmp_path / "env"))
  assert jit_cache.config.cache_dir == str(tmp_path / "env")
  jit_cache.set_cache_dir(None)  # off even with the variable set
  assert jit_cache.config.cache_dir is None
  jit_cache.set_cache_dir(tmp_path, max_bytes=1234)
  assert jit_cache.config.cache_dir == str(tmp_path)
  assert jit_cache.config.max_bytes == 1234
  with pytest.raises(TypeError, match="set_cache_dir: path"):
    jit_cache.set_cache_dir(3)
  with pytest.raises(ValueError, match="max_bytes must be positive"):
    jit_cache.set_cache_dir(tmp_path, max_bytes=0)
  with pytest.raises(TypeError, match="max_bytes must be an int"):
    jit_cache.set_cache_dir(tmp_path, max_bytes=1.5)


def test_user_primitive_is_not_persisted(tmp_path, cache_off):
  from jax.extend import core as jex_core  # pylint: disable=g-import-not-at-top
  from jax.interpreters import mlir  # pylint: disable=g-import-not-at-top

  prim = jex_core.Primitive("jaxworks_test_double")
  prim.def_abstract_eval(lambda x: x)
  mlir.register_lowering(
    prim, mlir.lower_fun(lambda x: x * 2, multiple_results=False)
  )
  jit_cache.set_cache_dir(tmp_path)
  f = jit_cache.jit(lambda x: prim.bind(x) + 1.0)
  x = jnp.arange(4.0)
  np.testing.assert_array_equal(f(x), x * 2 + 1)
  assert _entries(tmp_path) == []
  assert (
    "disk cache: not persisted (primitive jaxworks_test_double"
    in f.explain_miss(x)
  )


def test_key_changes_with_x64_and_placement(cache_off):
  f = lambda x: x + 1  # noqa: E731
  jaxpr = jax.make_jaxpr(f)(jnp.ones(3))
  fp = fingerprint.fingerprint(jaxpr)
  params = fingerprint.params_key({"donated_invars": (False,)})
  ctx = ()
  d0, d1 = jax.devices()[:2]
  on0 = jax.device_put(jnp.ones(3), d0)
  on1 = jax.device_put(jnp.ones(3), d1)
  k0 = disk_cache.make_key(fp, params, [on0], ctx)
  k1 = disk_cache.make_key(fp, params, [on1], ctx)
  assert k0 == disk_cache.make_key(fp, params, [on0], ctx)
  assert k0["program"] != k1["program"]
  with jax.enable_x64(True):
    kx = disk_cache.make_key(fp, params, [on0], ctx)
  assert kx["config"] != k0["config"]


def test_evict_removes_least_recently_used(tmp_path):
  now = time.time()
  for i, name in enumerate(["a", "b", "c"]):
    path = tmp_path / (name + disk_cache.SUFFIX)
    path.write_bytes(b"x" * 100)
    os.utime(path, (now - 100 + i, now - 100 + i))
  stale = tmp_path / ".tmp-dead.jwx.part"
  stale.write_bytes(b"x")
  os.utime(stale, (now - 7200, now - 7200))
  assert disk_cache.evict(str(tmp_path), 250, keep="a" + disk_cache.SUFFIX) == 1
  assert sorted(os.listdir(tmp_path)) == ["a.jwx", "c.jwx"]


def test_read_entry_rejects_garbage(tmp_path):
  key = {"format": 1, "program": "0" * 64}
  path = tmp_path / "x.jwx"
  for data, why in [
    (b"", "bad magic"),
    (b"hello world" * 10, "bad magic"),
    (
      disk_cache.MAGIC + struct.pack("<IIQ32s", 99, 0, 0, b"\0" * 32),
      "format 99",
    ),
  ]:
    path.write_bytes(data)
    payload, reason = disk_cache.read_entry(str(path), key)
    assert payload is None and why in reason
  disk_cache.write_entry(str(tmp_path), "x.jwx", key, b"payload")
  assert disk_cache.read_entry(str(path), key) == (b"payload", "")
  other = dict(key, jax="0.0.0")
  payload, reason = disk_cache.read_entry(str(path), other)
  assert payload is None and "version mismatch: jax" in reason


def test_background_writes_and_flush(tmp_path, cache_off):
  jit_cache.set_cache_dir(tmp_path / "bg")
  x = jnp.arange(3.0)
  jit_cache.jit(lambda v: v * 3.0 + 11.0)(x)
  assert jit_cache.config.flush(timeout=60)
  assert len(_entries(tmp_path / "bg")) == 1
  jit_cache.config.background_writes = False
  try:
    jit_cache.set_cache_dir(tmp_path / "fg")
    jit_cache.jit(lambda v: v * 3.0 + 12.0)(x)
    assert len(_entries(tmp_path / "fg")) == 1  # before the call returned
  finally:
    jit_cache.config.background_writes = True
  assert "background_writes=True" in repr(jit_cache.config)


def test_failed_write_warns_and_explains(tmp_path, cache_off):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  jit_cache.set_cache_dir(blocker / "sub")
  f = jit_cache.jit(lambda v: v * 3.0 + 13.0)
  x = jnp.arange(3.0)
  with pytest.warns(RuntimeWarning, match="could not write the disk cache"):
    jit_cache.config.background_writes = False
    try:
      np.testing.assert_array_equal(f(x), x * 3.0 + 13.0)
    finally:
      jit_cache.config.background_writes = True
  assert "not written" in f.explain_miss(x)


def test_encoding_is_canonical_and_typed():
  a = (1, "x", (2.5, None))
  b = (1, "x", (2.5, None))
  shared = (a, a)
  assert disk_key.encode(shared) == disk_key.encode((a, b))
  texts = {disk_key.encode(v) for v in (1, 1.0, True, "1", b"1", (1,), [1])}
  assert len(texts) == 7
  assert disk_key.encode(-0.0) != disk_key.encode(0.0)
  assert disk_key.encode(frozenset({"a", "b", "c"})) == disk_key.encode(
    frozenset(["c", "b", "a"])
  )
  assert disk_key.encode({"b": 1, "a": 2}) == disk_key.encode({"a": 2, "b": 1})

  class Mine:
    pass

  for bad in (Mine(), Mine, lambda: 0, jnp.ones(2)):
    with pytest.raises(disk_key.NotPersistable):
      disk_key.encode(bad)


def test_jax_primitives_are_found_user_ones_are_not():
  from jax.extend import core as jex_core  # pylint: disable=g-import-not-at-top

  assert disk_key.PRIMITIVES.contains(jax.lax.add_p)
  assert disk_key.PRIMITIVES.contains(jex_core.primitives.jit_p)
  mine = jex_core.Primitive("add")  # a user primitive named like jax's
  assert not disk_key.PRIMITIVES.contains(mine)


def test_entry_for_another_device_count_is_not_used(tmp_path):
  # Another machine shape: the same program with 4 host devices instead of
  # 8. The key differs (devices, XLA_FLAGS), so the 8-device entry is never
  # loaded, and explain_miss names why the sibling entry does not apply.
  _run(tmp_path, "chain11")
  four = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
  other = _run(tmp_path, "chain11", env=four)
  assert other["stats"]["disk_hits"] == 0 and other["lowered"] == [1]
  assert (
    "an entry for another environment was rejected" in (other["explain"][0])
  ), other["explain"][0]
  assert "different machine" in other["explain"][0]
  assert len(_entries(tmp_path)) == 2  # one per machine shape
  again = _run(tmp_path, "chain11", env=four)
  assert again["stats"]["disk_hits"] == 1 and again["lowered"] == [0]


def test_repeated_inner_calls_keep_what_their_parameters_hold(
  tmp_path, cache_off
):
  # Equations with the same parameter objects share one fingerprint key;
  # what those parameters hold (a host callback, by identity) still counts
  # for every equation: the program is never persisted.
  def cb(a):
    return np.asarray(a) * 2

  inner = jax.jit(lambda v: jax.pure_callback(cb, v, v))
  jit_cache.set_cache_dir(tmp_path)
  f = jit_cache.jit(lambda v: inner(inner(v) + 1.0))
  x = jnp.arange(4.0)
  np.testing.assert_array_equal(f(x), (x * 2 + 1) * 2)
  jit_cache.config.flush()
  assert _entries(tmp_path) == []
  jaxpr = jax.make_jaxpr(lambda v: inner(inner(v) + 1.0))(x)
  fp = fingerprint.fingerprint(jaxpr)
  assert fp is not None and fp.pins
  # Without the callback the same shape of program is persisted.
  plain = jax.jit(lambda v: v * 2.0)
  g = jit_cache.jit(lambda v: plain(plain(v) + 1.0))
  np.testing.assert_array_equal(g(x), (x * 2 + 1) * 2)
  jit_cache.config.flush()
  assert len(_entries(tmp_path)) == 1


def test_executable_is_serialized_on_the_writer_thread(
  tmp_path, cache_off, monkeypatch
):
  # A miss costs the key on top of jax.jit's first call: serializing the new
  # executable happens on the writer thread, after the call returned.
  seen = []
  serialize = disk_cache._serialize.serialize
  returned = threading.Event()

  def recording(compiled):
    assert returned.wait(timeout=30)
    seen.append(threading.current_thread().name)
    return serialize(compiled)

  monkeypatch.setattr(disk_cache._serialize, "serialize", recording)
  jit_cache.set_cache_dir(tmp_path)
  x = jnp.arange(3.0)
  out = jit_cache.jit(lambda v: v * 5.0 + 1.0)(x)
  returned.set()
  jit_cache.config.flush()
  assert seen == ["jaxworks-jit-cache-writer"]
  assert len(_entries(tmp_path)) == 1
  np.testing.assert_array_equal(out, x * 5.0 + 1.0)


def test_entries_serialized_while_their_executables_run_load_and_agree(
  tmp_path,
):
  # Each program is called 20 times while the writer thread serializes it;
  # a new process loads every entry, compiles nothing, and matches jax.jit
  # bit for bit (MLP training steps with gelu, log_softmax and powers, and
  # add chains).
  names = ",".join([f"mlp{k}" for k in range(6)] + ["chain7", "chain8"])
  first = _run(tmp_path, names, env={"WORKER_REPEAT": "20"})
  assert first["stats"]["disk_misses"] == 8
  assert len(_entries(tmp_path)) == 8
  second = _run(tmp_path, names)
  assert second["stats"]["disk_hits"] == 8
  assert second["compiled"] == [0] * 8


def test_executable_from_jax_persistent_cache_is_not_written(tmp_path):
  # XLA:CPU cannot serialize again an executable loaded from JAX's own
  # persistent cache: written, such an entry failed when run in the next
  # process ("Function add_add_fusion not found").
  jax_cache = {
    "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
  }
  ours = tmp_path / "ours"
  ours.mkdir()
  _run("-", "chain5", env=jax_cache)  # fills JAX's cache only
  assert os.listdir(tmp_path / "jax")
  both = _run(ours, "chain5", env=jax_cache)  # JAX's cache hit, ours missed
  assert both["stats"]["disk_misses"] == 1
  assert _entries(ours) == []
  assert "JAX's persistent compilation cache" in both["explain"][0]
  fresh = _run(ours, "chain5")  # compiles: written
  assert fresh["compiled"] == [1] and len(_entries(ours)) == 1
  warm = _run(ours, "chain5", env=jax_cache)
  assert warm["stats"]["disk_hits"] == 1 and warm["compiled"] == [0]
  assert warm["results"] == fresh["results"] == both["results"]
