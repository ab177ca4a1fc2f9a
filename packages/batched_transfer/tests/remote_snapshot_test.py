"""A restore from a bucket is a snapshot, against moto's S3 server
and gcp-storage-emulator on 127.0.0.1: readers in this process and in
another racing overwrites, a manager's retention and deletes get one whole
committed save or a clear error, never part of a tree; the processes of a
jax.distributed restore racing an overwrite read one version together;
0.6.x's layouts that cannot be told apart are an error, not a guess, and a
damaged one is replaced by an overwrite.
"""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from multiprocess_util import run_n  # noqa: E402
import object_servers  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402

# Private imports below: the bucket opened directly to plant 0.6.x layouts.
from jaxworks.batched_transfer._src.checkpoint import stores  # noqa: E402

API = "test"
RECORD = "jaxworks_dtypes.json"

s3_endpoint = object_servers.s3_endpoint
gcs_endpoint = object_servers.gcs_endpoint
url = object_servers.bucket_url

TREE = textwrap.dedent(
  """
  import numpy as np

  N = 16  # arrays in "a": an overwrite's requests, a reader's window

  def tree(seed):
    rng = np.random.default_rng(seed)
    return {
      "a": {f"x{i}": rng.standard_normal(64 + i).astype(np.float32)
            for i in range(N)},
      "rows": np.arange(64 * 8, dtype=np.int32).reshape(64, 8) + seed,
      "seed": seed,
      "tag": f"seed {seed}",
    }

  def whole(out):
    # The seed of a tree read whole and bit for bit; AssertionError else.
    seed = int(out["seed"])
    want = tree(seed)
    assert out["tag"] == want["tag"], (out["tag"], seed)
    assert sorted(out["a"]) == sorted(want["a"]), sorted(out["a"])
    for k, v in want["a"].items():
      assert np.asarray(out["a"][k]).tobytes() == v.tobytes(), (k, seed)
    assert np.asarray(out["rows"]).tobytes() == want["rows"].tobytes()
    return seed
  """
)
namespace: dict = {}
exec(TREE, namespace)
tree, whole = namespace["tree"], namespace["whole"]


def read_whole(url, errors, seen, meta=False):
  """One restore (or metadata) of ``url``: its seed into ``seen``, or a
  clear error into ``errors``."""
  try:
    if meta:
      m = bt.metadata(url)
      assert set(m) == {"a", "rows", "seed", "tag"}, m
      assert len(m["a"]) == 16 and m["rows"].shape == (64, 8), m
      seen.append(int(m["tag"].split()[1]))
    else:
      seen.append(whole(bt.restore(url)))
  except (FileNotFoundError, OSError) as err:
    errors.append(err)


def clear(errors, allowed):
  for err in errors:
    assert any(a in str(err) for a in allowed), err


def test_readers_race_overwrites(url):
  """Threads restoring and reading metadata (no target) while the path is
  overwritten again and again: each read is one whole committed save."""
  bt.save(url, tree(0))
  stop, seen, errors = threading.Event(), [], []

  def reader(meta):
    while not stop.is_set():
      read_whole(url, errors, seen, meta)

  readers = [threading.Thread(target=reader, args=(m,)) for m in (0, 0, 1)]
  for r in readers:
    r.start()
  try:
    for seed in range(1, 9):
      bt.save(url, tree(seed), overwrite=True)
  finally:
    stop.set()
    for r in readers:
      r.join()
  assert seen and set(seen) <= set(range(9)), seen
  clear(errors, ["replaced while reading"])
  assert whole(bt.restore(url)) == 8


READER = TREE + textwrap.dedent(
  """
  import json, sys, time
  from jaxworks import batched_transfer as bt
  url, stop, out = sys.argv[1], sys.argv[2], sys.argv[3]
  seen, errors = [], []
  import os
  while not os.path.exists(stop):
    try:
      if len(seen) % 3 == 2:
        seen.append(int(bt.metadata(url)["tag"].split()[1]))
      else:
        seen.append(whole(bt.restore(url)))
    except OSError as err:
      errors.append(str(err))
  with open(out, "w") as f:
    json.dump({"seen": seen, "errors": errors}, f)
  """
)


def test_a_reader_in_another_process_races_overwrites(url, tmp_path):
  """Another process restoring (and reading metadata) while this one
  overwrites: every result is one whole committed save or a clear error."""
  bt.save(url, tree(0))
  stop, out = str(tmp_path / "stop"), str(tmp_path / "out.json")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
  env["JAX_PLATFORMS"] = "cpu"
  child = subprocess.Popen(
    [sys.executable, "-c", READER, url, stop, out], env=env
  )
  try:
    time.sleep(2)  # its first reads
    for seed in range(1, 9):
      bt.save(url, tree(seed), overwrite=True)
  finally:
    open(stop, "w").close()
    assert child.wait(timeout=120) == 0
  got = json.load(open(out))
  assert got["seen"] and set(got["seen"]) <= set(range(9)), got
  for err in got["errors"]:
    assert "replaced while reading" in err, err


def test_a_read_only_manager_races_retention_and_deletes(url):
  """A read-only manager restores its latest step while another manager's
  retention (max_to_keep=1) and deletes remove steps: a whole step, the one
  asked for, or FileNotFoundError; never {} or part of a tree."""
  directory = url.rsplit("/", 1)[0] + "/mgr"
  writer = bt.CheckpointManager(directory, max_to_keep=1)
  writer.save(0, tree(0))
  writer.wait_until_finished()
  stop, seen, errors = threading.Event(), [], []

  def reader():
    ro = bt.CheckpointManager(directory, read_only=True)
    while not stop.is_set():
      ro.reload()
      step = ro.latest_step()
      if step is None:
        continue
      try:
        out = ro.restore(step)
        assert whole(out) == step, (whole(out), step)
        seen.append(step)
      except FileNotFoundError as err:
        errors.append(err)

  threads = [threading.Thread(target=reader) for _ in range(2)]
  for t in threads:
    t.start()
  try:
    for step in range(1, 5):
      writer.save(step, tree(step))
      writer.wait_until_finished()
      if step % 3 == 0:
        writer.delete(step)
  finally:
    stop.set()
    for t in threads:
      t.join()
    writer.close()
  assert seen, errors
  clear(errors, ["deleted while reading", "no step", "did not commit"])


def test_two_060_copies_that_tie(s3_endpoint, monkeypatch):
  """0.6.0 overwrites left two committed ``.jaxworks-new-`` copies beside a
  path without a record, within one second (S3's Last-Modified): which is
  newer cannot be told, so restore says so, naming both (0.6.0 chose by
  their random names); an overwrite replaces them all."""
  for k, v in object_servers.S3_ENV.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
  base = f"s3://ckpt/run-{uuid.uuid4().hex}"
  url = f"{base}/ckpt"
  copies = [f"{base}/.ckpt.jaxworks-new-{h * 16}" for h in ("a", "b")]
  for seed, copy in zip((1, 2), copies):
    bt.save(copy, tree(seed))
    object_servers.to_legacy(stores.open_storage(API, copy))
  records = [bytes(stores.open_storage(API, c).read(RECORD)) for c in copies]
  for _ in range(10):  # the records written again until within one second
    for copy, record in zip(copies, records):
      stores.open_storage(API, copy).write(RECORD, record)
    times = {stores.open_storage(API, c).mtime_ns(RECORD) for c in copies}
    if len(times) == 1:
      break
  assert len(times) == 1, times
  with pytest.raises(ValueError, match="same time") as err:
    bt.restore(url)
  assert all(c in str(err.value) for c in copies), err.value
  with pytest.raises(ValueError, match="same time"):
    bt.save(url, tree(3))  # without overwrite: the error, nothing written
  bt.save(url, tree(3), overwrite=True)
  assert whole(bt.restore(url)) == 3
  parent = stores.open_storage(API, base)
  assert parent.children() == ["ckpt"], parent.children()
  # Copies of different seconds: the newer one, as before.
  other = f"{base}/ckpt2"
  for seed, name in ((4, "a"), (5, "b")):
    copy = f"{base}/.ckpt2.jaxworks-new-{name * 16}"
    bt.save(copy, tree(seed))
    object_servers.to_legacy(stores.open_storage(API, copy))
    time.sleep(1.1)
  assert whole(bt.restore(other)) == 5  # b's record is the newer


def test_a_damaged_moved_is_replaced_by_an_overwrite(url):
  """0.6.x's ``.jaxworks-moved`` edited into naming no copy: restore and a
  plain save say the checkpoint is damaged; a save with overwrite=True
  replaces it, and removes the 0.6.x objects and the copy beside."""
  st = stores.open_storage(API, url)
  base, name = url.rsplit("/", 1)
  copy = f"{base}/.{name}.jaxworks-next-{'c' * 16}"
  bt.save(copy, tree(1))
  object_servers.to_legacy(stores.open_storage(API, copy))
  st.write(".jaxworks-moved", b"not a copy's name")
  st.write("a/x0.npy", b"an old object of the path")
  for fn in (bt.restore, bt.metadata):
    with pytest.raises(ValueError, match="damaged"):
      fn(url)
  with pytest.raises(ValueError, match="damaged"):
    bt.save(url, tree(2))
  bt.save(url, tree(2), overwrite=True)
  assert whole(bt.restore(url)) == 2
  keys = st.list()
  assert ".jaxworks-moved" not in keys and "a/x0.npy" not in keys, keys
  assert stores.open_storage(API, base).children() == [name]


RESTORER = TREE + textwrap.dedent(
  """
  import json, sys
  pid, port, base, url = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
  import jax
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                             num_processes=2, process_id=pid,
                             initialization_timeout=60)
  from jax.sharding import NamedSharding, PartitionSpec as P
  from jaxworks import batched_transfer as bt
  mesh = jax.make_mesh((8,), ("x",))
  rows = NamedSharding(mesh, P("x"))
  like = {
    "a": {f"x{i}": jax.ShapeDtypeStruct((64 + i,), np.float32)
          for i in range(N)},
    "rows": jax.ShapeDtypeStruct((64, 8), np.int32, sharding=rows),
    "seed": 0, "tag": "",
  }
  results = []
  for _ in range(10):
    try:
      out = bt.restore(url, like)
    except (OSError, RuntimeError) as err:
      results.append(["error", str(err)])
      continue
    seed = int(out["seed"])
    want = tree(seed)
    assert out["tag"] == want["tag"]
    for k, v in want["a"].items():
      assert np.asarray(out["a"][k]).tobytes() == v.tobytes(), (k, seed)
    for s in out["rows"].addressable_shards:  # this process's rows
      assert np.asarray(s.data).tobytes() == want["rows"][s.index].tobytes()
    results.append(["ok", seed])
  with open(f"{base}/restored-{pid}.json", "w") as f:
    json.dump(results, f)
  print("WORKER-OK", pid, flush=True)
  """
)


def test_a_multi_process_restore_races_an_overwrite(
  s3_endpoint, monkeypatch, tmp_path
):
  """Two processes of a jax.distributed job restore one global array (rows
  over both) again and again while this process overwrites the path: in
  each restore both processes read the same save (process 0 pins the
  version for both), whole, or raise a clear error."""
  for k, v in object_servers.S3_ENV.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
  url = f"s3://ckpt/run-{uuid.uuid4().hex}/ckpt"
  bt.save(url, tree(0))
  stop = threading.Event()
  saved = [0]

  def overwrite():
    while not stop.wait(0.2):
      saved[0] += 1
      bt.save(url, tree(saved[0]), overwrite=True)

  writer = threading.Thread(target=overwrite)
  writer.start()
  try:
    run_n(RESTORER, str(tmp_path), 2, timeout=300, extra=(url,))
  finally:
    stop.set()
    writer.join()
  got = [json.load(open(tmp_path / f"restored-{p}.json")) for p in (0, 1)]
  both = 0
  # A process that lost the race with the removal of the version pinned
  # raises; it posts its error on the restore's board, and the other raises
  # it too (no collective of the restore waits for a process that failed).
  for r0, r1 in zip(*got):
    assert (r0[0] == "ok") == (r1[0] == "ok"), (r0, r1)
    for kind, value in (r0, r1):
      if kind == "error":
        assert "replaced while reading" in value, value
    if r0[0] == r1[0] == "ok":
      assert r0[1] == r1[1], (r0, r1)  # one save, read by both
      both += 1
  assert both, got
  assert saved[0] > 1
