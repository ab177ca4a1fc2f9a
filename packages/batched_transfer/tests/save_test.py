"""save: durability (fsync), parents and URLs, failures, threads and budget,
and save(..., blocking=False)."""

import errno
import io
import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jaxworks_testing as jwt
import numpy as np
import pytest

from jaxworks import batched_transfer as bt

# Private imports below: save's steps patched to fail or stall; hostvalue.
from jaxworks.batched_transfer._src.checkpoint import checksum
from jaxworks.batched_transfer._src.checkpoint import commit
from jaxworks.batched_transfer._src.checkpoint import destination
from jaxworks.batched_transfer._src.checkpoint import format
from jaxworks.batched_transfer._src.checkpoint import hostvalue
from jaxworks.batched_transfer._src.checkpoint import pending
from jaxworks.batched_transfer._src.checkpoint import writer


def like(tree):
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), tree
  )


def tree_of(seed, n=4):
  rng = np.random.default_rng(seed)
  return {
    f"k{i}": {"w": rng.standard_normal((64, 8)).astype(np.float32)}
    for i in range(n)
  }


def check(path, tree):
  out = bt.restore(path, like(tree))
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.fixture
def fsyncs(monkeypatch):
  """(inode, kind) of everything fsynced, in order."""
  seen = []
  real = os.fsync

  def fsync(fd):
    st = os.fstat(fd)
    seen.append(
      (st.st_ino, "dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")
    )
    return real(fd)

  monkeypatch.setattr(os, "fsync", fsync)
  return seen


@pytest.mark.parametrize("name", ["ckpt", "ckpt.npz"])
def test_save_returns_only_when_everything_is_fsynced(tmp_path, fsyncs, name):
  path = str(tmp_path / name)
  for overwrite in (False, True):
    fsyncs.clear()
    bt.save(
      path, {"a": np.ones(3), "sub": {"b": np.zeros(2)}}, overwrite=overwrite
    )
    log = list(fsyncs)
    inodes = [i for i, _ in log]
    parent = os.stat(tmp_path).st_ino
    if name.endswith(".npz"):
      must = [os.stat(path).st_ino]
    else:
      must = [
        os.stat(os.path.join(root, f)).st_ino
        for root, _, files in os.walk(path)
        for f in files
      ] + [os.stat(path).st_ino, os.stat(os.path.join(path, "sub")).st_ino]
    for ino in must:
      assert ino in inodes, (ino, log)
    # The parent last: after the data and the rename.
    assert inodes[-1] == parent, log
    assert max(inodes.index(i) for i in must) < len(inodes) - 1


def test_missing_parents_are_created(tmp_path):
  for path in (tmp_path / "a" / "b" / "ckpt", tmp_path / "c" / "d" / "x.npz"):
    bt.save(path, {"x": np.arange(3, dtype=np.int32)})
    check(str(path), {"x": np.arange(3, dtype=np.int32)})


@pytest.mark.parametrize(
  "url", ["hdfs://namenode/ckpt", "http://host/x.npz", "file:///tmp/x"]
)
def test_a_url_is_refused_naming_the_path_and_the_fix(tmp_path, url):
  with pytest.raises(ValueError, match="is a URL") as info:
    bt.save(url, {"x": np.arange(3, dtype=np.int32)})
  assert repr(url) in str(info.value) and "mount the bucket" in str(info.value)
  assert "jaxworks.batched_transfer.save" in str(info.value)


def test_a_file_as_parent_is_named(tmp_path):
  (tmp_path / "f").write_text("x")
  with pytest.raises(FileExistsError, match="is not a directory"):
    bt.save(tmp_path / "f" / "ckpt", {"x": np.arange(3, dtype=np.int32)})


@pytest.mark.parametrize("name", ["ckpt", "ckpt.npz"])
def test_a_failed_save_keeps_the_old_checkpoint_and_leaves_nothing(
  tmp_path, monkeypatch, name
):
  path = str(tmp_path / name)
  old = tree_of(0)
  bt.save(path, old)
  real = hostvalue.write_npy
  calls = []

  def failing(f, a):
    calls.append(1)
    if len(calls) == 3:
      raise OSError(28, "No space left on device")
    real(f, a)

  monkeypatch.setattr(hostvalue, "write_npy", failing)
  with pytest.raises(OSError, match="No space left"):
    bt.save(path, tree_of(1), overwrite=True, write_threads=2)
  check(path, old)
  assert sorted(os.listdir(tmp_path)) == [name]


def test_the_save_lock_serializes_saves_of_one_directory(tmp_path):
  """Two threads saving one path over and over: every result is whole."""
  path = str(tmp_path / "ckpt")
  trees = [tree_of(0), tree_of(1, n=6)]
  errors = []

  def loop(t):
    try:
      for _ in range(10):
        bt.save(path, t, overwrite=True)
    except BaseException as e:  # reported below
      errors.append(e)

  threads = [threading.Thread(target=loop, args=(t,)) for t in trees]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert errors == []
  keys = set(os.listdir(path))
  tree = trees[0] if len(keys) == 5 else trees[1]
  check(path, tree)
  commit.REAPER.wait()  # the replaced copies go in the background
  assert commit.temporaries(path) == []


def test_device_copies_start_ahead_within_the_budget(tmp_path, monkeypatch):
  xs = {
    f"x{i:02d}": jnp.full((256,), i, jnp.float32) for i in range(12)
  }  # 1 KiB each
  events = []
  real_start = hostvalue.start_copy
  monkeypatch.setattr(
    hostvalue, "start_copy", lambda x: (events.append("start"), real_start(x))
  )
  real_take = writer.Staged.take

  def take(self, i):
    events.append(("take", i, self.inflight))
    return real_take(self, i)

  monkeypatch.setattr(writer.Staged, "take", take)
  bt.save(tmp_path / "c", xs, max_inflight_bytes=3 * 1024)
  check(str(tmp_path / "c"), xs)
  started = 0
  for e in events:
    if e == "start":
      started += 1
    else:
      _, i, inflight = e
      assert inflight <= 3 * 1024
      assert started - i <= 3  # never more than the budget ahead
  events.clear()
  bt.save(tmp_path / "d", xs, max_inflight_bytes=None)
  assert events[1:13] == ["start"] * 12  # no budget: every copy at once


@pytest.mark.parametrize(
  "kwargs",
  [{"write_threads": 0}, {"max_inflight_bytes": -1}, {"write_threads": True}],
)
def test_bad_arguments(tmp_path, kwargs):
  with pytest.raises(ValueError, match="must be a positive int"):
    bt.save(tmp_path / "x", {"a": np.ones(2, np.float32)}, **kwargs)


# ----------------------------------------------------------------- blocking=False


def test_non_blocking_save_lets_the_caller_change_and_delete_the_leaves(
  tmp_path,
):
  host = np.arange(1 << 16, dtype=np.float32)
  dev = jax.device_put(np.arange(1 << 16, dtype=np.int32), jwt.device(2))
  expected = {"host": host.copy(), "dev": np.asarray(dev).copy()}
  handle = bt.save(tmp_path / "c", {"host": host, "dev": dev}, blocking=False)
  assert isinstance(handle, bt.SaveHandle)
  host[:] = -1  # the caller owns its arrays again
  dev.delete()
  handle.wait()
  assert handle.done()
  check(str(tmp_path / "c"), expected)


def _sharded(values, spec, mesh_shape=(8,), fit=False):
  """``values`` over a mesh of ``mesh_shape`` (the test skips with fewer
  devices), or with ``fit`` over the devices present (one chip: a mesh of
  one device, where the point holds there too)."""
  names = ("a", "b")[: len(mesh_shape)]
  mesh = (jwt.mesh_fit if fit else jwt.mesh)(mesh_shape, names)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  return jax.device_put(values, sharding)


SHARDINGS = {
  "rows": lambda v: _sharded(v, ("a",)),
  "columns": lambda v: _sharded(v, (None, "a")),
  "grid": lambda v: _sharded(v, ("a", "b"), (4, 2)),
  "rows, replicated twice": lambda v: _sharded(v, ("a",), (4, 2)),
  "replicated": lambda v: _sharded(v, (), fit=True),
  "one device": lambda v: jax.device_put(v, jwt.device(3)),
}


@pytest.mark.parametrize("where", list(SHARDINGS))
@pytest.mark.parametrize("blocking", [True, False])
@pytest.mark.parametrize("name", ["ckpt", "ckpt.npz"])
def test_sharded_leaves_are_written_as_their_whole_array(
  tmp_path, where, blocking, name
):
  rng = np.random.default_rng(0)
  values = {  # held shard by shard (>= 1 MiB), and copied whole (smaller)
    "f32": rng.standard_normal((512, 768)).astype(np.float32),
    "bf16": rng.standard_normal((8, 8)).astype(jnp.bfloat16),
    "bf16_big": rng.standard_normal((256, 2048)).astype(jnp.bfloat16),
  }
  tree = {k: SHARDINGS[where](v) for k, v in values.items()}
  kinds = {k: type(hostvalue.of(x)).__name__ for k, x in tree.items()}
  sharded = where not in ("replicated", "one device")
  assert kinds["f32"] == ("Shards" if sharded else "ndarray"), kinds
  assert kinds["bf16"] == "ndarray", kinds
  h = bt.save(tmp_path / name, tree, blocking=blocking)
  if h is not None:
    h.wait()
  check(str(tmp_path / name), values)
  if name == "ckpt":  # numpy reads each file as the whole array
    a = np.load(tmp_path / name / "f32.npy")
    assert a.tobytes() == values["f32"].tobytes()


def test_the_host_value_of_a_cpu_array_is_its_buffer_not_a_copy():
  jwt.skip_on_accelerator("the host value of a device array is a copy")
  x = SHARDINGS["rows"](np.arange(2**18, dtype=np.float32).reshape(1024, 256))
  value = hostvalue.of(x)
  assert isinstance(value, hostvalue.Shards) and value.by_rows()
  pointers = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
  assert {a.ctypes.data for _, a in value.pieces} == pointers
  y = jax.device_put(np.arange(4.0), jwt.device(1))
  assert hostvalue.of(y).ctypes.data == y.unsafe_buffer_pointer()


def test_donating_the_leaves_of_a_non_blocking_save_keeps_what_it_writes(
  tmp_path,
):
  """The next training step donates and updates the saved arrays in place
  while the save writes them: the checkpoint holds the values at the call."""
  rng = np.random.default_rng(1)
  values = {
    "w": rng.standard_normal((64, 32)).astype(np.float32),
    "b": rng.standard_normal((32,)).astype(np.float32),
  }
  w = _sharded(values["w"], ("a",), fit=True)  # rows over the devices
  tree = {"w": w, "b": jnp.asarray(values["b"])}
  step = jax.jit(lambda t: jax.tree.map(lambda a: a * 2.0 + 1.0, t),
                 donate_argnums=0)  # fmt: skip
  handle = bt.save(tmp_path / "c", tree, blocking=False)
  for _ in range(3):
    tree = step(tree)
  handle.wait()
  check(str(tmp_path / "c"), values)
  assert float(tree["b"][0]) == pytest.approx(values["b"][0] * 8.0 + 7.0)


def _copies_recorded(monkeypatch):
  """The ``{leaf index: OnDevice}`` of each ``copy_on_devices`` call, with
  the buffers of its copies and of the leaves they copy."""
  calls = []
  real = hostvalue.copy_on_devices

  def record(leaves):
    out = real(leaves)
    calls.append({
      i: (
        [a.unsafe_buffer_pointer() for _, a in v.pieces],
        [a.unsafe_buffer_pointer() for _, a in
         hostvalue.distinct_shards(leaves[i])],
      )
      for i, v in out.items()
    })  # fmt: skip
    return out

  monkeypatch.setattr(hostvalue, "copy_on_devices", record)
  return calls


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_non_blocking_save_copies_its_large_leaves_on_their_devices(
  tmp_path, monkeypatch, dtype
):
  """The call copies each leaf of at least ``DEVICE_COPY_MIN_BYTES`` on its
  devices while each device's free memory holds its shards (largest
  first), and the writing thread takes the device-to-host copies: the
  call does not wait for them, and the leaves can be donated at once. The
  copies are the bytes (float16 NaN payloads kept). CPU devices report no
  memory (no device copies there): here they are given 3 MiB each, device
  3 none (one chip: its 3 MiB)."""
  n = jwt.device_count()
  free = {d: (0 if n > 1 and d == jwt.device(3) else 3 << 20)
          for d in jax.devices()}  # fmt: skip
  monkeypatch.setattr(hostvalue, "free_bytes", free.__getitem__)
  calls = _copies_recorded(monkeypatch)
  rng = np.random.default_rng(2)
  rows = (1 << 20) // np.dtype(dtype).itemsize // 256  # 1 MiB of 256 columns
  bits = rng.integers(0, 2**16, (rows, 256), np.uint16)
  values = {
    "a_sharded": rng.standard_normal((rows, 256)).astype(dtype),
    "b_big": rng.standard_normal((2 * rows, 256)).astype(dtype),
    "c_on_3": rng.standard_normal((rows, 256)).astype(dtype),
    "d_small": rng.standard_normal((8, 256)).astype(dtype),
    "e_bits": bits.view(np.float16).astype(dtype)
    if dtype == np.float32 else bits.view(np.float16),
  }  # fmt: skip
  assert np.isnan(values["e_bits"]).any()
  tree = {
    "a_sharded": _sharded(values["a_sharded"], ("a",), fit=True),
    "b_big": jax.device_put(values["b_big"], jwt.device(0)),
    "c_on_3": jax.device_put(values["c_on_3"], jwt.device(3)),
    "d_small": jax.device_put(values["d_small"], jwt.device(0)),
    "e_bits": _sharded(values["e_bits"], (), fit=True),  # replicated
  }
  step = jax.jit(lambda a: a * 2 + 1, donate_argnums=0)
  handle = bt.save(tmp_path / "c", tree, blocking=False)
  for _ in range(3):  # donated and overwritten while the save writes
    tree = {k: step(a) for k, a in tree.items()}
  handle.wait()
  check(str(tmp_path / "c"), values)
  (copied,) = calls
  keys = sorted(values)
  # Largest first: b_big (2 MiB on device 0), then the leaves of 1 MiB in
  # order while their devices have room. Device 3 has none: a_sharded (a
  # shard there) and c_on_3 are copied in the call, e_bits's replica 0 (on
  # device 0) fills device 0. One chip: a_sharded fills it.
  expected = {"b_big", "e_bits"} if n > 1 else {"b_big", "a_sharded"}
  assert {keys[i] for i in copied} == expected
  for new, old in copied.values():
    assert not set(new) & set(old)  # copies, not the leaves' buffers


def test_device_copies_not_yet_taken_count_against_later_saves(monkeypatch):
  """A device's peak use may not show the copies of a save called just
  before: those not yet taken (or dropped, a save that failed first) are
  counted against its free memory."""
  monkeypatch.setattr(hostvalue, "free_bytes", lambda d: 3 << 20)
  zeros, ones = np.zeros(1 << 19, np.float32), np.ones(1 << 19, np.float32)
  x = jax.device_put(zeros, jwt.device(0))  # 2 MiB each
  y = jax.device_put(ones, jwt.device(0))
  first = hostvalue.copy_on_devices([x])
  assert list(first) == [0]
  assert hostvalue.copy_on_devices([y]) == {}  # 1 MiB left
  assert np.asarray(first[0].host()).tobytes() == zeros.tobytes()
  second = hostvalue.copy_on_devices([y])
  assert list(second) == [0]
  assert hostvalue.copy_on_devices([x]) == {}
  del second  # never taken: let go as well
  third = hostvalue.copy_on_devices([y])
  assert np.asarray(third[0].host()).tobytes() == ones.tobytes()
  # An array in host memory is no device's to copy (its host value is a
  # host copy already).
  pinned = jax.sharding.SingleDeviceSharding(
    jwt.device(0), memory_kind="pinned_host"
  )
  assert hostvalue.copy_on_devices([jax.device_put(ones, pinned)]) == {}


def test_a_save_copies_on_devices_that_report_free_memory(
  tmp_path, monkeypatch
):
  """On CPU no device reports its memory (no device copies); an
  accelerator's do, and a large leaf is copied there, the copy's bytes
  saved after the leaf was donated."""
  calls = _copies_recorded(monkeypatch)
  x = np.arange(1 << 19, dtype=np.float32)  # 2 MiB
  tree = {"x": jax.device_put(x, jwt.device(0))}
  handle = bt.save(tmp_path / "c", tree, blocking=False)
  tree = jax.jit(lambda t: {"x": t["x"] + 1}, donate_argnums=0)(tree)
  handle.wait()
  check(str(tmp_path / "c"), {"x": x})
  on_accelerator = jwt.on_accelerator()
  assert (hostvalue.free_bytes(jwt.device(0)) > x.nbytes) == on_accelerator
  assert (calls == [{}]) != on_accelerator, calls


def test_a_background_error_is_raised_by_wait_and_by_the_next_save(
  tmp_path, monkeypatch
):
  def boom(*args):
    raise OSError(5, "Input/output error")

  monkeypatch.setattr(destination.DirectorySave, "write", boom)
  h = bt.save(tmp_path / "a", {"x": np.ones(2, np.float32)}, blocking=False)
  h._event.wait()
  with pytest.raises(OSError, match="Input/output error") as info:
    bt.save(tmp_path / "b", {"x": np.ones(2, np.float32)}, blocking=False)
  assert "blocking=False" in " ".join(getattr(info.value, "__notes__", []))
  with pytest.raises(OSError, match="Input/output error"):
    h.wait()  # the handle keeps its error
  monkeypatch.undo()
  pending.wait_all()
  pending._unseen.clear()  # the second save's error, seen here
  bt.save(tmp_path / "c", {"x": np.ones(2, np.float32)})  # no old error left


def test_wait_with_a_timeout(tmp_path, monkeypatch):
  gate = threading.Event()
  real = destination.DirectorySave.write
  monkeypatch.setattr(
    destination.DirectorySave, "write", lambda *a: (gate.wait(), real(*a))[1]
  )
  h = bt.save(tmp_path / "a", {"x": np.ones(2, np.float32)}, blocking=False)
  with pytest.raises(TimeoutError, match="did not finish within"):
    h.wait(timeout=0.01)
  assert not h.done()
  gate.set()
  h.wait()
  check(str(tmp_path / "a"), {"x": np.ones(2, np.float32)})


def test_the_process_exit_waits_for_pending_saves(tmp_path):
  script = textwrap.dedent(f"""
      import numpy as np
      from jaxworks import batched_transfer as bt
      from jaxworks.batched_transfer._src.checkpoint import destination as m
      real = m.DirectorySave.write
      def slow(*a):
        import time; time.sleep(0.5); return real(*a)
      m.DirectorySave.write = slow
      bt.save({str(tmp_path / "c")!r}, {{"x": np.arange(100000.0, dtype=np.float32)}}, blocking=False)
      print("returned", flush=True)
  """)
  # Host arrays only: the child keeps off an accelerator this process holds.
  env = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
    JAX_PLATFORMS="cpu",
  )
  out = subprocess.run(
    [sys.executable, "-c", script],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert out.returncode == 0 and "returned" in out.stdout, out.stderr
  check(str(tmp_path / "c"), {"x": np.arange(100000.0, dtype=np.float32)})


def _large_values():
  """Arrays of more than one checksum chunk (written in pieces), with tails
  that are not whole chunks, and one small array (written whole)."""
  rng = np.random.default_rng(5)
  chunk = checksum.CHUNK
  return {
    "f32": rng.standard_normal((8, chunk // 16 + 125)).astype(np.float32),
    "bf16": rng.standard_normal((24, chunk // 48 + 7)).astype(jnp.bfloat16),
    "small": np.arange(16, dtype=np.int16),
  }


def _sequential_file(a):
  """The .npy file one thread writes of ``a`` (hostvalue.write_npy)."""
  f = io.BytesIO()
  sums = hostvalue.write_npy(f, a)
  return f.getvalue(), sums


@pytest.fixture
def pwrites(monkeypatch):
  """The threads that called os.pwrite, by the file they wrote. The first
  two threads that write f32.npy wait for each other (a file written by
  one thread alone fails the save after 20 s)."""
  seen: dict[str, set] = {}
  real = os.pwrite
  meet = threading.Barrier(2, timeout=20)
  lock = threading.Lock()

  def pwrite(fd, data, at):
    name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
    me = threading.current_thread().name
    with lock:
      threads = seen.setdefault(name, set())
      first = name == "f32.npy" and me not in threads and len(threads) < 2
      threads.add(me)
    if first:
      meet.wait()
    return real(fd, data, at)

  monkeypatch.setattr(os, "pwrite", pwrite)
  return seen


@pytest.mark.parametrize(
  "where", ["numpy", "one device", "rows", "rows, replicated twice"]
)
def test_large_files_are_written_in_pieces_by_several_threads(
  tmp_path, pwrites, where
):
  values = _large_values()
  tree = values if where == "numpy" else {
    k: SHARDINGS[where](v) for k, v in values.items()
  }  # fmt: skip
  path = tmp_path / "ckpt"
  bt.save(path, tree)
  check(str(path), values)
  record = format.decode_record(
    "test", str(path), (path / format.RECORD).read_bytes()
  )
  for key, a in values.items():
    data, sums = _sequential_file(a)
    # The same bytes and checksums as one thread writing it in order.
    assert (path / f"{key}.npy").read_bytes() == data, key
    assert record.crc32c[key] == sums == hostvalue.digest(a), key
  assert len(pwrites["f32.npy"]) >= 2 and "bf16.npy" in pwrites
  assert "small.npy" not in pwrites  # written whole, by one thread
  assert np.load(path / "f32.npy").tobytes() == values["f32"].tobytes()


def _open_fds():
  return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("threads", [1, 8])
@pytest.mark.parametrize("fail_at", ["header", "a middle piece", "fsync"])
def test_a_failed_piece_keeps_the_old_checkpoint_and_closes_the_file(
  tmp_path, monkeypatch, threads, fail_at
):
  path = tmp_path / "ckpt"
  old = {"f32": np.zeros(3 * checksum.CHUNK // 4, np.float32)}
  bt.save(path, old)
  new = _large_values()
  real_pwrite, real_fsync = os.pwrite, os.fsync
  calls = []

  def pwrite(fd, data, at):
    if not os.readlink(f"/proc/self/fd/{fd}").endswith("f32.npy"):
      return real_pwrite(fd, data, at)
    calls.append(at)
    header = at == 0
    middle = at > checksum.CHUNK and len(calls) > 3
    if (fail_at == "header" and header) or (
      fail_at == "a middle piece" and middle
    ):
      raise OSError(errno.ENOSPC, "No space left on device")
    return real_pwrite(fd, data, at)

  def fsync(fd):
    if fail_at == "fsync" and os.path.isfile(f"/proc/self/fd/{fd}"):
      if os.readlink(f"/proc/self/fd/{fd}").endswith("f32.npy"):
        raise OSError(errno.EIO, "Input/output error")
    return real_fsync(fd)

  monkeypatch.setattr(os, "pwrite", pwrite)
  monkeypatch.setattr(os, "fsync", fsync)
  before = _open_fds()
  with pytest.raises(OSError) as info:
    bt.save(path, new, overwrite=True, write_threads=threads)
  want = errno.EIO if fail_at == "fsync" else errno.ENOSPC
  assert info.value.errno == want
  text = str(info.value)
  assert "jaxworks.batched_transfer.save" in text and "f32.npy" in text
  assert "Nothing was committed" in text
  assert _open_fds() == before  # every piece released, the file closed
  monkeypatch.undo()
  commit.REAPER.wait()
  check(str(path), old)
  assert sorted(os.listdir(tmp_path)) == ["ckpt"]
  bt.save(path, new, overwrite=True)  # nothing is left held
  check(str(path), new)


def _ranges(host):
  """The [start, end) address ranges of a host value's arrays."""
  arrays = [a for _, a in host.pieces] if hasattr(host, "pieces") else [host]
  return [(a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays]


def test_a_non_blocking_save_holds_no_view_of_a_cpu_buffer(
  tmp_path, monkeypatch
):
  """A save in the background writes private host copies of CPU arrays,
  not views of their buffers (JAX copies an array it is asked to donate
  while a view holds its buffer: at every step until the save is written);
  a blocking save writes the views. Arrays on one device, sharded in rows
  (by shard), replicated, and small sharded ones."""
  rng = np.random.default_rng(2)
  mesh = jwt.mesh((8,), ("a",))  # skips below 8 devices (a chip's round)
  values = {
    "one": rng.standard_normal((64, 64)).astype(np.float32),
    "rows": rng.standard_normal((1024, 512)).astype(np.float32),
    "replicated": rng.standard_normal((512, 512)).astype(np.float32),
    "small": rng.standard_normal((64, 8)).astype(np.float32),
  }
  tree = {
    "one": jax.device_put(values["one"], jwt.device(1)),
    "rows": jax.device_put(values["rows"], NamedSharding(mesh, P("a"))),
    "replicated": jax.device_put(
      values["replicated"], NamedSharding(mesh, P())
    ),
    "small": jax.device_put(values["small"], NamedSharding(mesh, P("a"))),
  }
  buffers = [
    (s.data.unsafe_buffer_pointer(), s.data.unsafe_buffer_pointer() + s.data.nbytes)
    for x in tree.values() for s in x.addressable_shards
  ]  # fmt: skip
  taken = []
  real = writer.host_array

  def recorded(api, path, x, *args, **kwargs):
    out = real(api, path, x, *args, **kwargs)
    if isinstance(x, jax.Array):
      taken.append(out)
    return out

  monkeypatch.setattr(writer, "host_array", recorded)

  def overlapping():
    return [
      (lo, hi) for v in taken for lo, hi in _ranges(v)
      if any(lo < b_hi and b_lo < hi for b_lo, b_hi in buffers)
    ]  # fmt: skip

  bt.save(tmp_path / "bg", tree, blocking=False).wait()
  assert len(taken) == 4 and not overlapping()
  taken.clear()
  bt.save(tmp_path / "views", tree)  # blocking: views, no copy
  assert overlapping()
  check(str(tmp_path / "bg"), values)
  check(str(tmp_path / "views"), values)
