"""CheckpointManager in a two-process job (jax.distributed on 127.0.0.1, 4
CPU devices each): every process makes the same calls (save, delete,
retention, wait_until_finished, close) and they work on both, for trees of
host arrays only and for trees of arrays spanning the processes; process 0
alone holds the directory's writer lease."""

import os
import textwrap

from multiprocess_util import run_two

WORKER = textwrap.dedent("""
    import json, os, sys
    process_id, port, base = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=2, process_id=process_id,
                               initialization_timeout=60)
    from jaxworks import batched_transfer as bt
    assert jax.process_count() == 2 and jax.device_count() == 8
    rows = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))

    def host(step):
      return {"w": np.full((4, 3), step, np.float32), "n": np.arange(5) + step}

    def spread(step):
      return {"w": jax.device_put(np.arange(16.0, dtype=np.float32) + step,
                                  rows),
              "n": np.arange(3, dtype=np.int32) + step}

    # Host arrays only: written once (by process 0), listed by both.
    mgr = bt.CheckpointManager(f"{base}/host")
    for step in (1, 2):
      assert mgr.save(step, host(step), metrics={"acc": float(step)})
    mgr.wait_until_finished()
    assert mgr.all_steps() == [1, 2], mgr.all_steps()
    # No leftovers; the writer lease is process 0's alone (the job's one
    # writer: process 1's saves above did not take one).
    hidden = [n for n in os.listdir(f"{base}/host") if n.startswith(".")]
    assert hidden == [".jaxworks-writer"], hidden
    (gen,) = os.listdir(f"{base}/host/.jaxworks-writer")
    with open(f"{base}/host/.jaxworks-writer/{gen}") as f:
      holder = json.load(f)["pid"]
    if process_id == 0:
      assert holder == os.getpid(), holder
    else:
      assert holder != os.getpid(), holder
    mgr.delete(1)  # both processes: both return
    assert mgr.all_steps() == [2], mgr.all_steps()
    assert mgr.metrics(2) == {"acc": 2.0}
    out = mgr.restore(2, target=jax.eval_shape(lambda: host(2)))
    assert float(out["w"][0, 0]) == 2.0
    # A step that is not there: process 0's error, named on process 1.
    try:
      mgr.delete(7)
    except FileNotFoundError as err:
      assert process_id == 0 and "no step 7" in str(err), err
    except RuntimeError as err:
      assert process_id == 1, err
      assert "failed on process 0" in str(err), err
      assert "FileNotFoundError" in str(err) and "no step 7" in str(err), err
    else:
      raise SystemExit("delete(7) did not raise")
    mgr.close()

    # Arrays spanning both processes, retention by best_fn, a delete while
    # a save is pending.
    acc = {1: 0.5, 2: 0.9, 3: 0.1, 4: 0.7}
    mgr = bt.CheckpointManager(f"{base}/spread", max_to_keep=2,
                               best_fn=lambda m: m["acc"])
    for step in (1, 2, 3, 4):
      assert mgr.save(step, spread(step), metrics={"acc": acc[step]})
    mgr.wait_until_finished()
    assert mgr.all_steps() == [2, 4], mgr.all_steps()
    assert mgr.best_step() == 2
    assert mgr.save(5, spread(5), metrics={"acc": 0.95})  # non-blocking
    # delete waits for the pending save, whose retention deletes step 4.
    mgr.delete(2)
    assert mgr.all_steps() == [5], mgr.all_steps()
    mgr.wait_until_finished()
    like = {"w": jax.ShapeDtypeStruct((16,), np.float32, sharding=rows),
            "n": jax.ShapeDtypeStruct((3,), np.int32)}
    out = mgr.restore(target=like)
    for s in out["w"].addressable_shards:
      np.testing.assert_array_equal(
          np.asarray(s.data), (np.arange(16.0, dtype=np.float32) + 5)[s.index])
    mgr.close()

    # Every collective's keys are gone from the coordinator's store.
    from jaxworks.batched_transfer._src import jax_internals as ji
    client = ji.distributed_client()
    client.wait_at_barrier("manager-done", 60_000)
    left = client.key_value_dir_get("jaxworks/batched_transfer/save/")
    assert left == [], left
    client.wait_at_barrier("manager-checked", 60_000)
    print("WORKER-OK", process_id, flush=True)
""")


def test_every_manager_call_on_both_processes(tmp_path):
  run_two(WORKER, str(tmp_path))
  # This one process sees what the job left.
  assert sorted(os.listdir(tmp_path / "host")) == ["2"]
  assert sorted(os.listdir(tmp_path / "spread")) == ["5"]


LATE = textwrap.dedent("""
    import sys, time
    process_id, port, base = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    import jax
    import numpy as np
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=2, process_id=process_id,
                               initialization_timeout=60)
    from jaxworks import batched_transfer as bt
    mgr = bt.CheckpointManager(f"{base}/run", barrier_timeout_s=2)
    mgr.save(1, {"w": np.ones(3)}, blocking=True)
    if process_id == 1:  # process 0 never calls delete
      t = time.monotonic()
      try:
        mgr.delete(1)
      except TimeoutError as err:
        text = str(err)
        assert "process 0 to call delete too" in text, text
        assert "barrier_timeout_s" in text, text
        assert time.monotonic() - t < 30
      else:
        raise AssertionError("delete returned without process 0")
    else:
      time.sleep(4)
    print("WORKER-OK", process_id, flush=True)
""")


def test_a_collective_delete_that_process_0_never_makes_times_out(tmp_path):
  """The others wait for process 0's outcome at most barrier_timeout_s,
  then raise TimeoutError naming who did not call what."""
  run_two(LATE, str(tmp_path))
