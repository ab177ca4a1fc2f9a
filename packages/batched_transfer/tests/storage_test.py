"""The storage layer against real servers on 127.0.0.1: moto's S3 server and
gcp-storage-emulator, each started by this test, beside the local file
system: keys, ranged and parallel reads, multipart uploads, the conditional
create that commits a checkpoint, configuration from each cloud's standard
environment and ``storage_options``, and the errors for a missing bucket, a
server that throttles or fails, and one that is not there.
"""

import os
import pathlib
import sys
import threading
import time
import uuid

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import object_servers  # noqa: E402

# Private imports below: the storage protocol (URLs, stores) is the subject.
from jaxworks.batched_transfer._src.checkpoint import destination  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import storage  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import stores  # noqa: E402

API = "test"


s3_endpoint = object_servers.s3_endpoint
gcs_endpoint = object_servers.gcs_endpoint


@pytest.fixture
def s3_env(monkeypatch, s3_endpoint):
  for k in list(os.environ):
    if k.startswith("AWS_"):
      monkeypatch.delenv(k)
  for k, v in object_servers.S3_ENV.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
  return s3_endpoint


@pytest.fixture
def gcs_env(monkeypatch, gcs_endpoint):
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_endpoint)
  return gcs_endpoint


@pytest.fixture(params=["local", "s3", "gs"])
def store(request, tmp_path):
  """A Storage at a fresh prefix, configured from the environment alone."""
  if request.param == "local":
    return stores.open_storage(API, str(tmp_path / "root"))
  request.getfixturevalue(f"{'gcs' if request.param == 'gs' else 's3'}_env")
  url = f"{request.param}://ckpt/run-{uuid.uuid4().hex}"
  return stores.open_storage(API, url, {"chunk_size": 5 * 2**20})


# URLs -------------------------------------------------------------------


@pytest.mark.parametrize(
  "path, want",
  [
    ("s3://b/run/1", ("s3", "b", "run/1")),
    ("S3://b/run//1/", ("s3", "b", "run/1")),
    ("gs://b", ("gs", "b", "")),
    ("az://container/p", ("az", "container", "p")),
    ("/tmp/a/../b", ("file", "", "/tmp/b")),
    (pathlib.Path("/tmp/c"), ("file", "", "/tmp/c")),
  ],
)
def test_parse(path, want):
  loc = storage.parse(API, path)
  assert (loc.scheme, loc.bucket, loc.prefix) == want


@pytest.mark.parametrize(
  "path, message",
  [
    ("ftp://b/x", "is a URL of a kind it does not take"),
    ("s3:///x", "names no bucket"),
    ("gs://b/a/../c", "'.' or '..' component"),
    ("", "empty"),
    # As destination.open refuses them: the message names the local path.
    ("file:///tmp/x/y", "for this one, the local path '/tmp/x/y'"),
    ("FILE:///tmp/x/y", "for this one, the local path '/tmp/x/y'"),
    ("file://localhost/tmp/x", "for this one, the local path '/tmp/x'"),
    ("file://host/x", "for this one, the local path '/x'"),
  ],
)
def test_parse_refuses(path, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    storage.parse(API, path)


@pytest.mark.parametrize("url", ["file:///tmp/x", "file://localhost/tmp/x"])
def test_open_storage_refuses_file_urls_as_destination_open(url):
  with pytest.raises(ValueError) as a:
    stores.open_storage(API, url)
  with pytest.raises(ValueError) as b:
    destination.open(API, url)
  assert str(a.value) == str(b.value)
  assert repr(url) in str(a.value) and "the local path" in str(a.value)


def test_parse_refuses_non_paths():
  with pytest.raises(TypeError, match="str or os.PathLike"):
    storage.parse(API, 3)


def test_location_navigation():
  loc = storage.parse(API, "gs://b/run/7")
  assert loc.url == "gs://b/run/7"
  assert loc.parent.url == "gs://b/run" and loc.name == "7"
  assert loc.child("x/y.npy").url == "gs://b/run/7/x/y.npy"
  assert loc.remote and not storage.parse(API, "/x").remote


def test_local_list_skips_a_file_gone_since_it_was_listed(
  tmp_path, monkeypatch
):
  """A file another writer renames away between the directory listing and
  its stat (a writer's temporary) is no key of the listing, not an error."""
  st = stores.open_storage(API, str(tmp_path))
  st.write("d/keep", b"1")
  st.write("d/.gone.jaxworks-new-1", b"2")
  real_walk = os.walk

  def walk(top, *args, **kwargs):
    for dirpath, dirnames, filenames in real_walk(top, *args, **kwargs):
      if ".gone.jaxworks-new-1" in filenames:  # listed, then renamed away
        os.rename(os.path.join(dirpath, ".gone.jaxworks-new-1"),
                  os.path.join(str(tmp_path), "elsewhere"))  # fmt: skip
      yield dirpath, dirnames, filenames

  monkeypatch.setattr(os, "walk", walk)
  assert st.list("d") == {"d/keep": 1}


def test_local_path_takes_no_storage_options(tmp_path):
  with pytest.raises(ValueError, match="local path"):
    stores.open_storage(API, str(tmp_path), {"endpoint": "http://x"})


# The interface on each storage ----------------------------------------------


def test_write_read_list_delete(store):
  store.write("a/b.npy", b"0123456789")
  store.write("a/bc.npy", memoryview(np.arange(4, dtype=np.int32)))
  store.write("z", b"")
  assert store.list() == {"a/b.npy": 10, "a/bc.npy": 16, "z": 0}
  assert store.list("a") == {"a/b.npy": 10, "a/bc.npy": 16}
  assert store.child("a").list() == {"b.npy": 10, "bc.npy": 16}
  store.write("a/d/e.npy", b"x")
  assert store.children() == ["a"] and store.child("a").children() == ["d"]
  store.delete(["a/d/e.npy"])
  assert store.size("a/b.npy") == 10 and store.exists("z")
  assert bytes(store.read("a/b.npy")) == b"0123456789"
  assert bytes(store.read("a/b.npy", 3, 7)) == b"3456"
  assert bytes(store.read("a/b.npy", 8, 100)) == b"89"
  assert bytes(store.read("a/b.npy", 10, 12)) == b""
  assert [bytes(b) for b in store.read_ranges("a/b.npy", [(0, 2), (5, 9)])] == [
    b"01",
    b"5678",
  ]
  np.testing.assert_array_equal(
    np.frombuffer(store.read("a/bc.npy"), np.int32), np.arange(4)
  )
  with pytest.raises(FileNotFoundError, match="missing.npy"):
    store.size("missing.npy")
  assert not store.exists("missing.npy")
  store.delete(["a/b.npy", "never-there"])
  assert sorted(store.list()) == ["a/bc.npy", "z"]
  assert store.delete_prefix() == 2 and store.list() == {}


def test_large_objects_in_parts(store, tmp_path, monkeypatch):
  """Multipart/resumable upload from a file, parallel ranged reads back."""
  monkeypatch.setattr(storage, "WHOLE", 4 * 2**20)  # parts above 4 MiB
  data = np.random.default_rng(0).integers(0, 255, 13 * 2**20, np.uint8)
  src = tmp_path / "src.bin"
  src.write_bytes(data.tobytes())
  store.upload("big/x.bin", str(src))
  store.write("big/y.bin", data)
  assert store.list("big") == {"big/x.bin": data.size, "big/y.bin": data.size}
  out = np.empty(data.size - 100, np.uint8)
  store.read_into("big/x.bin", 100, memoryview(out))
  np.testing.assert_array_equal(out, data[100:])
  dst = tmp_path / "dst.bin"
  assert store.download("big/y.bin", str(dst)) == data.size
  assert dst.read_bytes() == data.tobytes()
  with pytest.raises(OSError, match="truncated"):
    store.read_into("big/x.bin", 10, memoryview(np.empty(data.size, np.uint8)))


def test_create_never_replaces(store):
  store.create("commit", b"first")
  with pytest.raises(FileExistsError, match="commit' exists already"):
    store.create("commit", b"second")
  assert bytes(store.read("commit")) == b"first"


def test_replace_only_the_version_read(store):
  """The commit of an overwrite: a conditional replace against the version
  read (ETag, generation); a second replace with the same, now stale, tag
  loses, as does one of an object deleted since."""
  assert store.read_tagged("head") is None
  assert store.tag_of("head") is None
  store.create("head", b"v1")
  data, tag = store.read_tagged("head")
  assert data == b"v1" and store.tag_of("head") == tag
  store.replace("head", b"v2", tag)
  data2, tag2 = store.read_tagged("head")
  assert data2 == b"v2" and tag2 != tag
  with pytest.raises(storage.ChangedError, match="changed since it was read"):
    store.replace("head", b"v3", tag)  # stale: another writer came first
  assert bytes(store.read("head")) == b"v2"
  with pytest.raises(FileExistsError):  # ChangedError is one
    store.replace("head", b"v3", tag)
  store.delete(["head"])
  with pytest.raises(storage.ChangedError):
    store.replace("head", b"v4", tag2)
  assert store.read_tagged("head") is None


def test_s3_one_of_many_concurrent_replaces_wins(s3_env):
  store = stores.open_storage(API, f"s3://ckpt/race-{uuid.uuid4().hex}")
  store.create("head", b"start")
  _, tag = store.read_tagged("head")
  _one_of_eight_wins(
    store, "head", lambda i, data: store.replace("head", data, tag)
  )


def test_s3_a_bulk_delete_is_retried_after_a_dropped_connection(
  s3_endpoint, monkeypatch
):
  """S3's DeleteObjects is a POST, which the client does not retry: the
  storage layer does (deleting is idempotent), so a delete whose answer was
  lost, or made while the endpoint is away for a moment, completes."""
  proxy = object_servers.Proxy(s3_endpoint)
  try:
    for k, v in object_servers.S3_ENV.items():
      monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    store = stores.open_storage(
      API,
      f"s3://ckpt/del-{uuid.uuid4().hex}",
      {"max_retries": 6, "retry_timeout_s": 30},
    )
    keys = [f"k{i}" for i in range(5)]
    for k in keys:
      store.write(k, b"x")
    proxy.lose = 1  # the POST applied, its answer lost
    store.delete(keys)
    assert proxy.lose == 0 and store.list() == {}
    for k in keys:
      store.write(k, b"x")
    proxy.stop()
    threading.Timer(0.5, proxy.start).start()
    store.delete(keys)  # while the endpoint is away, and after
    assert store.list() == {}
  finally:
    proxy.stop()


SHORT = b'{"beat": 1}'
LONG = b'{"beat": 1.0697618, "pad": "' + b"x" * 300 + b'"}'


def test_a_whole_read_is_one_request(store):
  """A whole read (no ``end``) returns one version of the key whole, never
  the new bytes cut to the old length (the writer lease is rewritten every
  heartbeat while others read it): a rewrite made to happen right after any
  size request changes nothing."""
  store.write("lease", SHORT)
  size = store.size

  def size_then_rewrite(key):
    n = size(key)
    store.write(key, LONG)
    return n

  store.size = size_then_rewrite
  try:
    assert bytes(store.read("lease")) in (SHORT, LONG)
    assert bytes(store.read("lease", 3)) in (SHORT[3:], LONG[3:])
  finally:
    del store.size
  assert bytes(store.read("lease", len(LONG))) == b""
  assert bytes(store.read("lease", len(LONG) + 5)) == b""


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_whole_reads_racing_a_rewriter(kind, request, tmp_path):
  """Readers racing a rewriter of one key each get one version whole.
  (Not gcp-storage-emulator: it truncates an object before writing its new
  bytes, so its own reads can see it empty; GCS replaces objects whole.)"""
  if kind == "local":
    store = stores.open_storage(API, str(tmp_path / "root"))
  else:
    request.getfixturevalue("s3_env")
    store = stores.open_storage(API, f"s3://ckpt/run-{uuid.uuid4().hex}")
  store.write("lease", SHORT)
  stop, seen = threading.Event(), []

  def rewrite():
    i = 0
    while not stop.is_set():
      store.write("lease", (SHORT, LONG)[i % 2])
      i += 1

  thread = threading.Thread(target=rewrite)
  thread.start()
  try:
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
      seen.append(bytes(store.read("lease")))
  finally:
    stop.set()
    thread.join()
  assert seen and set(seen) <= {SHORT, LONG}


def test_keys_are_checked(store):
  for bad in ["", "/abs", "a//b", "a/../b", "./a"]:
    with pytest.raises(ValueError, match="bad key"):
      store.write(bad, b"x")


# S3: concurrency, configuration, faults ----------------------------------------


def _one_of_eight_wins(store, key, write):
  """Eight threads each ``write(i, b"writer <i>")`` the object ``key`` at
  once, where a conditional write refuses all but one (FileExistsError):
  exactly one wins, and the object holds its bytes."""
  results = []

  def attempt(i):
    try:
      write(i, f"writer {i}".encode())
      results.append(i)
    except FileExistsError:
      pass

  threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(results) == 1
  assert bytes(store.read(key)) == f"writer {results[0]}".encode()


def test_s3_one_of_many_concurrent_creates_wins(s3_env):
  store = stores.open_storage(API, f"s3://ckpt/race-{uuid.uuid4().hex}")
  _one_of_eight_wins(
    store, "marker", lambda i, data: store.create("marker", data)
  )


def test_s3_storage_options_over_the_environment(monkeypatch, s3_endpoint):
  for k in list(os.environ):
    if k.startswith("AWS_"):
      monkeypatch.delenv(k)
  monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing
  store = stores.open_storage(
    API,
    "s3://ckpt/opts",
    {
      "endpoint": s3_endpoint,
      "access_key_id": "a",
      "secret_access_key": "b",
      "region": "eu-west-1",
    },
  )
  store.write("x", b"1")
  assert store.list() == {"x": 1}


def test_s3_endpoint_url_s3_wins_over_endpoint_url(s3_env, monkeypatch):
  monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_env)
  monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
  stores.open_storage(API, "s3://ckpt/e").write("x", b"1")


def test_s3_missing_bucket(s3_env):
  store = stores.open_storage(API, "s3://no-such-bucket/run")
  with pytest.raises(FileNotFoundError) as e:
    store.write("x.npy", b"1")
  msg = str(e.value)
  assert "s3://no-such-bucket/run/x.npy" in msg
  assert "bucket 'no-such-bucket' does not exist" in msg and "create it" in msg


@pytest.mark.parametrize("status", [503, 500, 429])
def test_s3_throttling_and_5xx_retried_then_named(monkeypatch, status):
  with object_servers.failing_server(status) as (endpoint, counter):
    for k, v in object_servers.S3_ENV.items():
      monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    store = stores.open_storage(API, "s3://b/p", {"max_retries": 2})
    t0 = time.monotonic()
    with pytest.raises(OSError) as e:
      store.read("w.npy", 0, 10)
    assert time.monotonic() - t0 < 30
    msg = str(e.value)
    assert "s3://b/p/w.npy" in msg and "reading" in msg
    assert "2 retries" in msg and endpoint in msg
    assert counter.count == 3 if status != 429 else counter.count >= 1


def test_s3_server_not_there(monkeypatch):
  for k, v in object_servers.S3_ENV.items():
    monkeypatch.setenv(k, v)
  port = object_servers.free_port()
  monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
  store = stores.open_storage(
    API, "s3://b/p", {"max_retries": 1, "retry_timeout_s": 5}
  )
  with pytest.raises(OSError, match=r"writing 's3://b/p/k' failed"):
    store.write("k", b"x")


def test_storage_options_checked(s3_env):
  with pytest.raises(ValueError, match="max_retries"):
    stores.open_storage(API, "s3://ckpt/x", {"max_retries": -1})


# GCS -----------------------------------------------------------------------


def test_gcs_emulator_from_the_environment(gcs_env):
  store = stores.open_storage(API, "gs://ckpt/env")
  store.write("k", b"v")
  assert store.list() == {"k": 1}


def test_gcs_explicit_endpoint(monkeypatch, gcs_endpoint):
  monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
  store = stores.open_storage(
    API, "gs://ckpt/explicit", {"endpoint": gcs_endpoint}
  )
  store.write("k", b"v")
  assert bytes(store.read("k")) == b"v"


def test_gcs_missing_bucket(gcs_env):
  store = stores.open_storage(API, "gs://no-such-bucket/run")
  with pytest.raises(FileNotFoundError, match="bucket 'no-such-bucket'"):
    store.read("x.npy", 0, 4)


def test_gcs_unknown_option(gcs_env):
  with pytest.raises(ValueError, match="not GCS options"):
    stores.open_storage(API, "gs://ckpt/x", {"access_key_id": "a"})


# Azure: configuration only (no Azure server runs here) --------------------------


def test_azure_connection_string(monkeypatch):
  monkeypatch.setenv(
    "AZURE_STORAGE_CONNECTION_STRING",
    "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
    "AccountKey=a2V5;BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1;",
  )
  assert stores._connection_string(
    os.environ["AZURE_STORAGE_CONNECTION_STRING"]
  ) == {
    "account_name": "devstoreaccount1",
    "account_key": "a2V5",
    "endpoint": "http://127.0.0.1:10000/devstoreaccount1",
  }
  store = stores.open_storage(API, "az://container/run")
  assert store.url == "az://container/run"
  assert stores._connection_string("UseDevelopmentStorage=true") == {
    "use_emulator": True
  }


@pytest.mark.parametrize("piece", [1, 7, 100, 4096])
def test_into_fills_buffers_in_order(piece):
  """storage.Into: bytes arriving in pieces of any size fill its buffers
  one after another; what does not fit is dropped; a retried download
  seeks back and writes them again."""
  data = np.random.default_rng(piece).integers(0, 256, 300, np.uint8).tobytes()
  outs = [bytearray(5), bytearray(0), bytearray(190), bytearray(50)]
  into = storage.Into([memoryview(o) for o in outs])
  for attempt in range(2):
    into.seek(0)
    for i in range(0, len(data), piece):
      assert into.write(data[i : i + piece]) == len(data[i : i + piece])
    assert into.pos == into.size == 245, attempt
    assert b"".join(outs) == data[:245]
