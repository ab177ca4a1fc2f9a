"""Benchmark: bottom-up axis-name analysis and renaming on large jaxprs.

Generated programs: ``C`` chains of nested ``jit`` calls, each chain ``D``
levels deep (default 50) with ``L`` elementwise equations per level, so
~``C * D * (L + 1)`` equations in all; one "hot" chain additionally holds
``psum(axis 'i')`` equations in its innermost level, 1% of the total.
Jaxprs are assembled from traced template equations (tracing 100k distinct
equations would dominate the run), with effects set as JAX sets them.

Printed side by side (medians of repeats, GC off while timing, one
process):

* ``used_axis_names`` first query (cold cache) and repeated query, at
  1k/10k/100k equations and depth 50, then at 10k equations by depth;
* a naive top-down walk of the whole program per query (no memo);
* reading JAX's own ``jaxpr.effects`` (free at query time: JAX pays at
  trace time, shown as JAX's tracing cost per equation for scale);
* ``rename_axes`` of 'i' with the analysis warm, against a full top-down
  rebuild of every equation (what ``core.subst_axis_names`` did), with how
  much of the program the rename had to rebuild.

Usage: ``python axis_names_bench.py [--quick]``
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import gc
import statistics
import sys
import time

import jax
from jax import lax
from jax.extend.core import ClosedJaxpr
from jax.extend.core import Var
import jax.numpy as jnp

from jaxworks.axis_names import rename_axes
from jaxworks.axis_names import used_axis_names
from jaxworks.axis_names._src import analysis
from jaxworks.axis_names._src import jax_internals
from jaxworks.axis_names._src import rename
from jaxworks.axis_names._src import rules

sys.setrecursionlimit(10000)

X = jnp.ones(4, jnp.float32)
_PSUM = jax.make_jaxpr(lambda x: lax.psum(x, "i"), axis_env=[("i", 8)])(X).eqns[
  0
]
_SIN = jax.make_jaxpr(jnp.sin)(X).eqns[0]
_JIT = jax.make_jaxpr(lambda x: jax.jit(lambda y: y)(x))(X).eqns[0]
_TOP = jax.make_jaxpr(lambda x: x)(X).jaxpr


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
    params = dict(_JIT.params, jaxpr=ClosedJaxpr(sub, []))
    eqns.append(
      _JIT.replace(
        invars=[cur], outvars=[out], params=params, effects=set(sub.effects)
      )
    )
    effects |= set(sub.effects)
    cur = out
  return _TOP.replace(
    constvars=[],
    invars=[x],
    outvars=[cur],
    eqns=eqns,
    effects=effects,
    debug_info=None,
  )


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
  aval = _SIN.outvars[0].aval
  x = Var(aval)
  eqns, effects = [], set()
  for c in chains:
    out = Var(aval)
    eqns.append(
      _JIT.replace(
        invars=[x],
        outvars=[out],
        params=dict(_JIT.params, jaxpr=ClosedJaxpr(c, [])),
        effects=set(c.effects),
      )
    )
    effects |= set(c.effects)
  top = _TOP.replace(
    constvars=[],
    invars=[x],
    outvars=[eqns[-1].outvars[0]],
    eqns=eqns,
    effects=effects,
    debug_info=None,
  )
  return ClosedJaxpr(top, [])


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


def median_time(fn, repeats, setup=None, loops=1):
  """Median over ``repeats`` of the seconds per call of ``fn()``.

  Each repeat times ``loops`` calls in a row. The cyclic GC is off while
  timing (as in ``timeit``), so a collection of the large live heap is not
  billed to whichever call happens to trigger it.
  """
  times = []
  for _ in range(repeats):
    if setup is not None:
      setup()
    gc.collect()
    gc.disable()
    try:
      t0 = time.perf_counter()
      for _ in range(loops):
        fn()
      times.append((time.perf_counter() - t0) / loops)
    finally:
      gc.enable()
  return statistics.median(times)


def fmt(seconds):
  if seconds < 1e-3:
    return f"{seconds * 1e6:.2f} us"
  return f"{seconds * 1e3:.2f} ms"


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

  ``median_time`` collects before each repeat; freezing the (large, never
  freed) programs keeps those collections from rescanning them.
  """
  gc.collect()
  gc.freeze()
  return program


def query_row(closed, repeats, fast_loops):
  """(equations, cold, cold per eqn, repeated, naive, naive/repeated, effects)."""
  top = closed.jaxpr
  total = count_eqns(top)
  assert used_axis_names(closed) == {"i"} == naive_names(top)
  assert jax_internals.named_axis_effect_names(closed.effects) == {"i"}
  cold = median_time(
    lambda: used_axis_names(closed), repeats, setup=analysis.clear_cache
  )
  used_axis_names(closed)
  warm = median_time(lambda: used_axis_names(closed), repeats, loops=fast_loops)
  naive = median_time(lambda: naive_names(top), repeats)
  effects = median_time(
    lambda: jax_internals.named_axis_effect_names(closed.effects),
    repeats,
    loops=fast_loops,
  )
  return total, cold, cold / total, warm, naive, naive / warm, effects


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument(
    "--quick",
    action="store_true",
    help="small sizes, few repeats (a test runs this)",
  )
  args = ap.parse_args(argv)
  sizes = (1_000, 5_000) if args.quick else (1_000, 10_000, 100_000)
  repeats = 3 if args.quick else 15
  fast_loops = 1000

  print(f"jax {jax.__version__}; 1% of equations use 'i'\n")
  rows_q, rows_d, rows_r = [], [], []
  for n in sizes:
    closed = frozen(make_program(n))
    top = closed.jaxpr
    rows_q.append(query_row(closed, repeats, fast_loops))
    total = rows_q[-1][0]

    mapping = {"i": "k"}
    new = rename_axes(closed, mapping)
    assert used_axis_names(new) == {"k"}
    in_jaxprs, rebuilt = touched(top, new.jaxpr)
    ours = median_time(
      lambda: rename_axes(closed, mapping), repeats, setup=rename._RENAMED.clear
    )
    full = median_time(lambda: full_rebuild(top, mapping), repeats)
    rows_r.append((total, in_jaxprs / total, rebuilt, ours, full, ours / full))
  depth_size = sizes[1]
  for depth in (1, 10, 50):
    rows_d.append(
      (depth,)
      + query_row(
        frozen(make_program(depth_size, depth=depth)), repeats, fast_loops
      )
    )

  header = (
    "| first query (cold) | per equation | repeated query "
    "| naive top-down walk | naive / repeated | read jaxpr.effects |"
  )
  rule = "|---:|---:|---:|---:|---:|---:|---:|"
  print("## used_axis_names, nesting depth 50\n")
  print("| equations " + header)
  print(rule)
  for total, cold, per, warm, naive, ratio, eff in rows_q:
    print(
      f"| {total:,} | {fmt(cold)} | {fmt(per)} | {fmt(warm)} | "
      f"{fmt(naive)} | {ratio:,.0f}x | {fmt(eff)} |"
    )
  print(f"\n## used_axis_names, {rows_d[0][1]:,} equations by nesting depth\n")
  print("| depth " + header)
  print(rule)
  for depth, _, cold, per, warm, naive, ratio, eff in rows_d:
    print(
      f"| {depth} | {fmt(cold)} | {fmt(per)} | {fmt(warm)} | "
      f"{fmt(naive)} | {ratio:,.0f}x | {fmt(eff)} |"
    )
  print(
    f"\nJAX's whole tracing cost per equation, for scale (it fills "
    f"jaxpr.effects while tracing): "
    f"{fmt(trace_cost_per_eqn(200 if args.quick else 1000))}.\n"
  )
  print("## rename_axes({'i': 'k'}) with the analysis warm, nesting depth 50\n")
  print(
    "| equations | in rebuilt jaxprs | equations rebuilt | rename_axes "
    "| full rebuild | rename / full |"
  )
  print("|---:|---:|---:|---:|---:|---:|")
  for total, frac, rebuilt, ours, full, ratio in rows_r:
    print(
      f"| {total:,} | {frac:.1%} | {rebuilt:,} | {fmt(ours)} | "
      f"{fmt(full)} | {ratio:.3f} |"
    )


if __name__ == "__main__":
  main()
