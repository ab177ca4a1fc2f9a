"""Checkpoints in Azure Blob Storage (az://container/prefix), against
Azurite started on 127.0.0.1 by this test and configured as users do,
through AZURE_STORAGE_CONNECTION_STRING: save, restore and metadata; the
commit's conditional create and replace (If-None-Match, If-Match), a
second save without overwrite refused; an overwrite; CheckpointManager (metrics, retention, best step, delete,
reload, items) and its writer lease against a second process."""

import os
import subprocess
import sys
import textwrap
import uuid

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import object_servers  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402

# Private imports below: the bucket opened directly to list and plant objects.
from jaxworks.batched_transfer._src.checkpoint import stores  # noqa: E402

azure_connection = object_servers.azure_connection


@pytest.fixture
def url(azure_connection, monkeypatch):
  monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azure_connection)
  return f"az://ckpt/run-{uuid.uuid4().hex}"


def tree(seed):
  rng = np.random.default_rng(seed)
  return {
    "params": {
      "w": rng.standard_normal((64, 33)).astype(np.float32),
      "b": np.arange(7, dtype=np.int32) + seed,
    },
    "note": f"seed {seed}",
    "step": seed,
  }


def assert_tree(out, seed):
  want = tree(seed)
  np.testing.assert_array_equal(
    np.asarray(out["params"]["w"]), want["params"]["w"]
  )
  np.testing.assert_array_equal(
    np.asarray(out["params"]["b"]), want["params"]["b"]
  )
  assert out["note"] == want["note"] and out["step"] == seed


def test_save_restore_metadata_and_overwrite(url):
  path = f"{url}/1"
  bt.save(path, tree(1))
  assert_tree(bt.restore(path), 1)
  meta = bt.metadata(path)
  assert meta["params"]["w"] == jax.ShapeDtypeStruct((64, 33), np.float32)
  assert meta["note"] == "seed 1"
  like = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
    tree(0)["params"],
  )
  out = bt.restore(path, {"params": like}, partial_restore=True)
  np.testing.assert_array_equal(
    np.asarray(out["params"]["w"]), tree(1)["params"]["w"]
  )
  with pytest.raises(FileExistsError, match="overwrite=True"):
    bt.save(path, tree(2))
  assert_tree(bt.restore(path), 1)  # untouched
  bt.save(path, tree(2), overwrite=True)
  assert_tree(bt.restore(path), 2)
  handle = bt.save(path, tree(3), overwrite=True, blocking=False)
  handle.wait()
  assert_tree(bt.restore(path), 3)
  with pytest.raises(FileNotFoundError):
    bt.restore(f"{url}/never-saved")


def test_the_commit_is_a_conditional_create(url):
  """Of two creates of one key the second raises (If-None-Match on the
  emulator as on the service): no two writers both commit."""
  st = stores.open_storage("test", url)
  st.create("marker", b"first")
  with pytest.raises(FileExistsError, match="exists already"):
    st.create("marker", b"second")
  assert bytes(st.read("marker")) == b"first"
  st.write("big", bytes(range(256)) * 4096)
  assert st.list() == {"big": 256 * 4096, "marker": 5}
  assert bytes(st.read("big", 256, 260)) == bytes(range(4))


def test_the_overwrite_commit_is_a_conditional_replace(url):
  """A replace against the ETag read (If-Match) wins once: a second one
  with the same, now stale, ETag and one of a deleted blob raise
  ChangedError; an overwrite commits by it, and the head names one version
  of the path."""
  from jaxworks.batched_transfer._src.checkpoint import storage

  st = stores.open_storage("test", url)
  st.create("head", b"v1")
  data, tag = st.read_tagged("head")
  assert data == b"v1" and st.tag_of("head") == tag
  st.replace("head", b"v2", tag)
  with pytest.raises(storage.ChangedError, match="changed since it was read"):
    st.replace("head", b"v3", tag)
  assert st.read_tagged("head")[0] == b"v2"
  _, tag2 = st.read_tagged("head")
  st.delete(["head"])
  with pytest.raises(storage.ChangedError):
    st.replace("head", b"v4", tag2)
  path = f"{url}/ckpt"
  bt.save(path, tree(1))
  bt.save(path, tree(2), overwrite=True)
  assert_tree(bt.restore(path), 2)
  keys = stores.open_storage("test", path).list()
  assert len({k.split("/")[1] for k in keys if k != object_servers.HEAD}) == 1


def test_manager_in_a_container(url):
  mgr = bt.CheckpointManager(
    url, max_to_keep=2, best_fn=lambda m: m["acc"], item_names=("state", "data")
  )
  acc = {1: 0.5, 2: 0.9, 3: 0.1, 4: 0.7}
  for step in (1, 2, 3, 4):
    assert mgr.save(
      step,
      items={"state": tree(step), "data": {"epoch": step}},
      metrics={"acc": acc[step]},
    )
  mgr.wait_until_finished()
  assert mgr.all_steps() == [2, 4] and mgr.best_step() == 2
  assert mgr.metrics(4) == {"acc": 0.7}
  assert mgr.restore(4, items={"data": None}) == {"data": {"epoch": 4}}
  assert_tree(mgr.restore(2, items={"state": None})["state"], 2)
  assert mgr.metadata(4).metrics == {"acc": 0.7}
  assert not mgr.save(4, items={"state": tree(4)})  # exists: skipped
  mgr.delete(2)
  assert mgr.all_steps() == [4]
  mgr.reload()
  assert mgr.latest_step() == 4
  mgr.close()
  reader = bt.CheckpointManager(url, read_only=True)
  assert reader.all_steps() == [4]
  assert_tree(reader.restore(items={"state": None})["state"], 4)


SECOND = textwrap.dedent("""
    import sys
    import numpy as np
    from jaxworks import batched_transfer as bt
    mgr = bt.CheckpointManager(sys.argv[1])
    print("STEPS", mgr.all_steps(), flush=True)
    try:
      mgr.save(2, {"w": np.zeros(2)}, blocking=True)
    except bt.WriterConflictError as err:
      print("REFUSED", err, flush=True)
""")


def test_a_second_writer_process_is_refused(url, azure_connection):
  with bt.CheckpointManager(url) as mgr:
    assert mgr.save(1, {"w": np.ones(2)}, blocking=True)
    out = subprocess.run(
      [sys.executable, "-c", SECOND, url],
      env=dict(
        os.environ,
        AZURE_STORAGE_CONNECTION_STRING=azure_connection,
        PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
      ),
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert "STEPS [1]" in out.stdout, out.stdout + out.stderr
    assert "REFUSED" in out.stdout and repr(url) in out.stdout, out.stdout
    assert f"process {os.getpid()} on host" in out.stdout
  assert mgr.all_steps() == [1]
  st = stores.open_storage("test", url)
  assert not [k for k in st.list() if k.startswith(".jaxworks-writer/")]
