"""examples/train_lm.py, killed (SIGKILL) or stopped (SIGTERM) at random
moments and resumed, trains as an uninterrupted run does, bit for bit.

Each run is the example in a process of its own (this interpreter, this
environment: 8 host CPU devices), in its small configuration (``--tiny``).
"""

import importlib.util
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

EXAMPLE = pathlib.Path(__file__).with_name("train_lm.py")
STEPS = 20
SAVE_EVERY = 4
LINE = re.compile(r"^step (\d+) loss (\S+)$")
TIMEOUT_S = 180


@pytest.fixture(scope="module")
def example():
  spec = importlib.util.spec_from_file_location("train_lm", EXAMPLE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


_CACHE: list[str] = []


def _env():
  """This environment, with this process's ``sys.path`` and one JAX
  persistent compilation cache for every run (as a restarted job has): the
  first run compiles, the others read its executables."""
  if not _CACHE:
    _CACHE.append(tempfile.mkdtemp(prefix="train-lm-jax-cache-"))
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
  env["JAX_COMPILATION_CACHE_DIR"] = _CACHE[0]
  env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
  return env


def _cmd(directory, *extra):
  return [
    sys.executable,
    str(EXAMPLE),
    "--tiny",
    "--dir",
    str(directory),
    "--steps",
    str(STEPS),
    "--save-every",
    str(SAVE_EVERY),
    *extra,
  ]


def _losses(lines):
  """``[(step, repr of the loss)]`` of a run's step lines."""
  return [(int(m.group(1)), m.group(2)) for m in map(LINE.match, lines) if m]


class Run:
  """One run of the example: its output lines, exit status and stderr."""

  def __init__(self, lines, returncode, stderr):
    self.lines = lines
    self.returncode = returncode
    self.stderr = stderr
    self.losses = _losses(lines)

  def __repr__(self):
    return (
      f"Run(exit {self.returncode}, steps "
      f"{[s for s, _ in self.losses]}, stderr tail "
      f"{self.stderr[-1500:]!r})"
    )


def run(directory, *extra, stop=None, delay=0.0, sig=signal.SIGKILL):
  """Runs the example on ``directory``; with ``stop`` (a predicate of the
  step lines seen so far), sends ``sig`` ``delay`` seconds after the step
  line on which it first holds, then reads what the process still printed."""
  err_path = pathlib.Path(str(directory) + f".stderr.{time.monotonic_ns()}")
  with open(err_path, "w+") as err:
    proc = subprocess.Popen(
      _cmd(directory, *extra),
      env=_env(),
      stdout=subprocess.PIPE,
      stderr=err,
      text=True,
    )
    lines = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
      sent = False
      for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        assert time.monotonic() < deadline, f"timed out: {lines}"
        if not sent and stop is not None and LINE.match(lines[-1]):
          if stop(_losses(lines)):
            time.sleep(delay)
            proc.send_signal(sig)
            sent = True
      returncode = proc.wait(timeout=TIMEOUT_S)
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
    err.seek(0)
    return Run(lines, returncode, err.read())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """The reference: ``STEPS`` steps in one run; (run, final .npz, dir)."""
  root = tmp_path_factory.mktemp("uninterrupted")
  final = root / "final.npz"
  result = run(root / "ckpt", "--final", str(final))
  assert result.returncode == 0, result
  assert [s for s, _ in result.losses] == list(range(1, STEPS + 1)), result
  return result, final, root / "ckpt"


def _assert_same_arrays(path_a, path_b):
  with np.load(path_a) as a, np.load(path_b) as b:
    assert sorted(a.files) == sorted(b.files)
    assert len(a.files) > 20  # params and optimizer state, leaf by leaf
    for name in a.files:
      x, y = a[name], b[name]
      assert x.dtype == y.dtype, name
      assert x.shape == y.shape, name
      assert np.array_equal(x, y), f"{name} differs"


def _all_steps(directory):
  from jaxworks import batched_transfer as bt

  return bt.CheckpointManager(str(directory), read_only=True).all_steps()


def _resume_until_done(tmp_path, plan, sig, expect_rc):
  """Runs the example on a fresh directory, each run stopped by ``sig`` as
  the next entry of ``plan`` says, then once more to the end; returns the
  runs."""
  directory = tmp_path / "ckpt"
  final = tmp_path / "final.npz"
  runs = []
  for stop, delay in plan:
    result = run(directory, "--final", str(final), stop=stop, delay=delay,
                 sig=sig)  # fmt: skip
    runs.append(result)
    assert result.returncode == expect_rc, result
  last = run(directory, "--final", str(final))
  assert last.returncode == 0, last
  runs.append(last)
  return runs, final, directory


def _kill_plan(rng, kills):
  """``kills`` moments: right after the line of a save step (each run hits
  one) and at random step lines, each after a random delay (0-40 ms: inside
  the next step or the background write)."""

  # Every run is stopped by the middle step at the latest, so that none
  # reaches the end within the delay.
  def late(losses):
    return losses[-1][0] >= STEPS // 2

  def after_save_step(losses):
    return losses[-1][0] % SAVE_EVERY == 0 or late(losses)

  def after_lines(n):
    return lambda losses: len(losses) >= n or late(losses)

  plan = [(after_save_step, 0.0)]
  for _ in range(kills - 1):
    if rng.random() < 0.3:
      plan.append((after_save_step, rng.uniform(0.0, 0.04)))
    else:
      plan.append((after_lines(rng.randint(1, 2 * SAVE_EVERY)),
                   rng.uniform(0.0, 0.04)))  # fmt: skip
  rng.shuffle(plan)
  return plan


def _check_resumed(runs, reference, stopped_rc, preempted=False):
  expected = dict(reference.losses)
  printed = set()
  for i, r in enumerate(runs):
    for step, loss in r.losses:
      assert loss == expected[step], (
        f"run {i}: step {step} loss {loss} but the uninterrupted run's is "
        f"{expected[step]}"
      )
      printed.add(step)
    if i:
      # Each run resumes from the latest committed step, one that an
      # earlier run printed (and saved): step 1 (the first step of an empty
      # directory) or a multiple of the interval; none if nothing was
      # committed yet.
      before = max(s for x in runs[:i] for s, _ in x.losses)
      m = [re.match(r"^resumed from step (\d+)$", line) for line in r.lines]
      resumed = [int(x.group(1)) for x in m if x]
      start = resumed[0] if resumed else 0
      if start and not preempted:
        assert start <= before, r
        assert start == 1 or start % SAVE_EVERY == 0, r
      assert r.losses[0][0] == start + 1, r
      if preempted:  # from the step the previous run was stopped at
        assert start == runs[i - 1].losses[-1][0], r
  assert printed == set(range(1, STEPS + 1))
  assert runs[-1].losses[-1][0] == STEPS
  assert sum(r.returncode == stopped_rc for r in runs[:-1]) >= 3


def test_killed_and_resumed_runs_equal_an_uninterrupted_one(
  uninterrupted, tmp_path
):
  reference, reference_final, reference_dir = uninterrupted
  rng = random.Random(20261207)
  plan = _kill_plan(rng, kills=4)
  runs, final, directory = _resume_until_done(
    tmp_path, plan, signal.SIGKILL, -signal.SIGKILL
  )
  _check_resumed(runs, reference, -signal.SIGKILL)
  _assert_same_arrays(final, reference_final)
  # Retention kept the same steps: the last 3 saved.
  assert _all_steps(directory) == _all_steps(reference_dir)
  assert _all_steps(directory) == [STEPS - 2 * SAVE_EVERY, STEPS - SAVE_EVERY,
                                   STEPS]  # fmt: skip


def test_preempted_runs_save_their_step_and_resume_bit_for_bit(
  uninterrupted, tmp_path
):
  reference, reference_final, _ = uninterrupted
  rng = random.Random(20261208)
  plan = _kill_plan(rng, kills=3)
  directory = tmp_path / "ckpt"
  final = tmp_path / "final.npz"
  runs = []
  for stop, delay in plan:
    result = run(directory, "--final", str(final), stop=stop, delay=delay,
                 sig=signal.SIGTERM)  # fmt: skip
    runs.append(result)
    # SIGTERM: the step it was at is saved and committed, then exit 0.
    assert result.returncode == 0, result
    m = re.match(r"^preempted at step (\d+)$", result.lines[-1])
    assert m, result
    at = int(m.group(1))
    assert result.losses[-1][0] == at, result
    assert at in _all_steps(directory), (at, _all_steps(directory))
    assert not final.exists()  # it stopped before the end
  last = run(directory, "--final", str(final))
  assert last.returncode == 0, last
  runs.append(last)
  _check_resumed(runs, reference, 0, preempted=True)
  _assert_same_arrays(final, reference_final)
  assert _all_steps(directory) == [STEPS - 2 * SAVE_EVERY, STEPS - SAVE_EVERY,
                                   STEPS]  # fmt: skip


def test_the_checkpoint_reads_back_without_the_training_code(
  example, uninterrupted
):
  import jax
  import optax

  from jaxworks import batched_transfer as bt

  _, final, directory = uninterrupted
  saved = bt.restore(str(directory / str(STEPS)))  # no target
  cfg = example.TINY
  params, opt_state = example._init(cfg)  # pylint: disable=protected-access
  # The optimizer state as optax made it: EmptyState() and the named tuples.
  assert jax.tree.structure(saved["opt_state"]) == jax.tree.structure(opt_state)
  assert isinstance(saved["opt_state"][0], optax.EmptyState)
  assert type(saved["opt_state"][1][0]) is optax.ScaleByAdamState
  assert jax.tree.structure(saved["params"]) == jax.tree.structure(params)
  # The values are the final ones, leaf by leaf.
  flat, _ = jax.tree_util.tree_flatten_with_path(
    {"params": saved["params"], "opt_state": saved["opt_state"]}
  )
  with np.load(final) as npz:
    assert sorted(npz.files) == sorted(jax.tree_util.keystr(k) for k, _ in flat)
    for k, v in flat:
      want = npz[jax.tree_util.keystr(k)]
      assert np.asarray(v).dtype == want.dtype
      assert np.array_equal(np.asarray(v), want), jax.tree_util.keystr(k)
  # The data iterator's state, exactly: Python ints, the Generator's state.
  data = saved["data"]
  generator = np.random.Generator(np.random.PCG64(cfg.seed))
  for _ in range(STEPS):
    generator.integers(cfg.vocab)
  assert data == {
    "step": STEPS,
    "tokens_seen": STEPS * cfg.batch * (cfg.seq_len + 1),
    "rng": generator.bit_generator.state,
  }
  assert type(data["step"]) is int and type(data["tokens_seen"]) is int
  assert data["rng"]["state"]["state"] >= 2**64  # a 128-bit integer
  again = np.random.Generator(np.random.PCG64())
  again.bit_generator.state = data["rng"]
  assert np.array_equal(
    again.integers(2**62, size=8), generator.integers(2**62, size=8)
  )


def test_stock_jax_gives_the_same_run(uninterrupted, tmp_path):
  reference, reference_final, _ = uninterrupted
  final = tmp_path / "final.npz"
  stock = run(tmp_path / "ckpt", "--stock", "--final", str(final))
  assert stock.returncode == 0, stock
  assert stock.losses == reference.losses
  _assert_same_arrays(final, reference_final)
