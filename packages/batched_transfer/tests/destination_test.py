"""destination.open reads every path and URL once, with one answer per kind:
a local directory or .npz, a bucket prefix or .npz (moto's S3 server and
gcp-storage-emulator, started here); file:// and other URLs are refused
alike by save, restore, metadata and CheckpointManager, naming the fix.
Each kind saves, lists, times, reads and deletes through the same
interface.
"""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import object_servers  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402

# Private imports below: the internal Destination classes are the subject.
from jaxworks.batched_transfer._src.checkpoint import destination  # noqa: E402

API = "test"

s3_endpoint = object_servers.s3_endpoint
gcs_endpoint = object_servers.gcs_endpoint
url = object_servers.bucket_url


def tree(seed):
  return {
    "w": np.arange(12, dtype=np.float32).reshape(3, 4) + seed,
    "run": f"exp-{seed}",
  }


def test_each_kind_of_path_opens_its_destination(tmp_path):
  kinds = {
    str(tmp_path / "ckpt"): destination.LocalDirectory,
    str(tmp_path / "ckpt") + os.sep: destination.LocalDirectory,
    tmp_path / "ckpt.npz": destination.LocalNpz,
  }
  for path, kind in kinds.items():
    dest = destination.open(API, path)
    assert type(dest) is kind
    assert dest.path == str(tmp_path / os.path.basename(str(path).rstrip("/")))
  assert destination.open(API, tmp_path / "a.npz").npz
  assert not destination.open(API, tmp_path / "a").npz


@pytest.mark.parametrize(
  "text", ["file:///tmp/x", "FILE:///tmp/x", "file://localhost/tmp/x"]
)
def test_a_file_url_is_refused_by_every_api_naming_the_local_path(
  tmp_path, text
):
  calls = {
    "save": lambda: bt.save(text, tree(0)),
    "restore": lambda: bt.restore(text),
    "metadata": lambda: bt.metadata(text),
    "CheckpointManager": lambda: bt.CheckpointManager(text),
  }
  for name, call in calls.items():
    with pytest.raises(ValueError, match="is a URL") as info:
      call()
    message = str(info.value)
    assert f"jaxworks.batched_transfer.{name}" in message, message
    assert repr(text) in message and "'/tmp/x'" in message, message
  assert not os.path.exists("/tmp/x")


def test_other_urls_and_options_for_a_local_path_are_refused(tmp_path):
  with pytest.raises(ValueError, match="mount the bucket"):
    destination.open(API, "hdfs://namenode/ckpt")
  with pytest.raises(ValueError, match="storage_options are for"):
    destination.open(API, tmp_path / "x", {"region": "x"})
  with pytest.raises(TypeError, match="must be a str or os.PathLike"):
    destination.open(API, 3)


def _exercise(dest_of, path, npz):
  """Saves at ``path`` with bt.save, then reads, times, lists and deletes
  it through its destination (``dest_of(path)``)."""
  dest = dest_of(path)
  assert not dest.committed() and dest.commit_ns() is None
  assert not dest.delete()
  bt.save(path, tree(1))
  assert dest.committed()
  assert dest.commit_ns() > 0
  with dest.noting():
    opened = dest.open_checkpoint()
  try:
    arrays, record = opened.contents()
  finally:
    opened.close()
  assert sorted(arrays) == ["w"] and record.values == {"run": "exp-1"}
  if not npz:
    assert b'"run": "exp-1"' in dest.read_record()
  np.testing.assert_array_equal(bt.restore(path)["w"], tree(1)["w"])
  bt.save(path, tree(2), overwrite=True)
  assert bt.restore(path)["run"] == "exp-2"
  assert dest.delete() and not dest.committed()
  with pytest.raises(FileNotFoundError):
    bt.restore(path)


@pytest.mark.parametrize("name", ["ckpt", "ckpt.npz"])
def test_a_local_destination_saves_reads_and_deletes(tmp_path, name):
  path = str(tmp_path / name)
  _exercise(lambda p: destination.open(API, p), path, name.endswith(".npz"))
  parent = destination.open_directory(API, tmp_path)
  assert parent.path == str(tmp_path)
  bt.save(tmp_path / "7", tree(7))
  (tmp_path / "8").mkdir()  # not committed in a bucket; a directory here
  assert set(parent.committed_among(["7", "9"])) == {"7"}
  assert "7" in parent.children()


@pytest.mark.parametrize("npz", [False, True])
def test_a_bucket_destination_saves_reads_and_deletes(url, npz):
  path = url + (".npz" if npz else "")
  kind = destination.BucketNpz if npz else destination.BucketPrefix
  assert type(destination.open(API, path)) is kind
  _exercise(lambda p: destination.open(API, p), path, npz)
  parent = destination.open_directory(API, url.rsplit("/", 1)[0] + "/")
  assert parent.path == url.rsplit("/", 1)[0]
  bt.save(url + "-7", tree(7))
  name = url.rsplit("/", 1)[1]
  assert parent.committed_among([name + "-7", name + "-9"]) == [name + "-7"]
  assert name + "-7" in parent.children()
