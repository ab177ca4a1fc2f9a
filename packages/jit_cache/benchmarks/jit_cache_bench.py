"""jaxworks.jit_cache against stock jax.jit, side by side in one process.

Prints a markdown table of medians and ratios:

* jit_add_chain (upstream's benchmark): an inner jitted add called 100 times
  inside an outer jitted function that is re-created on every iteration; the
  full iteration (trace, compile or reuse, run) and the trace-only phase
  (``.trace(x)`` of a fresh outer function).
* the overhead of a cached call with 1, 10 and 100 array arguments.
* the signature extension against its pure-Python twin at 10, 100 and 1000
  leaves (jax Arrays, and tracers as seen by inner calls), and our argument
  key (flatten + signature) against jax's own C++ argument parsing.

Usage: ``python jit_cache_bench.py [--quick]`` (``--quick``: small repeat
counts, a few seconds).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from jaxworks import jit_cache
from jaxworks.jit_cache._src import jax_internals as ji
from jaxworks.jit_cache._src import signature as sigmod


def _median_seconds(fn, repeats: int, number: int) -> float:
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    for _ in range(number):
      fn()
    times.append((time.perf_counter() - t0) / number)
  return statistics.median(times)


def _side_by_side(fn_a, fn_b, repeats: int, number: int) -> tuple[float, float]:
  """Medians of interleaved repeats (noise on a shared machine hits both)."""
  a, b = [], []
  for _ in range(repeats):
    a.append(_median_seconds(fn_a, 1, number))
    b.append(_median_seconds(fn_b, 1, number))
  return statistics.median(a), statistics.median(b)


def _fmt_time(seconds: float) -> str:
  if seconds >= 1e-3:
    return f"{seconds * 1e3:.2f} ms"
  return f"{seconds * 1e6:.2f} us"


ROWS = []


def _row(name, stock, ours, ratio, goal, met):
  """met: True/False against a goal, None for rows that only report."""
  ROWS.append(
    (
      name,
      stock,
      ours,
      ratio,
      goal,
      "-" if met is None else "yes" if met else "no",
    )
  )


def bench_add_chain(quick: bool) -> None:
  size = 100
  x = jax.random.normal(jax.random.key(0), (2, 2))
  stock_inner = jax.jit(lambda a, b: jax.lax.add(a, b))
  our_inner = jit_cache.jit(lambda a, b: jax.lax.add(a, b))

  def make(jit_fn, inner):
    def f(v):
      for _ in range(size):
        v = inner(v, v)
      return v

    return jit_fn(f)

  def stock_iter():
    make(jax.jit, stock_inner)(x).block_until_ready()

  def our_iter():
    make(jit_cache.jit, our_inner)(x).block_until_ready()

  stock_iter()
  our_iter()
  repeats = 3 if quick else 15
  t_stock, t_ours = _side_by_side(stock_iter, our_iter, repeats, 1)
  ratio = t_stock / t_ours
  _row(
    "jit_add_chain (trace + compile/reuse + run)",
    _fmt_time(t_stock),
    _fmt_time(t_ours),
    f"{ratio:.1f}x faster",
    ">= 5x faster",
    ratio >= 5,
  )

  def stock_trace():
    make(jax.jit, stock_inner).trace(x)

  def our_trace():
    make(jit_cache.jit, our_inner).trace(x)

  stock_trace()
  our_trace()
  t_stock, t_ours = _side_by_side(
    stock_trace, our_trace, 3 if quick else 15, 2 if quick else 5
  )
  ratio = t_stock / t_ours
  _row(
    "jit_add_chain, trace-only phase",
    _fmt_time(t_stock),
    _fmt_time(t_ours),
    f"{ratio:.2f}x faster",
    "no slower (>= 1x)",
    ratio >= 1.0,
  )


def bench_call_overhead(quick: bool) -> None:
  def add_all(*args):
    out = args[0]
    for a in args[1:]:
      out = out + a
    return out

  for n in (1, 10, 100):
    args = [jnp.full((2,), float(i)) for i in range(n)]
    stock = jax.jit(add_all)
    ours = jit_cache.jit(add_all)
    stock(*args).block_until_ready()
    ours(*args).block_until_ready()
    number = {1: 2000, 10: 1000, 100: 300}[n]
    if quick:
      number //= 10
    t_stock, t_ours = _side_by_side(
      lambda: stock(*args), lambda: ours(*args), 5 if quick else 21, number
    )
    ratio = t_ours / t_stock
    _row(
      f"cached call, {n} array args",
      _fmt_time(t_stock),
      _fmt_time(t_ours),
      f"{ratio:.2f}x",
      "<= 1.5x",
      ratio <= 1.5,
    )


def bench_signature(quick: bool) -> None:
  repeats = 5 if quick else 15
  extra = ("tree", (), "ctx")
  for n in (10, 100, 1000):
    leaves = [jnp.full((i % 5 + 1,), 1.0) for i in range(n)]
    number = max(2, (2000 if not quick else 200) // n)
    t_py, t_cpp = _side_by_side(
      lambda: sigmod.py_signature(leaves, extra),
      lambda: sigmod.signature(leaves, extra),
      repeats,
      number,
    )
    ratio = t_py / t_cpp
    goal = ">= 5x" if n == 100 else "(report)"
    _row(
      f"signature, {n} jax Array leaves (Python twin vs C++)",
      _fmt_time(t_py),
      _fmt_time(t_cpp),
      f"{ratio:.1f}x faster",
      goal,
      ratio >= 5 if n == 100 else None,
    )

  tracer_rows = []

  def under_trace(*xs):
    for n in (10, 100, 1000):
      leaves = list(xs[:n])
      number = max(2, (2000 if not quick else 200) // n)
      t_py, t_cpp = _side_by_side(
        lambda: sigmod.py_signature(leaves, extra),
        lambda: sigmod.signature(leaves, extra),
        repeats,
        number,
      )
      tracer_rows.append((n, t_py, t_cpp))
    return xs[0]

  jax.make_jaxpr(under_trace)(*[jnp.ones((2,))] * 1000)
  for n, t_py, t_cpp in tracer_rows:
    ratio = t_py / t_cpp
    goal = ">= 5x" if n == 100 else "(report)"
    _row(
      f"signature, {n} tracer leaves (Python twin vs C++)",
      _fmt_time(t_py),
      _fmt_time(t_cpp),
      f"{ratio:.1f}x faster",
      goal,
      ratio >= 5 if n == 100 else None,
    )

  def key_rows(label, args, number):
    def ours():
      leaves, treedef = ji.tracing_registry.flatten((args, {}))
      return sigmod.signature(leaves, (treedef, ()))

    def stock_parse():
      return ji.jax_parse_arguments(args, {})

    def stock_full():  # what jax.jit computes per inner call: parse + avals
      _, dyn = ji.jax_parse_arguments(args, {})
      return tuple(ji.shaped_abstractify(x) for x in dyn)

    t_stock, t_ours = _side_by_side(stock_parse, ours, repeats, number)
    ratio = t_ours / t_stock
    _row(
      f"argument key, {label}: jax parse_arguments vs ours",
      _fmt_time(t_stock),
      _fmt_time(t_ours),
      f"{ratio:.2f}x",
      "<= 2x (goal)",
      ratio <= 2,
    )
    t_stock, t_ours = _side_by_side(stock_full, ours, repeats, number)
    ratio = t_ours / t_stock
    _row(
      f"argument key, {label}: jax parse_arguments + avals vs ours",
      _fmt_time(t_stock),
      _fmt_time(t_ours),
      f"{ratio:.2f}x",
      "(report)",
      None,
    )

  for n in (10, 100, 1000):
    args = tuple(jnp.full((i % 5 + 1,), 1.0) for i in range(n))
    key_rows(f"{n} jax Arrays", args, max(2, (2000 if not quick else 200) // n))

  def key_under_trace(*xs):
    for n in (10, 100):
      key_rows(
        f"{n} tracers", tuple(xs[:n]), max(2, (2000 if not quick else 200) // n)
      )
    return xs[0]

  jax.make_jaxpr(key_under_trace)(*[jnp.ones((2,))] * 100)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="few repeats, small sizes (seconds)"
  )
  opts = parser.parse_args(argv)
  t0 = time.perf_counter()
  bench_add_chain(opts.quick)
  bench_call_overhead(opts.quick)
  bench_signature(opts.quick)
  print(
    f"jaxworks.jit_cache {jit_cache.__version__} vs jax {jax.__version__}"
    f" on {jax.devices()[0].platform} ({len(jax.devices())} devices); "
    f"medians{' (--quick)' if opts.quick else ''}\n"
  )
  print("| benchmark | jax.jit / reference | jit_cache | ratio | goal | met |")
  print("|---|---|---|---|---|---|")
  for row in ROWS:
    print("| " + " | ".join(row) + " |")
  print(f"\n(total {time.perf_counter() - t0:.1f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
