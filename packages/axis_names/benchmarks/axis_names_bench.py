"""Benchmark: bottom-up axis-name analysis and renaming on large jaxprs.

Generated programs: ``C`` chains of nested ``jit`` calls, each chain ``D``
levels deep (default 50) with ``L`` elementwise equations per level, so
~``C * D * (L + 1)`` equations in all; one "hot" chain additionally holds
``psum(axis 'i')`` equations in its innermost level, 1% of the total.
Jaxprs are assembled from traced template equations (tracing 100k distinct
equations would dominate the run), with effects set as JAX sets them.

Printed side by side (medians of repeats, one process):

* ``used_axis_names`` first query (cold cache) and repeated query;
* a naive top-down walk of the whole program per query (no memo);
* reading JAX's own ``jaxpr.effects`` (free at query time: JAX pays at
  trace time, shown as JAX's tracing cost per equation for scale);
* ``rename_axes`` of 'i' with the analysis warm, against a full top-down
  rebuild of every equation (what ``core.subst_axis_names`` did).

Usage: ``python axis_names_bench.py [--quick]``
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import ClosedJaxpr, Var

from jaxworks.axis_names import rename_axes, used_axis_names
from jaxworks.axis_names._src import analysis, jax_internals, rename, rules

sys.setrecursionlimit(10000)

X = jnp.ones(4, jnp.float32)
_PSUM = jax.make_jaxpr(lambda x: lax.psum(x, "i"),
                       axis_env=[("i", 8)])(X).eqns[0]
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
    eqns.append(_JIT.replace(invars=[cur], outvars=[out], params=params,
                             effects=set(sub.effects)))
    effects |= set(sub.effects)
    cur = out
  return _TOP.replace(constvars=[], invars=[x], outvars=[cur], eqns=eqns,
                      effects=effects, debug_info=None)


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
    eqns.append(_JIT.replace(invars=[x], outvars=[out],
                             params=dict(_JIT.params, jaxpr=ClosedJaxpr(c, [])),
                             effects=set(c.effects)))
    effects |= set(c.effects)
  top = _TOP.replace(constvars=[], invars=[x], outvars=[eqns[-1].outvars[0]],
                     eqns=eqns, effects=effects, debug_info=None)
  return ClosedJaxpr(top, [])


def count_eqns(jaxpr):
  return sum(1 + sum(count_eqns(s) for s in analysis.subjaxprs(e.params))
             for e in jaxpr.eqns)


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


def touched_eqns(old, new):
  """Equations in jaxprs the rename rebuilt (not shared by identity)."""
  if old is new:
    return 0
  total = len(old.eqns)
  for eo, en in zip(old.eqns, new.eqns):
    so, sn = analysis.subjaxprs(eo.params), analysis.subjaxprs(en.params)
    total += sum(touched_eqns(a, b) for a, b in zip(so, sn))
  return total


def median_time(fn, repeats, setup=None):
  times = []
  for _ in range(repeats):
    if setup is not None:
      setup()
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
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


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true",
                  help="small sizes, few repeats (a test runs this)")
  args = ap.parse_args(argv)
  sizes = (1_000, 5_000) if args.quick else (1_000, 10_000, 100_000)
  repeats = 3 if args.quick else 7
  fast_repeats = 1000

  print(f"jax {jax.__version__}; nesting depth 50; 1% of equations use 'i'\n")
  rows_q, rows_r = [], []
  for n in sizes:
    closed = make_program(n)
    top = closed.jaxpr
    total = count_eqns(top)
    assert used_axis_names(closed) == {"i"} == naive_names(top)
    assert jax_internals.named_axis_effect_names(closed.effects) == {"i"}

    cold = median_time(lambda: used_axis_names(closed), repeats,
                       setup=analysis.clear_cache)
    used_axis_names(closed)
    warm = median_time(lambda: used_axis_names(closed), fast_repeats)
    naive = median_time(lambda: naive_names(top), repeats)
    effects = median_time(
        lambda: jax_internals.named_axis_effect_names(closed.effects),
        fast_repeats)
    rows_q.append((total, cold, cold / total, warm, naive, naive / warm,
                   effects))

    mapping = {"i": "k"}
    new = rename_axes(closed, mapping)
    assert used_axis_names(new) == {"k"}
    touched = touched_eqns(top, new.jaxpr)
    ours = median_time(lambda: rename_axes(closed, mapping), repeats,
                       setup=rename._RENAMED.clear)
    full = median_time(lambda: full_rebuild(top, mapping), repeats)
    rows_r.append((total, touched / total, ours, full, ours / full))

  print("## used_axis_names\n")
  print("| equations | first query (cold) | per equation | repeated query "
        "| naive top-down walk | naive / repeated | read jaxpr.effects |")
  print("|---:|---:|---:|---:|---:|---:|---:|")
  for total, cold, per, warm, naive, ratio, eff in rows_q:
    print(f"| {total:,} | {fmt(cold)} | {fmt(per)} | {fmt(warm)} | "
          f"{fmt(naive)} | {ratio:,.0f}x | {fmt(eff)} |")
  print(f"\nJAX's tracing cost for scale (it fills jaxpr.effects while "
        f"tracing): {fmt(trace_cost_per_eqn(200 if args.quick else 1000))}"
        " per equation.\n")
  print("## rename_axes({'i': 'k'}) with the analysis warm\n")
  print("| equations | touched part | rename_axes | full rebuild "
        "| rename / full |")
  print("|---:|---:|---:|---:|---:|")
  for total, frac, ours, full, ratio in rows_r:
    print(f"| {total:,} | {frac:.1%} | {fmt(ours)} | {fmt(full)} | "
          f"{ratio:.3f} |")


if __name__ == "__main__":
  main()
