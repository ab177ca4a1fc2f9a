"""The opt-in checkpoint codec, ``save(..., compression="zstd")``: every dtype
and layout restores bit for bit as from raw files, each compressed file is
a Zstandard frame of exactly the raw save's ``.npy`` bytes, raw saves keep
the record format earlier versions read, and damaged, mixed or replaced
files are clear errors; against moto's S3 server too.
"""

import io
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest
import zstandard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dtypes  # noqa: E402
import object_servers  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402

RECORD = "jaxworks_dtypes.json"
s3_endpoint = object_servers.s3_endpoint


def _tree(seed=0):
  rng = np.random.default_rng(seed)
  tree = {
    "a": {
      d.name: rng.integers(0, 255, (5, 7)).astype(d)
      for d in dtypes.NUMPY_DTYPES
    },
    "ml": {
      d.name: rng.standard_normal((3, 4)).astype(np.float32).astype(d)
      for d in dtypes.ML_DTYPES
    },
  }
  tree["fortran"] = np.asfortranarray(rng.standard_normal((6, 5)))
  tree["scalar0d"] = np.float32(2.5)
  tree["empty"] = np.zeros((0, 4), np.int16)
  tree["zeros"] = np.zeros((300, 300), np.float32)
  tree["py"] = {"i": 7, "f": 1.5, "b": True, "c": 1 + 2j}
  tree["text"] = "run-1"
  tree["none"] = None
  tree["dev"] = jax.device_put(jnp.arange(64.0).reshape(8, 8))
  return tree


def _same(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    if isinstance(x, str):
      assert x == y
      continue
    assert type(x) is type(y) or isinstance(y, jax.Array), (type(x), type(y))
    xa, ya = np.asarray(x), np.asarray(y)
    assert xa.dtype == ya.dtype and xa.shape == ya.shape
    assert xa.tobytes() == ya.tobytes()


def test_every_leaf_kind_restores_as_from_raw_files(tmp_path):
  tree = _tree()
  bt.save(tmp_path / "raw", tree)
  bt.save(tmp_path / "z", tree, compression="zstd")
  raw, z = bt.restore(tmp_path / "raw"), bt.restore(tmp_path / "z")
  _same(raw, z)
  _same(bt.restore(tmp_path / "z", tree), bt.restore(tmp_path / "raw", tree))
  assert bt.metadata(tmp_path / "z") == bt.metadata(tmp_path / "raw")
  # Onto a sharding: the placement path is the raw files'.
  mesh = jax.make_mesh((8,), ("x",))
  target = {
    "dev": jax.ShapeDtypeStruct(
      (8, 8), jnp.float32, sharding=NamedSharding(mesh, P("x"))
    )
  }
  bt.save(tmp_path / "d", {"dev": tree["dev"]}, compression="zstd")
  out = bt.restore(tmp_path / "d", target)
  assert out["dev"].sharding == target["dev"].sharding
  np.testing.assert_array_equal(out["dev"], tree["dev"])


def test_each_file_is_a_zstd_frame_of_the_raw_npy_file(tmp_path):
  tree = _tree(1)
  bt.save(tmp_path / "raw", tree)
  bt.save(tmp_path / "z", tree, compression="zstd")
  raws = {}
  for root, _, names in os.walk(tmp_path / "raw"):
    for n in names:
      if n.endswith(".npy"):
        rel = os.path.relpath(os.path.join(root, n), tmp_path / "raw")
        raws[rel] = open(os.path.join(root, n), "rb").read()
  zs = {}
  for root, _, names in os.walk(tmp_path / "z"):
    for n in names:
      if n != RECORD:
        assert n.endswith(".npy.zst"), n
        rel = os.path.relpath(os.path.join(root, n), tmp_path / "z")
        with open(os.path.join(root, n), "rb") as f:
          zs[rel[: -len(".zst")]] = (
            zstandard.ZstdDecompressor().stream_reader(f).read()
          )
  assert zs == raws
  assert (
    os.path.getsize(tmp_path / "z" / "zeros.npy.zst") < 4096
  )  # 360 KB of zeros
  rec_raw = json.loads((tmp_path / "raw" / RECORD).read_text())
  rec_z = json.loads((tmp_path / "z" / RECORD).read_text())
  assert (
    rec_raw["format"] == 2 and "codecs" not in rec_raw
  )  # earlier versions read it
  assert rec_z["format"] == 3 and rec_z["codecs"] == dict.fromkeys(
    rec_raw["dtypes"], "zstd"
  )
  assert rec_z["crc32c"] == rec_raw["crc32c"]  # of the uncompressed data


def test_large_leaves_compress_in_steps_to_the_raw_bytes_and_sums(tmp_path):
  # Leaves of several checksum chunks, written to the compressor a
  # codec.WRITE_STEP at a time (sums continued across steps and chunks), one
  # of them a sharded jax.Array written shard by shard: the files decompress
  # to the raw save's bytes and the record's sums are the raw save's.
  rng = np.random.default_rng(3)
  mesh = jax.make_mesh((8,), ("x",))
  tree = {
    "big": rng.integers(0, 255, 9 * 2**20 + 5, np.uint8),
    "sharded": jax.device_put(
      rng.standard_normal((8 * 1024, 96)).astype(np.float32),
      NamedSharding(mesh, P("x")),
    ),
  }
  bt.save(tmp_path / "raw", tree)
  bt.save(tmp_path / "z", tree, compression="zstd")
  for key in tree:
    with open(tmp_path / "z" / f"{key}.npy.zst", "rb") as f:
      got = zstandard.ZstdDecompressor().stream_reader(f).read()
    assert got == (tmp_path / "raw" / f"{key}.npy").read_bytes(), key
  rec_raw = json.loads((tmp_path / "raw" / RECORD).read_text())
  rec_z = json.loads((tmp_path / "z" / RECORD).read_text())
  assert rec_z["crc32c"] == rec_raw["crc32c"]
  assert len(rec_z["crc32c"]["big"]) == 2
  _same(tree, bt.restore(tmp_path / "z", tree))


def test_manager_and_overwrite_between_raw_and_compressed(tmp_path):
  p = tmp_path / "c"
  bt.save(p, {"w": np.arange(10)})
  bt.save(p, {"w": np.arange(5.0)}, overwrite=True, compression="zstd")
  assert sorted(os.listdir(p)) == [RECORD, "w.npy.zst"]
  np.testing.assert_array_equal(bt.restore(p)["w"], np.arange(5.0))
  bt.save(p, {"w": np.ones(3)}, overwrite=True)
  assert sorted(os.listdir(p)) == [RECORD, "w.npy"]
  m = bt.CheckpointManager(tmp_path / "m", max_to_keep=2, compression="zstd")
  for step in range(3):
    assert m.save(step, {"w": np.full(50, step)}, metrics={"loss": float(step)})
  m.wait_until_finished()
  assert m.all_steps() == [1, 2]
  np.testing.assert_array_equal(m.restore(2)["w"], np.full(50, 2))
  assert m.metrics(2) == {"loss": 2.0}
  m.close()
  with pytest.raises(ValueError, match="compression='lz4'.*zstd"):
    bt.CheckpointManager(tmp_path / "m2", compression="lz4")


@pytest.mark.parametrize("bad", ["gzip", "ZSTD", 1, True])
def test_bad_compression_is_refused_before_anything_is_written(tmp_path, bad):
  with pytest.raises(ValueError, match=r"save: compression=.*pass None"):
    bt.save(tmp_path / "c", {"w": np.ones(3)}, compression=bad)
  assert not os.path.exists(tmp_path / "c")


def test_npz_with_compression_is_refused(tmp_path):
  with pytest.raises(
    ValueError, match=r"\.npz.*drop the \.npz suffix or the compression"
  ):
    bt.save(tmp_path / "c.npz", {"w": np.ones(3)}, compression="zstd")
  assert os.listdir(tmp_path) == []


def _damage(path, how):
  f = path / "w.npy.zst"
  data = bytearray(f.read_bytes())
  if how == "flipped":
    data[len(data) // 2] ^= 0x55
    f.write_bytes(data)
  elif how == "truncated":
    f.write_bytes(data[: len(data) - 9])
  elif how == "appended":
    f.write_bytes(data + data)
  elif how == "raw beside":
    np.save(path / "w.npy", np.ones(3))
  elif how == "raw instead":
    f.unlink()
    np.save(path / "w.npy", np.random.default_rng(0).random((64, 64)))
  elif how == "other array":
    buf = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(buf, closefd=False) as w:
      np.save(w, np.zeros((64, 64)))
    f.write_bytes(buf.getvalue())
  elif how == "unknown codec":
    rec = json.loads((path / RECORD).read_text())
    rec["codecs"]["w"] = "brotli"
    (path / RECORD).write_text(json.dumps(rec))
  elif how == "not zstd":
    f.write_bytes(b"\x93NUMPY" + bytes(200))


# Damage found while reading the header, or while decompressing the data.
_UNREADABLE = (
  r"(reading .*w\.npy\.zst.* failed|w\.npy\.zst' is not a readable \.npy file)"
)


@pytest.mark.parametrize(
  "how,match",
  [
    ("flipped", _UNREADABLE),
    ("truncated", _UNREADABLE),
    ("appended", _UNREADABLE),
    ("raw instead", r"w\.npy\.zst' of the array at 'w' is missing"),
    ("other array", _UNREADABLE),
    ("unknown codec", r"'codecs' names \['brotli'\]"),
    ("not zstd", r"w\.npy\.zst.* is not a readable \.npy file"),
  ],
)
def test_damaged_compressed_files_are_clear_errors(tmp_path, how, match):
  p = tmp_path / "c"
  w = np.random.default_rng(1).random((64, 64))
  bt.save(p, {"w": w, "b": np.arange(4)}, compression="zstd")
  _damage(p, how)
  # A file the record names, gone: FileNotFoundError (as for a raw file).
  cls = FileNotFoundError if how == "raw instead" else ValueError
  with pytest.raises(cls, match=match) as info:
    bt.restore(p)
  assert "jaxworks.batched_transfer.restore" in str(info.value)
  with pytest.raises(cls, match=match):
    bt.restore(p, {"w": w, "b": np.arange(4)})


def test_a_raw_file_beside_a_compressed_one_is_not_read(tmp_path):
  """Only the files the record names are the checkpoint's."""
  p = tmp_path / "c"
  w = np.random.default_rng(1).random((64, 64))
  bt.save(p, {"w": w, "b": np.arange(4)}, compression="zstd")
  _damage(p, "raw beside")
  out = bt.restore(p)["w"]  # float32: x64 is off
  np.testing.assert_array_equal(np.asarray(out), w.astype(np.float32))


def test_file_replaced_after_validation_is_named(tmp_path, monkeypatch):
  """A compressed file swapped between restore's check and its read."""
  # Private: the reader's file class, patched to swap the file mid-restore.
  from jaxworks.batched_transfer._src.checkpoint import reader

  p = tmp_path / "c"
  w = np.random.default_rng(2).random((32, 32))
  bt.save(p, {"w": w}, compression="zstd")
  other = tmp_path / "o"
  bt.save(other, {"w": w + 1}, compression="zstd")
  real = reader.Files.read

  def swapped(self, s):
    os.replace(other / "w.npy.zst", p / "w.npy.zst")
    return real(self, s)

  monkeypatch.setattr(reader.Files, "read", swapped)
  monkeypatch.setattr(reader, "HELD_FILES", -1)  # reopened by name when read
  with pytest.raises(ValueError, match="replaced after restore validated it"):
    bt.restore(p)


def test_without_zstandard_the_fix_is_named(tmp_path):
  code = textwrap.dedent(
    f"""
    import sys
    sys.modules["zstandard"] = None  # as if not installed
    import numpy as np
    from jaxworks import batched_transfer as bt
    try:
      bt.save({str(tmp_path / "c")!r}, {{"w": np.ones(3)}}, compression="zstd")
    except ModuleNotFoundError as e:
      print("RAISED", e)
    import os
    print("EXISTS", os.path.exists({str(tmp_path / "c")!r}))
    bt.save({str(tmp_path / "r")!r}, {{"w": np.ones(3)}})  # raw saves need nothing
    print("RAW", bt.restore({str(tmp_path / "r")!r})["w"].tolist())
    """
  )
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, check=True
  ).stdout
  assert (
    "RAISED jaxworks.batched_transfer.save: compression='zstd' needs the zstandard package"
    in out
  )
  assert "jaxworks-batched-transfer[zstd]" in out
  assert "EXISTS False" in out and "RAW [1.0, 1.0, 1.0]" in out


def test_compressed_checkpoint_in_a_bucket(s3_endpoint, tmp_path, monkeypatch):
  for k, v in object_servers.S3_ENV.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
  tree = _tree(3)
  url = f"s3://ckpt/codec-{os.getpid()}"
  bt.save(url, tree, compression="zstd")
  bt.save(tmp_path / "raw", tree)
  assert bt.metadata(url) == bt.metadata(tmp_path / "raw")
  _same(bt.restore(url), bt.restore(tmp_path / "raw"))
  _same(bt.restore(url, tree), bt.restore(tmp_path / "raw", tree))
