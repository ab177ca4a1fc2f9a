"""restore of a checkpoint several processes wrote (it has a manifest): onto
every kind of target (layouts included, against stock jax.device_put), and
its files: opened relative to the checkpoint directory, regular files only,
headers and manifest validated before anything is placed, read through the
descriptors validated (whole old or whole new data while a save replaces it).

One checkpoint is written by two real processes (jax.distributed on
127.0.0.1, 4 CPU devices each), which also read it back onto shardings and
layouts over both (each opening only the shard files its devices need); the
file tests write the same layout with numpy (``write_manifest_checkpoint``),
which is quicker."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading

import jax
from jax.experimental.layout import Format
from jax.experimental.layout import Layout
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding
import ml_dtypes
from multiprocess_util import free_port
import numpy as np
from overwrite_race import restore_while_replacing
import pytest

from jaxworks import batched_transfer as bt

# Private imports below: the manifest format and reader, damaged or patched.
from jaxworks.batched_transfer._src.checkpoint import commit
from jaxworks.batched_transfer._src.checkpoint import format
from jaxworks.batched_transfer._src.checkpoint import reader
from jaxworks.batched_transfer._src.checkpoint import restore_shards

API = "jaxworks.batched_transfer.restore"


def values():
  rng = np.random.default_rng(0)
  return {
    "w": rng.standard_normal((16, 8)).astype(np.float32),
    "h": rng.standard_normal((8, 6)).astype(ml_dtypes.bfloat16),
    "r": np.arange(12, dtype=np.int32).reshape(4, 3),
    "s": np.float32(3.5).reshape(()),
  }


WORKER = textwrap.dedent("""
    import sys
    pid, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    import jax
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=2, process_id=pid,
                               initialization_timeout=60)
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxworks import batched_transfer as bt
    sys.path.insert(0, sys.argv[4])
    from manifest_restore_test import values
    mesh = jax.make_mesh((8,), ("x",))
    mesh2 = jax.make_mesh((4, 2), ("a", "b"))
    where = {"w": NamedSharding(mesh, P("x")),
             "h": NamedSharding(mesh2, P("a", "b")),  # tiles of 2 x 3
             "r": NamedSharding(mesh2, P("a")),       # each row on 2 devices
             "s": NamedSharding(mesh, P())}
    bt.save(path, {k: jax.device_put(v, where[k]) for k, v in values().items()})

    # Read back by both processes onto other shardings (w in rows: this
    # process's devices hold rows 8 * pid.. 8 * pid + 7); each opens only the
    # shard files its devices need.
    import os
    import numpy as np
    from jax.experimental.layout import Format, Layout
    v = values()
    other = {"w": NamedSharding(mesh, P("x")),
             "h": NamedSharding(mesh, P()),
             "r": NamedSharding(mesh2, P("b")),
             "s": None}
    like = {k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=other[k])
            for k, x in v.items()}
    opened, real_open = [], os.open
    def spy(file, *a, **k):
      opened.append(str(file))
      return real_open(file, *a, **k)
    os.open = spy
    try:
      out = bt.restore(path, like)
    finally:
      os.open = real_open
    for k, x in out.items():
      for s in x.addressable_shards:
        assert np.asarray(s.data).tobytes() == v[k][s.index].tobytes(), k
    w = sorted(f for f in opened if f.startswith("w.shards/"))
    assert w == [f"w.shards/{n}.npy" for n in range(4 * pid, 4 * pid + 4)], w

    # A column-major layout over both processes, as stock places it.
    fmt = Format(Layout((0, 1)), NamedSharding(mesh2, P("a")))
    out = bt.restore(path, like, placement={"w": fmt, "h": fmt, "r": None,
                                            "s": None})
    for k in ("w", "h"):
      stock = jax.device_put(v[k], fmt)
      assert out[k].format == stock.format, (out[k].format, stock.format)
      assert out[k].format.layout.major_to_minor == (0, 1)
      for s, t in zip(out[k].addressable_shards, stock.addressable_shards):
        assert s.index == t.index and s.device == t.device
        assert np.asarray(s.data).tobytes() == np.asarray(t.data).tobytes()
    print("WORKER-OK", pid, flush=True)
""")


@pytest.fixture(scope="module")
def two_process_checkpoint(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("mp") / "ckpt")
  env = dict(os.environ)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  env["JAX_PLATFORMS"] = "cpu"
  port = str(free_port())
  here = os.path.dirname(os.path.abspath(__file__))
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", WORKER, str(pid), port, path, here],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for pid in (0, 1)
  ]
  for p in procs:
    out, _ = p.communicate(timeout=240)
    assert p.returncode == 0 and "WORKER-OK" in out, out[-3000:]
  assert os.path.exists(os.path.join(path, format.MANIFEST))
  return path


def like(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _same(y, want):
  """``y`` equals stock's ``want``: values, dtype, sharding, layout, committed."""
  assert y.dtype == want.dtype and y.shape == want.shape
  assert y.sharding == want.sharding
  assert y.format.layout == want.format.layout
  assert y.committed == want.committed
  for s, t in zip(y.addressable_shards, want.addressable_shards):
    assert s.device == t.device and s.index == t.index
    assert np.asarray(s.data).tobytes() == np.asarray(t.data).tobytes()


def _targets():
  d = jax.devices()
  mesh = jax.make_mesh((8,), ("x",))
  mesh2 = jax.make_mesh((2, 4), ("a", "b"))
  col = Layout((0, 1))  # column-major: the first dimension varies fastest
  return {
    "rows": NamedSharding(mesh, P("x")),
    "tiles": NamedSharding(mesh2, P("a", "b")),
    "columns": NamedSharding(mesh2, P(None, "a")),
    "replicated": NamedSharding(mesh, P()),
    "device": d[3],
    "single": SingleDeviceSharding(d[5]),
    "none": None,
    "format-rows": Format(col, NamedSharding(mesh2, P("a"))),
    "format-device": Format(col, SingleDeviceSharding(d[2])),
    "format-default": Format(None, NamedSharding(mesh, P("x"))),
  }


@pytest.mark.parametrize("name", list(_targets()))
def test_a_two_process_checkpoint_restores_as_stock_places(
  two_process_checkpoint, name
):
  target = _targets()[name]
  v = values()
  where, stock = {}, {}
  for k, x in v.items():  # the target where stock can place the leaf
    t = target
    if isinstance(t, Format) and t.layout is not None and x.ndim != 2:
      t = Format(None, t.sharding)  # a 2-D layout: 2-D leaves
    try:
      stock[k] = jax.device_put(x, t)
    except Exception:  # a sharding the leaf cannot take (stock says why)
      t = None
      stock[k] = jax.device_put(x, t)
    where[k] = t
  assert any(t is target for t in where.values())
  out = bt.restore(two_process_checkpoint, like(v), placement=where)
  for k in v:
    _same(out[k], stock[k])


def test_a_column_major_layout_is_the_one_asked_for(two_process_checkpoint):
  v = values()
  s = NamedSharding(jax.make_mesh((4,), ("x",)), P("x"))
  fmt = Format(Layout((0, 1)), s)
  out = bt.restore(
    two_process_checkpoint, like(v), placement={"w": fmt, "h": fmt,
                                                "r": None, "s": None}
  )  # fmt: skip
  stock = jax.device_put(v["w"], fmt)
  assert out["w"].format == stock.format
  assert out["w"].format.layout.major_to_minor == (0, 1)
  _same(out["w"], stock)
  _same(out["h"], jax.device_put(v["h"], fmt))


# ---------------------------------------------------------- layout from numpy


def write_manifest_checkpoint(path, tree, rows=4, cols=1):
  """The layout several processes write, from numpy: each array of 2 or
  more dimensions in ``rows`` x ``cols`` tiles, others in one shard."""
  os.makedirs(path)
  arrays = {}
  for key, a in tree.items():
    r, c = (rows, cols) if a.ndim >= 2 else (1, 1)
    shards = []
    for i in range(r):
      for j in range(c):
        lo, hi = [], []
        if a.ndim >= 2:
          lo = [i * a.shape[0] // r, j * a.shape[1] // c]
          hi = [(i + 1) * a.shape[0] // r, (j + 1) * a.shape[1] // c]
        idx = tuple(slice(b, e) for b, e in zip(lo, hi))
        start = lo + [0] * (a.ndim - len(lo))
        part = a[idx]
        n = len(shards)
        os.makedirs(os.path.join(path, f"{key}.shards"), exist_ok=True)
        np.save(os.path.join(path, f"{key}.shards/{n}.npy"), part)
        shards.append(
          {"file": f"{key}.shards/{n}.npy", "start": start,
           "shape": list(part.shape)}
        )  # fmt: skip
    arrays[key] = {
      "shape": list(a.shape),
      "dtype": a.dtype.name,
      "shards": shards,
    }
  with open(os.path.join(path, format.MANIFEST), "w") as f:
    json.dump({"format": format.MANIFEST_FORMAT, "processes": 2,
               "arrays": arrays}, f)  # fmt: skip
  # The record last: it commits the checkpoint (a directory without one is
  # a save that did not commit).
  record = format.Record(dtypes={k: a.dtype.name for k, a in tree.items()})
  with open(os.path.join(path, format.RECORD), "wb") as f:
    f.write(format.encode_record(record))


def test_numpy_written_layout_restores(tmp_path):
  v = {"w": np.arange(96, dtype=np.float32).reshape(12, 8),
       "f": np.asfortranarray(np.arange(30, dtype=np.int16).reshape(5, 6)),
       "b": np.arange(5, dtype=np.uint8)}  # fmt: skip
  write_manifest_checkpoint(tmp_path / "c", v, rows=3, cols=2)
  mesh = jax.make_mesh((4, 2), ("a", "b"))
  for spec in (P("a", "b"), P("b", "a"), P(None, "b"), P()):
    where = {"w": NamedSharding(mesh, spec), "f": None, "b": None}
    out = bt.restore(tmp_path / "c", like(v), placement=where)
    for k in v:
      _same(out[k], jax.device_put(v[k], where[k]))


# ------------------------------------------------------------- files


def version(v, leaves=6, n=4096):
  return {
    f"l{i}": np.full((n, 4), v * 100 + i, np.float32) for i in range(leaves)
  }


def version_of(out):
  seen = set()
  for key, y in out.items():
    a = np.asarray(y)
    v, i = divmod(int(a[0, 0]), 100)
    if f"l{i}" != key or not np.all(a == a[0, 0]):
      return None
    seen.add(v)
  return seen.pop() if len(seen) == 1 else None


@pytest.mark.parametrize("held", [True, False], ids=["held", "reopened"])
def test_a_manifest_checkpoint_replaced_while_restoring_is_read_whole(
  tmp_path, monkeypatch, held
):
  if not held:  # every shard file opened again when read, and checked
    monkeypatch.setattr(reader, "HELD_FILES", 0)
  path = str(tmp_path / "c")
  write_manifest_checkpoint(path, version(1))
  target = like(version(1))
  placement = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))

  def save_version(v):  # two manifest checkpoints, then a single-process save
    if v % 3 == 0:
      bt.save(path, version(v), overwrite=True)
    else:
      tmp = str(tmp_path / f"new{v}")
      write_manifest_checkpoint(tmp, version(v), rows=8 if v % 4 else 2)
      commit.publish("test", tmp, path)

  results, errors, _ = restore_while_replacing(
    save_version,
    lambda: bt.restore(
      path, target, placement=placement, max_inflight_bytes=2**17
    ),
    version_of,
    attempts=200,
  )
  assert None not in results, f"{results.count(None)} restores mixed versions"
  read = [r for r in results if r % 3]  # manifest checkpoints read
  assert len(read) >= 5 and len(set(results)) > 2, results
  for err in errors:
    assert str(err).startswith(API), err


def _restore_in_thread(path, target, **kw):
  raised = []

  def run():
    try:
      bt.restore(path, target, **kw)
    except (ValueError, FileNotFoundError) as err:  # missing: FileNotFound
      raised.append(err)

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  thread.join(timeout=60)
  assert not thread.is_alive(), "restore blocked"
  assert len(raised) == 1, raised
  err = raised[0]
  return err.strerror if isinstance(err, OSError) and err.strerror else str(err)


@pytest.mark.parametrize("kind", ["fifo", "directory", "dev-zero", "truncated",
                                  "longer", "header", "missing"])  # fmt: skip
def test_a_bad_shard_file_is_refused_before_anything_is_placed(tmp_path, kind):
  v = version(1, leaves=2, n=64)
  write_manifest_checkpoint(tmp_path / "c", v)
  bad = tmp_path / "c" / "l1.shards" / "2.npy"
  data = bad.read_bytes()
  bad.unlink()
  if kind == "fifo":
    os.mkfifo(bad)  # opening a FIFO to read waits for a writer
  elif kind == "directory":
    bad.mkdir()
  elif kind == "dev-zero":
    bad.symlink_to("/dev/zero")
  elif kind == "truncated":
    bad.write_bytes(data[:-5])
  elif kind == "longer":
    bad.write_bytes(data + b"\0" * 16)
  elif kind == "header":
    bad.write_bytes(b"\x93NUMPY garbage")
  before = len(jax.live_arrays())
  text = _restore_in_thread(tmp_path / "c", like(v), placement=jax.devices()[1])
  assert text.startswith(API) and str(bad) in text, text
  assert len(jax.live_arrays()) == before  # nothing stays placed


def _damage(path, how):
  file = path / format.MANIFEST
  m = json.loads(file.read_text())
  if how == "json":
    file.write_text(file.read_text()[:-7])
  elif how == "outside":
    m["arrays"]["l0"]["shards"][0]["start"] = [4000, 0]
  elif how == "escape":
    m["arrays"]["l0"]["shards"][0]["file"] = "../../etc/passwd.npy"
  elif how == "gap":
    m["arrays"]["l0"]["shards"][1]["start"] = [0, 0]  # overlaps, leaves a gap
  elif how == "dtype":
    m["arrays"]["l0"]["dtype"] = "float64"
  elif how == "bool-shape":
    m["arrays"]["l0"]["shape"] = [True, 4]
  elif how == "format":
    m["format"] = 99
  elif how == "huge":  # sparse: a restore reading it all would take minutes
    with open(file, "r+b") as f:
      f.truncate(format.MAX_MANIFEST_BYTES + 10)
  elif how == "fifo":
    file.unlink()
    os.mkfifo(file)
  if how in ("outside", "escape", "gap", "dtype", "bool-shape", "format"):
    file.write_text(json.dumps(m))
  return file


@pytest.mark.parametrize("how", ["json", "outside", "escape", "gap", "dtype",
                                 "bool-shape", "format", "huge", "fifo"])  # fmt: skip
def test_a_damaged_manifest_is_refused(tmp_path, how):
  v = version(1, leaves=2, n=64)
  write_manifest_checkpoint(tmp_path / "c", v)
  file = _damage(tmp_path / "c", how)
  text = _restore_in_thread(tmp_path / "c", like(v))
  assert text.startswith(API), text
  if how == "dtype":  # the record (written with it) disagrees
    assert "but the manifest says float64" in text, text
  elif how == "gap":
    assert "do not tile" in text
  else:
    assert str(file) in text, text


def test_no_descriptor_stays_open(tmp_path):
  v = version(1, leaves=3, n=64)
  write_manifest_checkpoint(tmp_path / "c", v)
  before = set(os.listdir("/proc/self/fd"))
  bt.restore(tmp_path / "c", like(v))
  _damage(tmp_path / "c", "gap")
  with pytest.raises(ValueError):
    bt.restore(tmp_path / "c", like(v))
  assert set(os.listdir("/proc/self/fd")) == before


def test_only_the_files_of_this_process_devices_are_opened(
  tmp_path, monkeypatch
):
  v = version(1, leaves=1, n=64)
  write_manifest_checkpoint(tmp_path / "c", v, rows=8)
  opened = []
  real = reader.open_file

  def spy(name, dir_fd=None):
    opened.append(name)
    return real(name, dir_fd)

  monkeypatch.setattr(reader, "open_file", spy)
  out = bt.restore(tmp_path / "c", like(v), placement=jax.devices()[0])
  np.testing.assert_array_equal(np.asarray(out["l0"]), v["l0"])
  assert sorted(n for n in opened if n.endswith(".npy")) == sorted(
    f"l0.shards/{i}.npy" for i in range(8)
  )
  assert format.MANIFEST == "jaxworks_manifest.json"


@pytest.mark.parametrize("how", ["modified", "replaced"])
def test_a_shard_file_changed_after_validation_is_refused(
  tmp_path, monkeypatch, how
):
  if how == "replaced":  # opened again when read, and checked to be the same
    monkeypatch.setattr(reader, "HELD_FILES", 0)
  v = version(1, leaves=2, n=64)
  write_manifest_checkpoint(tmp_path / "c", v)
  bad = tmp_path / "c" / "l0.shards" / "1.npy"
  real = restore_shards._read

  def change_then_read(*args):  # after validation, before the batch is read
    data = bad.read_bytes()
    if how == "modified":  # in place: same inode, new size
      with open(bad, "ab") as f:
        f.write(b"\0" * 8)
    else:  # a new file, same size, at the name
      bad.unlink()
      bad.write_bytes(data)
    return real(*args)

  monkeypatch.setattr(restore_shards, "_read", change_then_read)
  with pytest.raises(ValueError) as err:
    bt.restore(tmp_path / "c", like(v))
  text = str(err.value)
  assert text.startswith(API) and str(bad) in text, text
  assert ("modified" if how == "modified" else "replaced") in text


@pytest.mark.parametrize("target", ["rows", "columns", "replicated", "none"])
def test_a_flipped_byte_in_a_shard_file_fails_its_checksum(
  two_process_checkpoint, tmp_path, target
):
  # Each shard file's CRC-32C chunks are in the manifest; a region that
  # covers a chunk whole is checked by the thread that read it, the rest
  # by reading the chunk again (rows: whole files; columns: parts of them).
  path = tmp_path / "ckpt"
  shutil.copytree(two_process_checkpoint, path)
  m = json.loads((path / format.MANIFEST).read_text())
  shard = m["arrays"]["w"]["shards"][3]
  assert isinstance(shard["crc32c"], list) and len(shard["crc32c"]) == 1
  with open(path / shard["file"], "r+b") as f:
    f.seek(-5, os.SEEK_END)
    b = f.read(1)
    f.seek(-5, os.SEEK_END)
    f.write(bytes([b[0] ^ 1]))
  where = {"rows": NamedSharding(jax.make_mesh((8,), ("x",)), P("x")),
           "columns": NamedSharding(jax.make_mesh((8,), ("x",)), P(None, "x")),
           "replicated": NamedSharding(jax.make_mesh((8,), ("x",)), P()),
           "none": None}[target]  # fmt: skip
  v = values()
  with pytest.raises(ValueError, match=r"w.shards/3.npy.*fails the checksum"):
    bt.restore(path, like(v), placement={"w": where, "h": None, "r": None,
                                          "s": None})  # fmt: skip
  out = bt.restore(path, like(v), verify=False)
  assert np.asarray(out["w"]).tobytes() != v["w"].tobytes()
  np.testing.assert_array_equal(np.asarray(out["r"]), v["r"])
