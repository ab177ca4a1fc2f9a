"""Benchmark: bottom-up axis-name analysis and renaming on large jaxprs.

Generated programs: ``C`` chains of nested ``jit`` calls, each chain ``D``
levels deep (default 50) with ``L`` elementwise equations per level, so
~``C * D * (L + 1)`` equations in all; one "hot" chain additionally holds
``psum(axis 'i')`` equations in its innermost level, 1% of the total.
Jaxprs are assembled from traced template equations (tracing 100k distinct
equations would dominate the run), with effects set as JAX sets them.

Rows (``jaxworks_bench``; medians of repeats, GC off while timing):

* stock-jax: ``used_axis_names`` on an analysed program (a repeated query)
  against reading and filtering JAX's own ``jaxpr.effects``, which JAX fills
  while tracing;
* naive: the first ``used_axis_names`` query (cold cache, the analysis
  itself) against a top-down walk of the whole program written here (no
  memo), at 1k/10k/100k equations and depth 50, then at 10k by depth;
* naive: ``rename_axes`` of 'i' with the analysis warm, against a full
  top-down rebuild of every equation (what ``core.subst_axis_names`` did);
* stock-jax: ``check_axis_names`` and ``collective_report`` of a
  ``shard_map`` over a nest of ``jit``s, each level calling the one below
  twice (``2**depth`` psums from ``depth + 1`` distinct jaxprs), against
  stock tracing (which raises for an unbound name) and stock trace + lower
  (whose HLO lists the collectives); naive: the check's walk of the traced
  program against a walk of every occurrence of each shared sub-jaxpr;
* stock-jax: tracing ``jit(shard_map(rename_axes(f, {'i': 'k'})))`` against
  tracing the same ``shard_map`` body written with ``'k'`` (every type in
  the body names the axis, so every equation is renamed); goal: at most
  1.2x.

Notes: the cold query per equation, JAX's tracing cost per equation (for
scale), how much of the program a rename rebuilt.

On an accelerator (``--platform tpu``): the analysis is host work, the
same as on cpu; the meshes are over the devices present (one chip), sizes
up to 10k equations, 5 repeats, the parts as the budget allows.

Usage: ``python axis_names_bench.py [--quick] [--json PATH] [--platform P]
[--budget-s S]``
"""

import jaxworks_bench as jb

# Before jax: on cpu, 8 host CPU devices and JAX_PLATFORMS=cpu.
PROFILE = jb.configure_devices(cpu_only=True)

import argparse  # noqa: E402
import gc  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
from jax import lax  # noqa: E402
from jax.extend.core import ClosedJaxpr  # noqa: E402
from jax.extend.core import Var  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxworks.axis_names import check_axis_names  # noqa: E402
from jaxworks.axis_names import collective_report  # noqa: E402
from jaxworks.axis_names import rename_axes  # noqa: E402
from jaxworks.axis_names import used_axis_names  # noqa: E402
from jaxworks.axis_names._src import analysis  # noqa: E402
from jaxworks.axis_names._src import jax_internals  # noqa: E402
from jaxworks.axis_names._src import rename_rewrite  # noqa: E402
from jaxworks.axis_names._src import rules  # noqa: E402

sys.setrecursionlimit(10000)

X = jnp.ones(4, jnp.float32)
_PSUM = jax.make_jaxpr(lambda x: lax.psum(x, "i"), axis_env=[("i", 8)])(X).eqns[
  0
]
_SIN = jax.make_jaxpr(jnp.sin)(X).eqns[0]
_JIT = jax.make_jaxpr(lambda x: jax.jit(lambda y: y)(x))(X).eqns[0]
_TOP = jax.make_jaxpr(lambda x: x)(X).jaxpr


def _jit_eqn(sub, invar, outvar):
  """A jit call of ``sub``, with its effects."""
  params = dict(_JIT.params, jaxpr=ClosedJaxpr(sub, []))
  return _JIT.replace(
    invars=[invar], outvars=[outvar], params=params, effects=set(sub.effects)
  )


def _jaxpr(invar, outvar, eqns, effects):
  return _TOP.replace(
    constvars=[],
    invars=[invar],
    outvars=[outvar],
    eqns=eqns,
    effects=effects,
    debug_info=None,
  )


def _level(sub, n_plain, n_psum):
  """A jaxpr: n_plain sin eqns, n_psum psum eqns, then a jit call of sub."""
  aval = _SIN.outvars[0].aval
  x = Var(aval)
  cur, eqns, effects = x, [], set()
  for tmpl in [_PSUM] * n_psum + [_SIN] * n_plain:
    out = Var(aval)
    eqns.append(tmpl.replace(invars=[cur], outvars=[out]))
    effects |= set(tmpl.effects)
    cur = out
  if sub is not None:
    out = Var(aval)
    eqns.append(_jit_eqn(sub, cur, out))
    effects |= set(sub.effects)
    cur = out
  return _jaxpr(x, cur, eqns, effects)


def _chain(depth, n_plain, n_psum):
  j = _level(None, n_plain, n_psum)
  for _ in range(depth - 1):
    j = _level(j, n_plain, 0)
  return j


def make_program(n_eqns, depth=50, per_level=19, psum_frac=0.01):
  chain_size = depth * (per_level + 1)
  n_chains = max(1, n_eqns // chain_size)
  n_psum = max(1, int(n_eqns * psum_frac))
  chains = [_chain(depth, per_level, n_psum)]  # the hot chain
  chains += [_chain(depth, per_level, 0) for _ in range(n_chains - 1)]
  x = Var(_SIN.outvars[0].aval)
  eqns = [_jit_eqn(c, x, Var(x.aval)) for c in chains]
  effects = set().union(*(c.effects for c in chains))
  return ClosedJaxpr(_jaxpr(x, eqns[-1].outvars[0], eqns, effects), [])


def count_eqns(jaxpr):
  return sum(
    1 + sum(count_eqns(s) for s in analysis.subjaxprs(e.params))
    for e in jaxpr.eqns
  )


def naive_names(jaxpr):
  """Top-down re-walk of the whole program, no memo (the old way)."""
  out = set()
  for eqn in jaxpr.eqns:
    out.update(analysis.own_names(eqn))
    bound = analysis.bound_names(eqn)
    for sub in analysis.subjaxprs(eqn.params):
      out |= naive_names(sub) - bound
  return out


def full_rebuild(jaxpr, mapping):
  """Rebuild every equation and sub-jaxpr, renaming params: no sharing."""
  eqns = []
  for eqn in jaxpr.eqns:
    params = dict(eqn.params)
    param = rules.AXIS_PARAMS.get(eqn.primitive.name)
    if param is not None:
      params[param] = rules.rename_in_param(params[param], mapping)
    for k, v in eqn.params.items():
      if isinstance(v, ClosedJaxpr):
        params[k] = ClosedJaxpr(full_rebuild(v.jaxpr, mapping), v.consts)
    eqns.append(eqn.replace(params=params))
  return jaxpr.replace(eqns=eqns, debug_info=jaxpr.debug_info)


def touched(old, new):
  """(equations in rebuilt jaxprs, equations rebuilt) of a rename.

  A rebuilt jaxpr copies its equation list; only the equations that use the
  renamed name (or hold a rebuilt sub-jaxpr) are new objects.
  """
  if old is new:
    return 0, 0
  in_jaxprs, rebuilt = len(old.eqns), 0
  for eo, en in zip(old.eqns, new.eqns):
    rebuilt += eo is not en
    so, sn = analysis.subjaxprs(eo.params), analysis.subjaxprs(en.params)
    for a, b in zip(so, sn):
      j, e = touched(a, b)
      in_jaxprs += j
      rebuilt += e
  return in_jaxprs, rebuilt


def trace_cost_per_eqn(n=1000):
  def f(x):
    for _ in range(n):
      x = jnp.sin(x)
    return x

  t0 = time.perf_counter()
  jax.make_jaxpr(f)(X)
  return (time.perf_counter() - t0) / n


def frozen(program):
  """``program``, with every live object moved out of the GC's reach.

  ``jb.median_time`` collects before each repeat; freezing the (large, never
  freed) programs keeps those collections from rescanning them.
  """
  gc.collect()
  gc.freeze()
  return program


def query_times(closed, repeats, fast_loops):
  """(equations, cold query, repeated query, naive walk, jaxpr.effects) s."""
  top = closed.jaxpr
  total = count_eqns(top)
  assert used_axis_names(closed) == {"i"} == naive_names(top)
  assert jax_internals.named_axis_effect_names(closed.effects) == {"i"}
  cold = jb.median_time(
    lambda: used_axis_names(closed), repeats, setup=analysis.clear_cache
  )
  used_axis_names(closed)
  warm = jb.median_time(
    lambda: used_axis_names(closed), repeats, inner=fast_loops
  )
  naive = jb.median_time(lambda: naive_names(top), repeats)
  effects = jb.median_time(
    lambda: jax_internals.named_axis_effect_names(closed.effects),
    repeats,
    inner=fast_loops,
  )
  return total, cold, warm, naive, effects


def _mesh_size():
  """8 devices on cpu; on an accelerator, as many as are present (up to 8)."""
  return 8 if PROFILE == "cpu" else min(8, jax.device_count())


def shared_nest(depth):
  """``shard_map`` over axis 'i' of ``depth`` nested jits, each calling the
  one below twice: ``2**depth`` psums, ``depth + 1`` distinct jaxprs."""
  f = lambda x: lax.psum(x, "i") * 2.0
  for _ in range(depth):
    g = jax.jit(f)
    f = (lambda g: lambda x: g(g(x)))(g)
  mesh = jax.make_mesh((_mesh_size(),), ("i",), axis_types=(AxisType.Auto,))
  # Without varying-axis types both calls at a level share one jaxpr.
  return jax.shard_map(
    f, mesh=mesh, in_specs=P("i"), out_specs=P("i"), check_vma=False
  )


def walk_every_occurrence(jaxpr, env):
  """The check's walk without a memo: each occurrence of a shared
  sub-jaxpr again (``check.walk`` before it kept one visit per jaxpr and
  axis environment)."""
  n = 0
  stack = [(jaxpr, dict(env))]
  while stack:
    j, e = stack.pop()
    for eqn in j.eqns:
      subs = analysis.subjaxprs(eqn.params)
      if not subs:
        n += bool(analysis.eqn_axis_names(eqn))
        continue
      used = [s for s in subs if analysis.uses_axes_anywhere(s)]
      inner = {**e, **analysis.binder_sizes(eqn)}
      stack.extend((s, inner) for s in used)
  return n


# A check or report of a program with shared sub-jaxprs costs at most 2x
# what stock pays to find the same (tracing; trace + lower), at any depth.
SHARED_GOAL = 0.5


def shared_rows(report, depths, repeats):
  """check_axis_names and collective_report of ``shared_nest``."""
  x = jnp.ones(32, jnp.float32)
  for depth in depths:
    f = shared_nest(depth)
    (row,) = collective_report(f, x).rows
    assert row.count == 2**depth
    what = f"shard_map of {depth} nested jits each called twice"
    report.add(
      f"check_axis_names, {what}",
      jb.median_time(lambda: check_axis_names(f, x), repeats),
      jb.median_time(lambda: jax.make_jaxpr(f)(x), repeats),
      "stock-jax",
      "tracing (raises NameError for an unbound name)",
      goal=SHARED_GOAL,
    )
    report.add(
      f"collective_report, {what}",
      jb.median_time(lambda: collective_report(f, x), repeats),
      jb.median_time(lambda: jax.jit(f).trace(x).lower(), repeats),
      "stock-jax",
      "trace + lower (the HLO lists the collectives)",
      goal=SHARED_GOAL,
    )
  depth = depths[0]
  closed = jax.make_jaxpr(shared_nest(depth))(x)
  assert walk_every_occurrence(closed.jaxpr, {}) == 2**depth
  report.add(
    f"check_axis_names(ClosedJaxpr), {depth} nested jits each called twice",
    jb.median_time(lambda: check_axis_names(closed), repeats),
    jb.median_time(lambda: walk_every_occurrence(closed.jaxpr, {}), repeats),
    "naive",
    "walk of every occurrence of a shared sub-jaxpr (no memo)",
    goal=1.0,
  )


def shard_map_body(name, n_lines):
  """A new ``shard_map`` body of ``n_lines`` lines over axis ``name``
  (``sin`` and a product each; a ``psum`` every 50 lines): inside the
  ``shard_map`` every value's type names the axis."""

  def body(x):
    for i in range(n_lines):
      x = jnp.sin(x) * 1.001
      if i % 50 == 0:
        x = lax.psum(x, name)
    return x

  return body


RENAMED_TRACE_GOAL = 1 / 1.2  # at most 1.2x stock tracing


def renamed_trace_rows(report, sizes, repeats):
  """Tracing ``jit(shard_map(rename_axes(f, {'i': 'k'})))`` against stock
  tracing of the same function written with ``'k'``."""
  mesh = jax.make_mesh((_mesh_size(),), ("k",), axis_types=(AxisType.Auto,))
  x = jax.ShapeDtypeStruct((8, 4), jnp.float32)

  def traced(f):
    return jax.jit(
      jax.shard_map(f, mesh=mesh, in_specs=P("k"), out_specs=P("k"))
    ).trace(x)

  for n in sizes:
    ours = traced(rename_axes(shard_map_body("i", n), {"i": "k"}))
    stock = traced(shard_map_body("k", n))
    assert str(ours.jaxpr) == str(stock.jaxpr)
    n_eqns = len(ours.jaxpr.eqns[0].params["jaxpr"].eqns)

    def setup():
      f_i, f_k = shard_map_body("i", n), shard_map_body("k", n)
      return (
        lambda: traced(rename_axes(f_i, {"i": "k"})),
        lambda: traced(f_k),
      )

    t_ours, t_stock = jb.median_pair(None, None, repeats, setup=setup)
    report.add(
      f"trace jit(shard_map(rename_axes(f, {{'i': 'k'}}))), {n:,} lines "
      f"({n_eqns:,} equations, every type names the axis)",
      t_ours,
      t_stock,
      "stock-jax",
      "tracing f written with 'k'",
      goal=RENAMED_TRACE_GOAL,
    )


EFFECTS = "jaxpr.effects (NamedAxisEffect names)"
WALK = "top-down walk of the whole program (no memo)"


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument(
    "--quick",
    action="store_true",
    help="small sizes, few repeats (a test runs this)",
  )
  jb.add_arguments(ap)
  args = ap.parse_args(argv)
  chip = PROFILE != "cpu"
  sizes = (1_000, 5_000) if args.quick else (1_000, 10_000, 100_000)
  repeats = 3 if args.quick else 15
  if chip and not args.quick:
    sizes, repeats = (1_000, 10_000), 5
  fast_loops = 1000
  report = jb.Report("axis_names", "axis_names_bench")
  report.finish_on_signal(args)
  budget = jb.Budget(args.budget_s)
  per_eqn: list = []
  report.section(
    "analysis", analysis_rows, report, sizes, repeats, fast_loops, per_eqn
  )
  report.section(
    "shared sub-jaxprs",
    shared_rows,
    report,
    (6, 10) if args.quick else (10, 20),
    repeats,
    budget=budget,
    min_s=10,
  )
  report.section(
    "renamed trace",
    renamed_trace_rows,
    report,
    (500,) if args.quick else (2_000,) if chip else (2_000, 10_000),
    3 if args.quick else 5 if chip else 9,
    budget=budget,
    min_s=10,
  )
  if per_eqn:
    report.note(
      "The first (cold) query costs "
      f"{jb.fmt_seconds(min(per_eqn))} - {jb.fmt_seconds(max(per_eqn))} per "
      "equation across sizes and depths; JAX's whole tracing cost per "
      "equation, for scale (it fills jaxpr.effects while tracing): "
      f"{jb.fmt_seconds(trace_cost_per_eqn(200 if args.quick else 1000))}."
    )
  report.note(f"jax {jax.__version__}; 1% of equations use 'i'.")
  report.finish(args)
  return report.exit_status()


def analysis_rows(report, sizes, repeats, fast_loops, per_eqn):
  """used_axis_names (repeated and cold) and rename_axes by size and depth;
  appends each cold query's time per equation to ``per_eqn``."""
  for n in sizes:
    closed = frozen(make_program(n))
    top = closed.jaxpr
    total, cold, warm, naive, effects = query_times(closed, repeats, fast_loops)
    per_eqn.append(cold / total)
    report.add(
      f"used_axis_names, repeated query, {total:,} equations, depth 50",
      warm,
      effects,
      "stock-jax",
      EFFECTS,
    )
    report.add(
      f"used_axis_names, first query (cold), {total:,} equations, depth 50",
      cold,
      naive,
      "naive",
      WALK,
    )

    mapping = {"i": "k"}
    new = rename_axes(closed, mapping)
    assert used_axis_names(new) == {"k"}
    in_jaxprs, rebuilt = touched(top, new.jaxpr)
    ours = jb.median_time(
      lambda: rename_axes(closed, mapping),
      repeats,
      setup=rename_rewrite._RENAMED.clear,
    )
    full = jb.median_time(lambda: full_rebuild(top, mapping), repeats)
    report.add(
      f"rename_axes({{'i': 'k'}}), analysis warm, {total:,} equations "
      f"({rebuilt:,} rebuilt, {in_jaxprs / total:.0%} in rebuilt jaxprs)",
      ours,
      full,
      "naive",
      "full top-down rebuild (core.subst_axis_names' way)",
    )
  depth_size = sizes[1]
  for depth in (1, 10):
    closed = frozen(make_program(depth_size, depth=depth))
    total, cold, _, naive, _ = query_times(closed, repeats, fast_loops)
    per_eqn.append(cold / total)
    report.add(
      f"used_axis_names, first query (cold), {total:,} equations, "
      f"depth {depth}",
      cold,
      naive,
      "naive",
      WALK,
    )


if __name__ == "__main__":
  sys.exit(main())
