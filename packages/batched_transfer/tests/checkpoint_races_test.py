"""Checkpoints beside other threads and processes: non-blocking overwrites
commit in call order, waits from several threads, managers racing with
another manager (another thread or process) on one directory, and the
commit where the system cannot exchange two directories."""

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from jaxworks import batched_transfer as bt

# Private imports below: commit's temp names and recovery; writes slowed.
from jaxworks.batched_transfer._src.checkpoint import commit
from jaxworks.batched_transfer._src.checkpoint import hostvalue


def tree(k):
  return {"w": np.full((64, 8), k, np.float32), "n": np.arange(3) + k}


def value(path):
  """The k of the tree(k) saved at ``path`` (asserting it is one tree)."""
  out = bt.restore(path)
  w = np.asarray(out["w"])
  assert np.unique(w).size == 1, np.unique(w)
  k = int(w[0, 0])
  np.testing.assert_array_equal(np.asarray(out["n"]), np.arange(3) + k)
  return k


def slow_writes(monkeypatch, seconds, only=None):
  """hostvalue.write_npy sleeps ``seconds`` first (for arrays whose first
  element is ``only``, if given)."""
  real = hostvalue.write_npy

  def slow(f, a):
    if only is None or np.asarray(a).reshape(-1)[0] == only:
      time.sleep(seconds)
    return real(f, a)

  monkeypatch.setattr(hostvalue, "write_npy", slow)


def test_non_blocking_overwrites_commit_in_call_order(tmp_path, monkeypatch):
  """The last call wins: a save to a path writes after the saves to it that
  were called before (here the first one is slow to start writing)."""
  path = str(tmp_path / "p")
  real_locked, calls = commit.locked, []

  def locked(p):
    calls.append(p)
    if len(calls) == 1:
      time.sleep(0.3)
    return real_locked(p)

  monkeypatch.setattr(commit, "locked", locked)
  first = bt.save(path, tree(1), overwrite=True, blocking=False)
  second = bt.save(path, tree(2), overwrite=True, blocking=False)
  second.wait()
  first.wait()
  assert value(path) == 2
  # A blocking save after a pending one commits after it, too.
  h = bt.save(path, tree(1), overwrite=True, blocking=False)
  bt.save(path, tree(3), overwrite=True)
  h.wait()
  assert value(path) == 3
  monkeypatch.undo()
  handles = [
    bt.save(path, tree(k), overwrite=True, blocking=False) for k in range(20)
  ]
  for h in handles:
    h.wait()
  assert value(path) == 19
  commit.REAPER.wait()  # the replaced copies go in the background
  assert sorted(os.listdir(tmp_path)) == ["p"]


def test_waits_from_several_threads_all_wait(tmp_path, monkeypatch):
  """wait_until_finished and close from other threads wait for the save
  (not only the first of them); the error is raised once."""
  slow_writes(monkeypatch, 0.3)
  mgr = bt.CheckpointManager(tmp_path)
  assert mgr.save(1, tree(1))
  seen = []

  def waiter(fn):
    fn()
    seen.append((1 in mgr.all_steps(), mgr.is_saving_in_progress()))

  threads = [
    threading.Thread(target=waiter, args=(f,))
    for f in (mgr.wait_until_finished, mgr.close, mgr.wait_until_finished)
  ]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert seen == [(True, False)] * 3, seen
  # A failed save: its error once, whichever thread sees it first.
  monkeypatch.setattr(
    hostvalue, "write_npy", lambda f, a: (time.sleep(0.2), 1 / 0)
  )
  assert mgr.save(2, tree(2))
  errors = []

  def wait():
    try:
      mgr.wait_until_finished()
    except ZeroDivisionError as err:
      errors.append(err)

  threads = [threading.Thread(target=wait) for _ in range(3)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(errors) == 1 and not mgr.is_saving_in_progress()
  assert mgr.all_steps() == [1]


def test_a_step_another_manager_deleted_after_listing_is_skipped(tmp_path):
  """best_step() and retention list the steps, then read their metrics: a
  step another manager deleted in between is skipped, and a save whose
  step committed does not raise."""
  mgr = bt.CheckpointManager(
    tmp_path, max_to_keep=2, best_fn=lambda m: m["acc"]
  )
  other = bt.CheckpointManager(tmp_path)
  for step, acc in ((1, 0.5), (2, 0.9), (3, 0.7)):
    mgr.save(step, tree(step), metrics={"acc": acc}, blocking=True)
  assert mgr.all_steps() == [2, 3]
  listed = mgr.all_steps()
  mgr.all_steps = lambda: list(listed)  # listed before the delete
  other.delete(2)
  mgr.reload()
  assert mgr.best_step() == 3
  # Retention after step 4 committed lists the steps as before too.
  assert mgr.save(4, tree(4), metrics={"acc": 0.1}, blocking=True)
  del mgr.all_steps
  assert mgr.all_steps() == [3, 4]
  with pytest.raises(FileNotFoundError, match="no step 2"):
    mgr.metrics(2)


OBSERVER = textwrap.dedent("""
    import sys, time
    from jaxworks import batched_transfer as bt
    mgr = bt.CheckpointManager(sys.argv[1], read_only=True,
                               best_fn=lambda m: m["acc"])
    calls = 0
    end = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:
      mgr.reload()
      mgr.best_step()
      mgr.all_steps()
      calls += 1
    print("OBSERVER-OK", calls, flush=True)
""")

# A second writer: steps 1001-1020 into the same directory (its retention
# would delete the first writer's steps): refused while the first one (this
# test's process) holds the directory's writer lease.
WRITER = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from jaxworks import batched_transfer as bt
    while not os.path.exists(os.path.join(sys.argv[1], ".jaxworks-writer")):
      time.sleep(0.01)  # the first writer's lease
    mgr = bt.CheckpointManager(sys.argv[1], max_to_keep=2,
                               best_fn=lambda m: m["acc"])
    mgr.all_steps(), mgr.best_step()  # reading needs no lease
    for step in range(1001, 1021):
      tree = {"w": np.full((64, 8), step, np.float32),
              "n": np.arange(3) + step}
      try:
        mgr.save(step, tree, metrics={"acc": (step * 7) % 11}, force=True)
      except bt.WriterConflictError as err:
        print("WRITER-REFUSED", err, flush=True)
      else:
        raise SystemExit(f"step {step} was saved by a second writer")
    print("WRITER-OK", flush=True)
""")


def test_a_manager_beside_threads_and_another_process(tmp_path):
  """One thread saves steps (non-blocking, retention by best_fn), others
  wait, check for errors, list, rank, reload and delete; another process
  observes the directory read-only, a third tries to save steps of its own
  there and is refused (WriterConflictError): nothing else raises (but
  delete of a step retention deleted first), every step kept is whole."""
  mgr = bt.CheckpointManager(
    tmp_path, max_to_keep=2, best_fn=lambda m: m["acc"]
  )
  reader = bt.CheckpointManager(tmp_path, best_fn=lambda m: m["acc"])
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
  others = [
    subprocess.Popen(
      [sys.executable, "-c", script, str(tmp_path), "6"],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for script in (OBSERVER, WRITER)
  ]
  errors = []
  done = threading.Event()

  def guarded(fn):
    def run():
      try:
        fn()
      except BaseException as err:  # noqa: BLE001  (reported below)
        errors.append(err)
        done.set()

    return threading.Thread(target=run)

  def save():
    for step in range(1, 41):
      mgr.save(step, tree(step), metrics={"acc": (step * 7) % 11}, force=True)
    mgr.wait_until_finished()
    done.set()

  def wait():
    while not done.is_set():
      mgr.wait_until_finished()
      mgr.is_saving_in_progress()
      mgr.check_for_errors()
      time.sleep(0.001)

  def read():
    while not done.is_set():
      reader.reload()
      reader.best_step()
      mgr.best_step()
      reader.all_steps()
      time.sleep(0.001)

  deleted = []

  def delete():  # the oldest step now and then (retention may be first)
    while not done.is_set():
      steps = reader.all_steps()
      if len(steps) > 1:
        try:
          mgr.delete(steps[0])
          deleted.append(steps[0])
        except FileNotFoundError as err:
          assert "no step" in str(err), err
      time.sleep(0.02)

  threads = [guarded(f) for f in (save, wait, wait, read, delete)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  outs = [p.communicate(timeout=120)[0] for p in others]
  assert not errors, errors
  assert "OBSERVER-OK" in outs[0], outs[0]
  assert "WRITER-OK" in outs[1], outs[1]
  assert outs[1].count("WRITER-REFUSED") == 20, outs[1]
  assert str(tmp_path) in outs[1] and "is being written by" in outs[1]
  kept = mgr.all_steps()
  assert 1 <= len(kept) <= 2, kept
  for step in kept:
    assert value(os.path.join(tmp_path, str(step))) == step
  mgr.close()  # gives the writer lease back
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_without_exchange_a_restore_between_the_renames(tmp_path, monkeypatch):
  """Where RENAME_EXCHANGE is unavailable an overwrite renames the old copy
  aside, then the new one in; a restore in between renames the old one
  back: the save tries again and commits, or after a few tries raises a
  clear OSError, the old checkpoint whole at the path."""
  path = str(tmp_path / "p")
  bt.save(path, tree(1))
  monkeypatch.setattr(commit, "_exchange", lambda a, b: False)
  real_rename = os.rename
  restores = []

  def rename(a, b):  # a restore right after each rename of path aside
    real_rename(a, b)
    if a == path and ".jaxworks-old-" in b and len(restores) < limit:
      restores.append(commit.recover(path))

  monkeypatch.setattr(os, "rename", rename)
  limit = 2
  bt.save(path, tree(2), overwrite=True)
  assert restores == [True, True]
  assert value(path) == 2
  commit.REAPER.wait()  # the old copy goes in the background
  assert sorted(os.listdir(tmp_path)) == ["p"]
  limit = 100
  with pytest.raises(OSError, match="RENAME_EXCHANGE") as err:
    bt.save(path, tree(3), overwrite=True)
  assert "p" in str(err.value) and "Save again" in str(err.value)
  assert value(path) == 2
  monkeypatch.setattr(os, "rename", real_rename)
  bt.save(path, tree(4), overwrite=True)
  assert value(path) == 4
  commit.REAPER.wait()
  assert sorted(os.listdir(tmp_path)) == ["p"]


def test_recover_skips_an_aside_another_process_took(tmp_path, monkeypatch):
  """Two old copies left aside: one is renamed away by another process
  between the scan and its stat; recover renames the other back."""
  path = str(tmp_path / "p")
  bt.save(path, tree(1))
  first = commit.temp_name(path, commit.OLD)
  os.rename(path, first)
  bt.save(str(tmp_path / "q"), tree(2))  # the newer aside
  second = commit.temp_name(path, commit.OLD)
  os.rename(str(tmp_path / "q"), second)
  real_scan = commit.temporaries

  def scan(p):
    found = real_scan(p)
    os.rename(second, str(tmp_path / "taken"))  # after the scan
    return found

  monkeypatch.setattr(commit, "temporaries", scan)
  assert commit.recover(path)
  assert value(path) == 1
