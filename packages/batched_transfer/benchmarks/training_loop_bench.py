"""A training loop that checkpoints: what its checkpoints cost it.

The loop is ``examples/train_lm.py``'s (its model, optimizer, data and
step: a 2-layer transformer LM, ``optax.chain(clip_by_global_norm(1.0),
adamw)``, data parallel over every device, the step a ``jax.jit`` donating
parameters and optimizer state). Each step: the batch, the step, its result
waited for (``jax.block_until_ready``), the loss as a float and the data
iterator's state (what a loop logs and saves; every way, the baseline
too), then the manager's save call, at every step, as both libraries
document it. The loop runs four ways in this
process, interleaved (each repeat runs each way once, the order rotated):

* no checkpoints: the baseline step time;
* jaxworks: ``bt.CheckpointManager(dir, max_to_keep=3,
  save_interval_steps=N)``, ``mgr.save(step, items={"params": ...,
  "opt_state": ..., "data": ...}, metrics={"loss": ...})`` (in the
  background, the default; the arrays of less than 1 MiB in one archive
  per item, the manager's default ``pack_below``: see the README);
* jaxworks, one file per leaf: the same with ``pack_below=None``;
* orbax: ``ocp.CheckpointManager(dir, options=ocp.CheckpointManagerOptions(
  max_to_keep=3, save_interval_steps=N))`` (asynchronous, its default),
  ``mgr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(...),
  opt_state=ocp.args.StandardSave(...), data=ocp.args.JsonSave(...)),
  metrics={"loss": ...})``;

each run ends with ``wait_until_finished()`` (not timed as a step). Two
configurations: the plain model (a checkpoint of a few MB) and the same
with a frozen 256 MiB float32 array among the parameters (random values,
not trained, passed through the step; replicated as every parameter).

Rows (jaxworks against orbax, medians over the save intervals of every
repeat; a step's time is the whole iteration: batch, step, wait, loss and
data state, save call; the save call alone is ``mgr.save``):

* the save call on save steps;
* the save call on the step after a save step;
* the slowdown of the ``K`` steps after a save: their mean step time minus
  the baseline's mean step time (that of the baseline run of the same
  repeat, run beside it: the load of a shared machine drifts);
* the time lost to checkpoints per save interval: the wall time of the
  ``N`` steps from a save step's successor to the next save step (one save
  call of each kind) minus ``N`` baseline steps (of the same repeat);
* for jaxworks, the interval against the baseline's (the fraction lost; goal
  under 1% where a save's write fits in the interval: a blocking save of the
  same tree, timed once, takes less than ``N`` baseline steps);
* the time lost per interval with the default ``pack_below`` against
  ``pack_below=None`` (a packed save holds the interpreter's lock for
  less time and costs less CPU time: fewer files, fsyncs and directories).

A slowdown or loss at or below the noise of the baseline (the standard error
of its mean step time, times ``N`` for an interval) cannot be told from none:
its row shows that noise floor, and the notes the value measured.

Files per saved step on disk (jaxworks, one file per leaf, orbax), and
requests per step in a bucket (moto's S3 server), with a step's save and
restore timed packed against one object per leaf (cpu profile only: the
files and requests are the same on any device).

On an accelerator the intervals are 100 and 200 steps (its steps take
about 2 ms: a save's write fits in such an interval, as in a real job).

``--quick``: the example's small configuration (``train_lm.TINY``), with
and without a 16 MiB frozen array, few steps. On an
accelerator (``--platform tpu``, the devices JAX picks) the frozen array is
64 MiB. ``--budget-s`` cuts the repeats.
"""

import os
import sys

import jaxworks_bench as jb

PROFILE = jb.configure_devices()  # before jax: 8 host CPU devices on cpu

# pylint: disable=wrong-import-position
import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import inspect  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

import jax  # noqa: E402

# The model of examples/train_lm.py (one copy of it): under Bazel from
# //examples:train_lm_lib, from a source tree by its path.
sys.path.append(
  os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 3,
               "examples")
)  # fmt: skip
import train_lm  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402

PKG = "batched_transfer"
ORBAX = "orbax CheckpointManager, async (its default)"


@dataclasses.dataclass
class Sizes:
  interval: int  # save_interval_steps
  intervals: int  # timed intervals per run
  after: int  # K: the steps after a save whose slowdown is measured
  repeats: int
  warmup: int = 3  # steps before the first timed interval


#: The ``pack_below`` of the packed rows: the manager's default.
PACK_BELOW = (
  inspect.signature(bt.CheckpointManager).parameters["pack_below"].default
)
#: The way of the loop whose manager writes one file per leaf
#: (``pack_below=None``; the default packs small leaves).
ONE_FILE = "jaxworks, one file per leaf"


class Loop:
  """One configuration: the compiled step, and runs of the loop."""

  def __init__(self, cfg):
    self.cfg = cfg
    self.shardings = train_lm.make_shardings()
    self.step_fn = train_lm.make_train_step(cfg, self.shardings)
    self.bytes = None

  def run(self, steps, saver=None):
    """``(iteration seconds, save-call seconds)`` per step, 1..``steps``;
    ``saver(step, params, opt_state, data_state, loss)`` is the save call
    (None: no checkpoints)."""
    params, opt_state = train_lm.init_state(self.cfg, self.shardings)
    data = train_lm.DataIterator(self.cfg, self.shardings)
    jax.block_until_ready((params, opt_state))
    if self.bytes is None:
      self.bytes = sum(x.nbytes for x in jax.tree.leaves((params, opt_state)))
    iteration, calls = [], []
    gc.collect()
    gc.disable()
    try:
      for step in range(1, steps + 1):
        start = time.perf_counter()
        tokens = data.next(step)
        params, opt_state, loss = self.step_fn(params, opt_state, tokens)
        jax.block_until_ready((params, opt_state, loss))
        # What a loop has anyway (it logs its loss), with or without
        # checkpoints: outside the save call's time (the loss's transfer
        # from a chip: ~0.3 ms a step, as much as a step's fifth).
        data_state, loss_value = data.state(), float(loss)
        mid = time.perf_counter()
        if saver is not None:
          saver(step, params, opt_state, data_state, loss_value)
        end = time.perf_counter()
        iteration.append(end - start)
        calls.append(end - mid)
    finally:
      gc.enable()
    return iteration, calls


def managed_run(loop, steps, interval, mgr, directory, save):
  """``loop.run`` with ``save`` (a call of ``mgr``, either library's), then
  the manager waited for, checked to hold the last save step, closed, and
  its ``directory`` removed."""
  try:
    out = loop.run(steps, save)
    mgr.wait_until_finished()
    assert mgr.all_steps()[-1] == steps - steps % interval, mgr.all_steps()
  finally:
    mgr.close()
    shutil.rmtree(directory, ignore_errors=True)
  return out


def jaxworks_run(loop, steps, interval, **options):
  directory = tempfile.mkdtemp(prefix="loop-jaxworks-")
  mgr = bt.CheckpointManager(
    directory, max_to_keep=3, save_interval_steps=interval, **options
  )

  def save(step, params, opt_state, data, loss):
    mgr.save(
      step,
      items={"params": params, "opt_state": opt_state, "data": data},
      metrics={"loss": loss},
    )

  return managed_run(loop, steps, interval, mgr, directory, save)


def orbax_run(loop, steps, interval):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  directory = tempfile.mkdtemp(prefix="loop-orbax-")
  mgr = ocp.CheckpointManager(
    directory,
    options=ocp.CheckpointManagerOptions(
      max_to_keep=3, save_interval_steps=interval
    ),
  )

  def save(step, params, opt_state, data, loss):
    mgr.save(
      step,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(params),
        opt_state=ocp.args.StandardSave(opt_state),
        data=ocp.args.JsonSave(data),
      ),
      metrics={"loss": loss},
    )

  return managed_run(loop, steps, interval, mgr, directory, save)


def write_seconds(loop, interval):
  """A blocking jaxworks save of the loop's tree (its write, whole)."""
  params, opt_state = train_lm.init_state(loop.cfg, loop.shardings)
  data = train_lm.DataIterator(loop.cfg, loop.shardings).state()
  directory = tempfile.mkdtemp(prefix="loop-write-")
  try:
    times = []
    for step in range(2):
      start = time.perf_counter()
      bt.save(
        os.path.join(directory, str(step)),
        {"params": params, "opt_state": opt_state, "data": data},
      )
      times.append(time.perf_counter() - start)
  finally:
    shutil.rmtree(directory, ignore_errors=True)
  del interval
  return min(times)


class Stats:
  """The measures of one way's runs, each against the baseline run of the
  same repeat (run beside it: the machine's load drifts between repeats)."""

  def __init__(self, runs, base_runs, sizes):
    n, k = sizes.interval, sizes.after
    save_calls, after_calls, after_all, slowdowns, lost = [], [], [], [], []
    for (iteration, calls), (base_iteration, _) in zip(runs, base_runs):
      base_mean = statistics.mean(base_iteration[sizes.warmup :])
      steps = len(iteration)
      after = []
      for s in range(sizes.warmup + 1, steps + 1):
        if s % n:
          continue
        save_calls.append(calls[s - 1])
        if s + 1 <= steps:
          after_calls.append(calls[s])
        if s + k <= steps:
          after.extend(iteration[s : s + k])
        if s + n <= steps:
          lost.append(sum(iteration[s : s + n]) - n * base_mean)
      slowdowns.append(statistics.mean(after) - base_mean)
      after_all.extend(after)
    self.save_call = statistics.median(save_calls)
    self.after_call = statistics.median(after_calls)
    self.after_mean = statistics.mean(after_all)
    self.slowdown = statistics.mean(slowdowns)
    self.lost = statistics.median(lost)
    self.intervals = len(lost)


def measure(report, name, loop, sizes, budget, share=0.9):
  """The rows of one configuration; its repeats stop (after the first) at
  ``share`` of the budget left (the plain model leaves the frozen one its
  part)."""
  n = sizes.interval
  steps = sizes.warmup + n * (sizes.intervals + 1)
  ways = {
    "none": lambda steps: loop.run(steps),
    "jaxworks": lambda steps: jaxworks_run(loop, steps, n),
    ONE_FILE: lambda steps: jaxworks_run(loop, steps, n, pack_below=None),
  }
  try:
    import orbax.checkpoint  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import

    ways["orbax"] = lambda steps: orbax_run(loop, steps, n)
  except ImportError as err:
    report.skip(f"orbax rows of {name}", f"orbax is not installed: {err}")
  for fn in ways.values():  # compile, warm every path once: two saves
    fn(n + 2)
  runs = {w: [] for w in ways}
  deadline = budget.until(share)
  for r in range(sizes.repeats):
    if r >= 1 and deadline is not None and time.monotonic() > deadline:
      break
    order = list(ways)
    order = order[r % len(order) :] + order[: r % len(order)]
    for way in order:
      os.sync()  # the previous run's writes flushed outside every timer
      runs[way].append(ways[way](steps))
  base = [t for it, _ in runs["none"] for t in it[sizes.warmup :]]
  base_mean = statistics.mean(base)
  noise = max(statistics.stdev(base) / len(base) ** 0.5, 1e-6)
  stats = {w: Stats(runs[w], runs["none"], sizes) for w in ways if w != "none"}
  write = write_seconds(loop, n)
  mb = loop.bytes / 1e6
  print(
    f"{name}: checkpoint {mb:.1f} MB; step {jb.fmt_seconds(base_mean)} "
    f"without checkpoints (noise {jb.fmt_seconds(noise)}); interval {n} "
    f"steps = {jb.fmt_seconds(n * base_mean)}; a blocking save writes in "
    f"{jb.fmt_seconds(write)}; {len(runs['none'])} repeats"
  )
  for way, st in stats.items():
    print(
      f"  {way:20s}: save call on save steps {jb.fmt_seconds(st.save_call)}, "
      f"on the step after {jb.fmt_seconds(st.after_call)}; the "
      f"{sizes.after} steps after a save {jb.fmt_seconds(st.after_mean)} "
      f"each (slowdown {st.slowdown * 1e3:+.2f} ms); lost per interval "
      f"{st.lost * 1e3:+.2f} ms ({100 * st.lost / (n * base_mean):+.2f}%), "
      f"over {st.intervals} intervals"
    )
  report.note(
    f"{name}: checkpoint {mb:.1f} MB, save_interval_steps={n}; step "
    f"{jb.fmt_seconds(base_mean)} without checkpoints (noise: standard "
    f"error of the mean {jb.fmt_seconds(noise)}); a blocking save of the "
    f"tree {jb.fmt_seconds(write)}; "
    + "; ".join(
      f"{way}: save call {jb.fmt_seconds(st.save_call)} on save steps, "
      f"{jb.fmt_seconds(st.after_call)} on the step after, slowdown of the "
      f"{sizes.after} steps after a save {st.slowdown * 1e3:+.2f} ms, lost "
      f"per interval {st.lost * 1e3:+.2f} ms "
      f"({100 * st.lost / (n * base_mean):+.2f}%)"
      for way, st in stats.items()
    )
    + f"; medians over {stats['jaxworks'].intervals} intervals of "
    f"{len(runs['none'])} runs of each way."
  )
  ours = stats["jaxworks"]
  theirs = stats.get("orbax")
  floor = noise
  if theirs is not None:
    report.add(
      f"{name}: save call on a save step",
      ours.save_call, theirs.save_call, "peer", ORBAX, goal=2.0,
    )  # fmt: skip
    report.add(
      f"{name}: save call on the step after a save step",
      ours.after_call, theirs.after_call, "peer", ORBAX, goal=1.0,
    )  # fmt: skip
    report.add(
      f"{name}: slowdown of the {sizes.after} steps after a save (vs no "
      "checkpoints)",
      max(ours.slowdown, floor), max(theirs.slowdown, floor), "peer", ORBAX,
      goal=1.0,
    )  # fmt: skip
    report.add(
      f"{name}: time lost to checkpoints per interval of {n} steps",
      max(ours.lost, n * floor), max(theirs.lost, n * floor), "peer", ORBAX,
      goal=1.0,
    )  # fmt: skip
  one_file = stats[ONE_FILE]
  report.add(
    f"{name}: time lost to checkpoints per interval of {n} steps, "
    f"pack_below={PACK_BELOW >> 20} MiB (vs one file per leaf)",
    max(ours.lost, n * floor), max(one_file.lost, n * floor), "ablation",
    "the same manager, pack_below=None (one file per leaf)",
  )  # fmt: skip
  fits = write < n * base_mean
  report.add(
    f"{name}: an interval of {n} steps with jaxworks checkpoints (vs none)",
    n * base_mean + max(ours.lost, 0.0), n * base_mean, "ablation",
    "the same loop without checkpoints",
    goal=1 / 1.01 if fits else None,
  )  # fmt: skip
  if not fits:
    report.note(
      f"{name}: no goal for the fraction of the interval lost: a blocking "
      f"save of the tree ({jb.fmt_seconds(write)}) does not fit in the "
      f"interval ({jb.fmt_seconds(n * base_mean)})."
    )


def _state(cfg):
  """The items a step of the loop saves (params, opt_state, data)."""
  shardings = train_lm.make_shardings()
  params, opt_state = train_lm.init_state(cfg, shardings)
  data = train_lm.DataIterator(cfg, shardings).state()
  return {"params": params, "opt_state": opt_state, "data": data}


def _files(path):
  return sum(len(names) for _, _, names in os.walk(path))


def _step_on_disk(items, **options):
  """Files of one step saved by jaxworks' manager (``options``: its
  settings, e.g. ``pack_below``)."""
  with tempfile.TemporaryDirectory(prefix="loop-files-") as d:
    mgr = bt.CheckpointManager(d, **options)
    mgr.save(1, items=items, metrics={"loss": 1.0})
    mgr.wait_until_finished()
    mgr.close()
    return _files(os.path.join(d, "1"))


def _orbax_step_on_disk(items):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  with tempfile.TemporaryDirectory(prefix="loop-files-") as d:
    mgr = ocp.CheckpointManager(d)
    mgr.save(
      1,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(items["params"]),
        opt_state=ocp.args.StandardSave(items["opt_state"]),
        data=ocp.args.JsonSave(items["data"]),
      ),
      metrics={"loss": 1.0},
    )
    mgr.wait_until_finished()
    mgr.close()
    return _files(os.path.join(d, "1"))


class Requests:
  """Calls of the bucket's storage layer (each an HTTP request for these
  small objects), counted while ``counting``."""

  NAMES = (
    "list", "children", "size", "mtime_ns", "read", "stream_into",
    "open_stream", "write", "_stream", "upload", "copy", "create", "tag_of",
    "read_tagged", "replace", "delete",
  )  # fmt: skip

  def __init__(self):
    import threading  # pylint: disable=import-outside-toplevel

    from jaxworks.batched_transfer._src.checkpoint import stores  # pylint: disable=import-outside-toplevel

    self.n, self.lock, self.on = 0, threading.Lock(), False
    cls = stores.ObstoreStorage
    for name in self.NAMES:
      real = vars(cls)[name]

      def call(st, *args, real=real, **kwargs):
        if self.on:
          with self.lock:
            self.n += 1
        return real(st, *args, **kwargs)

      setattr(cls, name, call)

  def count(self, fn):
    self.n, self.on = 0, True
    try:
      fn()
    finally:
      self.on = False
    return self.n


def step_files(report, cfg, repeats):
  """Files per saved step on disk (jaxworks, packed, orbax), objects and
  requests per step in a bucket (moto's S3 server), and the time of a
  step's save and restore to the bucket, packed against one object per
  leaf."""
  sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
  )
  import object_servers  # pylint: disable=import-outside-toplevel

  items = _state(cfg)
  below = f"pack_below={PACK_BELOW >> 20} MiB"
  on_disk = {
    f"jaxworks (its default {below})": _step_on_disk(items),
    "jaxworks pack_below=None": _step_on_disk(items, pack_below=None),
    "orbax": _orbax_step_on_disk(items),
  }
  report.note(
    "Files per saved step on disk (params, opt_state, data and the loss "
    "metric; the manager's own files included): "
    + ", ".join(f"{k} {v}" for k, v in on_disk.items())
    + "."
  )
  counter = Requests()
  with object_servers.s3_server_process() as endpoint:
    object_servers.s3_bucket(endpoint, "bench")
    os.environ.update(object_servers.S3_ENV, AWS_ENDPOINT_URL=endpoint)
    per_step = {}
    for label, pack in (("one object per leaf", None), (below, PACK_BELOW)):
      url = f"s3://bench/steps-{pack}"
      mgr = bt.CheckpointManager(url, pack_below=pack)
      saved = counter.count(
        lambda mgr=mgr: (
          mgr.save(1, items=items, metrics={"loss": 1.0}),
          mgr.wait_until_finished(),
        )
      )
      restored = counter.count(lambda mgr=mgr: mgr.restore(1))
      mgr.close()
      per_step[label] = (saved, restored)
    report.note(
      "Requests per step to s3:// (moto), counted at jaxworks' storage "
      "layer (a manager's save of the step and its wait, then its restore): "
      + "; ".join(
        f"{k}: save {s}, restore {r}" for k, (s, r) in per_step.items()
      )
      + "."
    )

    def setup():
      one, packed = (f"s3://bench/save-{uuid.uuid4().hex}" for _ in range(2))
      return (
        lambda: bt.save(packed, items, pack_below=PACK_BELOW),
        lambda: bt.save(one, items),
      )

    t_packed, t_one = jb.median_pair(None, None, repeats, setup=setup)
    report.add(
      f"save a step to s3:// (moto), {below} (vs one object per leaf)",
      t_packed, t_one, "ablation", "bt.save, one object per leaf", goal=1.0,
    )  # fmt: skip
    one, packed = "s3://bench/one", "s3://bench/packed"
    bt.save(one, items)
    bt.save(packed, items, pack_below=PACK_BELOW)
    t_packed, t_one = jb.median_pair(
      lambda: jax.block_until_ready(bt.restore(packed, items)),
      lambda: jax.block_until_ready(bt.restore(one, items)),
      repeats,
    )
    report.add(
      f"restore a step from s3:// (moto), {below} (vs one object per leaf)",
      t_packed, t_one, "ablation", "bt.restore, one object per leaf",
      goal=1.0,
    )  # fmt: skip


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--frozen-mib", type=int, default=None)
  p.add_argument("--repeats", type=int, default=None)
  jb.add_arguments(p)
  a = p.parse_args(argv)
  budget = jb.Budget(a.budget_s)
  accel = PROFILE != "cpu"
  cfg = train_lm.Config()
  if a.quick:
    cfg = train_lm.TINY
    plain = Sizes(interval=5, intervals=3, after=2, repeats=1)
    frozen = dataclasses.replace(plain)
    frozen_mib = 16
  else:
    plain = Sizes(interval=10, intervals=3, after=3, repeats=8)
    frozen = Sizes(interval=20, intervals=2, after=3, repeats=5)
    frozen_mib = 64 if accel else 256
    if accel:  # steps of ~2 ms: intervals that a save's write fits in
      plain = dataclasses.replace(plain, interval=100, repeats=6)
      frozen = dataclasses.replace(frozen, interval=200, repeats=4)
  if a.frozen_mib is not None:
    frozen_mib = a.frozen_mib
  if a.repeats is not None:
    plain.repeats = frozen.repeats = a.repeats
  report = jb.Report(PKG)
  report.finish_on_signal(a)
  report.section(
    "plain model",
    lambda: measure(report, "plain model", Loop(cfg), plain, budget, 0.4),
    budget=budget, min_s=20,
  )  # fmt: skip
  big = dataclasses.replace(cfg, frozen_mib=frozen_mib)
  name = f"with a frozen {frozen_mib} MiB array"
  report.section(
    name, lambda: measure(report, name, Loop(big), frozen, budget),
    budget=budget, min_s=20,
  )  # fmt: skip
  if not accel:  # the same files and requests on any device
    report.section(
      "files and requests per step",
      lambda: step_files(report, cfg, 3 if a.quick else 7),
      budget=budget, min_s=20,
    )  # fmt: skip
  report.finish(a)
  return report.exit_status()


if __name__ == "__main__":
  sys.exit(main())
