"""restore's streaming: reading into aligned buffers, overlap, budget, errors."""

import gc
import os
import re
import threading
import time
import weakref
import zipfile

import jax
import jaxworks_testing as jwt
import ml_dtypes
import numpy as np
import pytest

from jaxworks import batched_transfer as bt

# Private imports below: the prefetch pipeline's batches and threads.
from jaxworks.batched_transfer._src.checkpoint import prefetch
from jaxworks.batched_transfer._src.checkpoint import reader
from jaxworks.batched_transfer._src.checkpoint import restore_files


def like(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def reader_threads():
  return [t for t in threading.enumerate() if t.name == prefetch.THREAD_NAME]


@pytest.fixture(autouse=True)
def no_reader_thread_left():
  before = threading.active_count()
  yield
  assert reader_threads() == []
  assert threading.active_count() == before


class Spy:
  """Records reads (files.load) and placements (place) of one restore."""

  def __init__(self, monkeypatch, on_place=None, on_load=None):
    self.lock = threading.Lock()
    self.loaded, self.placed, self.results = [], [], []
    real_load, real_place = reader.load, restore_files.place

    def load(api, where, key, s, files):
      if on_load is not None:
        on_load(key)
      a = real_load(api, where, key, s, files)
      with self.lock:
        self.loaded.append(key)
      return a

    def place(leaves, target=None, **kwargs):
      if on_place is not None:
        on_place(len(self.placed))
      out = real_place(leaves, target, **kwargs)
      with self.lock:
        self.placed.append(list(leaves))
        self.results.extend(out)
      return out

    monkeypatch.setattr(reader, "load", load)
    monkeypatch.setattr(restore_files, "place", place)


@pytest.mark.parametrize("fmt", ["dir", "npz"])
def test_data_lands_in_aligned_buffers_that_the_device_takes_over(
  tmp_path, monkeypatch, fmt
):
  tree = {
    "a": np.arange(1000, dtype=np.float32),
    "b": np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4)),
    "c": np.ones((5, 3), ml_dtypes.bfloat16),  # raw bytes + the dtype record
  }
  path = tmp_path / ("c.npz" if fmt == "npz" else "c")
  bt.save(path, tree)
  spy = Spy(monkeypatch)
  device = jwt.device(3)
  out = bt.restore(path, like(tree), placement=device)
  leaves = [x for batch in spy.placed for x in batch]
  assert len(leaves) == 3
  for x, y, key in zip(leaves, spy.results, ["a", "b", "c"]):
    assert type(x) is np.ndarray and not isinstance(x.base, np.memmap)
    assert x.ctypes.data % reader.ALIGN == 0
    # On CPU the device array is the buffer restore read into: no second copy
    # (an accelerator copies it into its own memory).
    if x.flags.c_contiguous and not jwt.on_accelerator():
      assert y.unsafe_buffer_pointer() == x.ctypes.data, key
    np.testing.assert_array_equal(np.asarray(out[key]), tree[key])
    assert out[key].devices() == {device}


def test_buffers_of_a_dropped_restore_are_released_before_the_next(
  tmp_path, monkeypatch
):
  jwt.skip_on_accelerator("only a CPU array aliases the buffer restore read")
  tree = {"a": np.arange(2**16, dtype=np.float32)}
  bt.save(tmp_path / "d", tree)
  seen = []  # whether the first restore's buffer is alive when a read starts
  spy = Spy(monkeypatch, on_load=lambda key: seen.append(alive() is not None))
  alive = lambda: None  # noqa: E731
  was_enabled = gc.isenabled()
  gc.disable()  # Python's gc would release them too (jaxlib's gc callback)
  try:
    first = bt.restore(tmp_path / "d", like(tree))
    (buffer,) = spy.placed[0]
    alive = weakref.ref(buffer.base)
    assert first["a"].unsafe_buffer_pointer() == buffer.ctypes.data
    del first, buffer
    spy.placed.clear()
    spy.results.clear()
    assert alive() is not None  # jaxlib still holds the memory
    seen.clear()
    second = bt.restore(tmp_path / "d", like(tree))
    assert seen == [False]  # released before reading
    np.testing.assert_array_equal(np.asarray(second["a"]), tree["a"])
  finally:
    if was_enabled:
      gc.enable()


def test_compressed_members_are_inflated_in_the_reader(tmp_path, monkeypatch):
  tree = {"a": np.arange(100, dtype=np.int64), "b": np.ones(3, np.uint8)}
  np.savez_compressed(tmp_path / "c.npz", **tree)
  spy = Spy(monkeypatch)
  with jax.enable_x64(True):
    out = bt.restore(tmp_path / "c.npz", like(tree))
    for k in tree:
      assert out[k].dtype == tree[k].dtype
      np.testing.assert_array_equal(np.asarray(out[k]), tree[k])
  assert sorted(spy.loaded) == ["a", "b"]


def test_big_endian_data_is_swapped_in_its_own_buffer(tmp_path, monkeypatch):
  x = np.arange(4096, dtype=">f4").reshape(64, 64)
  np.savez(tmp_path / "d.npz", x=x)  # numpy's (a directory needs a record)
  spy = Spy(monkeypatch)
  out = bt.restore(
    tmp_path / "d.npz", {"x": jax.ShapeDtypeStruct((64, 64), np.float32)}
  )
  (placed,) = spy.placed[0]
  assert placed.dtype == np.dtype("float32") and placed.dtype.isnative
  assert placed.ctypes.data % reader.ALIGN == 0
  np.testing.assert_array_equal(np.asarray(out["x"]), x.astype(np.float32))


def test_batches_are_half_the_budget_and_reads_stay_within_it(
  tmp_path, monkeypatch
):
  tree = [np.full(256, k, np.float32) for k in range(10)]  # 1 KiB each
  tree.insert(6, np.zeros(2048, np.float32))  # 8 KiB: more than the budget
  bt.save(tmp_path / "s.npz", tree)
  state = {"in_flight": 0, "peak": 0, "before_big": None}
  lock = threading.Lock()

  def on_load(key):
    nbytes = 8192 if key == "6" else 1024
    with lock:
      if key == "6":
        state["before_big"] = state["in_flight"]
      state["in_flight"] += nbytes
      if key != "6":
        state["peak"] = max(state["peak"], state["in_flight"])

  spy = Spy(monkeypatch, on_load=on_load)
  real_place = restore_files.place

  def place_then_count(leaves, target=None, **kwargs):
    out = real_place(leaves, target, **kwargs)
    jax.block_until_ready(out)
    with lock:
      state["in_flight"] -= sum(x.nbytes for x in leaves)
    return out

  monkeypatch.setattr(restore_files, "place", place_then_count)
  out = bt.restore(tmp_path / "s.npz", like(tree), max_inflight_bytes=4096)
  # batches of at most 2 KiB; the 8 KiB leaf alone, read when nothing else is
  # in flight; every other read within the 4 KiB budget
  sizes = [sum(x.nbytes for x in b) for b in spy.placed]
  assert sizes == [2048, 2048, 2048, 8192, 2048, 2048]
  assert state["before_big"] == 0 and 0 < state["peak"] <= 4096
  assert state["in_flight"] == 0
  assert [int(np.asarray(x)[0]) for x in out] == [
    0,
    1,
    2,
    3,
    4,
    5,
    0,
    6,
    7,
    8,
    9,
  ]
  assert prefetch.split_batches([1024] * 6 + [8192] + [1024] * 4, 2048) == [
    [0, 1],
    [2, 3],
    [4, 5],
    [6],
    [7, 8],
    [9, 10],
  ]


@pytest.mark.parametrize("budget, threaded", [(2**20, False), (4096, True)])
def test_one_batch_is_read_on_the_calling_thread(
  tmp_path, monkeypatch, budget, threaded
):
  tree = [np.full(256, k, np.float32) for k in range(6)]
  bt.save(tmp_path / "d", tree)
  readers = set()
  Spy(monkeypatch, on_load=lambda key: readers.add(threading.current_thread()))
  out = bt.restore(tmp_path / "d", like(tree), max_inflight_bytes=budget)
  names = {t.name for t in readers}
  assert names == ({prefetch.THREAD_NAME} if threaded else {"MainThread"})
  assert [int(np.asarray(x)[0]) for x in out] == list(range(6))


def test_batches_are_capped_whatever_the_budget(tmp_path, monkeypatch):
  tree = [np.full(256, k, np.float32) for k in range(5)]  # 1 KiB each
  bt.save(tmp_path / "d", tree)
  monkeypatch.setattr(prefetch, "BATCH_CAP", 2048)
  spy = Spy(monkeypatch)
  out = bt.restore(tmp_path / "d", like(tree))  # default budget: 256 MiB
  assert [len(b) for b in spy.placed] == [2, 2, 1]
  assert [int(np.asarray(x)[0]) for x in out] == list(range(5))


def test_the_next_batch_is_read_while_one_is_placed(tmp_path, monkeypatch):
  tree = [np.full(256, k, np.float32) for k in range(6)]  # 3 batches of 2
  bt.save(tmp_path / "d", tree)
  started = [threading.Event() for _ in range(3)]
  overlapped = []

  def on_load(key):
    started[int(key) // 2].set()

  def on_place(k):
    if k + 1 < len(started):  # placing batch k waits for batch k+1's read
      overlapped.append(started[k + 1].wait(timeout=10))

  Spy(monkeypatch, on_place=on_place, on_load=on_load)
  out = bt.restore(tmp_path / "d", like(tree), max_inflight_bytes=4096)
  assert overlapped == [True, True]
  assert [int(np.asarray(x)[0]) for x in out] == list(range(6))


@pytest.mark.parametrize(
  "error", [ValueError, MemoryError, KeyboardInterrupt, OSError]
)
def test_an_error_in_the_reader_surfaces_with_nothing_half_done(
  tmp_path, monkeypatch, error
):
  tree = [np.full(256, k, np.float32) for k in range(8)]
  bt.save(tmp_path / "d", tree)

  def on_load(key):
    if key == "5":
      if error is ValueError:  # a real one: the file shrank after validation
        (tmp_path / "d" / "5.npy").write_bytes(b"\x93NUMPY")
      else:
        raise error("injected")

  spy = Spy(monkeypatch, on_load=on_load)
  with pytest.raises(error) as info:
    bt.restore(tmp_path / "d", like(tree), max_inflight_bytes=4096)
  if error is ValueError:
    assert "restore: the leaf at [5] (key '5'): reading" in str(info.value)
    assert "the file changed or is damaged" in str(info.value)
  assert spy.results and all(y.is_deleted() for y in spy.results)


def test_an_error_while_placing_stops_the_reader(tmp_path, monkeypatch):
  tree = [np.full(256, k, np.float32) for k in range(40)]
  bt.save(tmp_path / "d", tree)

  def on_place(k):
    if k == 1:
      raise RuntimeError("device fell over")

  spy = Spy(monkeypatch, on_place=on_place)
  with pytest.raises(RuntimeError, match="device fell over"):
    bt.restore(tmp_path / "d", like(tree), max_inflight_bytes=4096)
  # batch 1 was read, at most batch 2 besides; the rest never
  assert len(spy.loaded) <= 6
  assert spy.results and all(y.is_deleted() for y in spy.results)


def test_an_error_while_waiting_for_a_batch_deletes_it_too(
  tmp_path, monkeypatch
):
  tree = [np.full(256, k, np.float32) for k in range(6)]
  bt.save(tmp_path / "d", tree)
  spy = Spy(monkeypatch)
  real_wait, waits = jax.block_until_ready, []

  def wait(x):
    waits.append(x)
    if len(waits) == 2:  # the second batch is placed, then its transfer fails
      raise RuntimeError("transfer failed")
    return real_wait(x)

  monkeypatch.setattr(prefetch.jax, "block_until_ready", wait)
  with pytest.raises(RuntimeError, match="transfer failed"):
    bt.restore(tmp_path / "d", like(tree), max_inflight_bytes=4096)
  assert len(spy.results) == 4 and all(y.is_deleted() for y in spy.results)


def test_a_damaged_compressed_member_is_a_value_error(tmp_path):
  path = tmp_path / "c.npz"
  rng = np.random.default_rng(0)  # big and incompressible: opening reads
  a = rng.standard_normal(2**18).astype(np.float32)  # only the start
  np.savez_compressed(path, a=a)
  like_a = {"a": jax.ShapeDtypeStruct(a.shape, a.dtype)}
  with zipfile.ZipFile(path) as zf:
    (info,) = zf.infolist()
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    end = start + info.compress_size
  raw = bytearray(path.read_bytes())
  raw[end - 24 : end - 4] = b"\xff" * 20  # the deflated data, after the header
  path.write_bytes(bytes(raw))
  with pytest.raises(ValueError) as info:
    bt.restore(path, like_a)
  text = str(info.value)
  assert text.startswith("jaxworks.batched_transfer.restore: the leaf at ['a']")
  assert "reading member 'a.npy'" in text and "failed" in text


# ----------------------------------------------------------------------------- chunked reads


def chunk_threads():
  return [
    t
    for t in threading.enumerate()
    if t.name.startswith(reader.READ_THREAD_PREFIX)
  ]


class ChunkSpy:
  """Records (thread name, lo, hi) of every chunk read.

  With ``meet=n``, each thread's first chunk waits until ``n`` threads hold a
  chunk at once (a barrier), so a test sees the threads read concurrently
  however the machine schedules them; a broken barrier fails the read.
  """

  def __init__(self, monkeypatch, meet=None):
    self.lock = threading.Lock()
    self.reads = []
    barrier = threading.Barrier(meet) if meet else None
    seen = set()
    real = reader.read_range

    def read_range(fd, view, offset, lo, hi):
      me = threading.current_thread().name
      with self.lock:
        first = me not in seen
        seen.add(me)
      if barrier is not None and first:
        barrier.wait(timeout=60)
      real(fd, view, offset, lo, hi)
      with self.lock:
        self.reads.append((me, lo, hi))

    monkeypatch.setattr(reader, "read_range", read_range)


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_a_large_file_is_read_in_chunks_by_several_threads(
  tmp_path, monkeypatch, threads
):
  rng = np.random.default_rng(threads)
  tree = {"big": rng.standard_normal((64, 33)).astype(np.float32)}  # 8448 B
  bt.save(tmp_path / "d", tree)
  monkeypatch.setattr(reader, "CHUNK", 1000)
  spy = ChunkSpy(monkeypatch, meet=threads)
  out = bt.restore(tmp_path / "d", like(tree), read_threads=threads)
  np.testing.assert_array_equal(np.asarray(out["big"]), tree["big"])
  big = sorted((lo, hi) for name, lo, hi in spy.reads)
  # The chunks tile the array exactly once.
  assert big == [(lo, min(lo + 1000, 8448)) for lo in range(0, 8448, 1000)]
  # All `threads` threads (the caller and threads - 1 of the pool) held a
  # chunk at the same time: the barrier of `threads` parties let them through.
  names = {name for name, lo, hi in spy.reads}
  assert len(names) == threads and "MainThread" in names
  pool = names - {"MainThread"}
  assert all(n.startswith(reader.READ_THREAD_PREFIX) for n in pool)
  assert chunk_threads() == []  # the pool is joined when restore returns


def test_one_read_thread_reads_each_file_in_one_piece(tmp_path, monkeypatch):
  tree = {"big": np.arange(5000, dtype=np.float32)}
  bt.save(tmp_path / "d", tree)
  monkeypatch.setattr(reader, "CHUNK", 1000)
  spy = ChunkSpy(monkeypatch)
  out = bt.restore(tmp_path / "d", like(tree), read_threads=1)
  np.testing.assert_array_equal(np.asarray(out["big"]), tree["big"])
  assert spy.reads == [("MainThread", 0, 20000)]


def test_a_chunk_that_fails_fails_the_restore_after_every_thread_stopped(
  tmp_path, monkeypatch
):
  tree = {"big": np.arange(5000, dtype=np.float32)}
  bt.save(tmp_path / "d", tree)
  monkeypatch.setattr(reader, "CHUNK", 1000)
  file = tmp_path / "d" / "big.npy"
  real = reader.read_range
  active = []
  shrunk = threading.Event()

  def read_range(fd, view, offset, lo, hi):
    active.append(1)
    try:
      if lo == 0:  # the file shrinks after validation, while being read
        os.truncate(file, 5000)
        shrunk.set()
      assert shrunk.wait(timeout=10)
      real(fd, view, offset, lo, hi)
    finally:
      active.pop()

  monkeypatch.setattr(reader, "read_range", read_range)
  spy = Spy(monkeypatch)
  with pytest.raises(
    ValueError,
    match=r"restore: the leaf at \['big'\] \(key 'big'\): reading .*big\.npy' "
    r"failed: the data ends .* bytes early .*the file changed or is damaged",
  ):
    bt.restore(tmp_path / "d", like(tree), read_threads=4)
  assert active == [] and chunk_threads() == []
  assert spy.placed == []


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_read_threads_must_be_a_positive_int(tmp_path, bad):
  bt.save(tmp_path / "d", {"a": np.ones(3, np.float32)})
  with pytest.raises(
    ValueError,
    match=r"jaxworks\.batched_transfer\.restore: read_threads must be a "
    r"positive int or None, got " + re.escape(repr(bad)),
  ):
    bt.restore(
      tmp_path / "d", like({"a": np.ones(3, np.float32)}), read_threads=bad
    )


# ----------------------------------------------------------------------------- BatchReader


def test_batch_reader_keeps_to_its_budget_and_reads_a_large_batch_alone():
  sizes = [3, 3, 3, 10, 3, 3]
  lock = threading.Lock()
  state = {"counted": 0, "log": []}

  def read(k):
    with lock:
      state["counted"] += sizes[k]
      state["log"].append((k, state["counted"]))
    return k

  with prefetch.BatchReader(read, sizes, budget=6) as reader:
    for k in range(len(sizes)):
      assert reader.take(k) == k
      time.sleep(0.01)  # give the reader a chance to run ahead
      with lock:
        state["counted"] -= sizes[k]
      reader.release(k)
  log = dict(state["log"])
  assert log[3] == 10  # alone
  assert all(v <= 6 for k, v in log.items() if k != 3)
  assert reader_threads() == []


def test_batch_reader_close_while_blocked_stops_reading():
  calls = []
  reader = prefetch.BatchReader(lambda k: calls.append(k), [5, 5, 5], budget=5)
  reader.take(0)  # never released: batch 1 cannot start
  time.sleep(0.05)
  reader.close()
  assert calls == [0] and reader_threads() == []


def test_batch_reader_hands_over_the_exception_object():
  err = LookupError("no such batch")
  taken = threading.Event()

  def read(k):
    if k == 1:
      taken.wait(timeout=10)
      raise err
    return k

  with prefetch.BatchReader(read, [1, 1, 1], budget=100) as reader:
    assert reader.take(0) == 0
    taken.set()
    with pytest.raises(LookupError) as info:
      reader.take(1)
    assert info.value is err
    with pytest.raises(LookupError):  # and for every later batch
      reader.take(2)
