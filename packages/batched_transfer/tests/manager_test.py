"""CheckpointManager: steps, retention, should_save, restore, delete, errors,
and a training loop killed (SIGKILL) at 30 random moments."""

import os
import random
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from jaxworks import batched_transfer as bt
from jaxworks.batched_transfer._src.checkpoint import commit
from jaxworks.batched_transfer._src.checkpoint import saver

TREE = textwrap.dedent("""
    import numpy as np

    def tree(step):
      rng = np.random.default_rng(step)
      return {"params": {"w": rng.standard_normal((128, 512)).astype(np.float32),
                         "b": np.full(7, step, np.int32)},
              "opt": [rng.integers(0, 100, 5000).astype(np.int16)]}
""")
namespace: dict = {}
exec(TREE, namespace)
tree = namespace["tree"]
LIKE = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree(0))


def check_step(mgr, step):
  out = mgr.restore(step, target=LIKE)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(tree(step))):
    assert np.asarray(a).tobytes() == b.tobytes(), step


def test_steps_retention_and_restore(tmp_path):
  mgr = bt.CheckpointManager(
    tmp_path / "run", max_to_keep=2, keep_period=4, save_interval_steps=2
  )
  assert mgr.all_steps() == [] and mgr.latest_step() is None
  with pytest.raises(FileNotFoundError, match="no committed step"):
    mgr.restore(target=LIKE)
  saved = [s for s in range(13) if mgr.save(s, tree(s))]
  assert saved == [0, 2, 4, 6, 8, 10, 12]
  mgr.wait_until_finished()
  assert mgr.all_steps() == [0, 4, 8, 10, 12]
  assert mgr.latest_step() == 12
  assert not mgr.should_save(12) and not mgr.should_save(13)
  assert mgr.should_save(14) and not mgr.should_save(11)
  check_step(mgr, 12)
  out = mgr.restore(target=LIKE)  # the latest
  assert int(out["params"]["b"][0]) == 12
  check_step(mgr, 4)
  mgr.delete(4)
  assert mgr.all_steps() == [0, 8, 10, 12]
  with pytest.raises(
    FileNotFoundError, match=r"no step 4 .* are \[0, 8, 10, 12\]"
  ):
    mgr.restore(4, target=LIKE)
  assert mgr.save(13, tree(13), force=True, blocking=True)
  with pytest.raises(FileExistsError, match="step 13 exists"):
    mgr.save(13, tree(13), force=True)
  assert sorted(os.listdir(tmp_path / "run")) == ["0", "12", "13", "8"]


def test_placement_and_bad_arguments(tmp_path):
  mesh = jax.make_mesh((8,), ("x",))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  with bt.CheckpointManager(tmp_path) as mgr:
    mgr.save(1, {"w": np.arange(16, dtype=np.float32)})
  out = mgr.restore(
    target={"w": jax.ShapeDtypeStruct((16,), np.float32)}, placement=rows
  )
  assert out["w"].sharding == rows
  with pytest.raises(ValueError, match="max_to_keep must be a positive int"):
    bt.CheckpointManager(tmp_path, max_to_keep=0)
  with pytest.raises(ValueError, match="is a URL"):
    bt.CheckpointManager("gs://bucket/run")
  with pytest.raises(TypeError, match="step must be an int"):
    mgr.save("3", {})
  with pytest.raises(TypeError, match="pass target="):
    mgr.restore()


def test_a_failed_background_save_is_raised_by_the_next_call(
  tmp_path, monkeypatch
):
  mgr = bt.CheckpointManager(tmp_path)

  def boom(*a):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(saver, "write_checkpoint", boom)
  assert mgr.save(1, tree(1))
  with pytest.raises(OSError, match="No space left"):
    mgr.wait_until_finished()
  assert mgr.all_steps() == []
  mgr.save(2, tree(2))
  with pytest.raises(OSError, match="No space left"):
    mgr.save(3, tree(3))  # raises the error of step 2
  monkeypatch.undo()
  assert mgr.save(3, tree(3), blocking=True)
  assert mgr.all_steps() == [3]


def test_leftovers_of_killed_steps_are_never_listed_and_are_cleaned(tmp_path):
  mgr = bt.CheckpointManager(tmp_path)
  for name in (
    ".7.jaxworks-new-0123456789abcdef",
    ".3.jaxworks-del-0123456789abcdef",
  ):
    os.mkdir(tmp_path / name)
    (tmp_path / name / "x.npy").write_bytes(b"half")
  (tmp_path / "notes.txt").write_text("mine")
  (tmp_path / "9-old").mkdir()
  assert mgr.all_steps() == []
  mgr.save(8, tree(8), blocking=True)
  assert sorted(os.listdir(tmp_path)) == ["8", "9-old", "notes.txt"]


ZYGOTE = TREE + textwrap.dedent("""
    import os, signal, sys, time
    from jaxworks import batched_transfer as bt
    directory = sys.argv[1]
    t0 = time.perf_counter()
    bt.CheckpointManager(directory).save(0, tree(0), blocking=True)
    print("ready", time.perf_counter() - t0, flush=True)
    for line in sys.stdin:
      delay = float(line)
      pid = os.fork()
      if pid == 0:
        mgr = bt.CheckpointManager(directory, max_to_keep=2, keep_period=5)
        step = mgr.latest_step() + 1
        while True:  # a training loop: a step, then an async save
          mgr.save(step, tree(step))
          step += 1
      time.sleep(delay)
      os.kill(pid, signal.SIGKILL)
      os.waitpid(pid, 0)
      print("killed", flush=True)
""")


def test_a_killed_training_loop_leaves_only_complete_steps(tmp_path):
  directory = str(tmp_path / "run")
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
  zygote = subprocess.Popen(
    [sys.executable, "-c", ZYGOTE, directory],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
    env=env,
  )
  rng = random.Random("manager-kill")
  mgr = bt.CheckpointManager(directory)
  latest, leftovers = [], 0
  try:
    ready = zygote.stdout.readline().split()
    assert ready and ready[0] == "ready", ready
    one_save = float(ready[1])
    for _ in range(30):
      zygote.stdin.write(f"{rng.uniform(0, 4 * one_save + 0.01)}\n")
      zygote.stdin.flush()
      assert zygote.stdout.readline().strip() == "killed"
      leftovers += bool(commit.step_temporaries(directory))
      steps = mgr.all_steps()
      assert steps, "no committed step"
      for s in steps:  # every listed step is complete, bit for bit
        check_step(mgr, s)
      recent = [s for s in steps if s % 5]
      assert len(recent) <= 3, steps  # max_to_keep, and one not yet retired
      if latest:
        assert steps[-1] >= latest[-1]  # a committed step stays
      latest.append(steps[-1])
  finally:
    zygote.stdin.close()
    zygote.kill()
    zygote.wait()
  assert leftovers, "no kill landed in the middle of a save"
  assert latest[-1] > latest[0], latest  # the loop made progress
  mgr.save(latest[-1] + 1, tree(latest[-1] + 1), blocking=True)
  assert commit.step_temporaries(directory) == []
  assert all(n.isdigit() for n in os.listdir(directory)), os.listdir(directory)
