"""Across processes and re-created steps, on real training steps.

The workloads are ``train_step_worker.py``'s training steps (forward,
backward, hand-written Adam) in plain JAX: a 3-layer MLP and a 4-layer
transformer block stack (d_model 256), plus jit_add_chain, and a new user's
script (``train_step_worker.user_script``: MLP, AdamW with clipping, helper
jits for the data and the metrics, an eval function). Each new-process
case starts ``train_step_worker.py`` with this interpreter (medians over
several processes, interleaved):

* time to first result of the script (init with ``jax.random``, eager
  operations, the train step, an eval step) in a new process: warm with
  JAX's persistent compilation cache turned on by ``jax.config``
  (``jax.jit``) or by ``jit_cache.set_cache_dir`` (``jit_cache.jit``; since
  0.4.0 the same cache, and since 0.5.0 a call site's first call
  deserializes its entry while it traces: at most 1.0x), and cold; with
  the warm starts' time per phase (import, trace, lower, cache read,
  deserialize, first run) and their cache misses (XLA compiles) as notes;
* a sweep of 8 configurations in a new process, the step function
  re-created per configuration (hyperparameters are arguments), per
  re-created configuration against ``jax.jit`` (goal 5x) and ``jax.jit``
  with JAX's cache warm (goal 2x), and whole (see ``sweep_cases``);

and in this process: the step function re-created (against ``jax.jit`` and
``equinox.filter_jit``), the first call of never-seen programs (miss
overhead, persistent cache off and on), the cached call, and the inline
re-wrapped ``jit(f)(x)``.

On an accelerator (``--platform tpu``: the devices JAX picks, one chip),
where each new process opens the chip (~15 s) and only one process at a
time can hold it:

* first, while this process has not opened the chip: the warm start of a
  new process against JAX's persistent cache, four re-created bfloat16
  transformer train steps (``--program transformer --task sweep --configs
  4 --dtype bfloat16``), time to their first results once the backend is
  up (goal 1.0x); two processes write the caches, then warm ones alternate
  as the budget allows;
* then in this process: a sweep of 8 configurations of the MLP train step,
  the step re-created per configuration, a program new to both sides per
  repeat, per re-created configuration against ``jax.jit`` (goal 30x; its
  limit: tracing the re-created step, which every jit must, and a call of
  the compiled one), and the in-process rows above with fewer repeats. The new-process rows of the
  CPU profile are not run there (dozens of processes).

Usage: ``python train_step_bench.py [--quick] [--json PATH] [--platform P]
[--budget-s S]``.
"""

import os

import jaxworks_bench as jb

PROFILE = jb.configure_devices()  # before jax: 8 host CPU devices on cpu

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxworks import jit_cache  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step_worker as worker  # noqa: E402

WORKER = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), "train_step_worker.py"
)
JAX_CACHE = "JAX persistent compilation cache"
PKG = "jit_cache"


def fresh(*args: str) -> dict:
  """Runs the worker in a new process; returns its JSON result."""
  env = jb.fresh_env()  # bytecode cached as in an installed package
  env.pop("JAXWORKS_JIT_CACHE_DIR", None)
  # A TPU refuses a process started while another holds the chip (or just
  # after it ended): run_process starts it again once, 5 s later.
  proc = jb.run_process([sys.executable, WORKER, *args], env=env)
  if proc.returncode != 0:
    raise RuntimeError(
      f"train_step_worker {' '.join(args)} exited {proc.returncode}:\n"
      + proc.stderr[-3000:]
    )
  return json.loads(proc.stdout.strip().splitlines()[-1])


def runs(scenarios: dict, repeats: int) -> dict:
  """The worker's results per scenario, the scenarios interleaved per
  repeat, in turn forward and backward (A B, B A, ...): a scenario is not
  always the one started right after another process exited, so a drift
  of the shared machine within a repeat falls on every side alike."""
  results: dict = {name: [] for name in scenarios}
  for r in range(repeats):
    order = list(scenarios.items())
    for name, args in order if r % 2 == 0 else order[::-1]:
      if callable(args):  # arguments of repeat r (e.g. a fresh directory)
        args = args(r)
      results[name].append(fresh(*args))
  return results


def median_of(results: dict, field: str) -> dict:
  """Median ``field`` per scenario of ``runs``' results."""
  return {
    name: statistics.median(r[field] for r in rs)
    for name, rs in results.items()
  }


def medians(scenarios: dict, repeats: int, field: str = "first_s") -> dict:
  """Median ``field`` per scenario, the scenarios interleaved per repeat."""
  return median_of(runs(scenarios, repeats), field)


def new_process_cases(report, quick: bool, tmp: str) -> None:
  """Time to first result of the script (init, jax.random, eager ops, the
  train step, an eval step) in new processes: warm with JAX's persistent
  cache turned on through jax.config (jax.jit) or through
  jit_cache.set_cache_dir (jit_cache.jit: the same cache), and cold."""
  # Warm runs are short and their spread (imports, the machine) is as large
  # as the effects measured: more of them, interleaved; most for
  # jit_add_chain, whose first call takes 20-80 ms of a 2 s process (with 21
  # warm runs its ratio ranged 0.84x-1.14x over four runs of this bench).
  programs = [
    ("mlp", "MLP train step", (11, 7)),
    (
      "transformer",
      "4-layer transformer block train step, d_model 256",
      (11, 7),
    ),
    ("chain", "jit_add_chain", (41, 11)),
    (
      "user",
      "a new user's MLP script (AdamW with clipping, 4 jits, eval)",
      # 7 cold runs: a cold run's ~4 s are nearly all XLA compiles, whose
      # time on this shared machine spread by 2x between runs; the median of
      # 3 measured that spread more than jaxworks.
      (13, 7),
    ),
  ]
  if quick:  # --quick (the smoke test): jit_add_chain only, seconds
    programs = [("chain", "jit_add_chain", (1, 1))]
  for program, label, (warm_repeats, cold_repeats) in programs:
    jax_dir = os.path.join(tmp, program, "jax")
    jw_dir = os.path.join(tmp, program, "jw")
    p = ("--program", program)
    # First runs write the caches (and are cold runs with a cache on).
    medians(
      {
        "jax_write": ("--jit", "jax", "--jax-cache", jax_dir, *p),
        "jw_write": ("--jit", "jaxworks", "--jw-cache", jw_dir, *p),
      },
      1,
    )
    warm = {
      "jax_warm": ("--jit", "jax", "--jax-cache", jax_dir, *p),
      "jw_warm": ("--jit", "jaxworks", "--jw-cache", jw_dir, *p),
    }
    if program == "mlp" and not quick:
      warm["eqx_warm"] = ("--jit", "equinox", "--jax-cache", jax_dir, *p)
    cold = {
      "jax_cold": ("--jit", "jax", *p),
      "jw_cold": ("--jit", "jaxworks", *p),
    }
    field = "first_s" if program == "chain" else "script_s"
    what = "first call" if program == "chain" else "time to first result"
    warm_runs = runs(warm, warm_repeats)
    t = median_of(warm_runs, field)
    prefetched = median_of(
      {"jw": warm_runs["jw_warm"]}, "persistent_prefetched"
    )
    t.update(medians(cold, cold_repeats, field))
    report.add(
      f"{label}: {what} of a warm new process: jaxworks (set_cache_dir: "
      "JAX's cache) vs JAX's persistent cache",
      t["jw_warm"],
      t["jax_warm"],
      "stock-jax",
      JAX_CACHE,
      goal=1.0,
    )
    report.add(
      f"{label}: {what} of a cold new process (miss overhead)",
      t["jw_cold"],
      t["jax_cold"],
      "stock-jax",
      "jax.jit",
      goal=1 / 1.05,
    )
    if "eqx_warm" in t:
      report.add(
        f"{label}: {what} of a warm new process: jaxworks vs equinox with "
        "JAX's persistent cache",
        t["jw_warm"],
        t["eqx_warm"],
        "peer",
        "equinox.filter_jit",
      )
    phase_note(report, label, warm_runs)
    report.note(
      f"{label}, {what} in new processes (medians of {warm_repeats} warm, "
      f"{cold_repeats} cold runs; a warm jaxworks process answered "
      f"{prefetched['jw']:.0f} of JAX's cache reads with entries it had "
      "deserialized ahead): cold "
      f"jax.jit {jb.fmt_seconds(t['jax_cold'])}, cold jaxworks "
      f"{jb.fmt_seconds(t['jw_cold'])}, warm JAX cache "
      f"{jb.fmt_seconds(t['jax_warm'])}, warm jaxworks (the same cache) "
      f"{jb.fmt_seconds(t['jw_warm'])}"
    )


def phase_note(report, label: str, warm_runs: dict) -> None:
  """The per-phase breakdown of the warm starts (``train_step_worker.Phases``,
  medians per phase over the runs), both sides, as a note."""

  def phases(name):
    rs = [r["phases"] for r in warm_runs[name]]
    return {f: statistics.median(p[f] for p in rs) for f in rs[0]}

  jax_p, jw_p = phases("jax_warm"), phases("jw_warm")
  fmt = jb.fmt_seconds

  def line(p):
    return (
      f"import {fmt(p['import'])}, trace {fmt(p['trace'])}, lower "
      f"{fmt(p['lower'])} ({p['lowerings']:.0f} programs), cache read on "
      f"the main thread {fmt(p['cache_read'])}, cache key (hashing the "
      f"module) {fmt(p['key_and_compile'])}, first run and the rest "
      f"{fmt(p['first_run'])}"
    )

  misses = max(jax_p["cache_misses"], jw_p["cache_misses"])
  report.note(
    f"{label}, warm start per phase (jax.monitoring; medians of "
    f"{len(warm_runs['jw_warm'])}): JAX's cache: {line(jax_p)} (its cache "
    f"read reads, decompresses and deserializes); jaxworks: {line(jw_p)}, "
    "and deserialized ahead on a background thread "
    f"{fmt(jw_p['deserialize_background'])}. Compiles that asked the cache "
    f"{jw_p['cache_requests']:.0f} (jaxworks) and "
    f"{jax_p['cache_requests']:.0f} (JAX), misses {misses:.0f}: "
    + ("no XLA compile on either side" if misses == 0 else "XLA compiled")
    + ". Both lower every program: JAX's cache key is a hash of the lowered "
    "module"
  )


def sweep_cases(report, quick: bool, tmp: str) -> None:
  """8 configurations in a new process, the step re-created per
  configuration, hyperparameters passed as arguments.

  The goals (5x against ``jax.jit``, 2x against ``jax.jit`` with
  JAX's cache on) are per
  re-created configuration: the configurations after the first, which
  jaxworks reuses and stock compiles (or loads from its cache). The first
  configuration compiles on both sides, so a whole sweep's ratio is bounded
  by (C + 7 S) / (C + 7 r) for a first call C, a stock configuration S and a
  reuse r (at most 8x, about 5-6x for this step on 2 cores); it is printed
  too, without a goal."""
  if quick:  # --quick (the smoke test): no new-process sweep
    return
  jax_dir = os.path.join(tmp, "sweep", "jax")
  jw_dir = os.path.join(tmp, "sweep", "jw")
  s = ("--task", "sweep")
  fresh("--jit", "jax", "--jax-cache", jax_dir, *s)  # writes JAX's cache
  fresh("--jit", "jaxworks", "--jw-cache", jw_dir, *s)  # the same, via ours
  scenarios = {
    "jax": ("--jit", "jax", *s),
    "jw": ("--jit", "jaxworks", *s),
    "jax_warm": ("--jit", "jax", "--jax-cache", jax_dir, *s),
    "jw_warm": ("--jit", "jaxworks", "--jw-cache", jw_dir, *s),
    "eqx": ("--jit", "equinox", *s),
  }
  results = runs(scenarios, 7)
  rest = median_of(results, "sweep_rest_s")
  whole = median_of(results, "sweep_s")
  first = median_of(results, "first_s")
  case = "sweep of 8 configurations in a new process (step re-created per "
  per_config = "configuration), per re-created configuration (the 7 after "
  per_config += "the first)"
  warm = ", JAX's persistent cache on and warm for both "
  warm += "(jit_cache.set_cache_dir / jax.config)"
  report.add(
    case + per_config,
    rest["jw"],
    rest["jax"],
    "stock-jax",
    "jax.jit",
    goal=5.0,
  )
  report.add(
    case + per_config + warm,
    rest["jw_warm"],
    rest["jax_warm"],
    "stock-jax",
    JAX_CACHE,
    goal=2.0,
  )
  whole_sweep = "configuration), whole sweep (the first configuration "
  whole_sweep += "compiles on both sides)"
  report.add(
    case + whole_sweep, whole["jw"], whole["jax"], "stock-jax", "jax.jit"
  )
  report.add(
    case + whole_sweep + warm,
    whole["jw_warm"],
    whole["jax_warm"],
    "stock-jax",
    JAX_CACHE,
  )
  report.add(
    case + whole_sweep + ", vs equinox",
    whole["jw"],
    whole["eqx"],
    "peer",
    "equinox.filter_jit",
  )
  report.note(
    "Sweep in new processes (medians of 7, interleaved): first "
    f"configuration jax.jit {jb.fmt_seconds(first['jax'])}, jaxworks "
    f"{jb.fmt_seconds(first['jw'])}; the 7 re-created configurations after "
    f"it jax.jit {jb.fmt_seconds(rest['jax'])}, jaxworks "
    f"{jb.fmt_seconds(rest['jw'])} (warm cache: "
    f"{jb.fmt_seconds(rest['jax_warm'])} and "
    f"{jb.fmt_seconds(rest['jw_warm'])}). A whole sweep's ratio is bounded "
    "by the first compile both sides pay: (C + 7 S) / (C + 7 r) <= 8x."
  )


#: The warm-start row on an accelerator: four re-created bfloat16
#: transformer train steps in a new process.
WARM_CHIP = (
  "--program", "transformer", "--task", "sweep", "--configs", "4",
  "--dtype", "bfloat16",
)  # fmt: skip


#: What the warm start leaves of the budget on a chip: this process opens
#: the chip (~15 s) and runs the in-process sweep (8 compiles of jax.jit).
CHIP_RESERVE_S = 55


def warm_start_chip(report, quick: bool, tmp: str, budget) -> None:
  """A new process's warm start against JAX's persistent cache on the chip
  (this process must not have opened it: one process at a time holds it).
  Two processes write the caches; then warm ones alternate, one a side,
  more (up to 5) while the budget allows, CHIP_RESERVE_S kept for the
  rest: each process opens the chip, ~15 s."""
  # --quick (a trial on CPU): the MLP, two steps, one warm process a side.
  args = WARM_CHIP
  if quick:
    args = ("--program", "mlp", "--task", "sweep", "--configs", "2")
  jax_dir = os.path.join(tmp, "warm", "jax")
  jw_dir = os.path.join(tmp, "warm", "jw")
  sides = {
    "jax": ("--jit", "jax", "--jax-cache", jax_dir, *args),
    "jw": ("--jit", "jaxworks", "--jw-cache", jw_dir, *args),
  }
  stop = None
  if budget.seconds is not None:
    stop = time.monotonic() + budget.left() - CHIP_RESERVE_S
  start = time.monotonic()
  cold = {name: fresh(*a) for name, a in sides.items()}  # write the caches
  pair = time.monotonic() - start  # a cold pair: an upper bound of a warm one
  # The devices as the workers saw them (this process may never open them).
  report.devices.update(
    devices=cold["jax"]["devices"], device_kind=cold["jax"]["device_kind"]
  )
  results: dict = {name: [] for name in sides}
  for r in range(1 if quick else 5):
    if r and stop is not None and time.monotonic() + pair > stop:
      break
    start = time.monotonic()
    for name in sides if r % 2 == 0 else reversed(list(sides)):
      results[name].append(fresh(*sides[name]))
    pair = time.monotonic() - start
  t = median_of(results, "from_backend_s")
  steps = median_of(results, "steps_s")
  backend = median_of(results, "backend_s")
  n = len(results["jw"])
  what = "four re-created bf16 transformer train steps"
  if quick:
    what = "two re-created float32 MLP train steps"
  report.add(
    f"warm start of a new process, {what}: time to first results once the "
    "backend is up, jaxworks (set_cache_dir: JAX's cache) vs JAX's "
    "persistent cache",
    t["jw"],
    t["jax"],
    "stock-jax",
    JAX_CACHE,
    goal=1.0,
  )
  report.add(
    f"warm start of a new process, {what}: the steps alone (model initialised)",
    steps["jw"],
    steps["jax"],
    "stock-jax",
    JAX_CACHE,
  )
  report.note(
    f"Warm start on {devices_text(report)} (medians of {n} warm processes a "
    f"side, alternating): from the backend up to the last result "
    f"jaxworks {jb.fmt_seconds(t['jw'])}, JAX's cache "
    f"{jb.fmt_seconds(t['jax'])}; the steps alone "
    f"{jb.fmt_seconds(steps['jw'])} and {jb.fmt_seconds(steps['jax'])}; "
    f"bringing the backend up took {jb.fmt_seconds(backend['jw'])} and "
    f"{jb.fmt_seconds(backend['jax'])} (not counted); the cold processes "
    f"that wrote the caches {jb.fmt_seconds(cold['jw']['from_backend_s'])} "
    f"and {jb.fmt_seconds(cold['jax']['from_backend_s'])}."
  )
  phase_note(
    report,
    what,
    {"jax_warm": results["jax"], "jw_warm": results["jw"]},
  )


def devices_text(report) -> str:
  """``8 cpu devices``; on an accelerator without opening it here (the
  devices as this process or its workers saw them)."""
  info = jb.machine(open_backend=PROFILE == "cpu")
  info = info if "devices" in info else report.devices
  kind = f" ({info['device_kind']})" if "device_kind" in info else ""
  return f"{info.get('devices', '?')} devices{kind}"


def sweep_in_process(report, quick: bool, budget) -> None:
  """8 configurations of the MLP train step, the step re-created per
  configuration (hyperparameters as arguments), in this process: per
  repeat a program new to both sides (a batch size no repeat used), the
  sides alternating which goes first. The first configuration compiles on
  both sides; per re-created configuration (the 7 after it) jaxworks
  reuses the executable and ``jax.jit`` compiles again (goal 30x on an
  accelerator, where compiles cost more)."""
  configs = worker.SWEEP[: 3 if quick else 8]
  hps = [worker.hparams(lr, b1) for lr, b1 in configs]
  jax.block_until_ready(hps)
  sides = {"jw": jit_cache.jit, "jax": jax.jit}
  first = {k: [] for k in sides}
  rest = {k: [] for k in sides}
  # The limit of a re-created configuration: tracing the new function (any
  # jit must, to know its program) and a call of the compiled step.
  limit = []
  deadline = budget.until(0.5)
  for r in range(2 if quick else 5):
    if r >= 2 and deadline is not None and time.monotonic() > deadline:
      break
    params, opt, x, y, _ = worker.init(batch=worker.BATCH + 1 + r)
    jax.block_until_ready((params, opt, x, y))
    for name in sides if r % 2 == 0 else reversed(list(sides)):
      times = []
      for hp in hps:
        step = worker.make_step()  # re-created per configuration
        times.append(
          jb.timed_call(lambda s=step: sides[name](s)(params, opt, x, y, hp))[0]
        )
      first[name].append(times[0])
      rest[name].append(sum(times[1:]) / (len(times) - 1))
    compiled = jax.jit(worker.make_step())
    jb.timed_call(lambda: compiled(params, opt, x, y, hps[0]))
    per = []
    for hp in hps[1:]:
      step = worker.make_step()
      traced = lambda s=step, hp=hp: jax.jit(s).trace(params, opt, x, y, hp)
      run = lambda hp=hp: compiled(params, opt, x, y, hp)
      per.append(jb.timed_call(traced)[0] + jb.timed_call(run)[0])
    limit.append(sum(per) / len(per))
  med = {k: statistics.median(v) for k, v in rest.items()}
  med_first = {k: statistics.median(v) for k, v in first.items()}
  med_limit = statistics.median(limit)
  n = len(configs)
  report.add(
    f"sweep of {n} configurations in-process (MLP step re-created per "
    f"configuration), per re-created configuration (the {n - 1} after the "
    "first)",
    med["jw"],
    med["jax"],
    "stock-jax",
    "jax.jit",
    goal=30.0,
    limit=("trace of the new step + a call of the compiled one", med_limit),
  )
  report.note(
    f"In-process sweep (medians of {len(rest['jw'])} sweeps, a new program "
    f"each): first configuration jax.jit {jb.fmt_seconds(med_first['jax'])}, "
    f"jaxworks {jb.fmt_seconds(med_first['jw'])}; each re-created "
    f"configuration after it jax.jit {jb.fmt_seconds(med['jax'])} (a "
    f"compile), jaxworks {jb.fmt_seconds(med['jw'])} (trace, reuse, run); "
    "the limit, tracing the re-created step (jax.jit(step).trace) and "
    f"calling the compiled one: {jb.fmt_seconds(med_limit)}, so at most "
    f"{med['jax'] / med_limit:.1f}x."
  )


def in_process_cases(report, quick: bool, budget=None) -> None:
  """The in-process rows; with ``budget`` (an accelerator's round) each of
  the 6 measurements gets an equal share of the time left (at least 3
  repeats), and the equinox row is skipped where equinox is missing."""
  args = worker.init()
  jax.block_until_ready(args)
  repeats = 1 if quick else 9 if PROFILE == "cpu" else 5
  budget = budget or jb.Budget()
  shares = iter([1 / 6, 1 / 5, 1 / 4, 1 / 3, 1 / 2, 1.0])

  def until():
    return budget.until(next(shares, 1.0))

  def recreated(jit):
    return lambda: jit(worker.make_step())(*args)

  ours, stock = recreated(jit_cache.jit), recreated(jax.jit)
  ours()
  stock()
  t_ours, t_stock = jb.median_pair(ours, stock, repeats, deadline=until())
  report.add(
    "MLP train step re-created in-process (trace + reuse or compile + run)",
    t_ours,
    t_stock,
    "stock-jax",
    "jax.jit",
    goal=5.0,
  )
  try:
    import equinox  # pylint: disable=g-import-not-at-top
  except ImportError as err:
    equinox = None
    if not quick:
      report.skip("MLP train step re-created in-process, vs equinox", err)
  if not quick and equinox is not None:
    eqx = recreated(equinox.filter_jit)
    eqx()
    t_ours, t_eqx = jb.median_pair(ours, eqx, repeats, deadline=until())
    report.add(
      "MLP train step re-created in-process, vs equinox",
      t_ours,
      t_eqx,
      "peer",
      "equinox.filter_jit",
      goal=5.0,
    )

  # Cached call: the same step object called again (the training loop).
  step_ours = jit_cache.jit(worker.make_step())
  step_stock = jax.jit(worker.make_step())
  step_ours(*args)
  step_stock(*args)
  t_ours, t_stock = jb.median_pair(
    lambda: step_ours(*args),
    lambda: step_stock(*args),
    5 if quick else 21,
    inner=20 if quick else 100,
    deadline=until(),
  )
  report.add(
    "MLP train step, cached call",
    t_ours,
    t_stock,
    "stock-jax",
    "jax.jit",
    goal=1 / 1.1,
  )

  # Miss: the first call of a program never seen (distinct add chains).
  x = jnp.ones((4, 4), jnp.float32)
  counter = [0]

  def chain_fn():
    counter[0] += 1
    k = float(counter[0])

    def f(v):
      for _ in range(30):
        v = v + k
      return v * 0.5

    return f

  for on in (False, True):
    with tempfile.TemporaryDirectory() as d:
      jit_cache.set_cache_dir(d if on else None)
      t_ours, t_stock = jb.median_pair(
        lambda: jit_cache.jit(chain_fn())(x),
        lambda: jax.jit(chain_fn())(x),
        4 if quick else 30 if PROFILE == "cpu" else 9,
        deadline=until(),
      )
      jit_cache.set_cache_dir(None)
    report.add(
      "first call of a never-seen program in-process (miss overhead), "
      + ("persistent cache on" if on else "persistent cache off"),
      t_ours,
      t_stock,
      "stock-jax",
      "jax.jit",
      goal=1 / 1.05,
    )

  # Inline re-wrapped jit(f)(x), the same f (20 ops) wrapped at every call.
  def f20(v):
    for i in range(20):
      v = v * 1.01 + i
    return v

  jit_cache.jit(f20)(x)
  jax.jit(f20)(x)
  t_ours, t_stock = jb.median_pair(
    lambda: jit_cache.jit(f20)(x),
    lambda: jax.jit(f20)(x),
    5 if quick else 21,
    inner=20 if quick else 200,
    deadline=until(),
  )
  report.add(
    "re-wrapped jit(f)(x), 20-op f wrapped anew at every call",
    t_ours,
    t_stock,
    "stock-jax",
    "jax.jit",
    goal=1 / 1.2,
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  jb.add_arguments(parser)
  opts = parser.parse_args(argv)
  t0 = time.perf_counter()
  report = jb.Report(PKG, "train_step_bench")
  report.finish_on_signal(opts)
  budget = jb.Budget(opts.budget_s)
  with tempfile.TemporaryDirectory(prefix="jw-train-step-") as tmp:
    if PROFILE == "cpu":
      report.section(
        "new processes", new_process_cases, report, opts.quick, tmp
      )
      report.section("sweep", sweep_cases, report, opts.quick, tmp)
    else:  # before this process opens the chip: one holder at a time
      report.section(
        "warm start",
        warm_start_chip,
        report,
        opts.quick,
        tmp,
        budget,
        budget=budget,
        min_s=CHIP_RESERVE_S + 30,
      )
      report.skip(
        "the new-process rows of the cpu profile",
        "dozens of new processes, each opening the chip (~15 s); the "
        "warm-start row stands for them here",
      )
  if PROFILE != "cpu":
    report.section(
      "sweep in-process",
      sweep_in_process,
      report,
      opts.quick,
      budget,
      budget=budget,
      min_s=20,
    )
  report.section(
    "in-process rows",
    in_process_cases,
    report,
    opts.quick,
    None if PROFILE == "cpu" else budget,
    budget=budget,
    min_s=20,
  )
  report.note(
    f"jaxworks.jit_cache {jit_cache.__version__}, jax {jax.__version__}, "
    f"{devices_text(report)}; total {time.perf_counter() - t0:.1f} s"
  )
  report.finish(opts)
  return report.exit_status()


if __name__ == "__main__":
  sys.exit(main())
