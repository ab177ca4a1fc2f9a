"""Checkpoint edge cases: a header whose byte count overflows int64, a stray
file beside the saved tree, an OrderedDict target, a step that cannot be
removed, metrics JSON cannot hold, metrics of a deleted step, the old copy
an overwriting save leaves to the background reaper (its backlog, its
errors, exit and fork)."""

import collections
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest

from jaxworks import batched_transfer as bt

# Private imports below: commit.remove's threads, patched to refuse, fail or
# wait; commit.REAPER, which removes replaced copies in the background.
from jaxworks.batched_transfer._src.checkpoint import commit


def test_a_header_whose_byte_count_overflows_int64_is_refused(tmp_path):
  """6 * 3074457345618258603 float32 is 2**64 + 2 elements: 8 bytes once
  wrapped to int64, which the 8 bytes of data would match."""
  path = str(tmp_path / "c")
  bt.save(path, {"w": np.zeros(2, np.float32)})
  file = os.path.join(path, "w.npy")
  with open(file, "rb") as f:
    data = f.read()[-8:]
  with open(file, "wb") as f:
    header = {
      "descr": "<f4",
      "fortran_order": False,
      "shape": (6, 3074457345618258603),
    }
    np.lib.format.write_array_header_1_0(f, header)
    f.write(data)
  # The record says the shape save wrote: the header disagrees.
  with pytest.raises(ValueError, match=r"says shape \(2,\); the checkpoint"):
    bt.restore(path)
  # A record without shapes (an earlier version's): the data is too short.
  record = os.path.join(path, "jaxworks_dtypes.json")
  with open(record) as f:
    saved = json.load(f)
  del saved["shapes"]
  with open(record, "w") as f:
    json.dump(saved, f)
  needs = 6 * 3074457345618258603 * 4
  with pytest.raises(ValueError, match=f"holds 8 bytes .* needs {needs}"):
    bt.restore(path)


def test_a_stray_file_is_no_leaf_of_the_saved_tree(tmp_path):
  """restore restores the tree save recorded, as metadata lists it: a stray
  .npy beside it is ignored by both, with a target or without."""
  path = str(tmp_path / "c")
  bt.save(path, {"w": np.arange(3.0, dtype=np.float32), "run": "x"})
  np.save(os.path.join(path, "stray.npy"), np.zeros(2))
  assert sorted(bt.metadata(path)) == ["run", "w"]
  out = bt.restore(path)
  assert sorted(out) == ["run", "w"] and out["run"] == "x"
  np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(3.0))
  # Only the files the record names are the checkpoint's: a target of the
  # saved tree matches it exactly.
  out = bt.restore(path, {"w": np.zeros(3, np.float32), "run": ""})
  assert sorted(out) == ["run", "w"]


def test_an_ordered_dict_target_of_a_step_with_metrics(tmp_path):
  mgr = bt.CheckpointManager(tmp_path)
  state = {"a": np.ones(2, np.float32), "b": np.zeros(3, np.int32)}
  mgr.save(1, state, metrics={"loss": 0.5}, blocking=True)
  like = collections.OrderedDict(b=state["b"], a=state["a"])
  out = mgr.restore(1, like)
  assert type(out) is collections.OrderedDict
  assert list(out) == ["b", "a"]
  np.testing.assert_array_equal(np.asarray(out["a"]), state["a"])


def test_a_step_that_cannot_be_removed_warns_and_goes_later(
  tmp_path, monkeypatch
):
  mgr = bt.CheckpointManager(tmp_path, max_to_keep=1)
  mgr.save(1, {"w": np.ones(2)}, blocking=True)
  real_remove = commit.remove
  monkeypatch.setattr(commit, "remove", lambda p: None)  # EACCES, EBUSY, ...
  with pytest.warns(RuntimeWarning, match="could not all be removed"):
    mgr.delete(1)
    mgr.wait_until_finished()  # the removal runs in the background
  assert mgr.all_steps() == []
  left = [n for n in os.listdir(tmp_path) if ".jaxworks-del-" in n]
  assert len(left) == 1
  monkeypatch.setattr(commit, "remove", real_remove)
  mgr.save(2, {"w": np.ones(2)}, blocking=True)  # the next save removes it
  mgr.close()  # and the writer lease goes with close()
  assert os.listdir(tmp_path) == ["2"]


def test_metrics_json_cannot_hold_and_metrics_of_a_deleted_step(tmp_path):
  mgr = bt.CheckpointManager(tmp_path)
  with pytest.raises(TypeError, match="cannot be written as JSON.*keys"):
    mgr.save(1, {"w": np.ones(2)}, metrics={1: 0.5, "a": 0.2})
  mgr.save(1, {"w": np.ones(2)}, metrics={"a": 0.2}, blocking=True)
  bt.CheckpointManager(tmp_path).delete(1)
  mgr.reload()
  with pytest.raises(FileNotFoundError, match="no step 1 in"):
    mgr.metrics(1)


def test_removing_a_checkpoint_unlinks_its_files_and_follows_no_link(
  tmp_path,
):
  # Enough files for several unlinking threads, in nested directories, and
  # links to a directory and a file outside: they go, their targets stay.
  outside = tmp_path / "outside"
  outside.mkdir()
  (outside / "keep.npy").write_bytes(b"x")
  top = tmp_path / "ckpt"
  (top / "a" / "b").mkdir(parents=True)
  for d in (top, top / "a", top / "a" / "b"):
    for i in range(commit._REMOVE_ALONE + 5):
      (d / f"t{i}.npy").write_bytes(b"y" * 10)
  (top / "a" / "link").symlink_to(outside, target_is_directory=True)
  (top / "file_link.npy").symlink_to(outside / "keep.npy")
  commit.remove(str(top))
  assert not top.exists()
  assert os.listdir(outside) == ["keep.npy"]
  assert (outside / "keep.npy").read_bytes() == b"x"
  commit.remove(str(top))  # a missing one is fine


def test_removing_a_checkpoint_where_no_thread_starts(tmp_path, monkeypatch):
  # At interpreter shutdown no thread starts: the calling thread unlinks all.
  top = tmp_path / "ckpt"
  top.mkdir()
  for i in range(commit.REMOVE_THREADS * 2):
    (top / f"t{i}.npy").write_bytes(b"y")

  def refuse(self):
    raise RuntimeError("can't create new thread at interpreter shutdown")

  monkeypatch.setattr(commit.threading.Thread, "start", refuse)
  commit.remove(str(top))
  assert not top.exists()


def _gated_removal(monkeypatch):
  """commit.remove waits for the returned event before removing a copy."""
  gate, real = threading.Event(), commit.remove

  def remove(p):
    assert gate.wait(60)
    real(p)

  monkeypatch.setattr(commit, "remove", remove)
  return gate


def test_an_overwrite_returns_before_the_old_copy_is_removed(
  tmp_path, monkeypatch
):
  path = str(tmp_path / "c")
  bt.save(path, {"w": np.zeros(4)})
  gate = _gated_removal(monkeypatch)
  try:
    bt.save(path, {"w": np.ones(4)}, overwrite=True)  # returns: not removed
    np.testing.assert_array_equal(bt.restore(path)["w"], np.ones(4))
    old = commit.REAPER.pending()
    assert [p for _, p in commit.temporaries(path)] == sorted(old)
    # The next save leaves the copy being removed to the reaper, and
    # queues its own: the reaper holds BACKLOG copies at most.
    bt.save(path, {"w": np.full(4, 2.0)}, overwrite=True)
    assert old < commit.REAPER.pending()
    assert len(commit.REAPER.pending()) == commit.Reaper.BACKLOG
    third = threading.Thread(
      target=bt.save,
      args=(path, {"w": np.full(4, 3.0)}),
      kwargs={"overwrite": True},
    )
    third.start()
    third.join(0.5)
    assert third.is_alive()  # committed, then blocked: the backlog is full
    np.testing.assert_array_equal(bt.restore(path)["w"], np.full(4, 3.0))
  finally:
    gate.set()
  third.join()
  commit.REAPER.wait()
  assert commit.temporaries(path) == [] and commit.REAPER.pending() == set()
  np.testing.assert_array_equal(bt.restore(path)["w"], np.full(4, 3.0))


def test_a_copy_renamed_aside_is_never_put_back_while_removed(
  tmp_path, monkeypatch
):
  """Without RENAME_EXCHANGE the old copy is renamed aside, then under a
  deleted name before the reaper removes it: a restore of a missing path
  meanwhile (a delete between) never puts back a half-removed copy."""
  path = str(tmp_path / "c")
  bt.save(path, {"w": np.zeros(4)})
  monkeypatch.setattr(commit, "_exchange", lambda a, b: False)
  gate = _gated_removal(monkeypatch)
  try:
    bt.save(path, {"w": np.ones(4)}, overwrite=True)
    assert [k for k, _ in commit.temporaries(path)] == [commit.DELETED]
    os.rename(path, str(tmp_path / "moved"))
    assert not commit.recover(path)  # nothing old aside to put back
  finally:
    gate.set()
  commit.REAPER.wait()
  assert sorted(os.listdir(tmp_path)) == ["moved"]


def test_the_interpreter_waits_for_the_reaper_at_exit(tmp_path):
  script = textwrap.dedent(f"""
    import time
    import numpy as np
    from jaxworks import batched_transfer as bt
    from jaxworks.batched_transfer._src.checkpoint import commit
    real = commit.remove
    def slow(p):
      time.sleep(0.5)
      real(p)
    commit.remove = slow
    path = {str(tmp_path / "c")!r}
    bt.save(path, {{"w": np.zeros(4)}})
    bt.save(path, {{"w": np.ones(4)}}, overwrite=True)
    print("SAVED", len(commit.REAPER.pending()), flush=True)
  """)
  out = subprocess.run(
    [sys.executable, "-c", script], capture_output=True, text=True, check=True
  )
  assert "SAVED 1" in out.stdout, out
  assert os.listdir(tmp_path) == ["c"]


def test_the_reaper_goes_on_after_a_removal_raises(
  tmp_path, monkeypatch, caplog
):
  # A warning made an error (-W error) raises in the reaper's thread: it is
  # logged, and the removals after it still run.
  mgr = bt.CheckpointManager(tmp_path)
  for step in (1, 2):
    mgr.save(step, {"w": np.ones(2)}, blocking=True)
  real_remove = commit.remove
  monkeypatch.setattr(commit, "remove", lambda p: None)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    mgr.delete(1)
    mgr.wait_until_finished()
  assert "removing" in caplog.text and "could not all be removed" in caplog.text
  monkeypatch.setattr(commit, "remove", real_remove)
  mgr.delete(2)
  mgr.close()
  left = [n for n in os.listdir(tmp_path) if ".jaxworks-del-" in n]
  assert len(left) == 1 and left[0].startswith(".1."), left  # step 2's went
  assert mgr.all_steps() == []


@pytest.mark.filterwarnings("ignore:os.fork")
def test_a_forked_child_has_a_reaper_of_its_own(tmp_path, monkeypatch):
  gate = _gated_removal(monkeypatch)
  path = str(tmp_path / "c")
  bt.save(path, {"w": np.zeros(2)})
  try:
    bt.save(path, {"w": np.ones(2)}, overwrite=True)  # the parent's, held
    pid = os.fork()
    if pid == 0:  # the child: its reaper is empty and works
      code = 1
      try:
        monkeypatch.undo()
        if commit.REAPER.pending() == set():
          bt.save(path, {"w": np.full(2, 2.0)}, overwrite=True)
          commit.REAPER.wait()
          code = 0
      finally:
        os._exit(code)
    for _ in range(600):  # a child that hangs fails the test, not CI
      done, status = os.waitpid(pid, os.WNOHANG)
      if done:
        break
      time.sleep(0.1)
    else:
      os.kill(pid, 9)
      os.waitpid(pid, 0)
      raise AssertionError("the forked child hung")
    assert os.waitstatus_to_exitcode(status) == 0
  finally:
    gate.set()
  commit.REAPER.wait()
  np.testing.assert_array_equal(bt.restore(path)["w"], np.full(2, 2.0))
