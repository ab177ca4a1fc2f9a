"""Benchmark: jaxworks.stages_aot side by side with stock JAX, in one process.

Rows:
  * lowering a 1000-equation function for 1 platform (cpu) and for 3
    (cpu, cuda, tpu): ``stages_aot`` Traced.lower vs ``jax.jit(f).trace(x).lower``;
  * trace + lower + export + serialize + deserialize of the same function:
    ``stages_aot.trace(f, x).lower().export()`` vs ``jax.export.export(jax.jit(f))(x)``;
  * ``load_artifact`` of an artifact (exported for cpu, VJP order 1) vs
    reading its ``exported.bin`` and ``jax.export.deserialize``: the default
    (modules recorded in the manifest read in-process) and ``isolate=True``
    with the module reader's child process started cold (the cost every
    load paid before); the reference also sha256-hashes every file, as a
    load must; goal: at most 2x;
  * reload + first ``jax.grad`` (load, then differentiate): goal no slower
    than stock (stock compiles one executable per load);
  * in new processes (a server start), interleaved, medians of 5:
    ``load_artifact`` and then the first call, against reading and hashing
    the files, ``jax.export.deserialize`` and the first call.

Every repeat uses a fresh function object, so no trace or lowering cache is
hit; ours and stock alternate within each repeat (``jaxworks_bench.median_pair``);
garbage is collected between repeats, not inside the timer. Prints the rows
(reference: stock JAX) as a markdown table; ``--json PATH`` writes them.

On an accelerator (``--platform tpu``): 500 equations, 5 repeats, the
artifacts of the reload rows exported for the chip; the new-process rows
are not run there (each new process would open the chip, which this one
holds: one process at a time).

Usage: python stages_aot_bench.py [--quick] [--eqns N] [--repeats R]
  [--json PATH] [--platform P] [--budget-s S]
"""

import jaxworks_bench as jb

PROFILE = jb.configure_devices()  # before jax: 8 host CPU devices on cpu

import argparse  # noqa: E402
import hashlib  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxworks import stages_aot  # noqa: E402
from jaxworks.stages_aot._src import module_reader  # noqa: E402

_OPS = (jnp.sin, jnp.cos, jnp.tanh, lambda v: v * 1.001)


def make_fun(n_eqns):
  """A new function object whose jaxpr has exactly ``n_eqns`` equations."""

  def chain(x):
    for i in range(n_eqns):
      x = _OPS[i % len(_OPS)](x)
    return x

  return chain


def make_qr_fun(n_calls):
  """A new function object with ``n_calls`` QR decompositions (lowered per platform)."""

  def qrs(x):
    for _ in range(n_calls):
      q, r = jnp.linalg.qr(x)
      x = q @ r
    return x

  return qrs


EXPORT_GOAL = 1 / 1.1  # export costs at most 1.1x what jax.export costs
LOAD_GOAL = 1 / 2  # load_artifact: at most 2x reading, hashing, deserializing
RELOAD_GOAL = 1.0  # reload + first grad, first call: no slower than stock


def read_hash_deserialize(path):
  """What loading an artifact must at least do: read and sha256 every file,
  ``jax.export.deserialize`` the program."""
  data = {}
  for f in sorted(path.iterdir()):
    data[f.name] = f.read_bytes()
    hashlib.sha256(data[f.name]).hexdigest()
  return jax.export.deserialize(bytearray(data["exported.bin"]))


# A new process: load (ours or stock's), then the first call; prints
# [load seconds, first call seconds] (imports done before the timer).
FRESH_LOAD = """
import hashlib, json, pathlib, sys, time
import jax, jax.numpy as jnp
path, side = pathlib.Path(sys.argv[1]), sys.argv[2]
x = jnp.linspace(-1.0, 1.0, 128, dtype=jnp.float32)
x.block_until_ready()
if side == "ours":
  from jaxworks import stages_aot
  stages_aot.load_artifact  # the package imports its artifact module lazily
else:
  import jax.export
t0 = time.perf_counter()
if side == "ours":
  loaded = stages_aot.load_artifact(path).call
else:
  data = {}
  for f in sorted(path.iterdir()):
    data[f.name] = f.read_bytes()
    hashlib.sha256(data[f.name]).hexdigest()
  loaded = jax.export.deserialize(bytearray(data["exported.bin"])).call
t1 = time.perf_counter()
loaded(x).block_until_ready()
t2 = time.perf_counter()
print(json.dumps([t1 - t0, t2 - t1]))
"""


def fresh_load_rows(report, path, n, repeats):
  """load_artifact + first call against read + hash + deserialize + first
  call, each in a new process (a server start), interleaved; medians."""
  jb.run_fresh(FRESH_LOAD, (str(path), "ours"))  # writes the bytecode cache
  times = {"ours": [], "stock": []}
  for r in range(repeats):
    for side in ("ours", "stock") if r % 2 == 0 else ("stock", "ours"):
      times[side].append(jb.run_fresh(FRESH_LOAD, (str(path), side))[1])
  med = {
    side: [statistics.median(t[i] for t in ts) for i in (0, 1)]
    for side, ts in times.items()
  }
  report.add(
    f"load_artifact in a new process, {n} eqns, vjp order 1",
    med["ours"][0],
    med["stock"][0],
    "stock-jax",
    "file read + sha256 of every file + jax.export.deserialize",
    goal=LOAD_GOAL,
  )
  report.add(
    f"first call after load_artifact, new process, {n} eqns",
    med["ours"][1],
    med["stock"][1],
    "stock-jax",
    "first call after jax.export.deserialize",
    goal=RELOAD_GOAL,
  )


def measure(cases, repeats, budget=None, report=None):
  """cases: {name: setup -> (ours_thunk, stock_thunk)}; medians in seconds.

  With ``budget``, a case that does not fit (less than 5 s left) is
  skipped and ``report`` says so; each gets a share of what is left."""
  results = {}
  for i, (name, setup) in enumerate(cases.items()):
    if budget is not None and not budget.fits(5):
      report.skip(name, f"the time budget: {budget.left():.0f} s left")
      continue
    deadline = None if budget is None else budget.until(1 / (len(cases) - i))
    ours_fn, stock_fn = setup()  # a warm-up repeat, not timed
    ours_fn()
    stock_fn()
    results[name] = jb.median_pair(
      None, None, repeats, setup=setup, deadline=deadline
    )
  return results


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="small sizes, few repeats (< 20 s)"
  )
  jb.add_arguments(parser)
  parser.add_argument("--eqns", type=int, default=None)
  parser.add_argument("--repeats", type=int, default=None)
  args = parser.parse_args(argv)
  chip = PROFILE != "cpu"
  n = args.eqns or (200 if args.quick else 500 if chip else 1000)
  repeats = args.repeats or (3 if args.quick else 5 if chip else 21)
  n_qr = 10 if args.quick else 50
  budget = jb.Budget(args.budget_s)
  x = jax.ShapeDtypeStruct((128,), jnp.float32)
  assert len(jax.make_jaxpr(make_fun(n))(x).eqns) == n

  def lower_case(platforms, make=lambda: make_fun(n), arg=x):
    def setup():
      ours_traced = stages_aot.trace(make(), arg)
      stock_traced = jax.jit(make()).trace(arg)
      return (
        lambda: ours_traced.lower(lowering_platforms=platforms),
        lambda: stock_traced.lower(lowering_platforms=platforms),
      )

    return setup

  def export_case(platforms):
    def setup():
      f_ours, f_stock = make_fun(n), make_fun(n)
      return (
        lambda: stages_aot.deserialize(
          stages_aot.trace(f_ours, x)
          .lower(lowering_platforms=platforms)
          .export()
          .serialize()
        ),
        lambda: jax.export.deserialize(
          jax.export.export(jax.jit(f_stock), platforms=platforms)(
            x
          ).serialize()
        ),
      )

    return setup

  scratch = tempfile.TemporaryDirectory(prefix="stages_aot_bench-")
  saved = [0]

  def load_case(isolate):
    def setup():
      saved[0] += 1
      path = pathlib.Path(scratch.name) / f"art{saved[0]}"
      exp = (
        stages_aot.trace(make_fun(n), x)
        .lower(lowering_platforms=("cpu",))
        .export(vjp_order=1)
      )
      stages_aot.save_artifact(exp, path)
      module_reader._READER.stop()  # a cold child for isolate=True,
      module_reader._READER._cache.clear()  # and no answer cached
      return (
        lambda: stages_aot.load_artifact(path, isolate=isolate),
        lambda: read_hash_deserialize(path),
      )

    return setup

  def reload_grad_case():
    """A program reloaded (a server restart, a notebook cell run again) and
    differentiated: load, then the first jax.grad call."""

    def setup():
      saved[0] += 1
      path = pathlib.Path(scratch.name) / f"art{saved[0]}"
      stages_aot.save_artifact(
        stages_aot.trace(make_fun(n), x).lower().export(vjp_order=1), path
      )
      xs = jnp.linspace(-1.0, 1.0, 128, dtype=jnp.float32)

      def ours():
        loaded = stages_aot.load_artifact(path)
        return jax.grad(lambda v: loaded.call(v).sum())(xs).block_until_ready()

      def stock():
        loaded = jax.export.deserialize(
          bytearray((path / "exported.bin").read_bytes())
        )
        return jax.grad(lambda v: loaded.call(v).sum())(xs).block_until_ready()

      return ours, stock

    return setup

  one, three = ("cpu",), ("cpu", "cuda", "tpu")
  cases = {
    f"lower, {n} eqns, 1 platform (cpu)": lower_case(one),
    f"lower, {n} eqns, 3 platforms (cpu, cuda, tpu)": lower_case(three),
    f"lower, {n_qr} x qr (platform-specific lowering), 1 platform": lower_case(
      one, lambda: make_qr_fun(n_qr), jax.ShapeDtypeStruct((8, 8), jnp.float32)
    ),
    f"lower, {n_qr} x qr (platform-specific lowering), 3 platforms": lower_case(
      three,
      lambda: make_qr_fun(n_qr),
      jax.ShapeDtypeStruct((8, 8), jnp.float32),
    ),
    f"trace+lower+export+serialize+deserialize, {n} eqns, cpu": export_case(
      one
    ),
    f"trace+lower+export+serialize+deserialize, {n} eqns, cpu+cuda+tpu": export_case(
      three
    ),
    f"load_artifact, {n} eqns, vjp order 1": load_case(False),
    f"load_artifact(isolate=True), cold child, {n} eqns, vjp order 1": load_case(
      True
    ),
    f"reload + first jax.grad, {n} eqns, vjp order 1": reload_grad_case(),
  }
  report = jb.Report("stages_aot", "stages_aot_bench")
  report.finish_on_signal(args)
  fresh_report = jb.Report("stages_aot", "stages_aot_bench")
  with scratch:
    results = (
      report.section("in-process rows", measure, cases, repeats, budget, report)
      or {}
    )
    fresh_path = pathlib.Path(scratch.name) / "fresh"
    if chip:
      report.skip(
        "load_artifact and the first call in new processes",
        "each new process would open the chip, which this one holds (one "
        "process at a time)",
      )
    else:
      stages_aot.save_artifact(
        stages_aot.trace(make_fun(n), x).lower().export(vjp_order=1),
        fresh_path,
      )
      fresh_load_rows(fresh_report, fresh_path, n, 3 if args.quick else 5)
  for name, (ours, stock) in results.items():
    export = name.startswith("trace+lower+export")
    goal = EXPORT_GOAL if export else None
    if name.startswith("load_artifact"):
      reference = "file read + sha256 of every file + jax.export.deserialize"
      goal = None if "isolate" in name else LOAD_GOAL
    elif name.startswith("reload"):
      reference = "file read + jax.export.deserialize + jax.grad"
      goal = RELOAD_GOAL
    elif export:
      reference = "jax.export.export"
    else:
      reference = "jax.jit(f).trace(x).lower"
    report.add(
      name,
      ours,
      stock,
      "stock-jax",
      reference,
      goal=goal,
    )
  for row in fresh_report.rows:
    report.rows.append(row)
  names = list(cases)
  for label, (a, b) in [("elementwise chain", (0, 1)), ("qr", (2, 3))]:
    if names[a] not in results or names[b] not in results:
      continue
    r1, r3 = results[names[a]], results[names[b]]
    report.note(
      f"Lowering for 3 platforms / 1 platform ({label}): stages_aot "
      f"{r3[0] / r1[0]:.2f}x, stock {r3[1] / r1[1]:.2f}x."
    )
  report.note(
    f"Median of {repeats} repeats, a fresh function per repeat (no trace or "
    "lowering cache hit)."
  )
  report.finish(args)
  return report.exit_status()


if __name__ == "__main__":
  sys.exit(main())
