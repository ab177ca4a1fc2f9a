"""A save to a bucket writes straight into its objects, against moto's S3
server and gcp-storage-emulator started on 127.0.0.1 by this test: no local
temporary file or directory, the objects byte for byte the files a local
save writes (large leaves streamed in parts, sharded leaves, compressed
ones) under the save's version prefix, each byte sent once, a reader
polling during overwrites always finds a complete checkpoint, and a failed
or non-blocking save's errors where the caller sees them.
"""

import json
import os
import sys
import tempfile
import threading

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import object_servers  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402

# Private imports below: the object writer and the record, patched and read.
from jaxworks.batched_transfer._src.checkpoint import format  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import remote  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import storage  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import stores  # noqa: E402

API = "test"
MIB = 2**20

s3_endpoint = object_servers.s3_endpoint
gcs_endpoint = object_servers.gcs_endpoint


url = object_servers.bucket_url


def tree(seed, big=False):
  rng = np.random.default_rng(seed)
  mesh = jax.make_mesh((8,), ("x",))
  t = {
    "w": rng.standard_normal((64, 32), np.float32),
    "rows": jax.device_put(
      rng.standard_normal((256, 1024), np.float32),
      NamedSharding(mesh, P("x")),
    ),
    "small": jax.numpy.arange(8, dtype=jax.numpy.int32) + seed,
    "seed": seed,
    "run": f"exp-{seed}",
  }
  if big:  # over storage.WHOLE: a multipart (resumable) upload in parts
    t["big"] = rng.standard_normal(storage.WHOLE // 4 + 3 * MIB // 4 + 7)
    t["big"] = t["big"].astype(np.float32)
  return t


def check(out, t):
  assert set(out) == set(t)
  for k, v in t.items():
    if isinstance(v, (str, int)):
      assert out[k] == v
    else:
      np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(v))


def _without_id(record):
  """A record's JSON with its save's id (unique to each save) taken out."""
  data = json.loads(record)
  assert len(data.pop("save_id")) == 16
  return data


def files(root):
  out = {}
  for dirpath, _, names in os.walk(root):
    for n in names:
      full = os.path.join(dirpath, n)
      with open(full, "rb") as f:
        out[os.path.relpath(full, root).replace(os.sep, "/")] = f.read()
  return out


def objects(url):
  """The objects of the checkpoint at ``url`` (its head's version)."""
  st = object_servers.version_of(stores.open_storage(API, url))
  return {k: bytes(st.read(k)) for k in st.list()}


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_objects_are_the_files_on_disk(url, tmp_path, compression):
  t = tree(1, big=compression is None)
  local = str(tmp_path / "disk")
  bt.save(local, t, compression=compression)
  bt.save(url, t, compression=compression)
  on_disk, in_bucket = files(local), objects(url)
  assert sorted(in_bucket) == sorted(on_disk)
  for k, data in on_disk.items():
    if k == format.RECORD:  # each save's own id apart, the same record
      data, got = (_without_id(d) for d in (data, in_bucket[k]))
      assert got == data
      continue
    assert in_bucket[k] == data, k
  check(bt.restore(url), t)


def test_no_local_temporary_files(url, tmp_path, monkeypatch):
  made = []
  for name in (
    "mkdtemp",
    "mkstemp",
    "TemporaryDirectory",
    "NamedTemporaryFile",
  ):
    real = getattr(tempfile, name)

    def spy(*a, real=real, name=name, **k):
      made.append(name)
      return real(*a, **k)

    monkeypatch.setattr(tempfile, name, spy)
  empty = tmp_path / "tmp"
  empty.mkdir()
  monkeypatch.setattr(tempfile, "tempdir", str(empty))
  t = tree(2, big=True)
  bt.save(url, t)
  bt.save(url, tree(3), overwrite=True)
  bt.save(url + "-b", t, blocking=False).wait()
  assert made == [] and os.listdir(empty) == []
  check(bt.restore(url + "-b"), t)


def test_each_byte_is_sent_once(url, monkeypatch):
  t = tree(4, big=True)
  bt.save(url, t)
  sent = []
  real = storage.ObjectWriter.write

  def write(self, b):
    sent.append(len(memoryview(b).cast("B")))
    return real(self, b)

  monkeypatch.setattr(storage.ObjectWriter, "write", write)
  new = tree(5, big=True)
  bt.save(url, new, overwrite=True)  # a new version, no copy
  data = objects(url)
  assert sum(sent) == sum(len(v) for k, v in data.items() if k.endswith(".npy"))
  check(bt.restore(url), new)
  parent = stores.open_storage(API, url.rsplit("/", 1)[0])
  assert not [k for k in parent.list() if ".jaxworks-new-" in k]


def test_a_reader_polling_during_overwrites_always_finds_one(url, monkeypatch):
  st = stores.open_storage(API, url)
  bt.save(url, tree(0))
  cls = type(st)
  real_delete = cls.delete
  dropped = []

  def delete(self, keys):
    keys = list(keys)
    if any(self.location.child(k).url == f"{url}/{remote.HEAD}" for k in keys):
      dropped.append(keys)  # the commit point is never removed
    return real_delete(self, keys)

  monkeypatch.setattr(cls, "delete", delete)
  stop, seen, errors = threading.Event(), [], []

  def read():
    found = remote.source(API, st)
    data = found.read_record(API)
    return format.decode_record(API, found.st.url, data).values["run"]

  def poll():
    while not stop.is_set():
      for attempt in range(3):  # the version it pinned may be gone since
        try:
          seen.append(read())
          break
        except FileNotFoundError as e:
          if attempt == 2:
            errors.append(e)

  reader = threading.Thread(target=poll)
  reader.start()
  try:
    for seed in range(1, 5):
      bt.save(url, tree(seed), overwrite=True)
  finally:
    stop.set()
    reader.join()
  assert not dropped, dropped
  assert not errors, errors
  assert seen and set(seen) <= {f"exp-{s}" for s in range(5)}, seen
  check(bt.restore(url), tree(4))


def test_a_failed_object_commits_nothing_and_the_next_save_cleans(
  url, monkeypatch
):
  real = storage.ObjectWriter.close

  def close(self):
    if self.key == "rows.npy":
      raise OSError(5, "injected: the connection dropped")
    return real(self)

  monkeypatch.setattr(storage.ObjectWriter, "close", close)
  h = bt.save(url, tree(6), blocking=False)
  with pytest.raises(OSError, match="injected"):
    h.wait()
  with pytest.raises(FileNotFoundError, match="did not commit"):
    bt.restore(url)
  monkeypatch.setattr(storage.ObjectWriter, "close", real)
  bt.save(url, tree(7))
  check(bt.restore(url), tree(7))
  assert sorted(objects(url)) == sorted(files_of(tree(7)))
  # The failed save's version was removed: one version, and the head.
  keys = stores.open_storage(API, url).list()
  assert len({k.split("/")[1] for k in keys if k != remote.HEAD}) == 1


def files_of(t):
  return [f"{k}.npy" for k, v in t.items() if not isinstance(v, str)] + [
    format.RECORD
  ]


def test_a_failed_overwrite_keeps_the_old_one(url, monkeypatch):
  bt.save(url, tree(8))
  real = storage.ObjectWriter.close

  def close(self):
    if self.key == "w.npy":
      raise OSError(5, "injected: the connection dropped")
    return real(self)

  monkeypatch.setattr(storage.ObjectWriter, "close", close)
  with pytest.raises(OSError, match="injected"):
    bt.save(url, tree(9), overwrite=True)
  check(bt.restore(url), tree(8))
  parent = stores.open_storage(API, url.rsplit("/", 1)[0])
  assert not [k for k in parent.list() if ".jaxworks-new-" in k]
  keys = stores.open_storage(API, url).list()  # the failed version removed
  assert len({k.split("/")[1] for k in keys if k != remote.HEAD}) == 1


def test_a_non_blocking_save_returns_before_its_objects_are_written(url):
  gate = threading.Event()
  real = storage.ObjectWriter.close

  def close(self):
    assert gate.wait(60)
    return real(self)

  storage.ObjectWriter.close = close
  try:
    t = tree(10)
    h = bt.save(url, t, blocking=False)
    assert not h.done()
    with pytest.raises(FileNotFoundError):
      bt.restore(url)
    gate.set()
    h.wait()
  finally:
    storage.ObjectWriter.close = real
  check(bt.restore(url), t)
