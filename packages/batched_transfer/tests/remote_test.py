"""Checkpoints in buckets, against moto's S3 server and gcp-storage-emulator
started on 127.0.0.1 by this test: the same files as on disk under the
save's version prefix (copied with boto3 either way, they restore), the head
as the one commit point, a prefix without it absent, an overwrite that keeps
a complete checkpoint readable at every step, 0.6.x's layouts, and
leftovers of killed saves.
"""

import os
import sys
import threading
import uuid

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import object_servers  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402

# Private imports below: the bucket opened directly to list and plant objects.
from jaxworks.batched_transfer._src.checkpoint import stores  # noqa: E402

API = "test"
RECORD = "jaxworks_dtypes.json"
HEAD = object_servers.HEAD
version_of = object_servers.version_of


s3_endpoint = object_servers.s3_endpoint
gcs_endpoint = object_servers.gcs_endpoint


url = object_servers.bucket_url


def tree(seed):
  rng = np.random.default_rng(seed)
  return {
    "params": {
      "w": rng.standard_normal((64, 32), np.float32),
      "b": jax.numpy.arange(8, dtype=jax.numpy.int32) + seed,
    },
    "big": rng.standard_normal(3 * 2**20 // 4 + 5).astype(np.float32),
    "run": f"exp-{seed}",
    "step": seed,
  }


def save(url, t, overwrite=False):
  bt.save(url, t, overwrite=overwrite)


def restore(url, target=None):
  return bt.restore(url, target)


def metadata(url):
  return bt.metadata(url)


def local_files(root):
  """``{key: path}`` of every file under ``root``."""
  out = {}
  for dirpath, _, names in os.walk(root):
    for n in names:
      full = os.path.join(dirpath, n)
      out[os.path.relpath(full, root).replace(os.sep, "/")] = full
  return out


def check(out, t):
  assert out["run"] == t["run"] and out["step"] == t["step"]
  for k in ("w", "b"):
    np.testing.assert_array_equal(out["params"][k], t["params"][k])
  np.testing.assert_array_equal(out["big"], t["big"])


def test_save_restore_metadata(url):
  t = tree(1)
  save(url, t)
  st = stores.open_storage(API, url)
  assert set(version_of(st).list()) == {
    "big.npy",
    RECORD,
    "params/b.npy",
    "params/w.npy",
    "step.npy",
  }
  assert {k for k in st.list() if not k.startswith(".jaxworks-v/")} == {HEAD}
  check(restore(url), t)
  like = jax.tree.map(
    lambda x: (
      x if isinstance(x, (str, int)) else jax.ShapeDtypeStruct(x.shape, x.dtype)
    ),
    t,
  )
  check(restore(url, like), t)
  m = metadata(url)
  assert m["big"].shape == t["big"].shape and m["run"] == "exp-1"
  assert m["params"]["w"].dtype == np.float32


def test_second_save_without_overwrite_raises(url):
  save(url, tree(1))
  with pytest.raises(FileExistsError, match="pass overwrite=True"):
    save(url, tree(2))
  check(restore(url), tree(1))


def test_prefix_without_record_is_absent(url):
  st = stores.open_storage(API, url)
  killed = ".jaxworks-v/0123456789abcdef/w.npy"  # a killed save's
  st.write(killed, b"half a save")
  with pytest.raises(FileNotFoundError, match="did not commit"):
    restore(url)
  save(url, tree(3))  # the next save commits, then cleans up
  check(restore(url), tree(3))
  assert killed not in st.list()


def test_a_prefix_holding_objects_is_refused_without_overwrite(url):
  """As on disk, a save writes only to an empty prefix (0.6.x's leftovers,
  any other object); with overwrite=True it saves and removes the
  leftovers that a save writes, and leaves the rest."""
  st = stores.open_storage(API, url)
  st.write("w.npy", b"half a 0.6.x save")
  st.write("notes.txt", b"mine")
  with pytest.raises(FileExistsError, match="holds objects .*'notes.txt'"):
    save(url, tree(3))
  with pytest.raises(FileNotFoundError, match="did not commit"):
    restore(url)
  save(url, tree(3), overwrite=True)
  check(restore(url), tree(3))
  assert "w.npy" not in st.list() and "notes.txt" in st.list()


def test_a_prefix_of_checkpoints_is_never_replaced(url):
  """``a`` holding the committed ``a/inner`` (or a manager's directory of
  steps) is refused by a save, with or without overwrite, naming it."""
  outer = url + "/a"
  save(outer + "/inner", tree(1))
  for overwrite in (False, True):
    with pytest.raises(FileExistsError, match="a/inner"):
      save(outer, tree(2), overwrite=overwrite)
  check(restore(outer + "/inner"), tree(1))
  directory = url + "/mgr"
  with bt.CheckpointManager(directory) as mgr:
    mgr.save(1, tree(1))
  with pytest.raises(FileExistsError, match="mgr/1"):
    save(directory, tree(2), overwrite=True)
  with bt.CheckpointManager(directory) as mgr:
    assert mgr.all_steps() == [1]
    check(mgr.restore(1), tree(1))


def test_overwrite_keeps_one_complete_checkpoint(url, monkeypatch):
  save(url, tree(1))
  seen = []
  real_delete = stores.storage.Storage.delete_prefix

  st = stores.open_storage(API, url)
  cls = type(st)
  real_create = cls.create

  real_replace = cls.replace

  def replace(self, key, data, tag):
    # Around the commit (the head replaced): what a reader sees is whole,
    # old before, new after.
    seen.append(restore(url)["step"])
    real_replace(self, key, data, tag)
    seen.append(restore(url)["step"])

  def create(self, key, data):
    assert key != HEAD, "the head is replaced, never created again"
    return real_create(self, key, data)

  monkeypatch.setattr(cls, "create", create)
  monkeypatch.setattr(cls, "replace", replace)
  save(url, tree(2), overwrite=True)
  monkeypatch.setattr(cls, "create", real_create)
  monkeypatch.setattr(cls, "replace", real_replace)
  assert seen == [1, 2], seen  # old until the head names the new one
  check(restore(url), tree(2))
  # One version left: the old one was removed after the commit.
  versions = {k.split("/")[1] for k in st.list() if k.startswith(".jaxworks-v")}
  assert versions == {version_of(st).location.name}
  parent = stores.open_storage(API, url.rsplit("/", 1)[0])
  assert not [k for k in parent.list() if ".jaxworks-" in k.split("/")[0]]
  del real_delete


def test_killed_overwrite_leaves_the_new_one_readable(url):
  """0.6.0, killed after the old record was removed: the staging copy is
  read; an overwrite replaces that layout with a head."""
  save(url, tree(1))
  st = stores.open_storage(API, url)
  object_servers.to_legacy(st)
  parent = stores.open_storage(API, url.rsplit("/", 1)[0])
  name = url.rsplit("/", 1)[1]
  new = parent.child(f".{name}.jaxworks-new-0123456789abcdef")
  for key in st.list():
    new.write(key, st.read(key))
  st.delete([RECORD])
  check(restore(url), tree(1))  # from the committed copy beside the path
  with pytest.raises(FileExistsError):
    save(url, tree(2))  # still a checkpoint there
  save(url, tree(2), overwrite=True)
  check(restore(url), tree(2))
  assert not [k for k in parent.list() if ".jaxworks-new-" in k]
  assert RECORD not in st.list() and HEAD in st.list()


def test_npz_object(url):
  url = url + ".npz"
  save(url, tree(4))
  check(restore(url), tree(4))
  with pytest.raises(FileExistsError):
    save(url, tree(5))
  save(url, tree(5), overwrite=True)
  check(restore(url), tree(5))


def test_truncated_object_after_commit_is_an_error(url):
  save(url, tree(6))
  st = version_of(stores.open_storage(API, url))
  data = bytes(st.read("big.npy"))
  st.write("big.npy", data[:-4096])
  with pytest.raises(ValueError, match="big"):
    restore(url)


def test_same_files_as_on_disk_both_ways(tmp_path, s3_endpoint, monkeypatch):
  """Copied with boto3 from disk to the bucket and back, both restore."""
  import boto3

  for k, v in object_servers.S3_ENV.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
  client = boto3.client("s3", endpoint_url=s3_endpoint)
  t = tree(7)
  local = str(tmp_path / "disk")
  bt.save(local, t)
  prefix = f"copied-{uuid.uuid4().hex}"
  for key, path in local_files(local).items():
    client.upload_file(path, "ckpt", f"{prefix}/{key}")
  check(restore(f"s3://ckpt/{prefix}"), t)

  url = f"s3://ckpt/saved-{uuid.uuid4().hex}"
  save(url, t)
  back = tmp_path / "back"
  prefix = version_of(stores.open_storage(API, url)).location.prefix
  listing = client.list_objects_v2(Bucket="ckpt", Prefix=prefix + "/")
  for obj in listing["Contents"]:
    dst = back / obj["Key"][len(prefix) + 1 :]
    dst.parent.mkdir(parents=True, exist_ok=True)
    client.download_file("ckpt", obj["Key"], str(dst))
  check(bt.restore(str(back)), t)
  assert sorted(os.listdir(back)) == sorted(os.listdir(local))


# The public API ---------------------------------------------------------------


def test_public_save_restore_metadata(url):
  t = tree(8)
  assert bt.save(url, t) is None
  check(bt.restore(url), t)
  assert bt.metadata(url)["params"]["w"].shape == (64, 32)
  with pytest.raises(FileExistsError, match="pass overwrite=True"):
    bt.save(url, t)
  handle = bt.save(url, tree(9), overwrite=True, blocking=False)
  handle.wait()
  check(bt.restore(url), tree(9))
  with pytest.raises(FileNotFoundError, match="did not commit"):
    bt.restore(url + "-none")


def test_public_storage_options(s3_endpoint, monkeypatch):
  for k in list(os.environ):
    if k.startswith("AWS_"):
      monkeypatch.delenv(k)
  opts = {
    "endpoint": s3_endpoint,
    "access_key_id": "a",
    "secret_access_key": "b",
    "region": "us-east-1",
  }
  url = f"s3://ckpt/opts-{uuid.uuid4().hex}"
  bt.save(url, tree(10), storage_options=opts)
  check(bt.restore(url, storage_options=opts), tree(10))
  assert bt.metadata(url, storage_options=opts)["run"] == "exp-10"
  with pytest.raises(ValueError, match="storage_options are for"):
    bt.restore("/tmp/x", storage_options=opts)


def test_public_missing_bucket_is_raised_by_the_call(s3_endpoint, monkeypatch):
  for k, v in object_servers.S3_ENV.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
  with pytest.raises(FileNotFoundError, match="bucket 'no-such-bucket'"):
    bt.save("s3://no-such-bucket/x", tree(11), blocking=False)
  with pytest.raises(FileNotFoundError, match="no-such-bucket"):
    bt.restore("s3://no-such-bucket/x")


# CheckpointManager ---------------------------------------------------------------


def test_manager_in_a_bucket(url):
  directory = url.rsplit("/", 1)[0] + "/steps"
  mgr = bt.CheckpointManager(
    directory, max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min"
  )
  for step, loss in [(1, 0.9), (2, 0.4), (3, 0.7), (4, 0.6)]:
    mgr.save(step, tree(step), metrics={"loss": loss})
  mgr.wait_until_finished()
  assert mgr.all_steps() == [2, 4] and mgr.best_step() == 2
  assert mgr.latest_step() == 4 and mgr.metrics(2) == {"loss": 0.4}
  check(mgr.restore(2), tree(2))
  meta = mgr.metadata(4)
  assert meta.item_metadata["params"]["w"].shape == (64, 32)
  assert meta.commit_timestamp_nsecs > 0
  with pytest.raises(FileExistsError, match="step 4 exists"):
    mgr.save(4, tree(4), force=True)
  mgr.delete(2)
  assert mgr.all_steps() == [4]
  st = stores.open_storage(API, directory)
  assert not [k for k in st.list() if k.startswith("2/")]
  # A step without its head (a killed save) is not listed.
  st.write("7/.jaxworks-v/0123456789abcdef/params/w.npy", b"half")
  other = bt.CheckpointManager(directory)
  assert other.all_steps() == [4]
  other.reload()
  check(other.restore(), tree(4))
  mgr.save(7, tree(7), blocking=True)
  assert other.all_steps() == [4, 7] and other.latest_step() == 7
  check(other.restore(7), tree(7))
  assert "7/.jaxworks-v/0123456789abcdef/params/w.npy" not in st.list()
  mgr.close()


# Faults ----------------------------------------------------------------------


def test_altered_object_after_commit_fails_its_checksum(url):
  save(url, tree(12))
  st = version_of(stores.open_storage(API, url))
  data = bytearray(st.read("params/w.npy"))
  data[-1] ^= 0xFF
  st.write("params/w.npy", bytes(data))
  with pytest.raises(ValueError, match="w.npy") as e:
    bt.restore(url)
  assert any(url in n for n in e.value.__notes__), e.value.__notes__


def test_refused_credentials_name_the_fix(monkeypatch):
  with object_servers.failing_server(403) as (endpoint, _):
    for k, v in object_servers.S3_ENV.items():
      monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    with pytest.raises(PermissionError) as e:
      bt.save("s3://b/denied", tree(13))
    msg = str(e.value)
    assert "s3://b" in msg and "refused" in msg and "AWS_ACCESS_KEY_ID" in msg


def test_server_stopped_mid_save_then_restarted(monkeypatch):
  """moto's state outlives its server in this process: a server stopped
  while a save uploads, then a new one, is a restart of the service."""
  for k, v in object_servers.S3_ENV.items():
    monkeypatch.setenv(k, v)
  big = {f"x{i}": np.full(2**20, i, np.float32) for i in range(24)}
  url = f"s3://restart/run-{uuid.uuid4().hex}"
  opts = {"max_retries": 1, "retry_timeout_s": 5}
  with object_servers.s3_server() as endpoint:
    object_servers.s3_bucket(endpoint, "restart")
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    handle = bt.save(url, big, blocking=False, storage_options=opts)
  # The server stopped while the handle uploads (or before it began).
  with pytest.raises(OSError, match="s3://restart/run-"):
    handle.wait()
  with object_servers.s3_server() as endpoint:
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    with pytest.raises(FileNotFoundError, match="did not commit"):
      bt.restore(url)
    bt.save(url, big)  # cleans what the stopped save left, and commits
    out = bt.restore(url)
    assert sorted(out) == sorted(big)
    np.testing.assert_array_equal(out["x23"], big["x23"])


def test_non_blocking_saves_to_one_url_commit_in_call_order(url, monkeypatch):
  from jaxworks.batched_transfer._src.checkpoint import remote

  gate = threading.Event()
  real = remote.Bucket.commit

  def commit(self, *a):
    assert gate.wait(60)  # the first save commits after the second call
    return real(self, *a)

  monkeypatch.setattr(remote.Bucket, "commit", commit)
  handles = [bt.save(url, tree(20), blocking=False)]
  with pytest.raises(FileExistsError, match="still being written"):
    bt.save(url, tree(21), blocking=False)
  gate.set()
  handles += [
    bt.save(url, tree(s), overwrite=True, blocking=False) for s in range(22, 27)
  ]
  for h in handles:
    h.wait()
  check(bt.restore(url), tree(26))
