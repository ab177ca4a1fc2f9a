"""Saves of two processes (jax.distributed on 127.0.0.1, four CPU devices
each) to moto's S3 server started by this test: each process uploads its
own shards, process 0 creates the record once both did. Restore by both
processes onto other shardings (bit for bit), by this one process, and by
numpy from a plain copy of the objects; each process's progress bars; an
overwrite; a failure injected on
process 1 before and after its upload (every process raises naming process
1, nothing new is committed), a commit whose answer process 0 lost (read
back: committed, every process returns);
CheckpointManager's save, restore, retention and delete; process 1 killed
mid-upload (process 0 names it, nothing is committed)."""

import json
import os
import sys
import textwrap

import boto3
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from multiprocess_util import numpy_read
from multiprocess_util import run_n
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import object_servers  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402

s3_endpoint = object_servers.s3_endpoint
RECORD = "jaxworks_dtypes.json"
HEAD = object_servers.HEAD

VALUES = textwrap.dedent("""
    import numpy as np
    import ml_dtypes

    def values(k):
      rng = np.random.default_rng(k)
      return {"w": rng.standard_normal((16, 4)).astype(np.float32),
              "h": rng.standard_normal((8, 6)).astype(ml_dtypes.bfloat16),
              "r": np.arange(12, dtype=np.int32).reshape(4, 3) + k,
              "n": np.arange(8, dtype=np.int16) * k}
""")

WORKER = VALUES + textwrap.dedent("""
    import json, os, signal, sys, time
    pid, port, base, url = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    import jax
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=2, process_id=pid,
                               initialization_timeout=60)
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxworks import batched_transfer as bt
    # Private: save's steps, patched to fail on one process.
    from jaxworks.batched_transfer._src.checkpoint import hostvalue, remote
    from jaxworks.batched_transfer._src.checkpoint import stores
    mesh = jax.make_mesh((8,), ("x",))
    mesh2 = jax.make_mesh((4, 2), ("a", "b"))
    shardings = {"w": NamedSharding(mesh, P("x")),
                 "h": NamedSharding(mesh2, P("a")),  # each shard on 2 devices
                 "r": NamedSharding(mesh, P())}      # "n": a host array
    other = {"w": NamedSharding(mesh2, P("b", "a")),
             "h": NamedSharding(mesh, P()),
             "r": NamedSharding(mesh2, P("a")),
             "n": NamedSharding(mesh, P("x"))}
    T = 20.0  # barrier_timeout_s where nothing should wait for it

    def placed(k):  # global arrays made with no collective
      v = values(k)
      out = {key: jax.make_array_from_callback(x.shape, shardings[key],
                                               lambda i, x=x: x[i])
             if key in shardings else x for key, x in v.items()}
      return {**out, "run": f"exp-{k}"}

    def check(out, k):
      # Every shard this process holds is the source's bytes.
      v = values(k)
      assert out["run"] == f"exp-{k}", out["run"]
      for key, x in v.items():
        got = out[key]
        assert got.dtype == x.dtype and got.shape == x.shape, key
        assert got.sharding == other[key], (key, got.sharding)
        for s in got.addressable_shards:
          assert np.asarray(s.data).tobytes() == x[s.index].tobytes(), key

    def like(k):
      v = values(k)
      return {**{key: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=other[key])
                 for key, x in v.items()}, "run": ""}

    outcomes = {}

    def attempt(label, fn):
      try:
        fn()
      except Exception as err:
        outcomes[label] = [type(err).__name__, str(err)]
      else:
        outcomes[label] = ["ok", ""]

    def patched(owner, name, new):
      real = getattr(owner, name)
      setattr(owner, name, new(real))
      return lambda: setattr(owner, name, real)

    # A save, a non-blocking save, restores by both processes.
    bt.save(f"{url}/a", placed(1), barrier_timeout_s=T)
    check(bt.restore(f"{url}/a", like(1)), 1)
    h = bt.save(f"{url}/b", placed(2), blocking=False, barrier_timeout_s=T,
                progress=True)
    h.wait()
    check(bt.restore(f"{url}/b", like(2)), 2)
    # A second save without overwrite: every process raises FileExistsError.
    attempt("exists", lambda: bt.save(f"{url}/a", placed(3), barrier_timeout_s=T))
    # Overwrite: the new tree, the old one readable until the new commit.
    bt.save(f"{url}/a", placed(3), overwrite=True, barrier_timeout_s=T)
    check(bt.restore(f"{url}/a", like(3)), 3)

    def failing(real):
      def fail(*a, **k):
        raise OSError(28, "No space left on device (injected)")
      return fail

    def after_upload(real):
      def up(self, *a):
        real(self, *a)
        raise OSError(5, "I/O error after the upload (injected)")
      return up

    def lost(real):  # the commit applied, its answer lost
      def replace(self, *a):
        real(self, *a)
        raise OSError(5, "the connection dropped (injected)")
      return replace

    for label, owner, name, new, path, ow, who in (
        ("before", hostvalue, "write_npy", failing, "c", False, 1),
        ("after", remote.Bucket, "write", after_upload, "c", False, 1),
        ("overwrite", remote.Bucket, "write", after_upload, "a", True, 1),
        ("lost", stores.ObstoreStorage, "replace", lost, "b", True, 0)):
      undo = patched(owner, name, new) if pid == who else (lambda: None)
      attempt(label, lambda: bt.save(f"{url}/{path}", placed(4),
                                     overwrite=ow, barrier_timeout_s=T))
      undo()
    check(bt.restore(f"{url}/a", like(3)), 3)  # the old one stays
    check(bt.restore(f"{url}/b", like(4)), 4)  # read back: committed

    # CheckpointManager: save, retention, restore, delete.
    mgr = bt.CheckpointManager(f"{url}/run", max_to_keep=2, barrier_timeout_s=T)
    for step in (1, 2, 3):
      assert mgr.save(step, placed(step), blocking=step != 2)
    mgr.wait_until_finished()
    assert mgr.all_steps() == [2, 3], mgr.all_steps()
    check(mgr.restore(target=like(3)), 3)
    check(mgr.restore(2, target=like(2)), 2)
    mgr.delete(2)
    assert mgr.all_steps() == [3], mgr.all_steps()
    mgr.close()

    # Process 1 dies (SIGKILL) while it uploads its shards.
    with open(f"{base}/out-{pid}.json", "w") as f:
      json.dump(outcomes, f)
    if pid == 1:
      patched(remote, "_upload",
              lambda real: lambda *a: os.kill(os.getpid(), signal.SIGKILL))
    attempt("killed", lambda: bt.save(f"{url}/d", placed(5), barrier_timeout_s=3))
    with open(f"{base}/out-{pid}.json", "w") as f:
      json.dump(outcomes, f)
    print("WORKER-OK", pid, flush=True)
    os._exit(0)  # jax.distributed's shutdown would wait for process 1
""")

namespace: dict = {}
exec(VALUES, namespace)
values = namespace["values"]


@pytest.fixture
def s3(s3_endpoint, monkeypatch):
  for k, v in object_servers.S3_ENV.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
  return boto3.client(
    "s3",
    endpoint_url=s3_endpoint,
    aws_access_key_id="testing",
    aws_secret_access_key="testing",
    region_name="us-east-1",
  )


def _objects(s3, prefix):
  pages = s3.get_paginator("list_objects_v2").paginate(
    Bucket="ckpt", Prefix=prefix + "/"
  )
  return sorted(
    o["Key"][len(prefix) + 1 :]
    for page in pages
    for o in page.get("Contents", [])
  )


def _download(s3, prefix, into):
  """A plain copy of the objects under ``prefix`` (as any tool makes it)."""
  for key in _objects(s3, prefix):
    dst = os.path.join(into, *key.split("/"))
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    s3.download_file("ckpt", f"{prefix}/{key}", dst)
  return into


def test_two_processes_save_to_a_bucket(s3, tmp_path):
  base = str(tmp_path)
  url = "s3://ckpt/two"
  outputs = run_n(WORKER, base, 2, timeout=240, extra=(url,), dead=(1,))
  for text in outputs:  # save(progress=True): each process's bar, one pass
    assert "save [" in text and "upload [" not in text, text[-2000:]
  out = [json.load(open(os.path.join(base, f"out-{p}.json"))) for p in (0, 1)]
  for p in (0, 1):
    kind, text = out[p]["exists"]
    assert kind in ("FileExistsError", "RuntimeError"), (p, kind, text)
    assert "pass overwrite=True" in text, (p, text)
    assert out[p]["lost"] == ["ok", ""], (p, out[p]["lost"])
    for label in ("before", "after", "overwrite"):
      kind, text = out[p][label]
      assert kind != "ok", (p, label)
      assert "injected" in text, (p, label, text)
      if p == 0:  # the others' error names the process that failed
        assert "failed on process 1" in text, (label, text)
  assert "nothing was committed" in out[0]["after"][1], out[0]["after"]
  kind, text = out[0]["killed"]
  assert kind == "TimeoutError", (kind, text)
  assert "for process 1 to finish writing" in text, text
  assert "nothing was committed" in text, text

  # Nothing is committed where a save failed; the objects of a committed
  # save are those a save to disk writes, and read back with numpy alone.
  for name in ("c", "d"):
    assert HEAD not in _objects(s3, f"two/{name}"), name
    with pytest.raises(FileNotFoundError, match="did not commit"):
      bt.restore(f"{url}/{name}")
  head = json.loads(
    s3.get_object(Bucket="ckpt", Key=f"two/a/{HEAD}")["Body"].read()
  )
  version = f"two/a/.jaxworks-v/{head['save']}"
  keys = _objects(s3, version)
  assert keys == sorted(
    [RECORD, "jaxworks_manifest.json", "n.npy"]
    + [f"w.shards/{i}.npy" for i in range(8)]
    + [f"h.shards/{i}.npy" for i in range(4)]
    + ["r.shards/0.npy"]
  ), keys
  got = numpy_read(_download(s3, version, os.path.join(base, "copy")))
  for k, x in values(3).items():
    assert got[k].tobytes() == x.tobytes(), k

  # This one process restores them (every shard), and the manager's steps.
  out = bt.restore(f"{url}/a")
  assert out["run"] == "exp-3"
  for k, x in values(3).items():
    assert np.asarray(out[k]).tobytes() == x.tobytes(), k
  mgr = bt.CheckpointManager(f"{url}/run")
  assert mgr.all_steps() == [3]
  mesh = jax.make_mesh((8,), ("x",))
  like = {
    k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P()))
    for k, x in values(3).items()
  }
  got = mgr.restore(target={**like, "run": ""})
  for k, x in values(3).items():
    assert np.asarray(got[k]).tobytes() == x.tobytes(), k
