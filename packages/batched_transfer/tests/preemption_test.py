"""A training loop never waits on a step it does not save, and a job told
to stop (SIGTERM; JAX's preemption sync point in a job of several
processes) saves its current step: CheckpointManager.save decides first,
reached_preemption says when to save and exit."""

import os
import random
import signal
import sys
import textwrap
import threading
import time

from multiprocess_util import run_two
import numpy as np
import pytest

from jaxworks import batched_transfer as bt

# Private imports below: the SIGTERM watch is process-wide (reset between
# tests), and the directory save whose write a test holds back.
from jaxworks.batched_transfer._src.checkpoint import local
from jaxworks.batched_transfer._src.checkpoint import preemption


@pytest.fixture(autouse=True)
def fresh_watch():
  before = signal.getsignal(signal.SIGTERM)
  preemption.reset()
  yield
  preemption.reset()
  signal.signal(signal.SIGTERM, before)


def state(step):
  return {"w": np.full((8, 4), step, np.float32), "n": step}


def held_writes(monkeypatch, fail=False):
  """An Event that the directory saves' writes wait for (set it to let
  them go); with ``fail``, each then fails as a full disk would."""
  go = threading.Event()
  real = local.DirectorySave.write

  def write(self, *args, **kwargs):
    assert go.wait(60), "the held write was never let go"
    out = real(self, *args, **kwargs)
    if fail:
      raise OSError(28, "No space left on device (injected)")
    return out

  monkeypatch.setattr(local.DirectorySave, "write", write)
  return go


def in_thread(fn):
  """Runs ``fn`` on a thread; (the thread, the list its result lands in)."""
  out = []
  t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
  t.start()
  return t, out


def test_a_step_not_saved_never_waits_for_the_save_in_flight(
  tmp_path, monkeypatch
):
  go = held_writes(monkeypatch)
  mgr = bt.CheckpointManager(str(tmp_path / "run"), save_interval_steps=5)
  assert mgr.save(5, state(5))  # non-blocking: its write is held
  assert mgr.is_saving_in_progress()
  for step in range(6, 10):  # the steps after a save step: decided at once
    t, out = in_thread(lambda step=step: mgr.save(step, state(step)))
    t.join(10)
    assert out == [False], (step, out)
    assert mgr.should_save(step) is False
  assert mgr.is_saving_in_progress()  # still held: nothing waited on it
  # A step that is saved waits for the one in flight (one save at a time).
  t, out = in_thread(lambda: mgr.save(10, state(10)))
  t.join(0.5)
  assert t.is_alive() and out == []
  go.set()
  t.join(30)
  assert out == [True]
  mgr.wait_until_finished()
  assert mgr.all_steps() == [5, 10]
  mgr.close()


def test_an_error_of_the_save_in_flight_is_raised_by_the_next_call(
  tmp_path, monkeypatch
):
  """Deciding first does not lose the background error: the first call
  after the failed write raises it, once; the failed step is not the last
  saved (the next save step saves)."""
  go = held_writes(monkeypatch, fail=True)
  mgr = bt.CheckpointManager(str(tmp_path / "run"), save_interval_steps=5)
  assert mgr.save(5, state(5))
  assert mgr.save(6, state(6)) is False  # decided while 5 is in flight
  go.set()
  with pytest.raises(OSError, match="injected"):
    for step in range(7, 10):  # the first call to see it failed raises
      assert mgr.save(step, state(step)) is False
      time.sleep(0.2)
  mgr.check_for_errors()  # raised once
  assert mgr.all_steps() == []
  monkeypatch.undo()
  # 5 is not the last saved: a step older than 5 is due again, by policy.
  assert mgr.should_save(0)
  assert mgr.save(10, state(10))
  mgr.wait_until_finished()
  assert mgr.all_steps() == [10]
  mgr.close()


def run_loop(mgr, steps, kill_at, before_save):
  """A training loop saving at every step as the README shows; SIGTERM to
  this process at step ``kill_at`` (before or after its save). The step it
  stopped at."""
  for step in steps:
    if step == kill_at and before_save:
      os.kill(os.getpid(), signal.SIGTERM)
    mgr.save(step, state(step))
    if step == kill_at and not before_save:
      os.kill(os.getpid(), signal.SIGTERM)
    if mgr.reached_preemption(step):
      mgr.wait_until_finished()
      return step
  raise AssertionError("the loop was never told to stop")


@pytest.mark.parametrize("seed", range(6))
def test_sigterm_at_a_random_moment_saves_the_step_the_loop_stops_at(
  tmp_path, seed
):
  rng = random.Random(seed)
  kill_at = rng.randrange(1, 40)
  before_save = rng.random() < 0.5
  mgr = bt.CheckpointManager(
    str(tmp_path / "run"), save_interval_steps=10, max_to_keep=2
  )
  stopped = run_loop(mgr, range(60), kill_at, before_save)
  # It stops at the step it noticed the signal, or the next one.
  assert stopped in (kill_at, kill_at + 1), (kill_at, before_save, stopped)
  assert stopped == kill_at or not before_save
  # That step is committed, whole, and the newest.
  assert mgr.latest_step() == stopped
  out = mgr.restore(stopped)
  np.testing.assert_array_equal(out["w"], state(stopped)["w"])
  assert out["n"] == stopped
  mgr.close()
  # A resumed manager (the next run of the job) starts from there.
  again = bt.CheckpointManager(str(tmp_path / "run"), save_interval_steps=10)
  assert again.latest_step() == stopped
  assert again.reached_preemption(stopped + 1) is False
  again.close()


def test_reached_preemption_is_false_without_a_signal_and_gives_the_handler_back(
  tmp_path,
):
  seen = []
  previous = signal.signal(signal.SIGTERM, lambda *a: seen.append(a[0]))
  try:
    mgr = bt.CheckpointManager(str(tmp_path / "run"))
    assert not any(mgr.reached_preemption(s) for s in range(3))
    assert signal.getsignal(signal.SIGTERM) is not previous  # watching
    os.kill(os.getpid(), signal.SIGTERM)
    assert seen == []  # noted, not passed on
    assert mgr.reached_preemption(3) is False  # step 3 was not saved
    assert mgr.should_save(4)  # the next step saves (not an interval step)
    assert mgr.save(4, state(4))
    assert mgr.reached_preemption(4) and mgr.reached_preemption(5)
    mgr.wait_until_finished()
    assert mgr.all_steps() == [4]
    # A second SIGTERM goes where it went before the watch.
    os.kill(os.getpid(), signal.SIGTERM)
    assert seen == [signal.SIGTERM]
    mgr.close()
  finally:
    signal.signal(signal.SIGTERM, previous)


def test_a_thread_cannot_watch_and_says_so(tmp_path, caplog):
  mgr = bt.CheckpointManager(str(tmp_path / "run"))
  t, out = in_thread(lambda: mgr.reached_preemption(1))
  t.join(10)
  assert out == [False]
  assert "main thread" in caplog.text
  with pytest.raises(ValueError, match="reached_preemption"):
    mgr.reached_preemption(-1)
  mgr.close()


WORKER = textwrap.dedent("""
    import os, signal, sys, time
    process_id, port, base = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    import jax
    import numpy as np
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=2, process_id=process_id,
                               initialization_timeout=60)
    from jaxworks import batched_transfer as bt
    mgr = bt.CheckpointManager(f"{base}/run", save_interval_steps=100)
    for step in range(400):
      if step == 7 and process_id == 1:  # the scheduler's notice, to one
        os.kill(os.getpid(), signal.SIGTERM)
      mgr.save(step, {"w": np.full((4,), step, np.float32)})
      time.sleep(0.05)  # a training step's time: the notice travels meanwhile
      if mgr.reached_preemption(step):
        mgr.wait_until_finished()
        print("STOPPED", step, mgr.all_steps(), flush=True)
        break
    else:
      raise SystemExit("never told to stop")
    mgr.close()
    print("WORKER-OK", process_id, flush=True)
""")


def test_every_process_of_a_job_stops_at_the_same_saved_step(tmp_path):
  """jax.distributed: SIGTERM to process 1 alone; JAX's preemption sync
  point makes both processes reach one step, which both save (together)
  and commit before they exit."""
  outs = run_two(WORKER, str(tmp_path))
  lines = [
    line for out in outs for line in out.splitlines() if "STOPPED" in line
  ]
  assert len(lines) == 2, outs
  assert lines[0] == lines[1], lines
  step = int(lines[0].split()[1])
  assert step > 7
  assert f"[0, {step}]" in lines[0], lines


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice: Linux")
def test_a_background_save_runs_below_the_training_steps_priority(
  tmp_path, monkeypatch
):
  """The threads of a non-blocking save (and the writer threads they
  start) yield the CPU to the training steps: nice +10 (the step's thread
  keeps its own); a blocking save runs at the caller's priority."""
  seen = {}
  real = local.DirectorySave.write

  def write(self, *args, **kwargs):
    me = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    child = []
    t = threading.Thread(
      target=lambda: child.append(
        os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
      )
    )
    t.start()
    t.join()
    seen[threading.current_thread() is threading.main_thread()] = (me, child[0])
    return real(self, *args, **kwargs)

  monkeypatch.setattr(local.DirectorySave, "write", write)
  base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
  bt.save(str(tmp_path / "bg"), state(1), blocking=False).wait()
  bt.save(str(tmp_path / "fg"), state(1))
  assert seen[False] == (min(19, base + 10),) * 2, (base, seen)
  assert seen[True] == (base, base), (base, seen)
  assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
