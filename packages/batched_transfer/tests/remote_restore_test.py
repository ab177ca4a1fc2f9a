"""restore and metadata of checkpoints in buckets, streamed: against moto's
S3 server and gcp-storage-emulator started on 127.0.0.1 by this test.

Every leaf kind restores bit for bit; no temporary file or directory is
made (the objects are streamed into restore's buffers); each array takes
one request: its header and data together where the record says its shape
(the header checked when it arrives), else (a checkpoint of an earlier
version) on S3 a request held after its header, one that fails midway taken
up by range; the bytes requested, counted through the storage
layer's own ``read``, ``stream_into`` and ``open_stream``, are the ones the
devices need (a replicated region once, a sharded one by parts,
and with two processes each reads only its devices' shard files);
``metadata`` reads no array where the record says its shape, headers
only of the others; objects damaged after the commit
(truncated, altered, deleted) are errors naming the URL, the key and the
fix; an overwrite's copy beside the path is read while the path has no
record.
"""

import collections
import json
import os
import sys
import tempfile
import textwrap
import threading
import uuid

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from memory_maps import record_pieces  # noqa: E402
from memory_maps import vm_flags  # noqa: E402
from multiprocess_util import run_n  # noqa: E402
import object_servers  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402

# Private imports below: restore's probes and storage, patched to count.
from jaxworks.batched_transfer._src.checkpoint import checksum  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import format  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import gcs  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import restore_objects  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import stores  # noqa: E402

API = "test"
RECORD = format.RECORD
MiB = 2**20

s3_endpoint = object_servers.s3_endpoint
gcs_endpoint = object_servers.gcs_endpoint


def _s3_env(monkeypatch, endpoint):
  for k, v in object_servers.S3_ENV.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)


url = object_servers.bucket_url


#: The end of a request of a whole object (no range): all of it.
WHOLE = float("inf")


@pytest.fixture
def requests(monkeypatch):
  """Every request of an object's bytes the storage layer makes, as
  ``{key: [(start, end), ...]}``, keys relative to the checkpoint (its own
  ``read``, ``stream_into`` and ``open_stream``, of both stores; a request of
  the whole object ends at ``WHOLE``)."""
  seen = collections.defaultdict(list)
  lock = threading.Lock()
  real_stream = stores.ObstoreStorage.open_stream

  def open_stream(self, key):
    with lock:
      seen[key].append((0, WHOLE))
    return real_stream(self, key)

  monkeypatch.setattr(stores.ObstoreStorage, "open_stream", open_stream)
  for cls in (stores.ObstoreStorage, gcs.GCSStorage):
    real, real_into = cls.read, cls.stream_into

    def read(self, key, start=0, end=None, real=real):
      with lock:
        seen[key].append((start, end))
      return real(self, key, start, end)

    def stream_into(self, key, start, *outs, real=real_into):
      n = sum(memoryview(o).nbytes for o in outs)
      with lock:
        seen[key].append((start, start + n))
      return real(self, key, start, *outs)

    monkeypatch.setattr(cls, "read", read)
    monkeypatch.setattr(cls, "stream_into", stream_into)
  return seen


def _bytes(ranges):
  return sum(e - s for s, e in ranges)


def objects_at(url):
  """The storage of the objects of the checkpoint at ``url``: its head's
  version, or the path itself (0.6.x's layout, or none)."""
  st = stores.open_storage(API, url)
  if not st.exists(object_servers.HEAD):
    return st
  return object_servers.version_of(st)


def as_earlier_version(url):
  """Rewrites the checkpoint at ``url`` as versions before ``shapes`` wrote
  it (0.6.x's layout; restore then reads each header first)."""
  st = stores.open_storage(API, url)
  object_servers.to_legacy(st)
  record = json.loads(bytes(st.read(RECORD)))
  assert record.pop("shapes")
  record.pop("scalars", None)  # nor exact Python scalars (nor nodes)
  record.pop("nodes", None)
  st.write(RECORD, json.dumps(record).encode())


def leaves():
  """Every leaf kind the bucket tests save (remote_test's and more)."""
  rng = np.random.default_rng(0)
  return {
    "params": {
      "w": rng.standard_normal((64, 32), np.float32),
      "b": jax.numpy.arange(8, dtype=jax.numpy.int32),
      "bf16": rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16),
      "f8": rng.standard_normal(24).astype(ml_dtypes.float8_e4m3fn),
    },
    "big": rng.standard_normal(3 * MiB // 4 + 5).astype(np.float32),
    # Several checksum chunks: read in parallel parts, one request each.
    "huge": rng.integers(0, 2**31, 35 * MiB // 4)
    .astype(np.int32)
    .reshape(-1, 8),
    "fortran": np.asfortranarray(rng.standard_normal((7, 5), np.float32)),
    "mask": rng.standard_normal(33) > 0,
    "empty": np.zeros((0, 4), np.float16),
    "c64": (rng.standard_normal(6) + 1j).astype(np.complex64),
    "scalar": np.float32(2.5),
    "run": "exp-1",
    "step": 7,
    "nothing": None,
  }


def same(out, t):
  """Bit for bit: dtype, shape and bytes of every array, values of others."""
  flat_out, tree_out = jax.tree.flatten(out, is_leaf=lambda x: x is None)
  flat_t, tree_t = jax.tree.flatten(t, is_leaf=lambda x: x is None)
  assert tree_out == tree_t
  for a, b in zip(flat_out, flat_t):
    if isinstance(b, (str, type(None))) or type(a) is int:
      assert a == b and type(a) is type(b)
      continue
    if isinstance(b, int):  # a Python scalar target: its 0-d array
      assert np.asarray(a).item() == b and a.weak_type
      continue
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert (
      np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
    )


def test_every_leaf_kind_bit_for_bit(url, requests):
  t = leaves()
  bt.save(url, t)
  requests.clear()
  same(bt.restore(url), t)
  # Every byte of every array requested once, in parallel requests: an
  # array whose shape the record says in one request with its header; the
  # others (Fortran order, no data) opened with their first PROBE bytes (all
  # of a small one).
  st = objects_at(url)
  for key, size in st.list().items():
    if key in (RECORD, "step.npy"):  # a Python scalar: from the record
      continue
    covered = np.zeros(size, np.int32)
    for s, e in requests[key]:
      covered[s : min(e, size)] += 1
    assert covered.min() >= 1, key  # everything read
    assert (covered > 1).sum() <= restore_objects.PROBE, (
      key
    )  # once, but the header
  for key, size in st.list().items():  # one request per object
    if key not in (RECORD, "step.npy"):
      assert requests[key] == [(0, size)], (key, requests[key])
  assert "step.npy" not in requests  # its exact value is in the record
  # A checkpoint of an earlier version (no shapes in its record): on S3 a
  # request of the whole object, held after its header for the rest; on GCS
  # the header when opened, then the data in one request (streamed).
  as_earlier_version(url)
  st = objects_at(url)  # 0.6.x's layout now: at the path
  requests.clear()
  same(bt.restore(url), t)
  huge = sorted(requests["huge.npy"])
  if url.startswith("s3://"):
    for key, size in st.list().items():
      if key != RECORD and size:
        assert requests[key] in ([(0, WHOLE)], [(0, size)]), requests[key]
    assert huge == [(0, WHOLE)], huge
  else:
    assert len(huge) == 2 and huge[1][1] == st.list()["huge.npy"], huge
  like = jax.tree.map(
    lambda x: (
      x
      if isinstance(x, (str, int)) or x is None
      else jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype)
    ),
    t,
    is_leaf=lambda x: x is None,
  )
  same(bt.restore(url, like), t)


def test_small_arrays_take_one_request_each(url, requests, monkeypatch):
  """A tree of many small arrays: each object in one request (header and
  data), however little memory restore may use; none when opened."""
  rng = np.random.default_rng(2)
  t = {f"s{i:02d}": rng.standard_normal(25_000, np.float32) for i in range(40)}
  bt.save(url, t)
  monkeypatch.setattr(restore_objects, "HELD", 0)
  for budget in (2**30, 2 * 2**20, 1):
    requests.clear()
    same(bt.restore(url, max_inflight_bytes=budget), t)
    for k in t:
      assert requests[f"{k}.npy"] == [(0, 100_128)], requests[f"{k}.npy"]
  requests.clear()
  assert bt.metadata(url)["s00"].shape == (25_000,)
  assert set(requests) == {RECORD}, requests  # no array read


def test_small_arrays_of_an_earlier_version(url, requests, monkeypatch):
  """Many small arrays whose record does not say their shapes: each object
  read whole when opened (one request), its data not requested again;
  within max_inflight_bytes."""
  rng = np.random.default_rng(2)
  t = {f"s{i:02d}": rng.standard_normal(25_000, np.float32) for i in range(40)}
  bt.save(url, t)
  as_earlier_version(url)
  requests.clear()
  same(bt.restore(url), t)
  for k in t:
    assert requests[f"{k}.npy"] == [(0, 100_128)], requests[f"{k}.npy"]
  # With less memory allowed than the tree: on S3 still one request each
  # (the rest held after their header until their data's turn); on GCS the
  # rest header first, then data.
  requests.clear()
  same(bt.restore(url, max_inflight_bytes=2 * 2**20), t)
  counts = [len(requests[f"{k}.npy"]) for k in t]
  if url.startswith("s3://"):
    assert counts == [1] * len(t), counts
    small = 2 * 2**20 // 100_128  # read whole within the budget
    assert all(requests[f"{k}.npy"] == [(0, WHOLE)] for k in list(t)[small:])
    # At most HELD requests held: the others' data requested again.
    monkeypatch.setattr(restore_objects, "HELD", 3)
    requests.clear()
    same(bt.restore(url, max_inflight_bytes=2 * 2**20), t)
    counts = [len(requests[f"{k}.npy"]) for k in t]
    assert counts == [1] * (small + 3) + [2] * (len(t) - small - 3), counts
  else:
    assert sum(counts) > len(t)


def test_array_of_exactly_one_part_takes_one_request(
  url, requests, monkeypatch
):
  """An array whose data is exactly restore_objects.PART bytes (its object
  a header longer): one part, so on S3 one request of the whole object,
  held after its header for the data."""
  monkeypatch.setattr(restore_objects, "PART", 8 * MiB)
  t = {"w": np.arange(2 * MiB, dtype=np.float32)}  # 8 MiB of data
  bt.save(url, t, max_inflight_bytes=64 * MiB)
  requests.clear()
  same(bt.restore(url, max_inflight_bytes=8 * MiB), t)
  size = objects_at(url).list()["w.npy"]
  assert requests["w.npy"] == [(0, size)], requests["w.npy"]
  as_earlier_version(url)  # its header first
  requests.clear()
  same(bt.restore(url, max_inflight_bytes=8 * MiB), t)
  if url.startswith("s3://"):
    assert requests["w.npy"] == [(0, WHOLE)], requests["w.npy"]
  else:  # the header when opened, then the data in one request
    assert len(requests["w.npy"]) == 2, requests["w.npy"]


def test_large_array_in_parts(url, requests, monkeypatch):
  """An array larger than restore_objects.PART: parts read at once, each
  checked; a byte altered in the middle part is found."""
  monkeypatch.setattr(restore_objects, "PART", 16 * MiB)
  t = {"huge": leaves()["huge"]}
  bt.save(url, t)
  requests.clear()
  same(bt.restore(url), t)
  st = objects_at(url)
  header = st.list()["huge.npy"] - t["huge"].nbytes
  parts = sorted(requests["huge.npy"])  # the first with the header
  sizes = [e - s for s, e in parts]
  assert sizes == [header + 16 * MiB, 16 * MiB, 3 * MiB], parts
  data = bytearray(st.read("huge.npy"))
  data[20 * MiB] ^= 1
  st.write("huge.npy", bytes(data))
  with pytest.raises(ValueError, match="checksum|CRC") as e:
    bt.restore(url)
  assert st.where("huge.npy") in str(e.value)


def test_buffers_keep_small_pages(url):
  # Data at network speed hides 4 KiB page faults; huge pages made bucket
  # restores bimodal (see reader.HostMemory).
  size = 4 * MiB // 4
  t = {"w": np.arange(size, dtype=np.float32)}
  bt.save(url, t)
  target = {"w": jax.ShapeDtypeStruct((size,), np.float32)}
  out = bt.restore(url, target)
  same(out, t)
  # Placed without a copy: the device buffer is restore's own map.
  assert "hg" not in vm_flags(out["w"].unsafe_buffer_pointer())


# ------------------------------------------- rows whose bytes start off alignment


def _rows_target(tree, spec=P("x")):
  mesh = jax.make_mesh((8,), ("x",))
  return {
    k: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=NamedSharding(mesh, spec)
    )
    for k, x in tree.items()
  }


@pytest.fixture
def pieces(monkeypatch):
  return record_pieces(monkeypatch)


def test_rows_off_alignment_are_placed_without_a_copy(url, requests, pieces):
  # A row of 4001 float32 (16004 bytes) puts every device's rows but the
  # first off the CPU runtime's 64-byte alignment in one buffer: each
  # device's rows are read into a buffer of their own (in the one request),
  # which becomes the device's buffer.
  rng = np.random.default_rng(0)
  t = {
    "one_row_each": rng.random((8, 4001), np.float32),
    "two_rows_each": rng.random((16, 4001), np.float32),
    "int16": rng.integers(-9, 9, (8, 9, 1001), np.int16),
  }
  bt.save(url, t)
  requests.clear()
  out = bt.restore(url, _rows_target(t))
  same(out, t)
  for k, y in out.items():
    assert y.sharding == _rows_target(t)[k].sharding
    assert len(requests[f"{k}.npy"]) == 1, requests[f"{k}.npy"]
    for shard in y.addressable_shards:
      assert shard.data.unsafe_buffer_pointer() in pieces
      assert np.array_equal(np.asarray(shard.data), t[k][shard.index])
  assert len(pieces) == 3 * 8


@pytest.mark.parametrize(
  "spec,shape,dtype",
  [
    (P("x"), (8, 4096), np.float32),  # aligned already: one buffer
    (P(None, "x"), (3, 8 * 1001), np.float32),  # split in columns
    (P(), (8, 4099), np.float32),  # replicated
    (P("x"), (8, 8001), ml_dtypes.bfloat16),  # stored as raw bytes
    (P("x"), (8, 4), np.float32),  # small: a shared map
  ],
  ids=["aligned", "columns", "replicated", "bfloat16", "small"],
)
def test_other_placements_read_one_buffer(url, pieces, spec, shape, dtype):
  rng = np.random.default_rng(1)
  t = {"a": rng.random(shape, np.float32).astype(dtype)}
  bt.save(url, t)
  out = bt.restore(url, _rows_target(t, spec))
  same(out, t)
  assert pieces == []


def test_parts_across_device_buffers_are_checked(
  url, requests, monkeypatch, pieces
):
  # 8 x 4.4 MiB rows in parts of 8 MiB: parts end inside device buffers;
  # each part's checksums span the buffers, and a damaged byte is found.
  monkeypatch.setattr(restore_objects, "PART", 8 * MiB)
  rng = np.random.default_rng(2)
  t = {"w": rng.random((8, 1146881), np.float32)}
  bt.save(url, t)
  requests.clear()
  same(bt.restore(url, _rows_target(t)), t)
  assert len(requests["w.npy"]) == 5, requests["w.npy"]
  assert len(pieces) == 8
  st = objects_at(url)
  data = bytearray(st.read("w.npy"))
  data[-20 * MiB] ^= 1
  st.write("w.npy", bytes(data))
  with pytest.raises(ValueError, match="checksum|CRC") as e:
    bt.restore(url, _rows_target(t))
  assert st.where("w.npy") in str(e.value)


def test_compressed_checkpoint(url):
  t = {"zeros": np.zeros((256, 256), np.float32), "r": leaves()["big"]}
  bt.save(url, t, compression="zstd")
  assert any(k.endswith(".zst") for k in objects_at(url).list())
  same(bt.restore(url), t)


def test_no_temporary_file_or_directory(url, monkeypatch, tmp_path):
  t = leaves()
  bt.save(url, t)
  empty = tmp_path / "tmp"
  empty.mkdir()
  monkeypatch.setenv("TMPDIR", str(empty))
  monkeypatch.setattr(tempfile, "tempdir", str(empty))

  def refuse(*args, **kwargs):
    raise AssertionError("restore made a temporary file or directory")

  for name in (
    "mkdtemp",
    "mkstemp",
    "TemporaryDirectory",
    "NamedTemporaryFile",
  ):
    monkeypatch.setattr(tempfile, name, refuse)
  same(bt.restore(url), t)
  assert bt.metadata(url)["big"].shape == t["big"].shape
  assert os.listdir(empty) == []


def test_metadata_reads_headers_only(url, requests):
  """metadata reads no array whose shape the record says (here all but the
  empty one: a Fortran-order leaf is saved as a C-order file), the header
  only of the others."""
  t = leaves()
  bt.save(url, t)
  for earlier in (False, True):
    if earlier:
      as_earlier_version(url)
    requests.clear()
    m = bt.metadata(url)
    assert m["huge"].shape == t["huge"].shape and m["run"] == "exp-1"
    assert m["params"]["bf16"].dtype == ml_dtypes.bfloat16
    read = {k for k in requests if k.endswith(".npy")}
    assert read == ({"empty.npy"} if not earlier else read)
    for key, ranges in requests.items():
      if key.endswith(".npy"):
        assert _bytes(ranges) <= restore_objects.PROBE, (key, ranges)


def test_partial_restore_reads_only_the_leaves_asked_for(url, requests):
  t = leaves()
  bt.save(url, t)
  requests.clear()
  want = {"params": {"w": jax.ShapeDtypeStruct((64, 32), np.float32)}}
  out = bt.restore(url, want, partial_restore=True)
  np.testing.assert_array_equal(out["params"]["w"], t["params"]["w"])
  # The headers of every array (validation), the data of w alone.
  assert _bytes(requests["huge.npy"]) <= restore_objects.PROBE
  assert _bytes(requests["big.npy"]) <= restore_objects.PROBE


# Checkpoints several processes wrote: the ranges each device needs --------


def write_manifest(st, tree, rows):
  """The layout several processes write (each array of 2 or more dimensions
  in ``rows`` tiles of whole rows, one shard file each, with checksums),
  uploaded to the storage ``st`` with its record; ``{file: data bytes}``."""
  arrays, sizes = {}, {}
  with tempfile.TemporaryDirectory() as d:
    for key, a in tree.items():
      r = rows if a.ndim >= 2 else 1
      shards = []
      for i in range(r):
        lo, hi = i * a.shape[0] // r, (i + 1) * a.shape[0] // r
        part = np.ascontiguousarray(a[lo:hi] if a.ndim else a)
        name = f"{key}.shards/{i}.npy"
        local = os.path.join(d, f"{key}-{i}.npy")
        np.save(local, part)
        st.upload(name, local)
        sizes[name] = part.nbytes
        shards.append({
          "file": name,
          "start": [lo] + [0] * (a.ndim - 1) if a.ndim else [],
          "shape": list(part.shape),
          "crc32c": checksum.of(memoryview(part.reshape(-1).view(np.uint8))),
        })  # fmt: skip
      arrays[key] = {"shape": list(a.shape), "dtype": a.dtype.name,
                     "shards": shards}  # fmt: skip
  manifest = {
    "format": format.MANIFEST_FORMAT,
    "processes": 2,
    "arrays": arrays,
  }
  st.write(format.MANIFEST, json.dumps(manifest).encode())
  record = format.Record(dtypes={k: a.dtype.name for k, a in tree.items()})
  st.create(RECORD, format.encode_record(record))
  return sizes


def sharded_values():
  rng = np.random.default_rng(1)
  return {
    "w": rng.standard_normal((256, 1024)).astype(np.float32),  # 1 MiB
    "e": rng.standard_normal((64, 96)).astype(ml_dtypes.bfloat16),
  }


def test_sharded_restore_reads_each_needed_range_once(url, requests):
  v = sharded_values()
  st = objects_at(url)
  sizes = write_manifest(st, v, rows=8)
  mesh = jax.make_mesh((8,), ("a",))
  for spec in (P("a"), P(), P(None, "a")):
    where = NamedSharding(mesh, spec)
    requests.clear()
    target = {
      k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where)
      for k, a in v.items()
    }
    out = bt.restore(url, target)
    for k in v:
      assert out[k].sharding == where
      same(np.asarray(out[k]), v[k])
    for name, n in sizes.items():
      # Each shard file's data once, whatever the replication: 8 devices
      # holding the whole array read it once, not 8 times.
      data = _bytes(r for r in requests[name])
      assert n <= data <= n + restore_objects.SHARD_PROBE, (
        spec,
        name,
        requests[name],
      )


def test_sharded_restore_onto_part_of_the_array(url, requests):
  """A region narrower than the files' (a target sharded along columns
  while the files tile rows): only the bytes of whole rows of each file in
  runs, every file's checksum still checked."""
  v = {"w": np.arange(64 * 4096, dtype=np.float32).reshape(64, 4096)}
  st = objects_at(url)
  write_manifest(st, v, rows=2)
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  where = NamedSharding(mesh, P("a", "b"))
  out = bt.restore(
    url, {"w": jax.ShapeDtypeStruct((64, 4096), np.float32, sharding=where)}
  )
  same(np.asarray(out["w"]), v["w"])
  # Bit flipped in the middle of a file: the restore fails, naming it.
  data = bytearray(st.read("w.shards/1.npy"))
  data[len(data) // 2] ^= 1
  st.write("w.shards/1.npy", bytes(data))
  with pytest.raises(ValueError, match=r"w\.shards/1\.npy") as e:
    bt.restore(
      url, {"w": jax.ShapeDtypeStruct((64, 4096), np.float32, sharding=where)}
    )
  assert "checksum" in str(e.value) or "CRC" in str(e.value)


RESTORE_WORKER = textwrap.dedent("""
    import sys, threading
    pid, port, base, url = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    import jax
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=2, process_id=pid,
                               initialization_timeout=60)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxworks import batched_transfer as bt
    from jaxworks.batched_transfer._src.checkpoint import stores
    seen, lock = {}, threading.Lock()
    real = stores.ObstoreStorage.read
    def read(self, key, start=0, end=None):
      with lock:
        seen.setdefault(key, []).append((start, end))
      return real(self, key, start, end)
    stores.ObstoreStorage.read = read
    real_into = stores.ObstoreStorage.stream_into
    def stream_into(self, key, start, out):
      with lock:
        seen.setdefault(key, []).append((start, start + len(out)))
      return real_into(self, key, start, out)
    stores.ObstoreStorage.stream_into = stream_into
    mesh = jax.make_mesh((8,), ("a",))
    where = NamedSharding(mesh, P("a"))
    out = bt.restore(url, {"w": jax.ShapeDtypeStruct((256, 1024), np.float32,
                                                     sharding=where)})
    want = np.random.default_rng(1).standard_normal((256, 1024)).astype(np.float32)
    for s in out["w"].addressable_shards:
      assert np.array_equal(np.asarray(s.data), want[s.index]), s.index
    files = sorted(k for k in seen if k.startswith("w.shards/"))
    mine = sorted(f"w.shards/{i}.npy" for i in range(4 * pid, 4 * pid + 4))
    assert files == mine, (files, mine)
    data = sum(e - s for k in files for s, e in seen[k])
    assert 4 * 2**17 <= data <= 4 * 2**17 + 4 * 16 * 1024, data
    print("WORKER-OK", pid, flush=True)
""")


def test_two_processes_each_read_only_their_shards(s3_endpoint, monkeypatch):
  _s3_env(monkeypatch, s3_endpoint)
  url = f"s3://ckpt/run-{uuid.uuid4().hex}/ckpt"
  write_manifest(objects_at(url), {"w": sharded_values()["w"]}, rows=8)
  run_n(RESTORE_WORKER, "unused", 2, timeout=240, extra=(url,))


# Objects damaged after the commit -------------------------------------------


def test_truncated_object(url):
  t = leaves()
  bt.save(url, t)
  st = objects_at(url)
  data = bytes(st.read("big.npy"))
  st.write("big.npy", data[:-4096])
  with pytest.raises(ValueError, match="truncated or damaged") as e:
    bt.restore(url)
  assert st.where("big.npy") in str(e.value) and "'big'" in str(e.value)


def test_truncated_large_object(url):
  t = leaves()
  bt.save(url, t)
  st = objects_at(url)
  data = bytes(st.read("huge.npy"))
  st.write("huge.npy", data[: len(data) // 2])
  with pytest.raises(ValueError, match="truncated or damaged") as e:
    bt.restore(url)
  assert st.where("huge.npy") in str(e.value)


def test_truncated_after_listing_on_the_held_request(s3_endpoint, monkeypatch):
  """An object truncated between the listing and its one request (header
  and data in the same one): the error names its URL and the fix."""
  _s3_env(monkeypatch, s3_endpoint)
  url = f"s3://ckpt/run-{uuid.uuid4().hex}/ckpt"
  t = {"huge": leaves()["huge"]}
  bt.save(url, t)
  st = objects_at(url)
  data = bytes(st.read("huge.npy"))
  real = stores.ObstoreStorage.list

  def listed_then_truncated(self, prefix=""):
    out = real(self, prefix)
    if "huge.npy" in out:
      st.write("huge.npy", data[: len(data) // 2])
    return out

  monkeypatch.setattr(stores.ObstoreStorage, "list", listed_then_truncated)
  with pytest.raises(ValueError, match="ends at byte .* was truncated") as e:
    bt.restore(url)
  assert st.where("huge.npy") in str(e.value) and "save it again" in str(
    e.value
  )


def test_held_request_failing_midway_is_taken_up_by_range(
  s3_endpoint, monkeypatch, requests
):
  """A held request that fails after its header (dropped, timed out): the
  rest of the object is requested by range, every byte still checked."""
  _s3_env(monkeypatch, s3_endpoint)
  url = f"s3://ckpt/run-{uuid.uuid4().hex}/ckpt"
  t = {"huge": leaves()["huge"], "big": leaves()["big"]}
  bt.save(url, t)
  as_earlier_version(url)
  real = stores.ObstoreStorage.open_stream

  def failing(self, key):
    stream = real(self, key)
    chunks = stream._chunks

    def first_then_fail():
      yield next(chunks)
      raise OSError(f"{key}: connection reset")

    stream._chunks = first_then_fail()
    return stream

  monkeypatch.setattr(stores.ObstoreStorage, "open_stream", failing)
  requests.clear()
  same(bt.restore(url, max_inflight_bytes=2 * MiB), t)
  for key in ("huge.npy", "big.npy"):
    size = objects_at(url).list()[key]
    first, rest = requests[key]
    assert first == (0, WHOLE) and rest[1] == size, requests[key]
    assert rest[0] <= restore_objects.PROBE + 2 * stores.STREAM_CHUNK, rest


def test_failed_restore_reads_nothing(url, requests):
  """A target that does not match the record's shapes: no array is read."""
  t = {"huge": leaves()["huge"], "big": leaves()["big"]}
  bt.save(url, t)
  requests.clear()
  bad = {"huge": jax.ShapeDtypeStruct((1, 8), np.int32), "big": t["big"]}
  with pytest.raises(ValueError, match="shape"):
    bt.restore(url, bad)
  assert not any(k.endswith(".npy") for k in requests), requests


def test_failed_restore_drops_held_requests(s3_endpoint, monkeypatch):
  """A checkpoint of an earlier version, a target that does not match:
  nothing is read past the headers and every held request is dropped."""
  _s3_env(monkeypatch, s3_endpoint)
  url = f"s3://ckpt/run-{uuid.uuid4().hex}/ckpt"
  t = {"huge": leaves()["huge"], "big": leaves()["big"]}
  bt.save(url, t)
  as_earlier_version(url)
  held = []
  real = restore_objects._probe

  def probe(*args, **kwargs):
    obj = real(*args, **kwargs)
    held.append(obj)
    return obj

  monkeypatch.setattr(restore_objects, "_probe", probe)
  bad = {"huge": jax.ShapeDtypeStruct((1, 8), np.int32), "big": t["big"]}
  with pytest.raises(ValueError, match="shape"):
    bt.restore(url, bad)
  assert any(o.key == "huge.npy" for o in held)
  assert all(o.stream is None for o in held), held


@pytest.mark.parametrize(
  "key, like",
  [
    ("params/w.npy", np.zeros((32, 64), np.float32)),  # the same size
    ("huge.npy", np.zeros((35 * MiB // 64, 16), np.int32)),
    ("params/bf16.npy", np.zeros((16, 8), np.float16)),
    ("big.npy", np.zeros(6, np.float32)),  # no room for a header
  ],
)
def test_object_replaced_by_another_array(url, key, like):
  """An object replaced after the commit by another array: its header,
  checked against the record's shape and dtype when it arrives with the
  data (or when opened), is an error naming the object; nothing placed."""
  bt.save(url, leaves())
  st = objects_at(url)
  f = tempfile.TemporaryFile()
  np.save(f, like)
  f.seek(0)
  st.write(key, f.read())
  with pytest.raises(ValueError) as e:
    bt.restore(url)
  text = str(e.value)
  assert st.where(key) in text and "damaged" in text, text
  assert "says shape" in text, text


@pytest.mark.parametrize("key", ["params/w.npy", "huge.npy", "big.npy"])
def test_altered_object(url, key):
  t = leaves()
  bt.save(url, t)
  st = objects_at(url)
  data = bytearray(st.read(key))
  data[-100] ^= 0x40
  st.write(key, bytes(data))
  with pytest.raises(ValueError, match="checksum|CRC") as e:
    bt.restore(url)
  assert st.where(key) in str(e.value)
  assert "damaged" in str(e.value)
  assert any(url in n for n in e.value.__notes__)
  # verify=False reads what is there (the user's choice), without error.
  bt.restore(url, verify=False)


def test_deleted_object(url):
  bt.save(url, leaves())
  st = objects_at(url)
  st.delete(["params/w.npy"])
  with pytest.raises(FileNotFoundError, match="params") as e:
    bt.restore(url)
  assert url in str(e.value)


def test_deleted_shard_file(url):
  st = objects_at(url)
  write_manifest(st, sharded_values(), rows=8)
  st.delete(["w.shards/3.npy"])
  with pytest.raises(FileNotFoundError, match=r"w\.shards/3\.npy") as e:
    bt.restore(url)
  assert "save the checkpoint again" in str(e.value)


def test_truncated_shard_file(url):
  st = objects_at(url)
  write_manifest(st, sharded_values(), rows=8)
  data = bytes(st.read("w.shards/5.npy"))
  st.write("w.shards/5.npy", data[:-8])
  with pytest.raises(
    ValueError, match=r"w\.shards/5\.npy.*truncated or damaged"
  ):
    bt.restore(url)


# Commit records -------------------------------------------------------------


def test_prefix_without_record_is_absent(url):
  bt.save(url, leaves())
  st = stores.open_storage(API, url)
  st.delete([object_servers.HEAD])  # its version stays: not a checkpoint
  with pytest.raises(FileNotFoundError, match="did not commit"):
    bt.restore(url)
  with pytest.raises(FileNotFoundError, match="did not commit"):
    bt.metadata(url)
  bt.save(url, leaves())  # 0.6.x's layout without its record: the same
  object_servers.to_legacy(st)
  st.delete([RECORD])
  with pytest.raises(FileNotFoundError, match="did not commit"):
    bt.restore(url)
  with pytest.raises(FileNotFoundError, match="did not commit"):
    bt.metadata(url)


def test_overwrite_copy_beside_the_path_is_read(url):
  """An overwrite killed after removing the old record: the new checkpoint
  committed beside the path is what restore reads."""
  t = leaves()
  parent_url, _, name = url.rpartition("/")
  beside = f"{parent_url}/.{name}.jaxworks-new-{uuid.uuid4().hex[:16]}"
  bt.save(url, {"old": np.zeros(3)})
  bt.save(beside, t)
  object_servers.to_legacy(stores.open_storage(API, url))
  object_servers.to_legacy(stores.open_storage(API, beside))
  stores.open_storage(API, url).delete([RECORD])
  same(bt.restore(url), t)
  assert bt.metadata(url)["run"] == "exp-1"
