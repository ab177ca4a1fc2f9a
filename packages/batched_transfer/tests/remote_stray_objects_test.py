"""Objects a bucket can hold that no save writes, against real servers on
127.0.0.1 (moto's S3, the GCS emulator), put there with each cloud's own
client: folder markers (``run/ckpt/``, what the S3 console's "Create
folder", rclone and s3fs make) and keys with an empty, ``.`` or ``..``
segment or a control character (legal in both). A checkpoint ignores what
it does not name, whatever the key: save, restore, metadata, an overwrite
and a CheckpointManager work beside them, and leave them as they are; a
listing the client library refuses says so, once, without retries.

Also: a failed delete names the object once (not a doubled prefix), and
wrong credentials give an error naming the URL and the setting to fix (an
IAM-enforcing moto server; Azurite, which checks its account key).
"""

import os
import sys
import uuid

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import object_servers  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402

# Private imports below: the bucket opened directly to plant objects.
from jaxworks.batched_transfer._src.checkpoint import stores  # noqa: E402

s3_endpoint = object_servers.s3_endpoint
gcs_endpoint = object_servers.gcs_endpoint
azure_connection = object_servers.azure_connection

#: Stray keys under a checkpoint's prefix P (``{}`` is P).
STRAYS = [
  "{}/",  # a folder marker
  "{}/sub/",
  "{}//notes.txt",
  "{}/./x",
  "{}/../y",
  "{}/a\x01b",
  "{}/x/\x7f",
]
#: gcp-storage-emulator keeps objects as files and refuses ``.``/``..``.
CASES = [("s3", k) for k in STRAYS] + [
  ("gs", k) for k in STRAYS if "/./" not in k and "/../" not in k
]


def tree(seed):
  rng = np.random.default_rng(seed)
  return {
    "w": rng.standard_normal((16, 9)).astype(np.float32),
    "n": np.arange(4, dtype=np.int64) * seed,
    "tag": f"seed {seed}",
  }


def check(out, seed):
  want = tree(seed)
  assert out["tag"] == want["tag"]
  np.testing.assert_array_equal(np.asarray(out["w"]), want["w"])
  assert np.asarray(out["n"]).tolist() == want["n"].tolist()


@pytest.fixture(params=["s3", "gs"], name="bucket")
def bucket_fixture(request, monkeypatch):
  """(scheme, a function putting an object with the cloud's own client)."""
  if request.param == "s3":
    import boto3

    ep = request.getfixturevalue("s3_endpoint")
    for k, v in object_servers.S3_ENV.items():
      monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", ep)
    client = boto3.client("s3", endpoint_url=ep, **_boto3_keys())

    def put(key, data=b""):
      client.put_object(Bucket="ckpt", Key=key, Body=data)

    def keys(prefix):
      pages = client.get_paginator("list_objects_v2").paginate(
        Bucket="ckpt", Prefix=prefix
      )
      return {o["Key"] for p in pages for o in p.get("Contents", [])}

  else:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage as gcs_client

    ep = request.getfixturevalue("gcs_endpoint")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", ep)
    client = gcs_client.Client(
      project="test",
      credentials=AnonymousCredentials(),
      client_options={"api_endpoint": ep},
    )

    def put(key, data=b""):
      client.bucket("ckpt").blob(key).upload_from_string(data)

    def keys(prefix):
      return {b.name for b in client.list_blobs("ckpt", prefix=prefix)}

  return request.param, put, keys


def _boto3_keys():
  return {
    "aws_access_key_id": object_servers.S3_ENV["AWS_ACCESS_KEY_ID"],
    "aws_secret_access_key": object_servers.S3_ENV["AWS_SECRET_ACCESS_KEY"],
    "region_name": object_servers.S3_ENV["AWS_REGION"],
  }


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize(("bucket", "stray"), CASES, indirect=["bucket"])
def test_a_stray_object_is_ignored(bucket, stray, when):
  """A stray object under the prefix, put before the first save (a save
  without overwrite refuses it where the listing shows it) or beside a
  committed checkpoint: every operation works and leaves it there."""
  scheme, put, keys = bucket
  run = f"run-{uuid.uuid4().hex}"
  prefix = f"{run}/ckpt"
  url = f"{scheme}://ckpt/{prefix}"
  key = stray.format(prefix)
  if when == "before":
    put(key, b"not a checkpoint's")
    try:
      bt.save(url, tree(1))
    except FileExistsError as err:  # a key the listing shows: as on disk,
      assert "holds objects" in str(err)  # a save refuses a prefix with it
      bt.save(url, tree(1), overwrite=True)  # and saves beside it
  else:
    bt.save(url, tree(1))
  if when == "after":
    put(key, b"not a checkpoint's")
  check(bt.restore(url), 1)
  assert bt.metadata(url)["tag"] == "seed 1"
  for seed in (2, 3):
    bt.save(url, tree(seed), overwrite=True)
    check(bt.restore(url), seed)
  with pytest.raises(FileExistsError):
    bt.save(url, tree(4))
  assert key in keys(run)  # left as it was


@pytest.mark.parametrize(("bucket", "stray"), CASES, indirect=["bucket"])
def test_a_managers_directory_with_a_stray_object(bucket, stray):
  """A stray object in a step's prefix is ignored like any checkpoint's;
  one right under the manager's directory too, but where obstore (S3,
  Azure) cannot list the directory's steps for it: that is then a clear
  StrayKeyError naming the directory, not a retried network fault."""
  scheme, put, keys = bucket
  run = f"run-{uuid.uuid4().hex}"
  directory = f"{scheme}://ckpt/{run}/mgr"
  inner = stray.format(f"{run}/mgr/3")
  with bt.CheckpointManager(directory, max_to_keep=2) as m:
    for step in range(4):
      m.save(step, tree(step))
    m.wait_until_finished()
    # Beside step 3's objects (before them, it is refused: as on disk, a
    # save goes to an empty prefix).
    put(inner, b"x")
    assert m.all_steps() == [2, 3]
    check(m.restore(3), 3)
  top = stray.format(f"{run}/mgr")
  put(top, b"x")
  first = top[len(f"{run}/mgr/") :].split("/")[0]
  refused = scheme == "s3" and (
    top.endswith("//") or first in ("", ".", "..")
    or any(ord(c) < 32 or ord(c) == 127 for c in first)
  ) and top != f"{run}/mgr/"  # fmt: skip
  with bt.CheckpointManager(directory) as m:
    if refused:
      with pytest.raises(bt.StrayKeyError, match="rename or delete"):
        m.all_steps()
    else:
      assert m.all_steps() == [2, 3]
      m.delete(2)
      assert m.all_steps() == [3]
      check(m.restore(3), 3)
  assert {inner, top} <= keys(run)


def test_a_folder_marker_of_the_parent(bucket):
  scheme, put, _ = bucket
  run = f"run-{uuid.uuid4().hex}"
  put(f"{run}/")
  put(f"{run}//")
  url = f"{scheme}://ckpt/{run}/ckpt"
  bt.save(url, tree(5))
  bt.save(url, tree(6), overwrite=True)
  check(bt.restore(url), 6)


def test_a_listing_the_client_refuses_says_so_once(s3_endpoint, monkeypatch):
  """obstore refuses a key with an empty segment while listing: the error
  is StrayKeyError, names the key and what to do, and says no network
  fault (its retries are for those)."""
  import boto3

  for k, v in object_servers.S3_ENV.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
  run = f"run-{uuid.uuid4().hex}"
  boto3.client("s3", endpoint_url=s3_endpoint, **_boto3_keys()).put_object(
    Bucket="ckpt", Key=f"{run}/p//bad", Body=b""
  )
  st = stores.open_storage("test", f"s3://ckpt/{run}/p")
  with pytest.raises(bt.StrayKeyError) as err:
    st.list()
  text = str(err.value)
  assert f"s3://ckpt/{run}/p" in text and "//bad" in text
  assert "not retried" in text and "retries" not in text.replace(
    "not retried", ""
  )
  assert isinstance(err.value, OSError)
  # A listing that needs no key under the stray one works.
  assert stores.open_storage("test", f"s3://ckpt/{run}").children() == ["p"]


@pytest.mark.parametrize("scheme", ["s3", "az"])
def test_a_failed_delete_names_the_object_once(scheme, monkeypatch):
  with object_servers.failing_server(503) as (endpoint, _):
    opts = {"endpoint": endpoint, "max_retries": 0, "retry_timeout_s": 1}
    if scheme == "s3":
      for k, v in object_servers.S3_ENV.items():
        monkeypatch.setenv(k, v)
    else:
      opts |= {
        "account_name": object_servers.AZURE_ACCOUNT,
        "account_key": object_servers.AZURE_KEY,
      }
    st = stores.open_storage("test", f"{scheme}://bkt/mgr", opts)
    with pytest.raises(OSError) as err:
      st.delete([".jaxworks-writer/00000000000000000001"])
  text = str(err.value)
  assert f"{scheme}://bkt/mgr/.jaxworks-writer/00000000000000000001" in text
  assert "mgr/mgr" not in text


def refused_everywhere(url, setting):
  """A save beside ``url``, its restore and its metadata are refused with
  a PermissionError naming the URL and ``setting``."""
  for call in (
    lambda: bt.save(url + "-2", tree(2)),
    lambda: bt.restore(url),
    lambda: bt.metadata(url),
  ):
    with pytest.raises(PermissionError) as err:
      call()
    text = str(err.value)
    assert url in text and setting in text, text


def test_wrong_s3_credentials(monkeypatch):
  """moto checking credentials against its IAM users: the right key saves
  and restores; a wrong secret or an unknown key is refused, with a
  PermissionError naming the URL and the settings to fix."""
  with object_servers.s3_server_process(no_auth_actions=4) as endpoint:
    keys = object_servers.s3_user(endpoint, "auth")
    for k in list(os.environ):
      if k.startswith("AWS_"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    for k, v in keys.items():
      monkeypatch.setenv(k, v)
    url = f"s3://auth/run-{uuid.uuid4().hex}/ckpt"
    bt.save(url, tree(1))
    check(bt.restore(url), 1)
    for wrong in (
      {"AWS_SECRET_ACCESS_KEY": "wrong"},
      {"AWS_ACCESS_KEY_ID": "AKIAUNKNOWN000000000"},
    ):
      with monkeypatch.context() as mp:
        for k, v in wrong.items():
          mp.setenv(k, v)
        refused_everywhere(url, "AWS_SECRET_ACCESS_KEY")
    # Options over the environment: the right key in storage_options.
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    opts = {
      "access_key_id": keys["AWS_ACCESS_KEY_ID"],
      "secret_access_key": keys["AWS_SECRET_ACCESS_KEY"],
    }
    check(bt.restore(url, storage_options=opts), 1)


def test_wrong_azure_credentials(azure_connection, monkeypatch):
  """Azurite checks the account key's signatures: a wrong key is refused,
  naming the URL and AZURE_STORAGE_CONNECTION_STRING."""
  monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azure_connection)
  url = f"az://ckpt/run-{uuid.uuid4().hex}/ckpt"
  bt.save(url, tree(1))
  wrong = azure_connection.replace(object_servers.AZURE_KEY, "d3Jvbmcga2V5" * 8)
  assert wrong != azure_connection
  monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", wrong)
  refused_everywhere(url, "AZURE_STORAGE_CONNECTION_STRING")
