"""restore and the files under it: replaced while read, not regular, memory."""

import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from memory_maps import record_pieces
from memory_maps import vm_flags
import numpy as np
from overwrite_race import restore_while_replacing
import pytest

from jaxworks import batched_transfer as bt

# Private imports below: the file reader's memory and huge pages.
from jaxworks.batched_transfer._src.checkpoint import format
from jaxworks.batched_transfer._src.checkpoint import reader

API = "jaxworks.batched_transfer.restore"


def like(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


# ------------------------------------------------------- replaced while restoring


def version(v, leaves=8, n=16384):
  """A checkpoint whose every value names its version and its leaf; even
  versions have longer arrays (the data of every file or member after the
  first lies elsewhere)."""
  n += 16 * (v % 2 == 0)
  return {f"l{i}": np.full(n, v * 100 + i, np.float32) for i in range(leaves)}


def version_of(out):
  """The one version every leaf of ``out`` holds whole, or None (a mix)."""
  seen = set()
  for key, y in out.items():
    a = np.asarray(y)
    v, i = divmod(int(a[0]), 100)
    if f"l{i}" != key or not np.all(a == a[0]):
      return None
    seen.add(v)
  return seen.pop() if len(seen) == 1 else None


@pytest.mark.parametrize(
  "fmt,held",
  [("dir", True), ("npz", True), ("dir", False)],
  ids=["dir", "npz", "dir-reopened"],
)
def test_a_checkpoint_replaced_while_restoring_is_read_whole_or_refused(
  tmp_path, monkeypatch, fmt, held
):
  if not held:  # every file opened again when read, and checked to be the same
    monkeypatch.setattr(reader, "HELD_FILES", 0)
  path = tmp_path / ("c.npz" if fmt == "npz" else "c")
  bt.save(path, version(1))
  target = like(version(1))
  # One 64 KiB leaf per batch: reading and placing interleave.
  results, errors, _ = restore_while_replacing(
    lambda v: bt.save(path, version(v), overwrite=True),
    lambda: bt.restore(path, target, max_inflight_bytes=2**17),
    version_of,
    attempts=300,
  )
  assert None not in results, f"{results.count(None)} restores mixed versions"
  assert len(results) >= 20 and len(set(results)) > 1
  for err in errors:  # clear errors: validation's, or "changed"
    assert str(err).startswith(API), err


def test_a_file_replaced_before_it_is_opened_again_is_refused(
  tmp_path, monkeypatch
):
  monkeypatch.setattr(reader, "HELD_FILES", 0)
  bt.save(tmp_path / "d", version(1, leaves=2))
  real = reader.load

  def replace_then_load(api, where, key, s, files):
    bt.save(tmp_path / "new", version(2, leaves=2))
    os.replace(tmp_path / "new" / f"{key}.npy", tmp_path / "d" / f"{key}.npy")
    return real(api, where, key, s, files)

  monkeypatch.setattr(reader, "load", replace_then_load)
  with pytest.raises(
    ValueError, match=r"reading .*l0\.npy' failed: it was replaced after"
  ):
    bt.restore(tmp_path / "d", like(version(1, leaves=2)))


def test_a_file_modified_in_place_while_read_is_refused(tmp_path, monkeypatch):
  bt.save(tmp_path / "d", version(1, leaves=1))
  file = tmp_path / "d" / "l0.npy"
  real = reader.load

  def modify_then_load(api, where, key, s, files):
    st = os.stat(file)
    with open(file, "r+b") as f:  # same inode, same size, other values
      f.seek(-4, os.SEEK_END)
      f.write(np.float32(7).tobytes())
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    return real(api, where, key, s, files)

  monkeypatch.setattr(reader, "load", modify_then_load)
  with pytest.raises(
    ValueError, match=r"reading .*l0\.npy' failed: it was modified while"
  ):
    bt.restore(tmp_path / "d", like(version(1, leaves=1)))


@pytest.mark.parametrize("where", ["leaf", "record", "checkpoint"])
def test_what_is_not_a_regular_file_is_refused_without_blocking(
  tmp_path, where
):
  bt.save(tmp_path / "d", version(1, leaves=1))
  fifo = {
    "leaf": tmp_path / "d" / "l0.npy",
    "record": tmp_path / "d" / format.RECORD,
    "checkpoint": tmp_path / "c.npz",
  }[where]
  if fifo.exists():
    fifo.unlink()
  os.mkfifo(fifo)  # opening a FIFO to read waits for a writer
  path = fifo if where == "checkpoint" else tmp_path / "d"
  raised = []

  def run():
    try:
      bt.restore(path, like(version(1, leaves=1)))
    except ValueError as err:
      raised.append(err)

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  thread.join(timeout=60)
  assert not thread.is_alive(), "restore blocked on a FIFO"
  (err,) = raised
  text = str(err)
  assert (
    text.startswith(API)
    and str(fifo if where != "checkpoint" else path) in text
  )
  assert "regular file" in text


def test_no_descriptor_stays_open(tmp_path):
  def open_fds():
    return set(os.listdir("/proc/self/fd"))

  for fmt in ("d", "c.npz"):
    bt.save(tmp_path / fmt, version(1))
  before = open_fds()
  for fmt in ("d", "c.npz"):
    bt.restore(tmp_path / fmt, like(version(1)))
    with pytest.raises(ValueError, match="is stored in .* as"):
      bt.restore(tmp_path / fmt, like(version(1, n=3)))
  assert open_fds() == before


# ----------------------------------------------------------------------- memory

_MEMORY_SCRIPT = textwrap.dedent(
  """
  import gc, os, sys
  import jax, numpy as np
  from jaxworks import batched_transfer as bt

  def rss_mib():
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

  path, how, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
  keys = sorted(k[:-4] for k in os.listdir(path) if k.endswith(".npy"))
  target = {k: jax.ShapeDtypeStruct((2**20,), np.float32) for k in keys}

  def one():
    if how == "restore":
      bt.restore(path, target)  # the result is dropped at once
    else:
      jax.device_put({k: np.load(os.path.join(path, k + ".npy")) for k in keys})

  for _ in range(3):
    one()
  gc.collect()
  start = rss_mib()
  for _ in range(n):
    one()
  gc.collect()
  print(rss_mib() - start)
  """
)


def _growth_mib(path, how, n):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
  out = subprocess.run(
    [sys.executable, "-c", _MEMORY_SCRIPT, str(path), how, str(n)],
    env=env,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert out.returncode == 0, out.stderr
  return float(out.stdout.split()[-1])


def test_dropped_restores_give_their_memory_back(tmp_path):
  # 16 leaves of 4 MiB: buffers of that size, allocated on the reader thread
  # with malloc, stayed in glibc's arenas (+3-6 MiB per restore).
  rng = np.random.default_rng(0)
  bt.save(
    tmp_path / "d",
    {f"l{i:02}": rng.random(2**20, np.float32) for i in range(16)},
  )
  n = 40
  baseline = _growth_mib(tmp_path / "d", "np.load", n)
  growth = _growth_mib(tmp_path / "d", "restore", n)
  # One restore holds 64 MiB; a leak of 1 MiB per restore would exceed this.
  assert growth < max(baseline, 0) + 32, (growth, baseline)


def huge_pages_advisable():
  return (
    reader._MADV_HUGEPAGE is not None
    and os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
    and "[never]"
    not in open("/sys/kernel/mm/transparent_hugepage/enabled").read()
  )


@pytest.mark.skipif(
  not huge_pages_advisable(), reason="no transparent huge pages"
)
def test_large_restore_buffers_ask_for_huge_pages_from_disk_only(tmp_path):
  # From the page cache, huge pages fault memory in 2 MiB at a time; a
  # bucket restore's memory keeps 4 KiB pages (see reader.HostMemory).
  size = reader.HUGE_PAGE // 4 * 2  # two huge pages of float32
  for huge in (True, False):
    mem = reader.HostMemory(huge_pages=huge)
    big, _ = mem.empty((size,), np.dtype(np.float32))
    small, _ = mem.empty((16,), np.dtype(np.float32))
    assert ("hg" in vm_flags(big.ctypes.data)) is huge
    assert "hg" not in vm_flags(small.ctypes.data)  # a shared 1 MiB map
  bt.save(tmp_path / "c", {"w": np.arange(size, dtype=np.float32)})
  out = bt.restore(
    tmp_path / "c", {"w": jax.ShapeDtypeStruct((size,), np.float32)}
  )
  assert np.array_equal(np.asarray(out["w"]), np.arange(size, dtype=np.float32))
  # Placed on its device without a copy: the device buffer is restore's map.
  assert "hg" in vm_flags(out["w"].unsafe_buffer_pointer())


# ---------------------------------------------- rows whose bytes start off alignment


def _rows(tree):
  mesh = jax.make_mesh((8,), ("x",))
  rows = NamedSharding(mesh, P("x"))
  return {
    k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows)
    for k, x in tree.items()
  }


@pytest.mark.parametrize("fmt", ["dir", "npz"])
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_off_alignment_are_placed_without_a_copy(
  tmp_path, monkeypatch, fmt, threads
):
  # A row of 300001 float32 (1.2 MB) puts every device's rows but the
  # first off the CPU runtime's 64-byte alignment in one buffer: each
  # device's rows are read into a buffer of their own, which becomes the
  # device's buffer; the 8 MiB chunks (checked one by one) cross them.
  made = record_pieces(monkeypatch)
  rng = np.random.default_rng(0)
  t = {
    "w": rng.random((8, 300001), np.float32),
    "s": rng.random((8, 4001), np.float32),
  }
  path = tmp_path / ("c.npz" if fmt == "npz" else "c")
  bt.save(path, t)
  out = bt.restore(path, _rows(t), read_threads=threads)
  for k, y in out.items():
    assert np.array_equal(np.asarray(y), t[k])
    for shard in y.addressable_shards:
      assert shard.data.unsafe_buffer_pointer() in made
  assert len(made) == 16
  # A damaged byte in the third device's rows is found.
  f = path / "w.npy" if fmt == "dir" else path
  data = bytearray(f.read_bytes())
  start = data.find(t["w"].tobytes()[:4096])
  data[start + 2 * 1_200_004 + 7] ^= 1
  f.write_bytes(bytes(data))
  with pytest.raises(ValueError, match="checksum|CRC"):
    bt.restore(path, _rows(t), read_threads=threads)


def test_rows_aligned_or_cast_read_one_buffer(tmp_path, monkeypatch):
  made = record_pieces(monkeypatch)
  rng = np.random.default_rng(1)
  t = {
    "aligned": rng.random((8, 4096), np.float32),
    "cast": rng.random((8, 4001), np.float32),
  }
  bt.save(tmp_path / "c", t)
  target = _rows(t)
  target["cast"] = jax.ShapeDtypeStruct(
    (8, 4001), jnp.bfloat16, sharding=target["cast"].sharding
  )
  out = bt.restore(tmp_path / "c", target)
  assert np.array_equal(np.asarray(out["aligned"]), t["aligned"])
  assert np.array_equal(np.asarray(out["cast"]), t["cast"].astype(jnp.bfloat16))
  assert made == []
