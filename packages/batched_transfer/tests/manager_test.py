"""CheckpointManager: steps, retention, should_save, restore, delete, errors,
metrics and best_fn, keep_time_interval, should_save_fn and save_on_steps,
named items, step names, read-only managers, and a training loop killed
(SIGKILL) at 30 random moments."""

import datetime
import inspect
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import warnings

import jax
import numpy as np
import pytest

from jaxworks import batched_transfer as bt

# Private imports below: commit's temp names, the lease file, a write patched.
from jaxworks.batched_transfer._src.checkpoint import commit
from jaxworks.batched_transfer._src.checkpoint import destination
from jaxworks.batched_transfer._src.checkpoint import lease

#: Temporary names saves of numbered steps leave (commit.temp_name).
STEP_TEMPS = commit.temp_pattern(r"\d+")

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


def listed(directory):
  """The names in a manager's directory but its writer lease (held from
  its first save until close())."""
  return sorted(n for n in os.listdir(directory) if n != lease.PREFIX)


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
  mgr.wait_until_finished()  # deleted steps are removed in the background
  assert listed(tmp_path / "run") == ["0", "12", "13", "8"]
  mgr.close()  # gives the writer lease back: only the steps remain
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
    bt.CheckpointManager("hdfs://namenode/run")
  with pytest.raises(TypeError, match="step must be an int"):
    mgr.save("3", {})
  with pytest.raises(TypeError, match="pass the tree to save, or items="):
    mgr.save(3)
  with pytest.raises(TypeError, match="not both"):
    mgr.save(3, {"w": 1}, items={"a": {"w": 1}})
  with pytest.raises(ValueError, match="best_mode must be 'max' or 'min'"):
    bt.CheckpointManager(tmp_path, best_mode="lowest")
  with pytest.raises(TypeError, match="keep_time_interval must be a datetime"):
    bt.CheckpointManager(tmp_path, keep_time_interval=60)
  with pytest.raises(ValueError, match="step_prefix must be"):
    bt.CheckpointManager(tmp_path, step_prefix="a/b")
  with pytest.raises(ValueError, match="reserved for the step's metrics"):
    bt.CheckpointManager(tmp_path, item_names=["__jaxworks_metrics__"])


def test_a_failed_background_save_is_raised_by_the_next_call(
  tmp_path, monkeypatch
):
  mgr = bt.CheckpointManager(tmp_path)

  def boom(*a):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(destination.DirectorySave, "write", boom)
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
  assert listed(tmp_path) == ["8", "9-old", "notes.txt"]


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
      leftovers += bool(commit.scan(directory, STEP_TEMPS))
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
  mgr.wait_until_finished()  # the steps it dropped go in the background
  assert commit.scan(directory, STEP_TEMPS) == []
  assert all(n.isdigit() for n in listed(directory)), os.listdir(directory)


needs_partial_restore = pytest.mark.skipif(
  "partial_restore" not in inspect.signature(bt.restore).parameters,
  reason="bt.restore(partial_restore=) is not implemented yet",
)
needs_metadata = pytest.mark.skipif(
  not hasattr(bt, "metadata"), reason="bt.metadata is not implemented yet"
)


def small(step):
  return {"w": np.full((3,), step, np.float32), "n": np.arange(4) + step}


SMALL = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), small(0))


def test_metrics_are_stored_with_the_step_and_rank_it(tmp_path):
  mgr = bt.CheckpointManager(
    tmp_path, max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min"
  )
  losses = {1: 0.5, 2: 0.1, 3: 0.9, 4: 0.3, 5: 0.7}
  for step, loss in losses.items():
    assert mgr.save(step, small(step), metrics={"loss": np.float32(loss)})
  mgr.wait_until_finished()
  assert mgr.all_steps() == [2, 4]  # the two lowest losses
  assert mgr.best_step() == 2
  assert mgr.metrics(4) == {"loss": pytest.approx(0.3)}
  # The metrics leaf is in the step's checkpoint (one commit), and restore
  # leaves it out; a target missing a stored leaf is still refused.
  record = json.loads((tmp_path / "4" / "jaxworks_dtypes.json").read_text())
  assert json.loads(record["values"]["__jaxworks_metrics__"])["metrics"] == {
    "loss": pytest.approx(0.3)
  }
  out = mgr.restore(4, target=SMALL)
  assert sorted(out) == ["n", "w"] and float(out["w"][0]) == 4.0
  with pytest.raises(ValueError, match="n"):
    mgr.restore(4, target={"w": SMALL["w"]})
  # A new manager reads the metrics back from disk.
  again = bt.CheckpointManager(
    tmp_path, max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min"
  )
  assert again.best_step() == 2 and again.metrics(2) == {
    "loss": pytest.approx(0.1)
  }
  # Without best_fn, best_step is the latest step (as orbax).
  assert bt.CheckpointManager(tmp_path).best_step() == 4


def test_steps_without_metrics_and_keep_checkpoints_without_metrics(tmp_path):
  def run(keep):
    d = tmp_path / str(keep)
    mgr = bt.CheckpointManager(
      d,
      max_to_keep=2,
      best_fn=lambda m: m["acc"],
      keep_checkpoints_without_metrics=keep,
    )
    with warnings.catch_warnings(record=True) as seen:
      warnings.simplefilter("always")
      mgr.save(1, small(1), blocking=True)  # no metrics
    assert any("without metrics=" in str(w.message) for w in seen)
    for step, acc in ((2, 0.5), (3, 0.9), (4, 0.7)):
      mgr.save(step, small(step), metrics={"acc": acc}, blocking=True)
    return mgr.all_steps(), mgr.best_step()

  assert run(True) == ([1, 3, 4], 3)
  assert run(False) == ([3, 4], 3)


def test_metrics_need_a_dict_tree_and_json(tmp_path):
  mgr = bt.CheckpointManager(tmp_path)
  with pytest.raises(TypeError, match=r"must be a dict.*items=\{'state'"):
    mgr.save(1, [np.zeros(2)], metrics={"loss": 1.0})
  with pytest.raises(ValueError, match="reserved"):
    mgr.save(1, {"__jaxworks_metrics__": np.zeros(2)}, metrics={"a": 1})
  with pytest.raises(TypeError, match="JSON cannot store"):
    mgr.save(1, small(1), metrics={"f": object()})
  assert mgr.all_steps() == []
  # Items carry metrics whatever the item's tree is.
  mgr.save(
    1, items={"state": [np.zeros(2)]}, metrics={"a": [1, 2]}, blocking=True
  )
  assert mgr.metrics(1) == {"a": [1, 2]}


def test_keep_time_interval_keeps_a_step_every_interval(tmp_path):
  mgr = bt.CheckpointManager(
    tmp_path, max_to_keep=1, keep_time_interval=datetime.timedelta(seconds=30)
  )
  t0 = 1_700_000_000
  # Commit times (the step directories' mtimes): every 10 s.
  for step in range(1, 8):
    mgr.save(step, small(step), blocking=True)
    os.utime(tmp_path / str(step), (t0 + 10 * step, t0 + 10 * step))
  # Kept by time: 1 (the first), 4 (30 s after 1), 7 (30 s after 4); 7 is
  # the newest too. Steps 2, 3, 5, 6 went when a newer step committed.
  mgr.save(8, small(8), blocking=True)  # now: long after 7
  assert mgr.all_steps() == [1, 4, 7, 8]


def test_should_save_fn_and_save_on_steps(tmp_path):
  seen = []

  def fn(step, last):
    seen.append((step, last))
    return step % 5 == 0

  mgr = bt.CheckpointManager(
    tmp_path / "fn", should_save_fn=fn, save_on_steps=[3]
  )
  saved = [s for s in range(1, 12) if mgr.save(s, small(s))]
  mgr.wait_until_finished()
  assert saved == [5, 10]  # should_save_fn overrides save_on_steps
  assert seen[:5] == [(1, None), (2, None), (3, None), (4, None), (5, None)]
  assert seen[5] == (6, 5)  # the pending save counts as saved
  mgr = bt.CheckpointManager(
    tmp_path / "on", save_interval_steps=4, save_on_steps={3, 6, 7}
  )
  saved = [s for s in range(1, 10) if mgr.save(s, small(s))]
  mgr.wait_until_finished()
  assert saved == [1, 3, 4, 6, 7, 8]  # the first step, as orbax
  assert mgr.should_save(12) and not mgr.should_save(11)


@needs_partial_restore
def test_named_items_are_one_step_and_restore_alone(tmp_path):
  mgr = bt.CheckpointManager(tmp_path, item_names=("params", "opt", "data"))
  params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
  opt = [np.ones(3, np.float32), np.zeros(2, np.int32)]
  assert mgr.save(
    1, items={"params": params, "opt": opt}, metrics={"loss": 0.5}
  )
  mgr.wait_until_finished()
  assert listed(tmp_path) == ["1"]  # one step, one commit
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  out = mgr.restore(1, items={"params": like})
  assert list(out) == ["params"]
  np.testing.assert_array_equal(out["params"]["w"], params["w"])
  both = mgr.restore(items={"params": like, "opt": None})
  assert sorted(both) == ["opt", "params"]
  for a, b in zip(both["opt"], opt):
    assert np.asarray(a).dtype == b.dtype
    np.testing.assert_array_equal(a, b)
  with pytest.raises(KeyError, match=r"no item 'data'.*\['opt', 'params'\]"):
    mgr.restore(1, items={"data": None})
  with pytest.raises(ValueError, match="not one of item_names"):
    mgr.save(2, items={"other": params})


@needs_partial_restore
@needs_metadata
def test_named_items_with_str_and_int_leaves(tmp_path):
  mgr = bt.CheckpointManager(tmp_path)
  data = {"epoch": 3, "file": "shard-0007.tfrecord", "offsets": [10, 20]}
  mgr.save(5, items={"params": {"w": np.ones(2)}, "data": data}, blocking=True)
  out = mgr.restore(5, items={"data": None})
  assert out == {"data": data}
  assert jax.tree.map(type, out) == jax.tree.map(type, {"data": data})
  # Metadata: the str and the Python scalars as stored, arrays as their
  # ShapeDtypeStruct (as bt.metadata).
  meta = mgr.item_metadata(5)
  assert meta["data"]["file"] == data["file"]
  assert meta["data"]["epoch"] == 3 and type(meta["data"]["epoch"]) is int
  assert meta["params"]["w"] == jax.ShapeDtypeStruct((2,), np.float64)


@needs_metadata
def test_metadata_reads_no_arrays_and_reload(tmp_path):
  mgr = bt.CheckpointManager(tmp_path, best_fn=lambda m: m["acc"])
  mgr.save(1, small(1), metrics={"acc": 0.25}, blocking=True)
  meta = mgr.metadata(1)
  assert meta.step == 1 and meta.metrics == {"acc": 0.25}
  assert meta.item_metadata == SMALL  # no metrics leaf in it
  assert meta.commit_timestamp_nsecs == os.stat(tmp_path / "1").st_mtime_ns
  assert mgr.metadata() == meta  # the latest
  # Another manager replaces step 1: reload() forgets what was read.
  other = bt.CheckpointManager(tmp_path)
  other.delete(1)
  other.save(1, small(1), metrics={"acc": 0.75}, blocking=True)
  assert mgr.metrics(1) == {"acc": 0.25}  # cached
  mgr.reload()
  assert mgr.metrics(1) == {"acc": 0.75}


def test_is_saving_in_progress_and_check_for_errors(tmp_path, monkeypatch):
  mgr = bt.CheckpointManager(tmp_path)
  gate = threading.Event()
  real = destination.DirectorySave.write
  fail = []

  def slow(*a, **k):
    gate.wait(30)
    if fail:
      raise OSError(28, "No space left on device")
    return real(*a, **k)

  monkeypatch.setattr(destination.DirectorySave, "write", slow)
  assert not mgr.is_saving_in_progress()
  mgr.save(1, small(1))
  assert mgr.is_saving_in_progress()
  mgr.check_for_errors()  # running: nothing to raise, and no wait
  gate.set()
  mgr.wait_until_finished()
  assert not mgr.is_saving_in_progress() and mgr.all_steps() == [1]
  gate.clear()
  fail.append(1)
  mgr.save(2, small(2))
  gate.set()
  while mgr.is_saving_in_progress():
    pass
  with pytest.raises(OSError, match="No space left"):
    mgr.check_for_errors()
  mgr.check_for_errors()  # raised once
  mgr.wait_until_finished()
  assert mgr.all_steps() == [1]


def test_step_prefix_and_fixed_length(tmp_path):
  mgr = bt.CheckpointManager(
    tmp_path, step_prefix="ckpt", step_format_fixed_length=8, max_to_keep=2
  )
  (tmp_path / "7").mkdir()  # not of the format: not a step, left alone
  (tmp_path / "ckpt_7").mkdir()
  (tmp_path / "ckpt_000000007").mkdir()
  (tmp_path / ".ckpt_00000009.jaxworks-new-0123456789abcdef").mkdir()
  assert mgr.all_steps() == []
  for step in (100, 200, 300):
    mgr.save(step, small(step))
  mgr.wait_until_finished()
  assert mgr.all_steps() == [200, 300]
  assert listed(tmp_path) == [
    "7",
    "ckpt_000000007",
    "ckpt_00000200",
    "ckpt_00000300",
    "ckpt_7",
  ]
  assert float(mgr.restore(300, target=SMALL)["w"][0]) == 300.0
  mgr.delete(200)
  assert mgr.all_steps() == [300]
  mgr.save(123456789, small(1), blocking=True)  # longer than 8 digits
  assert os.path.isdir(tmp_path / "ckpt_123456789")
  assert mgr.all_steps() == [300, 123456789]


def test_read_only_never_writes(tmp_path):
  missing = tmp_path / "missing"
  ro = bt.CheckpointManager(missing, read_only=True, max_to_keep=1)
  assert not missing.exists() and ro.all_steps() == []
  assert ro.latest_step() is None and not ro.should_save(1)
  with pytest.warns(UserWarning, match="read only"):
    assert ro.save(1, small(1), force=True) is False
  assert not missing.exists()
  rw = bt.CheckpointManager(tmp_path / "run")
  for step in (1, 2):
    rw.save(step, small(step), blocking=True)
  ro = bt.CheckpointManager(tmp_path / "run", read_only=True, max_to_keep=1)
  with pytest.warns(UserWarning, match="not deleted"):
    assert ro.delete(1) is None
  assert ro.all_steps() == [1, 2]
  assert float(ro.restore(target=SMALL)["w"][0]) == 2.0
