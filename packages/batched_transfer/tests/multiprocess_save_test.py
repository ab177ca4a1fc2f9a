"""save, save(blocking=False) and CheckpointManager across two processes
(jax.distributed on 127.0.0.1, 4 CPU devices each): each process writes its
shards, process 0 the manifest, the commit after a barrier; restore by two
processes onto other shardings (each reading only the shard files its
devices need), by this one process, and by numpy alone."""

import json
import os
import textwrap

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import ml_dtypes
from multiprocess_util import numpy_read
from multiprocess_util import run_two
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

    # Every finished save's keys are gone from the coordinator's store.
    from jaxworks.batched_transfer._src import jax_internals as ji
    client = ji.distributed_client()
    client.wait_at_barrier("saves-done", 60_000)
    left = client.key_value_dir_get("jaxworks/batched_transfer/save/")
    assert left == [], left
    # Both have looked before either posts the next save's keys.
    client.wait_at_barrier("keys-checked", 60_000)

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


def test_two_processes_save_and_restore(tmp_path):
  base = str(tmp_path)
  run_two(WORKER, base)

  namespace: dict = {}
  exec(VALUES, namespace)
  values = namespace["values"]
  # numpy alone
  for path, step in (("sync", 0), ("async", 1), ("run/3", 3)):
    got = numpy_read(os.path.join(base, path))
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


SETUP = VALUES + textwrap.dedent("""
    import os, sys, time
    process_id, port, base = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=process_id, initialization_timeout=60)
    from jaxworks import batched_transfer as bt
    # Private: save's steps, patched to count, fail or kill.
    from jaxworks.batched_transfer._src.checkpoint import commit, hostvalue, multiprocess
    mesh = jax.make_mesh((8,), ("x",))

    def placed(step=0):
      v = values(step)
      s = {"w": NamedSharding(mesh, P("x")), "h": NamedSharding(mesh, P("x")),
           "r": NamedSharding(mesh, P()), "n": None}
      return {k: v[k] if s[k] is None else jax.device_put(v[k], s[k]) for k in v}
""")

FAIL_WORKER = SETUP + textwrap.dedent("""
    def inject(pid, owner, name, what):
      # owner.name raises OSError(what) once, on process pid only.
      real = getattr(owner, name)
      def boom(*a, **k):
        setattr(owner, name, real)
        raise OSError(5, what)
      if process_id == pid:
        setattr(owner, name, boom)

    def expect(pid, what, call, path):
      # Every process raises within seconds (the timeout is 60 s); the
      # failing process its own error, the others one naming it.
      t0 = time.monotonic()
      try:
        call()
      except Exception as err:
        took, text = time.monotonic() - t0, str(err)
      else:
        raise SystemExit(f"no error for {what}")
      assert took < 10, (what, took)
      assert what in text, (what, text)
      if process_id != pid:
        assert f"failed on process {pid}" in text, text
        assert "jaxworks.batched_transfer" in text and repr(path) in text, text
      print("FAILED-FAST", what, round(took, 3), flush=True)

    def save(name, step, **kw):
      return bt.save(f"{base}/{name}", placed(step), overwrite=True,
                     barrier_timeout_s=60, **kw)

    # Each failure is followed by a save with the same processes that works.
    cases = [(1, multiprocess, "plan_save", "boom-plan"),
             (0, commit, "clean", "boom-clean"),
             (0, commit, "temp_name", "boom-mkdir"),
             (1, hostvalue, "write_npy", "boom-write"),
             (0, commit, "publish", "boom-commit")]
    for n, (pid, owner, name, what) in enumerate(cases):
      inject(pid, owner, name, what)
      expect(pid, what, lambda: save("c", 10 + n), f"{base}/c")
      save("c", n)
    # A non-blocking save whose host copy fails on process 1 (in the call):
    # process 0's handle fails in the background; no one waits for it, so
    # process 0's next save raises it, inside that collective save, and so
    # process 1's raises too (in step); then a save works.
    path = f"{base}/c"
    inject(1, hostvalue, "start_copy", "boom-copy")
    if process_id == 1:
      expect(1, "boom-copy", lambda: save("c", 20, blocking=False), path)
    else:
      save("c", 20, blocking=False)._event.wait()  # failed, not seen
    expect(0, "boom-copy", lambda: save("c", 21), path)
    save("c", 5)
    # The manager: retention fails on process 0 after the commit; a
    # non-blocking step whose host copy fails on process 1, whose error
    # process 0 raises at its next step; then steps work.
    mgr = bt.CheckpointManager(f"{base}/run", max_to_keep=1, barrier_timeout_s=60)
    assert mgr.save(1, placed(1), blocking=True)
    if process_id == 0:
      def retain():
        raise OSError(5, "boom-retain")
      mgr._retain = retain
    # Retention failing after the step committed only warns (the next save
    # retries it): every process returns.
    assert mgr.save(2, placed(2), blocking=True)
    mgr.__dict__.pop("_retain", None)
    inject(1, hostvalue, "start_copy", "boom-step")
    if process_id == 1:
      expect(1, "boom-step", lambda: mgr.save(3, placed(3)), f"{base}/run/3")
    else:
      assert mgr.save(3, placed(3))
    def step4():
      mgr.save(4, placed(4))
      mgr.wait_until_finished()  # process 1: its error is in the background
    expect(0, "boom-step", step4, f"{base}/run/4")
    assert mgr.save(5, placed(5))
    mgr.wait_until_finished()
    assert mgr.all_steps() == [5], mgr.all_steps()
    # Failed saves too leave no keys once both processes raised.
    from jaxworks.batched_transfer._src import jax_internals as ji
    client = ji.distributed_client()
    client.wait_at_barrier("saves-done", 60_000)
    left = client.key_value_dir_get("jaxworks/batched_transfer/save/")
    assert left == [], left
    print("WORKER-OK", process_id, flush=True)
""")


def test_a_failure_on_one_process_is_raised_by_all_at_once(tmp_path):
  """Each process fails in turn at some stage of a collective save (barrier
  timeout 60 s): both raise within seconds, the others naming the failing
  process, and the next save of the same processes works (their save
  numbers stay in step)."""
  base = str(tmp_path)
  outputs = run_two(FAIL_WORKER, base)
  for i, text in enumerate(outputs):
    assert text.count("FAILED-FAST") == 7 + 2 * i, text
  namespace: dict = {}
  exec(VALUES, namespace)
  for path, step in (("c", 5), ("run/5", 5)):
    got = numpy_read(os.path.join(base, path))
    want = namespace["values"](step)
    for k in want:
      assert got[k].tobytes() == want[k].tobytes(), (path, k)
  assert sorted(os.listdir(base)) == ["c", "run"]
  assert sorted(os.listdir(os.path.join(base, "run"))) == ["5"]


DONATE_WORKER = SETUP + textwrap.dedent("""
    # What a non-blocking save holds: the host views of the shards
    # (recorded as (buffer, view) addresses), no private copies.
    held = []
    real_of = hostvalue.of
    def of(x):
      out = real_of(x)
      held.append((x.unsafe_buffer_pointer(), out.ctypes.data))
      return out
    hostvalue.of = of
    step = jax.jit(lambda t: jax.tree.map(lambda a: a * 2 + 1, t), donate_argnums=0)
    tree = placed(0)
    del tree["n"]  # a host leaf: not donated
    h = bt.save(f"{base}/async", tree, blocking=False)
    mine = len(held)
    for _ in range(3):  # the next steps donate and overwrite the arrays
      tree = step(tree)
    h.wait()
    assert mine == 4 + 4 + 1 * (process_id == 0), held  # w, h shards; r once
    assert all(buf == view for buf, view in held), held
    mgr = bt.CheckpointManager(f"{base}/run")
    for s in (1, 2):
      assert mgr.save(s, tree)  # steps 1, 2 hold the values after 3, 6 steps
      tree = step(step(step(tree)))
    mgr.wait_until_finished()
    print("WORKER-OK", process_id, flush=True)
""")


def test_a_non_blocking_save_holds_views_while_the_next_steps_donate(
  tmp_path,
):
  """save(blocking=False) across processes holds each shard's host view (no
  copy); the next steps donate and overwrite the arrays while it writes, and
  the checkpoints hold the values at the calls."""
  base = str(tmp_path)
  run_two(DONATE_WORKER, base)
  namespace: dict = {}
  exec(VALUES, namespace)
  want = {k: v for k, v in namespace["values"](0).items() if k != "n"}
  for path in ("async", "run/1", "run/2"):
    got = numpy_read(os.path.join(base, path))
    assert sorted(got) == sorted(want)
    for k in want:
      assert got[k].dtype == want[k].dtype
      assert got[k].tobytes() == want[k].tobytes(), (path, k)
    for _ in range(3):  # three steps, rounded as the device rounds
      want = {k: (v * 2 + 1).astype(v.dtype) for k, v in want.items()}


HOST_TREES = textwrap.dedent("""
    import os, sys
    process_id, port, base = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=process_id, initialization_timeout=60)
    from jaxworks import batched_transfer as bt
    # Private: save's steps, patched to count, fail or kill.
    from jaxworks.batched_transfer._src.checkpoint import hostvalue

    writes = []
    real_write = hostvalue.write_npy
    def counting(f, value):
      writes.append(getattr(f, "name", "?"))
      return real_write(f, value)
    hostvalue.write_npy = counting

    # A tree with no cross-process array, saved by both processes: written
    # once (process 0), after both trees were found equal. (Both processes
    # used to write it: FileExistsError on one, depending on timing.)
    host = {"a": np.arange(6, dtype=np.int32), "cfg": {"run": "exp-42", "seed": 3},
            "none": None}
    bt.save(f"{base}/host", host)
    assert (len(writes) > 0) == (process_id == 0), writes
    out = bt.restore(f"{base}/host")
    assert out["cfg"] == {"run": "exp-42", "seed": 3} and out["none"] is None
    np.testing.assert_array_equal(np.asarray(out["a"]), host["a"])
    # The manager: the same step, once, listed on both.
    mgr = bt.CheckpointManager(f"{base}/run", max_to_keep=1)
    for step in (1, 2):
      assert mgr.save(step, host)
    mgr.wait_until_finished()
    assert mgr.all_steps() == [2], mgr.all_steps()
    h = bt.save(f"{base}/host-async", host, blocking=False)
    h.wait()

    def expect(fn, cls, text):
      try:
        fn()
      except cls as err:
        assert text in str(err), (text, err)
      else:
        raise SystemExit(f"no {cls.__name__}: {text}")

    # Values that differ between the processes: refused by both, nothing
    # committed (process 0 would have written its own and dropped 1's).
    differ = {"a": np.arange(6) + process_id}
    expect(lambda: bt.save(f"{base}/differ", differ),
           ValueError if process_id == 0 else RuntimeError,
           "differs between process 0 and process 1")
    differ_str = {"run": f"p{process_id}"}
    expect(lambda: bt.save(f"{base}/differ", differ_str),
           ValueError if process_id == 0 else RuntimeError,
           "save different trees")
    assert not os.path.exists(f"{base}/differ")
    # Per-process checkpoints: collective=False, each process alone.
    bt.save(f"{base}/own-{process_id}", differ, collective=False)
    got = bt.restore(f"{base}/own-{process_id}")
    assert int(np.asarray(got["a"])[0]) == process_id

    # Two leaves, one file: a host leaf at key "w.shards/0" and shard 0 of
    # the sharded array "w" (both processes restored w with rows replaced).
    mesh = jax.make_mesh((8,), ("x",))
    wv = np.arange(64.0, dtype=np.float32).reshape(16, 4)
    w = jax.device_put(wv, NamedSharding(mesh, P("x")))
    clash = {"w": w, "w.shards": {"0": np.zeros((2, 4), np.float32)}}
    expect(lambda: bt.save(f"{base}/clash", clash), ValueError,
           "'w.shards/0.npy'")
    assert not os.path.exists(f"{base}/clash")
    # str and None leaves beside sharded arrays.
    bt.save(f"{base}/mixed", {"w": w, "note": "hello", "none": None})
    out = bt.restore(f"{base}/mixed", {"w": jax.ShapeDtypeStruct(w.shape, w.dtype,
                                                                 sharding=w.sharding),
                                       "note": ""})
    assert out["note"] == "hello"
    for s in out["w"].addressable_shards:
      assert np.asarray(s.data).tobytes() == wv[s.index].tobytes()
    print("WORKER-OK", process_id, flush=True)
""")


def test_trees_that_span_no_processes_are_written_once(tmp_path):
  run_two(HOST_TREES, str(tmp_path))
  assert sorted(os.listdir(tmp_path / "run")) == ["2"]
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]
