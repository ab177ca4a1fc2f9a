"""save's ``pack_below``: small leaves stored together in one uncompressed
archive (``jaxworks_packed.npz``) beside the larger leaves' files, on disk
and in buckets (moto's S3 server and the GCS emulator on 127.0.0.1).

Each test compares against the same tree saved one file per leaf (the
oracle: restore with and without a target, ``metadata``), reads the
archive with numpy alone, counts the files, objects and requests, and
damages the archive (a flipped byte, a missing member, a missing
archive, a compressed member), which restore refuses naming the file.
"""

import collections
import io
import json
import os
import sys
import threading
import zipfile

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import object_servers  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402

# Private imports below: the record's names, the bucket's storage (counted).
from jaxworks.batched_transfer._src.checkpoint import format  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import gcs  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import stores  # noqa: E402

PACKED = format.PACKED
RECORD = format.RECORD
url = object_servers.bucket_url
s3_endpoint = object_servers.s3_endpoint
gcs_endpoint = object_servers.gcs_endpoint


def model_state():
  """A small model's training state: large weights, small biases and
  norms, optimizer counts, Python scalars, a bfloat16 leaf, str and None."""
  rng = np.random.default_rng(0)
  mesh = jax.make_mesh((8,), ("d",))
  rows = NamedSharding(mesh, P("d"))
  return {
    "params": {
      "w": jax.device_put(rng.normal(size=(64, 256)).astype(np.float32), rows),
      "b": jnp.asarray(rng.normal(size=(256,)), jnp.float32),
      "norm": jnp.asarray(rng.normal(size=(16,)), jnp.bfloat16),
      "emb": rng.normal(size=(32, 64)).astype(np.float32),
    },
    "opt": [
      {"count": jnp.asarray(7, jnp.int32), "mu": np.zeros((3,), np.float64)},
      (),
    ],
    "step": 12,
    "lr": 0.1,
    "flag": True,
    "tokens": 2**40,
    "name": "run-1",
    "none": None,
    "mask": np.array([True, False, True]),
    "raw": np.arange(6, dtype=ml_dtypes.float8_e4m3fn).reshape(2, 3),
  }


def same(a, b):
  """Equal trees: the same structure, leaf types, dtypes, shardings and
  bytes."""
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    assert type(x) is type(y), (x, y)
    if isinstance(x, (jax.Array, np.ndarray)):
      assert x.dtype == y.dtype and x.shape == y.shape
      assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
      if isinstance(x, jax.Array):
        assert x.sharding == y.sharding
    else:
      assert x == y


def files_in(path):
  """The files under ``path``, relative to it, sorted."""
  out = [os.path.relpath(os.path.join(r, n), path) for r, _, ns in os.walk(path)
         for n in ns]  # fmt: skip
  return sorted(out)


def test_small_leaves_are_one_archive_numpy_reads(tmp_path):
  tree = model_state()
  bt.save(tmp_path / "one", tree)
  bt.save(tmp_path / "packed", tree, pack_below=4096)
  one, packed = files_in(tmp_path / "one"), files_in(tmp_path / "packed")
  # The 64x256 and 32x64 float32 weights (64 KiB, 8 KiB) keep their files.
  assert packed == sorted([RECORD, PACKED, "params/w.npy", "params/emb.npy"])
  assert len(one) == 12  # 11 arrays and the record
  record = json.loads((tmp_path / "packed" / RECORD).read_bytes())
  assert record["format"] == format.PACKED_FORMAT
  assert json.loads((tmp_path / "one" / RECORD).read_bytes())["format"] < 5
  members = np.load(tmp_path / "packed" / PACKED)
  assert sorted(members.files) == sorted(record["packed"])
  for key in members.files:  # byte for byte the file the unpacked save wrote
    alone = np.load(tmp_path / "one" / (key + ".npy"))
    assert members[key].tobytes() == alone.tobytes()
    assert members[key].dtype == alone.dtype
  with zipfile.ZipFile(tmp_path / "packed" / PACKED) as zf:
    assert {i.compress_type for i in zf.infolist()} == {zipfile.ZIP_STORED}


def test_restore_as_saved_and_onto_a_target(tmp_path):
  tree = model_state()
  bt.save(tmp_path / "one", tree)
  bt.save(tmp_path / "packed", tree, pack_below=1 << 20)
  assert files_in(tmp_path / "packed") == [RECORD, PACKED]
  same(bt.restore(tmp_path / "packed"), bt.restore(tmp_path / "one"))
  same(bt.metadata(tmp_path / "packed"), bt.metadata(tmp_path / "one"))
  same(
    bt.restore(tmp_path / "packed", tree), bt.restore(tmp_path / "one", tree)
  )
  # Onto other shardings, and a part of the tree.
  mesh = jax.make_mesh((4, 2), ("a", "b"))
  target = jax.tree.map(
    lambda x: (
      jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))
      if isinstance(x, (jax.Array, np.ndarray))
      else x
    ),
    tree,
  )
  same(
    bt.restore(tmp_path / "packed", target),
    bt.restore(tmp_path / "one", target),
  )
  part = {"params": {"b": target["params"]["b"]}}
  got = bt.restore(tmp_path / "packed", part, partial_restore=True)
  same(got, bt.restore(tmp_path / "one", part, partial_restore=True))


def test_with_compression_the_large_leaves_are_compressed(tmp_path):
  pytest.importorskip("zstandard")
  tree = model_state()
  bt.save(tmp_path / "c", tree, pack_below=4096, compression="zstd")
  assert files_in(tmp_path / "c") == sorted(
    [RECORD, PACKED, "params/w.npy.zst", "params/emb.npy.zst"]
  )
  record = json.loads((tmp_path / "c" / RECORD).read_bytes())
  assert set(record["codecs"]) == {"params/w", "params/emb"}
  bt.save(tmp_path / "one", tree)
  same(bt.restore(tmp_path / "c"), bt.restore(tmp_path / "one"))


def test_manager_steps_have_fewer_files(tmp_path):
  tree = model_state()
  counts = {}
  for name, below in (("one", None), ("packed", 4096)):
    mgr = bt.CheckpointManager(tmp_path / name, pack_below=below)
    for step in (1, 2):
      mgr.save(step, items={"state": tree, "meta": {"epoch": step}})
    mgr.wait_until_finished()
    counts[name] = len(files_in(tmp_path / name / "2"))
    mgr.close()
  assert counts["packed"] < counts["one"], counts
  for step in (1, 2):
    same(
      bt.CheckpointManager(tmp_path / "packed").restore(step),
      bt.CheckpointManager(tmp_path / "one").restore(step),
    )


def test_a_manager_packs_arrays_under_1_mib_unless_told_not_to(tmp_path):
  big = np.arange(2**18 + 1, dtype=np.float32)  # just over 1 MiB
  tree = dict(model_state(), big=big)
  layouts, restored = {}, {}
  for name, options in (
    ("default", {}),
    ("options", {"options": bt.CheckpointManagerOptions()}),
    ("none", {"pack_below": None}),
  ):
    mgr = bt.CheckpointManager(tmp_path / name, **options)
    mgr.save(1, items={"state": tree})
    mgr.wait_until_finished()
    mgr.close()
    layouts[name] = files_in(tmp_path / name / "1")
    record = json.loads((tmp_path / name / "1" / RECORD).read_bytes())
    packed = record.get("packed") or []
    if name == "none":
      assert not packed and PACKED not in layouts[name]
    else:
      # every array under 1 MiB in the archive, the 1 MiB + 4 B one beside
      assert layouts[name] == sorted([RECORD, PACKED, "state/big.npy"])
      assert "state/big" not in packed and len(packed) == 11, packed
    restored[name] = bt.CheckpointManager(tmp_path / name).restore(1)
  assert len(layouts["none"]) == 13  # 12 arrays and the record
  same(restored["default"], restored["none"])
  same(restored["options"], restored["none"])


def test_bad_pack_below_is_refused_before_anything_is_written(tmp_path):
  for bad in (0, -1, 1.5, "64k", True):
    with pytest.raises(ValueError, match="pack_below must be a positive int"):
      bt.save(tmp_path / "c", {"x": np.ones(3)}, pack_below=bad)
    with pytest.raises(ValueError, match="pack_below"):
      bt.CheckpointManager(tmp_path / "m", pack_below=bad)
  assert not os.path.exists(tmp_path / "c")


def test_a_leaf_whose_directory_is_the_archive_is_refused(tmp_path):
  tree = {PACKED: {"x": np.ones(100)}, "y": np.ones(2)}
  with pytest.raises(ValueError, match="jaxworks_packed.npz"):
    bt.save(tmp_path / "c", tree, pack_below=64)
  assert not os.path.exists(tmp_path / "c")
  bt.save(tmp_path / "c", tree)  # without packing: no archive, saved
  got = bt.restore(tmp_path / "c")
  assert np.array_equal(got[PACKED]["x"], tree[PACKED]["x"])


def _flip_data_byte(data, member="params/b.npy"):
  """Flips a byte in the data of ``member`` of the archive bytes ``data``
  (its local header's name comes first, then its .npy header, then data)."""
  npy = data.index(b"\x93NUMPY", data.index(member.encode()))
  header_len = int.from_bytes(data[npy + 8 : npy + 10], "little")
  data[npy + 10 + header_len + 17] ^= 0x40


def _rewrite_archive(path, change):
  """The archive at ``path`` written again with ``change(name, bytes)``
  applied to each member (None drops it)."""
  with zipfile.ZipFile(path) as zf:
    members = [(i.filename, zf.read(i)) for i in zf.infolist()]
  buf = io.BytesIO()
  with zipfile.ZipFile(buf, "w") as zf:
    for name, data in members:
      data = change(name, data)
      if data is not None:
        zf.writestr(name, data)
  os.chmod(path, 0o644)
  with open(path, "wb") as f:
    f.write(buf.getvalue())


@pytest.mark.parametrize(
  "damage", ["flipped", "dropped", "deleted", "deflated"]
)
def test_a_damaged_archive_is_refused_naming_it(tmp_path, damage):
  tree = model_state()
  bt.save(tmp_path / "c", tree, pack_below=4096)
  archive = tmp_path / "c" / PACKED
  if damage == "flipped":  # one byte of a member's data, the size kept
    data = bytearray(archive.read_bytes())
    _flip_data_byte(data)
    archive.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="damaged") as e:
      bt.restore(tmp_path / "c")
    assert PACKED in str(e.value)
    return
  if damage == "dropped":
    _rewrite_archive(archive, lambda n, d: None if n == "step.npy" else d)
    match = "packed"
  elif damage == "deleted":
    os.remove(archive)
    match = "missing"
  else:
    with zipfile.ZipFile(archive) as zf:
      members = [(i.filename, zf.read(i)) for i in zf.infolist()]
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as zf:
      for name, data in members:
        zf.writestr(name, data)
    match = "packed"
  with pytest.raises((ValueError, FileNotFoundError), match=match) as e:
    bt.restore(tmp_path / "c")
  assert PACKED in str(e.value)
  with pytest.raises((ValueError, FileNotFoundError), match=match):
    bt.metadata(tmp_path / "c")


def test_a_record_with_bad_packed_keys_is_damaged(tmp_path):
  bt.save(tmp_path / "c", model_state(), pack_below=4096)
  path = tmp_path / "c" / RECORD
  record = json.loads(path.read_bytes())
  for bad in ("step", ["nope"], ["name"], [1], record["packed"] * 2):
    path.write_text(json.dumps(dict(record, packed=bad)))
    with pytest.raises(ValueError, match="'packed'.*damaged|damaged.*packed"):
      bt.restore(tmp_path / "c")


@pytest.fixture
def requests(monkeypatch):
  """The object keys the storage layer writes and reads, with a count each:
  ``{"write": Counter, "read": Counter}``."""
  seen = {"write": collections.Counter(), "read": collections.Counter()}
  lock = threading.Lock()

  def counted(kind, real):
    def call(self, key, *args, **kwargs):
      with lock:
        seen[kind][key] += 1
      return real(self, key, *args, **kwargs)

    return call

  for cls in (stores.ObstoreStorage, gcs.GCSStorage):
    for name, kind in (
      ("write", "write"), ("open_write", "write"),
      ("read", "read"), ("stream_into", "read"),
    ):  # fmt: skip
      if name in vars(cls):
        monkeypatch.setattr(cls, name, counted(kind, vars(cls)[name]))
  monkeypatch.setattr(
    stores.ObstoreStorage, "open_stream",
    counted("read", stores.ObstoreStorage.open_stream),
  )  # fmt: skip
  return seen


def _arrays(counter):
  """The array objects (and the archive) among the keys counted."""
  return {
    k.rsplit("/", 1)[-1] if "/" in k else k: n
    for k, n in counter.items()
    if k.endswith((".npy", ".npz"))
  }


def test_in_a_bucket_one_object_and_one_request(url, requests, tmp_path):
  tree = model_state()
  bt.save(tmp_path / "one", tree)
  bt.save(url, tree, pack_below=4096)
  written = _arrays(requests["write"])
  assert sorted(written) == sorted([PACKED, "w.npy", "emb.npy"]), written
  assert written[PACKED] == 1
  requests["read"].clear()
  got = bt.restore(url)
  read = _arrays(requests["read"])
  assert read[PACKED] == 1 and set(read) == {PACKED, "w.npy", "emb.npy"}, read
  same(got, bt.restore(tmp_path / "one"))
  same(bt.restore(url, tree), bt.restore(tmp_path / "one", tree))
  same(bt.metadata(url), bt.metadata(tmp_path / "one"))


def test_in_a_bucket_a_damaged_member_is_refused(url):
  bt.save(url, model_state(), pack_below=4096)
  st = object_servers.version_of(stores.open_storage("test", url))
  data = bytearray(st.read(PACKED))
  _flip_data_byte(data)
  st.write(PACKED, bytes(data))
  with pytest.raises(ValueError, match="damaged") as e:
    bt.restore(url)
  assert PACKED in str(e.value)
