"""What restore reads is what save wrote: checksums (CRC-32C per 8 MiB of
each file of a directory checkpoint, the CRC-32 of each .npz member, checked
by default, in the threads that read); and save never writes what restore
cannot read or replaces what it may not: colliding keys, pending saves to
one path, a commit that would replace, failed writes with their errno."""

import errno
import os
import subprocess
import sys
import textwrap
import threading
import zipfile

import jax
import numpy as np
import pytest

from jaxworks import batched_transfer as bt

# Private imports below: checksums, checked reads, commit: patched or damaged.
from jaxworks.batched_transfer._src.checkpoint import checksum
from jaxworks.batched_transfer._src.checkpoint import commit
from jaxworks.batched_transfer._src.checkpoint import destination
from jaxworks.batched_transfer._src.checkpoint import reader
from jaxworks.batched_transfer._src.checkpoint import writer


def _flip(file, at):
  with open(file, "r+b") as f:
    f.seek(at)
    b = f.read(1)
    f.seek(at)
    f.write(bytes([b[0] ^ 0x10]))


def _tree():
  rng = np.random.default_rng(0)
  return {
    "w": rng.standard_normal((64, 32)).astype(np.float32),
    "b": np.arange(7, dtype=np.int32),
  }


def like(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def test_a_flipped_byte_in_an_npz_member_is_an_error(tmp_path):
  # np.load raises BadZipFile: Bad CRC-32; restore read the member in place
  # and returned wrong values.
  path = tmp_path / "c.npz"
  bt.save(path, _tree())
  with zipfile.ZipFile(path) as zf:
    info = zf.getinfo("w.npy")
  _flip(path, info.header_offset + 30 + len("w.npy") + 128 + 40)
  with pytest.raises(zipfile.BadZipFile, match="CRC"):
    dict(np.load(path))
  with pytest.raises(
    ValueError, match=r"\['w'\].*member 'w.npy' of .*c.npz.*CRC-32"
  ):
    bt.restore(path, like(_tree()))
  # verify=False: the opt-out reads what is there.
  out = bt.restore(path, like(_tree()), verify=False)
  assert np.asarray(out["w"]).tobytes() != _tree()["w"].tobytes()


@pytest.mark.parametrize("threads", [1, 4])
def test_a_flipped_byte_in_a_directory_file_is_an_error(tmp_path, threads):
  big = np.random.default_rng(1).standard_normal(3 * 2**20).astype(np.float32)
  tree = {"big": big, "small": np.ones(5, np.int16)}  # big: 12 MiB, 2 chunks
  path = tmp_path / "d"
  bt.save(path, tree)
  ok = bt.restore(path, like(tree), read_threads=threads)
  assert np.asarray(ok["big"]).tobytes() == big.tobytes()
  _flip(path / "big.npy", 128 + checksum.CHUNK + 12345)  # in the 2nd chunk
  with pytest.raises(
    ValueError,
    match=r"\['big'\].*big.npy.*fails the checksum check .*bytes "
    rf"{checksum.CHUNK}-",
  ):
    bt.restore(path, like(tree), read_threads=threads)
  out = bt.restore(path, like(tree), read_threads=threads, verify=False)
  assert np.asarray(out["big"]).tobytes() != big.tobytes()


def test_the_checksums_are_in_the_record_and_match_the_files(tmp_path):
  import json

  bt.save(tmp_path / "d", {"a": {"x": np.arange(10.0)}, "s": "str"})
  record = json.loads((tmp_path / "d" / "jaxworks_dtypes.json").read_text())
  data = (tmp_path / "d" / "a" / "x.npy").read_bytes()
  assert record["crc32c"] == {"a/x": checksum.of(memoryview(data[128:]))}
  assert record["values"] == {"s": "str"}


def test_colliding_keys_and_files_are_refused_before_writing(tmp_path):
  # "a" writes a.npy; "a.npy"/"b" needs a.npy as a directory.
  with pytest.raises(ValueError, match=r"file 'a.npy'.*\['a.npy'\]\['b'\]"):
    bt.save(tmp_path / "d", {"a": np.ones(1), "a.npy": {"b": np.ones(1)}})
  assert not os.listdir(tmp_path)


def test_pending_non_blocking_saves_reserve_their_path(tmp_path):
  # Both were accepted and the second replaced the first without overwrite.
  path = tmp_path / "p"
  t1, t2 = {"x": np.zeros(4)}, {"x": np.ones(4)}
  gate = threading.Event()
  real = destination.DirectorySave.write

  def slow(*a, **k):
    gate.wait(30)
    return real(*a, **k)

  destination.DirectorySave.write = slow
  try:
    h1 = bt.save(path, t1, blocking=False)
    with pytest.raises(FileExistsError, match="still being written"):
      bt.save(path, t2, blocking=False)
    with pytest.raises(FileExistsError, match="still being written"):
      bt.save(path, t2)
    h3 = bt.save(path, t2, blocking=False, overwrite=True)  # allowed
  finally:
    gate.set()
    destination.DirectorySave.write = real
  h3.wait()
  try:  # committed first and replaced by h3, or refused after h3's commit
    h1.wait()
  except FileExistsError as err:
    assert "created while this save wrote" in str(err)
  assert np.asarray(bt.restore(path)["x"]).tolist() == [1.0] * 4
  with pytest.raises(FileExistsError, match="exists"):
    bt.save(path, t2, blocking=False)


@pytest.mark.parametrize("fmt", ["d", "c.npz"])
def test_the_commit_never_replaces_without_overwrite(tmp_path, fmt):
  # Another writer creates the path after save checked it: the commit (a
  # no-replace rename) refuses, the other checkpoint stays whole.
  path = tmp_path / fmt
  real = commit.publish

  def other_first(api, tmp, target, overwrite=True):
    # (written elsewhere and renamed in: this save holds the parent's lock)
    commit.publish = real
    other = tmp_path / "elsewhere" / fmt
    bt.save(other, {"other": np.arange(3)})
    os.rename(other, target)
    return real(api, tmp, target, overwrite)

  commit.publish = other_first
  try:
    with pytest.raises(FileExistsError, match="created while this save wrote"):
      bt.save(path, {"x": np.ones(2)})
  finally:
    commit.publish = real
  np.testing.assert_array_equal(
    np.asarray(bt.restore(path)["other"]), [0, 1, 2]
  )
  assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


def test_enospc_keeps_its_errno_and_names_the_checkpoint_and_file(tmp_path):
  # /dev/full: every write fails with ENOSPC, as a full disk does.
  with pytest.raises(OSError) as info:
    writer.write_file(
      "api",
      str(tmp_path / "ckpt"),
      "/dev/full",
      lambda f: f.write(b"x" * 2**20),
    )
  err = info.value
  assert err.errno == errno.ENOSPC and err.filename == "/dev/full"
  assert "ckpt" in str(err) and "free space" in str(err)


_EFBIG = textwrap.dedent("""
    import errno, os, resource, sys
    import numpy as np
    from jaxworks import batched_transfer as bt
    base = sys.argv[1]
    bt.save(os.path.join(base, "c"), {"x": np.zeros(10)})  # the old one
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, resource.RLIM_INFINITY))
    for name in ("c", "c.npz"):
      try:
        bt.save(os.path.join(base, name), {"x": np.zeros(2**20)},
                overwrite=True)
      except OSError as err:
        assert err.errno == errno.EFBIG, err
        assert os.path.join(base, name) in str(err), err
        assert "file-size limit" in str(err), err
        print("EFBIG", name, err.filename)
      else:
        raise SystemExit("no OSError")
    out = bt.restore(os.path.join(base, "c"))
    assert out["x"].shape == (10,)  # the old checkpoint is whole
    assert not [n for n in os.listdir(base) if n.startswith(".")]
""")


def test_a_file_size_limit_raises_efbig_naming_the_checkpoint(tmp_path):
  # numpy's tofile raised OSError('1048576 requested and 518112 written').
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  r = subprocess.run(
    [sys.executable, "-c", _EFBIG, str(tmp_path)],
    env=env,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert r.returncode == 0, r.stdout + r.stderr
  assert r.stdout.count("EFBIG") == 2, r.stdout
  assert "jaxworks-new" in r.stdout  # the temporary file that failed


def test_checksums_are_crc32c_against_an_independent_implementation():
  # google-crc32c (Google's C library) as the oracle: lengths around the
  # vector widths, views at odd offsets, continued sums, and every dtype's
  # buffer shape the writer hands over.
  import google_crc32c

  assert checksum.crc(b"123456789") == 0xE3069283  # the catalogue's check
  rng = np.random.default_rng(1)
  data = rng.integers(0, 256, 2 * checksum.CHUNK + 77, np.uint8)
  lengths = [0, 1, 7, 8, 15, 16, 63, 64, 65, 127, 128, 255, 256, 4095, 4097]
  lengths += [int(n) for n in rng.integers(0, data.size - 64, 40)]
  for n in lengths:
    for at in (0, 1, 3, 61):
      part = data[at : at + n]
      want = google_crc32c.value(part.tobytes())
      assert checksum.crc(memoryview(part)) == want, (n, at)
      cut = n // 3
      head = checksum.crc(memoryview(part[:cut]))
      assert checksum.crc(memoryview(part[cut:]), head) == want, (n, at, cut)
  words = rng.random((33, 17)).astype(np.float64)
  assert checksum.crc(memoryview(words)) == google_crc32c.value(words.tobytes())
  assert checksum.of(memoryview(data)) == [
    google_crc32c.value(data[lo : lo + checksum.CHUNK].tobytes())
    for lo in range(0, data.size, checksum.CHUNK)
  ]


_WITHOUT = """
import os, sys
for name in sys.argv[2:]:
  sys.modules[name] = None  # as if not installed
import jax, numpy as np
from jaxworks import batched_transfer as bt
from jaxworks.batched_transfer._src.checkpoint import checksum
print("implementation", checksum.IMPLEMENTATION)
x = np.arange(3 * 2**20, dtype=np.float32)
print("device_put", bool((np.asarray(bt.device_put(x)) == x).all()))
path = os.path.join(sys.argv[1], "ckpt")
try:
  bt.save(path, {"x": x})
except ImportError as err:
  print("save ImportError", err)
  print("left", sorted(os.listdir(sys.argv[1])))
else:
  got = bt.restore(path, {"x": jax.ShapeDtypeStruct(x.shape, x.dtype)})
  print("restored", bool((np.asarray(got["x"]) == x).all()))
  print("sums", checksum.of(memoryview(x)))
"""


@pytest.mark.parametrize("missing", [["fastcrc"], ["fastcrc", "crc32c"]])
def test_checkpoints_without_fastcrc(tmp_path, missing):
  # An install without jaxworks' requirements (pip --no-deps, as upstream
  # JAX's test runs with jaxworks swapped in): crc32c gives the same sums;
  # with neither, importing and device_put work and only a checkpoint
  # raises, naming the fix, and leaves nothing behind.
  import google_crc32c

  env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
  r = subprocess.run(
    [sys.executable, "-c", _WITHOUT, str(tmp_path), *missing],
    env=env, capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert r.returncode == 0, r.stdout + r.stderr
  out = r.stdout
  assert "device_put True" in out, out
  if missing == ["fastcrc"]:
    assert "implementation crc32c" in out, out
    assert "restored True" in out, out
    data = np.arange(3 * 2**20, dtype=np.float32).tobytes()
    want = [
      google_crc32c.value(data[lo : lo + checksum.CHUNK])
      for lo in range(0, len(data), checksum.CHUNK)
    ]
    assert len(want) == 2 and f"sums {want}" in out, out
  else:
    assert "implementation None" in out, out
    assert "save ImportError" in out and "pip install 'fastcrc>=0.5'" in out
    assert "left []" in out, out


@pytest.mark.parametrize("fast", [True, False])
def test_checked_reads_in_steps_check_every_byte_and_stop_at_the_end(
  tmp_path, monkeypatch, fast
):
  # A chunk read as restore reads it (a step at a time, each summed; in C++
  # where the CPU has the vector CRC-32C, else in Python, both forced here):
  # the right bytes pass, one flipped byte anywhere fails, and a file that
  # ends early raises EOFError instead of checking a partly filled buffer.
  monkeypatch.setattr(reader._checked_read, "FAST", fast)
  step = reader.FAST_SUM_STEP if fast else reader.SUM_STEP
  data = np.random.default_rng(2).integers(0, 256, 3 * step + 11, np.uint8)
  path = tmp_path / "data"
  path.write_bytes(b"h" * 7 + data.tobytes())
  sums = checksum.of(memoryview(data))
  fd = os.open(path, os.O_RDONLY)
  try:
    out = np.zeros_like(data)
    reader.read_checked(fd, memoryview(out), 7, 0, data.size, sums)
    np.testing.assert_array_equal(out, data)
    for at in (0, step - 1, step, 2 * step + 5, data.size - 1):
      bad = data.copy()
      bad[at] ^= 0x10
      with pytest.raises(checksum.Mismatch):
        reader.read_checked(
          fd,
          memoryview(out),
          7,
          0,
          data.size,
          [checksum.of(memoryview(bad))[0]],
        )
    with pytest.raises(EOFError, match="ends 9 bytes early"):
      reader.read_checked(
        fd,
        memoryview(np.zeros(data.size + 9, np.uint8)),
        7,
        0,
        data.size + 9,
        sums,
      )
  finally:
    os.close(fd)


def test_checksum_chunks_and_sums_agree():
  data = np.random.default_rng(0).integers(
    0, 256, 3 * checksum.CHUNK + 5, np.uint8
  )
  sums = checksum.Sums()
  for lo in range(0, data.size, 1_000_003):
    sums.update(data[lo : lo + 1_000_003])
  assert sums.done() == checksum.of(data.data)
  assert len(checksum.of(data.data)) == 4
  checksum.check(checksum.of(data.data), data.data)
  bad = data.copy()
  bad[-1] ^= 1
  with pytest.raises(checksum.Mismatch, match="bytes 25165824-25165829"):
    checksum.check(checksum.of(data.data), bad.data)
