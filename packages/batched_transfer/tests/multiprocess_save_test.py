"""save, save(blocking=False) and CheckpointManager across two processes
(jax.distributed on 127.0.0.1, 4 CPU devices each): each process writes its
shards, process 0 the manifest, the commit after a barrier; restore by two
processes onto other shardings (each reading only the shard files its
devices need), by this one process, and by numpy alone."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import ml_dtypes
import numpy as np

from jaxworks import batched_transfer as bt

VALUES = textwrap.dedent("""
    import numpy as np
    import ml_dtypes

    def values(step=0):
      rng = np.random.default_rng(step)
      return {"w": rng.standard_normal((16, 4)).astype(np.float32),
              "h": rng.standard_normal((8, 6)).astype(ml_dtypes.bfloat16),
              "r": np.arange(12, dtype=np.int32).reshape(4, 3) + step,
              "n": np.arange(5, dtype=np.int16)}
""")

WORKER = VALUES + textwrap.dedent("""
    import sys, time
    process_id, port, base = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=process_id, initialization_timeout=60)
    from jaxworks import batched_transfer as bt
    assert jax.process_count() == 2 and jax.device_count() == 8

    mesh = jax.make_mesh((8,), ("x",))
    mesh2 = jax.make_mesh((4, 2), ("a", "b"))
    shardings = {"w": NamedSharding(mesh, P("x")),
                 "h": NamedSharding(mesh2, P("a")),  # each shard on 2 devices
                 "r": NamedSharding(mesh, P()),      # on every device
                 "n": None}                          # a host array

    def placed(step=0):
      v = values(step)
      return {k: v[k] if s is None else jax.device_put(v[k], s)
              for k, s in shardings.items()}

    bt.save(f"{base}/sync", placed())
    h = bt.save(f"{base}/async", placed(1), blocking=False)
    h.wait()
    mgr = bt.CheckpointManager(f"{base}/run", max_to_keep=2)
    for step in range(1, 4):
      assert mgr.save(step, placed(step))
    mgr.wait_until_finished()
    assert mgr.all_steps() == [2, 3], mgr.all_steps()

    # Restore by both processes onto other shardings; record the shard files read.
    other = {"w": NamedSharding(mesh2, P("b", "a")),
             "h": NamedSharding(mesh, P(None, None)),
             "r": NamedSharding(mesh2, P("a")),
             "n": NamedSharding(mesh, P())}
    import os
    opened = []  # the files restore opens (shard files: relative to the checkpoint)
    real_open = os.open
    def spy_open(file, *a, **k):
      opened.append(str(file))
      return real_open(file, *a, **k)
    os.open = spy_open
    for path, step in ((f"{base}/sync", 0), (f"{base}/async", 1), (None, 3)):
      v = values(step)
      like = {k: jax.ShapeDtypeStruct(v[k].shape, v[k].dtype, sharding=other[k]) for k in v}
      out = bt.restore(path, like) if path else mgr.restore(target=like)
      for k, x in out.items():
        assert x.sharding == other[k], k
        for s in x.addressable_shards:
          assert np.asarray(s.data).tobytes() == v[k][s.index].tobytes(), (k, path)
    os.open = real_open
    # Rows of w: this process's devices hold rows 8*pid..8*pid+7 with rows
    # over mesh (the restore of "sync" onto rows reads 4 of the 8 row files).
    opened.clear(); os.open = spy_open
    v = values(0)
    like = {k: jax.ShapeDtypeStruct(v[k].shape, v[k].dtype, sharding=other[k]) for k in v}
    like["w"] = jax.ShapeDtypeStruct((16, 4), np.float32, sharding=shardings["w"])
    out = bt.restore(f"{base}/sync", like)
    os.open = real_open
    w_files = sorted(f.rsplit("/", 1)[1] for f in opened if "w.shards" in f)
    assert w_files == [f"{n}.npy" for n in range(4 * process_id, 4 * process_id + 4)], w_files

    # A process that never arrives: the other gets TimeoutError, nothing is committed.
    lost = out  # global arrays made with no collective (device_put's check is one)
    bt.save(f"{base}/sync", out, overwrite=True)  # replaces a manifest checkpoint
    if process_id == 0:
      try:
        bt.save(f"{base}/lost", lost, barrier_timeout_s=3)
      except TimeoutError as err:
        assert "barrier_timeout_s" in str(err), err
      else:
        raise SystemExit("no TimeoutError")
      import os
      assert not os.path.exists(f"{base}/lost")
      assert not [n for n in os.listdir(base) if n.startswith(".lost.")]
    print("WORKER-OK", process_id, flush=True)
""")


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _numpy_read(path):
  """Every array of a multi-process checkpoint, with numpy and json alone."""
  with open(os.path.join(path, "jaxworks_manifest.json")) as f:
    manifest = json.load(f)
  out = {}
  for key, entry in manifest["arrays"].items():
    dtype = np.dtype(entry["dtype"])  # ml_dtypes names need ml_dtypes imported
    a = np.empty(entry["shape"], dtype)
    for shard in entry["shards"]:
      data = np.load(os.path.join(path, shard["file"]))
      where = tuple(
        slice(s, s + n) for s, n in zip(shard["start"], shard["shape"])
      )
      a[where] = data.view(dtype) if data.dtype.kind == "V" else data
    out[key] = a
  return out


def test_two_processes_save_and_restore(tmp_path):
  base = str(tmp_path)
  env = dict(os.environ)
  env.update(
    JAX_PLATFORMS="cpu",
    XLA_FLAGS="--xla_force_host_platform_device_count=4",
    PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
  )
  port = str(_free_port())
  procs = [
    subprocess.Popen(
      [
        sys.executable,
        "-c",
        "import faulthandler; faulthandler.dump_traceback_later(120, exit=True)\n"
        + WORKER,
        str(i),
        port,
        base,
      ],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=150)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.communicate()
  for i, (p, text) in enumerate(zip(procs, outputs)):
    assert f"WORKER-OK {i}" in text, f"process {i}:\n{text[-4000:]}"

  namespace: dict = {}
  exec(VALUES, namespace)
  values = namespace["values"]
  # numpy alone
  for path, step in (("sync", 0), ("async", 1), ("run/3", 3)):
    got = _numpy_read(os.path.join(base, path))
    want = values(step)
    assert sorted(got) == sorted(want)
    for k in want:
      assert (
        got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes()
      )
  with open(os.path.join(base, "async", "jaxworks_manifest.json")) as f:
    manifest = json.load(f)
  assert manifest["processes"] == 2
  assert len(manifest["arrays"]["w"]["shards"]) == 8
  assert len(manifest["arrays"]["h"]["shards"]) == 4  # replicated pairs once
  assert len(manifest["arrays"]["r"]["shards"]) == 1
  assert sorted(os.listdir(os.path.join(base, "run"))) == ["2", "3"]
  assert not any(n.startswith(".sync.") for n in os.listdir(base))
  # Written by two processes, read by one (8 devices here), onto rows.
  mesh = jax.make_mesh((8,), ("x",))
  want = values(0)
  like = {
    k: jax.ShapeDtypeStruct(
      v.shape,
      v.dtype,
      sharding=NamedSharding(mesh, P("x") if k == "h" else P()),
    )
    for k, v in want.items()
  }
  out = bt.restore(os.path.join(base, "sync"), like)
  for k, x in out.items():
    assert np.asarray(x).tobytes() == want[k].tobytes(), k
  assert out["h"].dtype == ml_dtypes.bfloat16
