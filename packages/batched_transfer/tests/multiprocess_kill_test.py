"""Collective saves across two processes (jax.distributed on 127.0.0.1, four
CPU devices each) killed (SIGKILL) at random moments: one process or both.

Each trial starts two processes that save steps of a tree sharded across
both with a CheckpointManager (max_to_keep=2, blocking and not in turn) and
the same tree with ``save(..., overwrite=True)`` to one path, in a loop, until
the test kills one or both. After each kill: a surviving process raised (or
was ended by jax.distributed's own failure detection) within its barrier
timeout, no partly written step is listed, every listed step and the
overwritten path hold the exact values of their step (numpy alone, and
restore for the latest step), and no committed step went missing. The next
trial's first save (new processes) removes what the killed save left and
commits. Two lanes (directories) run their trials side by side; the seeds
are fixed and each kill is printed.
"""

import concurrent.futures
import os
import random
import subprocess
import sys
import textwrap
import time

import jax
from multiprocess_util import free_port
from multiprocess_util import numpy_read
import numpy as np

from jaxworks import batched_transfer as bt

# Private imports below: commit's temp names, left by a killed save.
from jaxworks.batched_transfer._src.checkpoint import commit

#: Temporary names saves of numbered steps leave (commit.temp_name).
STEP_TEMPS = commit.temp_pattern(r"\d+")

LANES = 2
TRIALS = 16  # per lane: 32 kills
TIMEOUT_S = 3.0  # barrier_timeout_s of the saves
SLACK_S = 15.0  # scheduling on a busy machine (CI runs tests side by side)

VALUES = textwrap.dedent("""
    import numpy as np
    import ml_dtypes

    def values(step):
      rng = np.random.default_rng(step)
      return {"w": rng.standard_normal((256, 256)).astype(np.float32),
              "h": rng.standard_normal((64, 32)).astype(ml_dtypes.bfloat16),
              "r": rng.integers(0, 2**30, (1000,)).astype(np.int32),
              "step": np.array(step, np.int32)}
""")

WORKER = VALUES + textwrap.dedent("""
    import os, sys, time
    pid, port, base, first, timeout, once = sys.argv[1:]
    pid, first, timeout = int(pid), int(first), float(timeout)
    import jax
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=2, process_id=pid,
                               initialization_timeout=60)
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxworks import batched_transfer as bt
    mesh = jax.make_mesh((8,), ("x",))
    mesh2 = jax.make_mesh((4, 2), ("a", "b"))
    shardings = {"w": NamedSharding(mesh, P("x")),
                 "h": NamedSharding(mesh2, P("a")),  # each shard on 2 devices
                 "r": NamedSharding(mesh, P())}      # "step": a host leaf

    def placed(step):  # global arrays made with no collective
      return {k: jax.make_array_from_callback(x.shape, shardings[k],
                                              lambda i, x=x: x[i])
              if k in shardings else x for k, x in values(step).items()}

    mgr = bt.CheckpointManager(f"{base}/run", max_to_keep=2,
                               barrier_timeout_s=timeout)
    step = first
    try:
      # The first save of these processes cleans what killed ones left.
      mgr.save(step, placed(step), blocking=True)
      bt.save(f"{base}/ow", placed(step), overwrite=True,
              barrier_timeout_s=timeout)
      print("ready", step, flush=True)
      while once != "once":
        step += 1
        tree = placed(step)
        mgr.save(step, tree, blocking=bool(step % 2))
        bt.save(f"{base}/ow", tree, overwrite=True, barrier_timeout_s=timeout)
        print("saved", step, time.monotonic(), flush=True)
    except BaseException as err:
      text = f"{type(err).__name__}: {err}".replace("\\n", " ")
      print("ERROR", time.monotonic(), text, flush=True)
      os._exit(3)
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("end")  # all have seen the outcome
    os._exit(0)
""")

namespace: dict = {}
exec(VALUES, namespace)
values = namespace["values"]


def _check_exact(path, step=None):
  """The checkpoint at ``path`` holds the values of its step, bit for bit;
  returns the step."""
  got = numpy_read(path)
  if step is None:
    step = int(got["step"])
  want = values(step)
  assert sorted(got) == sorted(want), (path, sorted(got))
  for k in want:
    assert got[k].dtype == want[k].dtype, (path, k)
    assert got[k].tobytes() == want[k].tobytes(), (path, step, k)
  return step


class _Pair:
  """The two processes of one trial; their output lines, as they come."""

  def __init__(self, base, first, once=False):
    env = dict(os.environ)
    env.update(
      JAX_PLATFORMS="cpu",
      XLA_FLAGS="--xla_force_host_platform_device_count=4",
      PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
    )
    port = str(free_port())
    self.procs = [
      subprocess.Popen(
        [sys.executable, "-c", WORKER, str(i), port, base, str(first)]
        + [str(TIMEOUT_S), "once" if once else "loop"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
      )
      for i in range(2)
    ]
    self.lines = [[], []]

  def read_until(self, i, prefix, deadline):
    """Lines of process ``i`` up to one starting with ``prefix`` (or its
    exit); that line or None."""
    p = self.procs[i]
    while time.monotonic() < deadline:
      line = p.stdout.readline()
      if not line:
        return None
      self.lines[i].append(line.strip())
      if line.startswith(prefix):
        return line.strip()
    return None

  def kill(self, i):
    self.procs[i].kill()
    self.procs[i].wait()

  def close(self):
    """Kills what is left; the rest of the output; the exit codes."""
    for i, p in enumerate(self.procs):
      if p.poll() is None:
        p.kill()
      if not p.stdout.closed:
        self.lines[i] += p.communicate()[0].split("\n")
    return [p.returncode for p in self.procs]


def _lane(base, seed):
  """One lane's trials; returns what it saw."""
  rng = random.Random(seed)
  kinds = ["0", "1", "both"] * (TRIALS // 3 + 1)
  rng.shuffle(kinds)
  kinds = kinds[:TRIALS]
  seen = {"kills": 0, "leftovers": 0, "survivor": [], "log": []}
  left: list[str] = []
  latest_seen = 0
  cycles: list[float] = []  # seconds of one loop (a step and the path)
  for trial in range(TRIALS + 1):
    first = bt.CheckpointManager(os.path.join(base, "run")).latest_step() or 0
    pair = _Pair(base, first + 1, once=trial == TRIALS)
    try:
      t0 = time.monotonic()
      for i in range(2):
        ready = pair.read_until(i, "ready", t0 + 120)
        assert ready, (base, trial, i, pair.lines[i], pair.close())
      took = time.monotonic() - t0
      # The killed save's leftovers are gone after the next first save.
      gone = [p for p in left if os.path.lexists(p)]
      assert not gone, (base, trial, gone)
      if trial == TRIALS:  # the last processes save once and exit
        codes = [p.wait(60) for p in pair.procs]
        assert codes == [0, 0], (base, pair.close(), pair.lines)
        assert (
          _check_exact(os.path.join(base, "run", str(first + 1))) == first + 1
        )
        break
      kind = kinds[trial]
      # Kill times cover three loops: every moment of both saves.
      span = 3 * (float(np.median(cycles)) if cycles else 0.15)
      delay = rng.uniform(0, span)
      time.sleep(delay)
      victims = [0, 1] if kind == "both" else [int(kind)]
      killed_at = time.monotonic()
      for n, i in enumerate(victims):
        if n:
          time.sleep(rng.uniform(0, 0.02))
        pair.kill(i)
      seen["kills"] += len(victims)
      seen["log"].append(
        f"{os.path.basename(base)} trial {trial}: kill {kind} after "
        f"{delay:.3f} s of {span:.3f} (start {took:.1f} s)"
      )
      if kind != "both":  # the survivor: an error, not a hang
        survivor = 1 - victims[0]
        error = pair.read_until(
          survivor, "ERROR", killed_at + TIMEOUT_S + SLACK_S
        )
        if error is None:  # ended by jax.distributed (the coordinator died)?
          try:
            pair.procs[survivor].wait(
              max(0.1, killed_at + TIMEOUT_S + SLACK_S - time.monotonic())
            )
          except subprocess.TimeoutExpired:
            raise AssertionError(
              (base, trial, "survivor hangs", pair.lines[survivor])
            ) from None
          assert survivor == 1, (base, trial, pair.lines[survivor])
          seen["survivor"].append("ended by jax.distributed")
        else:
          _, when, text = error.split(" ", 2)
          assert float(when) - killed_at < TIMEOUT_S + SLACK_S, (trial, error)
          if survivor == 0:
            assert "barrier_timeout_s" in text and "process 1" in text, text
          seen["survivor"].append(text.split(":")[0])
    finally:
      pair.close()
    # No partly written step is listed; every listed step is exact.
    mgr = bt.CheckpointManager(os.path.join(base, "run"))
    steps = mgr.all_steps()
    assert steps and len(steps) <= 3, (base, trial, steps)
    for s in steps:
      _check_exact(os.path.join(base, "run", str(s)), s)
    saved = [int(x.split()[1]) for x in pair.lines[0] if x.startswith("saved")]
    # "saved s": save to ow of step s and mgr.save(s) returned; step s - 1
    # committed (s - 1 is kept: max_to_keep=2 keeps s - 1 and s).
    if saved:
      assert steps[-1] >= saved[-1] - 1, (base, trial, steps, saved)
    times = [
      float(x.split()[2]) for x in pair.lines[0] if x.startswith("saved")
    ]
    cycles += list(np.diff(times))
    assert steps[-1] >= latest_seen, (base, trial, steps, latest_seen)
    latest_seen = steps[-1]
    # The latest step restores bit for bit.
    want = values(steps[-1])
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in want.items()}
    out = mgr.restore(target=like)
    for k, x in out.items():
      assert np.asarray(x).tobytes() == want[k].tobytes(), (trial, k)
    ow_step = _check_exact(os.path.join(base, "ow"))
    assert not saved or ow_step >= saved[-1], (base, trial, ow_step, saved)
    left = [
      p
      for _, p in commit.scan(os.path.join(base, "run"), STEP_TEMPS)
      + commit.temporaries(os.path.join(base, "ow"))
    ]
    seen["leftovers"] += bool(left)
  return seen


def test_killed_collective_saves_leave_only_complete_steps(tmp_path):
  lanes = [str(tmp_path / f"lane{n}") for n in range(LANES)]
  for base in lanes:
    os.mkdir(base)
  with concurrent.futures.ThreadPoolExecutor(LANES) as pool:
    results = list(
      pool.map(_lane, lanes, [f"mp-kill-{n}" for n in range(LANES)])
    )
  for r in results:
    print("\n".join(r["log"]))
  kills = sum(r["kills"] for r in results)
  trials = sum(len(r["log"]) for r in results)
  assert trials >= 30 and kills >= 30, (trials, kills)
  survivors = [s for r in results for s in r["survivor"]]
  print("survivors:", survivors)
  assert len(survivors) >= 15, survivors
  # Some kills landed in the middle of a save (a temporary was left).
  assert sum(r["leftovers"] for r in results) > 0, results
  for base in lanes:  # nothing left but the steps and the path
    assert sorted(os.listdir(base)) == ["ow", "run"], os.listdir(base)
    # (and the writer lease of the last killed process 0, which the next
    # manager would take over)
    names = os.listdir(os.path.join(base, "run"))
    assert all(n.isdigit() or n == ".jaxworks-writer" for n in names), names
