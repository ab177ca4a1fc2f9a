"""jaxworks.jit_cache against stock jax.jit, side by side in one process.

Prints a markdown table of medians and ratios:

* jit_add_chain (upstream's benchmark): an inner jitted add called 100 times
  inside an outer jitted function that is re-created on every iteration; the
  full iteration (trace, compile or reuse, run) and the trace-only phase
  (``.trace(x)`` of a fresh outer function).
* the overhead of a cached call with 1, 10 and 100 array arguments, keyword
  arguments and a static argument.
* the signature extension against its pure-Python twin at 10, 100 and 1000
  leaves (jax Arrays, and tracers as seen by inner calls), and our argument
  key (leaves, treedef and signature in one pass) against jax's own C++
  argument parsing.
* the import time ``import jaxworks.jit_cache`` adds to ``import jax``, in
  new processes.

Usage: ``python jit_cache_bench.py [--quick] [--json PATH] [--platform P]
[--budget-s S]`` (``--quick``: small repeat counts, a few seconds); rows in
the schema of ``benchmarks/support/jaxworks_bench.py``. ``--platform tpu``:
on the devices JAX picks (one chip), the cached-call rows first with fewer
calls per repeat (a call costs ~120 us there), the other parts as the
budget allows, the import rows last (new processes that import jax, never
open the chip).
"""

import os

import jaxworks_bench as jb

PROFILE = jb.configure_devices()  # before jax: 8 host CPU devices on cpu

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxworks import jit_cache  # noqa: E402
from jaxworks.jit_cache._src import jax_internals as ji  # noqa: E402
from jaxworks.jit_cache._src import signature as sigmod  # noqa: E402

sys.path.insert(  # the pure-Python signature twin lives with the tests
  0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
)

import signature_twin  # noqa: E402


def _pair(fn_a, fn_b, repeats: int, number: int) -> tuple[float, float]:
  """Interleaved medians of seconds per call (jaxworks_bench.median_pair).

  Results are dropped, not awaited: the rows time dispatch and key
  computation, and awaiting a pytree of 1,000 arrays would bill
  ``block_until_ready``'s walk to whichever side returns them.
  """
  return jb.median_pair(
    lambda: _drop(fn_a()), lambda: _drop(fn_b()), repeats, inner=number
  )


def _drop(_) -> None:
  return None


REPORT = jb.Report("jit_cache", "jit_cache_bench")


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
  repeats = 3 if quick else 15 if PROFILE == "cpu" else 7
  t_stock, t_ours = _pair(stock_iter, our_iter, repeats, 1)
  REPORT.add(
    "jit_add_chain (trace + compile/reuse + run)",
    t_ours,
    t_stock,
    "stock-jax",
    "jax.jit",
    goal=5.0,
  )

  def stock_trace():
    make(jax.jit, stock_inner).trace(x)

  def our_trace():
    make(jit_cache.jit, our_inner).trace(x)

  stock_trace()
  our_trace()
  t_stock, t_ours = _pair(
    stock_trace, our_trace, 3 if quick else 15, 2 if quick else 5
  )
  REPORT.add(
    "jit_add_chain, trace-only phase",
    t_ours,
    t_stock,
    "stock-jax",
    "jax.jit",
    goal=1.0,
  )


def _add_cached_call(case: str, t_ours: float, t_stock: float) -> None:
  """A cached-call row against jax.jit (goal: parity). On an accelerator,
  where a cached call's time is the runtime's, its limit is jaxlib's C++
  dispatcher, which serves both sides (at most parity)."""
  limit = None
  if PROFILE != "cpu":
    limit = ("jaxlib's C++ dispatcher, which serves both: parity", t_stock)
  REPORT.add(
    case, t_ours, t_stock, "stock-jax", "jax.jit", goal=1.0, limit=limit
  )


def bench_call_overhead(quick: bool) -> None:
  """A cached call: jax.jit returns jaxlib's C++ dispatcher itself; a
  JitFunction forwards to the same kind of dispatcher from C (goal: no
  slower than stock, keyword and static arguments included)."""

  def add_all(*args):
    out = args[0]
    for a in args[1:]:
      out = out + a
    return out

  def keywords(x, y, *, z):
    return x + y * z

  def scaled(x, n):
    return x * n

  repeats = 5 if quick else 31
  numbers = {1: 2000, 10: 1000, 100: 300}
  if PROFILE != "cpu" and not quick:  # ~120 us a call on a TPU
    repeats, numbers = 15, {1: 500, 10: 400, 100: 200}
  for n in (1, 10, 100):
    args = [jnp.full((2,), float(i)) for i in range(n)]
    stock = jax.jit(add_all)
    ours = jit_cache.jit(add_all)
    stock(*args).block_until_ready()
    ours(*args).block_until_ready()
    number = numbers[n]
    if quick:
      number //= 10
    t_stock, t_ours = _pair(
      lambda: stock(*args), lambda: ours(*args), repeats, number
    )
    _add_cached_call(f"cached call, {n} array args", t_ours, t_stock)
  x = jnp.ones((2,))
  number = 200 if quick else 2000 if PROFILE == "cpu" else 500
  cases = (
    ("cached call, keyword arguments", keywords, {}, lambda f: f(x, y=x, z=x)),
    (
      "cached call, a static argument",
      scaled,
      {"static_argnums": 1},
      lambda f: f(x, 3),
    ),
  )
  for label, fun, options, call in cases:
    stock = jax.jit(fun, **options)
    ours = jit_cache.jit(fun, **options)
    call(stock).block_until_ready()
    call(ours).block_until_ready()
    t_stock, t_ours = _pair(
      lambda: call(stock), lambda: call(ours), repeats, number
    )
    _add_cached_call(label, t_ours, t_stock)


def bench_signature(quick: bool) -> None:
  repeats = 5 if quick or PROFILE != "cpu" else 15
  extra = ("tree", (), "ctx")
  for n in (10, 100, 1000):
    leaves = [jnp.full((i % 5 + 1,), 1.0) for i in range(n)]
    number = max(2, (2000 if not quick else 200) // n)
    t_py, t_cpp = _pair(
      lambda: signature_twin.py_signature(leaves, extra),
      lambda: sigmod.signature(leaves, extra),
      repeats,
      number,
    )
    REPORT.add(
      f"signature, {n} jax Array leaves (C++ vs its Python twin)",
      t_cpp,
      t_py,
      "ablation",
      "pure-Python signature",
      goal=5.0 if n in (100, 1000) else None,
    )

  tracer_rows = []

  def under_trace(*xs):
    for n in (10, 100, 1000):
      leaves = list(xs[:n])
      number = max(2, (2000 if not quick else 200) // n)
      t_py, t_cpp = _pair(
        lambda: signature_twin.py_signature(leaves, extra),
        lambda: sigmod.signature(leaves, extra),
        repeats,
        number,
      )
      tracer_rows.append((n, t_py, t_cpp))
    return xs[0]

  jax.make_jaxpr(under_trace)(*[jnp.ones((2,))] * 1000)
  for n, t_py, t_cpp in tracer_rows:
    REPORT.add(
      f"signature, {n} tracer leaves (C++ vs its Python twin)",
      t_cpp,
      t_py,
      "ablation",
      "pure-Python signature",
      goal=5.0 if n == 100 else None,
    )

  def key_rows(label, args, number, goal):
    def ours():  # leaves, treedef and Signature in one pass (core._key)
      return sigmod.key((args, {}), (), None)

    def stock_parse():
      return ji.jax_parse_arguments(args, {})

    def stock_full():  # what jax.jit computes per inner call: parse + avals
      _, dyn = ji.jax_parse_arguments(args, {})
      return tuple(ji.shaped_abstractify(x) for x in dyn)

    t_stock, t_ours = _pair(stock_parse, ours, repeats, number)
    REPORT.add(
      f"argument key, {label}: ours vs jax parse_arguments",
      t_ours,
      t_stock,
      "stock-jax",
      "jax parse_arguments",
      goal=goal,
    )
    t_stock, t_ours = _pair(stock_full, ours, repeats, number)
    REPORT.add(
      f"argument key, {label}: ours vs jax parse_arguments + avals",
      t_ours,
      t_stock,
      "stock-jax",
      "jax parse_arguments + avals",
    )

  for n in (10, 100, 1000):
    args = tuple(jnp.full((i % 5 + 1,), 1.0) for i in range(n))
    key_rows(
      f"{n} jax Arrays",
      args,
      max(2, (2000 if not quick else 200) // n),
      1.0 if n in (100, 1000) else 1 / 2,
    )

  def key_under_trace(*xs):
    for n in (10, 100):
      key_rows(
        f"{n} tracers",
        tuple(xs[:n]),
        max(2, (2000 if not quick else 200) // n),
        1 / 2,
      )
    return xs[0]

  jax.make_jaxpr(key_under_trace)(*[jnp.ones((2,))] * 100)


_IMPORT = """
import json, sys, time
t0 = time.perf_counter()
import jax
t1 = time.perf_counter()
if sys.argv[1] == "jaxworks":
  import jaxworks.jit_cache
t2 = time.perf_counter()
print(json.dumps([t1 - t0, t2 - t0]))
"""


def bench_import(quick: bool) -> None:
  """``import jax; import jaxworks.jit_cache`` against ``import jax``, each
  in new processes, interleaved (the goal: at most 30 ms added)."""
  ours, stock, added = [], [], []
  repeats = 5 if quick else 15 if PROFILE == "cpu" else 7
  for i in range(repeats):
    for which in ("jaxworks", "stock") if i % 2 else ("stock", "jaxworks"):
      _, (t_jax, t_all) = jb.run_fresh(_IMPORT, args=(which,))
      if which == "jaxworks":
        ours.append(t_all)
        added.append(t_all - t_jax)
      else:
        stock.append(t_all)
  med = sorted(ours)[len(ours) // 2]
  ref = sorted(stock)[len(stock) // 2]
  REPORT.add(
    "import jax + import jaxworks.jit_cache, new process (import time)",
    med,
    ref,
    "stock-jax",
    "import jax",
    goal=ref / (ref + 0.030),  # at most 30 ms added
  )
  REPORT.note(
    "import jaxworks.jit_cache adds "
    f"{1e3 * sorted(added)[len(added) // 2]:.1f} ms to import jax (median of "
    f"{len(added)} new processes; names are imported when first used)"
  )


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  jb.add_arguments(parser)
  opts = parser.parse_args(argv)
  budget = jb.Budget(opts.budget_s)
  REPORT.finish_on_signal(opts)
  t0 = time.perf_counter()
  # On an accelerator the cached-call rows (the TPU issue's) come first.
  parts = [
    ("cached calls", bench_call_overhead, 5),
    ("jit_add_chain", bench_add_chain, 15),
    ("signature", bench_signature, 10),
    ("import time", bench_import, 25),
  ]
  if PROFILE == "cpu":
    parts = [parts[1], parts[0], parts[2], parts[3]]  # as always on cpu
  for name, part, min_s in parts:
    REPORT.section(name, part, opts.quick, budget=budget, min_s=min_s)
  REPORT.note(
    f"jaxworks.jit_cache {jit_cache.__version__} vs jax {jax.__version__}"
    f" on {jax.devices()[0].platform} ({len(jax.devices())} devices); "
    f"medians; total {time.perf_counter() - t0:.1f} s"
  )
  REPORT.finish(opts)
  return REPORT.exit_status()


if __name__ == "__main__":
  sys.exit(main())
