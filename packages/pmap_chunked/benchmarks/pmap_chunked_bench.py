"""jaxworks.pmap_chunked.pmap side by side with stock jax.pmap (one process).

Rows:
  - dispatch, 1 / 10 args: per-call time of a cached pmap whose inputs are the
    outputs of the same kind of pmap (already laid out), median of repeats.
  - first call: trace + compile + run of a freshly created pmap of a new
    program; and of a re-created closure of a program compiled before
    (jaxworks.jit_cache reuses the executable).
  - handoff pmap -> jit / pmap -> pmap: bytes copied when a pmap output is
    donated to jax.jit (or to a pmap): an output shard that reuses an input
    shard's buffer proves the input was taken without copy or reshard.

Usage: pmap_chunked_bench.py [--quick]
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import itertools
import statistics
import time

import jax
import jax.numpy as jnp

from jaxworks.pmap_chunked import pmap


def _per_call(fun, args, calls):
  start = time.perf_counter()
  for _ in range(calls):
    out = fun(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / calls


def dispatch_pair(nargs, calls, repeats):
  """Per-call seconds of stock and jaxworks pmap, measured in alternation.

  Each side's inputs are outputs of its own kind of pmap (already laid out).
  Returns (median stock, median ours, median of the per-repeat ratios): the
  pairs share the drift of a busy machine, so their ratio is the stable figure.
  """
  sides = []
  for make_pmap in (jax.pmap, pmap):
    ident = make_pmap(lambda x: x)
    base = ident(jnp.ones((jax.device_count(), 16)))
    args = [ident(base + i) for i in range(nargs)]
    fun = make_pmap(lambda *a: a[0] + a[-1])
    jax.block_until_ready(fun(*args))
    sides.append((fun, args))
  stock, ours = [], []
  for _ in range(repeats):
    stock.append(_per_call(*sides[0], calls))
    ours.append(_per_call(*sides[1], calls))
  ratios = [o / s for s, o in zip(stock, ours)]
  return (
    statistics.median(stock),
    statistics.median(ours),
    statistics.median(ratios),
  )


_fresh = itertools.count(1)


def first_call(make_pmap, size, same_function=False):
  """Time of the first call of a freshly created pmap.

  Each call gets a new Python function. With same_function=False its constant
  differs from every earlier one (a genuinely new program: trace + compile);
  with True it is a re-created closure of an already compiled program.
  """
  x = jnp.ones((jax.device_count(), size))
  k = 0 if same_function else next(_fresh)

  def f(v):
    return jnp.tanh(v * (k + 1)) @ jnp.ones((size, 4)) + jax.lax.psum(
      v.sum(), "i"
    )

  start = time.perf_counter()
  jax.block_until_ready(make_pmap(f, axis_name="i")(x))
  return time.perf_counter() - start


def _pointers(a):
  return {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}


def handoff(make_pmap, size, to_pmap):
  out = make_pmap(lambda v: v * 2)(jnp.ones((jax.device_count(), size)))
  before = _pointers(out)
  if to_pmap:
    nxt = make_pmap(lambda v: v + 1, donate_argnums=0)(out)
  else:
    nxt = jax.jit(lambda a: a + 1, donate_argnums=0)(out)
  copied = sum(
    s.data.nbytes
    for s in nxt.addressable_shards
    if s.data.unsafe_buffer_pointer() not in before
  )
  return copied, sum(s.data.nbytes for s in nxt.addressable_shards)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="small sizes and few repeats (< 20 s)"
  )
  quick = parser.parse_args().quick
  calls, repeats = (200, 5) if quick else (500, 31)
  compile_repeats = 2 if quick else 5
  size = 64 if quick else 4096

  ours, stock = pmap, jax.pmap
  rows = []
  for nargs in (1, 10):
    t_stock, t_ours, ratio = dispatch_pair(nargs, calls, repeats)
    rows.append(
      (
        f"dispatch, {nargs} arg{'s' if nargs > 1 else ''} (us/call)",
        t_stock * 1e6,
        t_ours * 1e6,
        ratio,
      )
    )
  first_call(stock, size, same_function=True)  # warm up JAX itself
  first_call(ours, size, same_function=True)
  for label, same in (
    ("first call: trace+compile+run (ms)", False),
    ("first call of a re-created identical function (ms)", True),
  ):
    t_stock, t_ours = [], []
    for _ in range(compile_repeats):
      t_stock.append(first_call(stock, size, same))
      t_ours.append(first_call(ours, size, same))
    rows.append(
      (
        label,
        statistics.median(t_stock) * 1e3,
        statistics.median(t_ours) * 1e3,
        statistics.median(o / s for s, o in zip(t_stock, t_ours)),
      )
    )

  print(
    f"jax {jax.__version__}, {jax.device_count()} "
    f"{jax.devices()[0].platform} devices"
    f"{' (--quick)' if quick else ''}\n"
  )
  print(
    "| measure | jax.pmap | jaxworks pmap | ratio (ours / jax, median of pairs) |"
  )
  print("|---|---:|---:|---:|")
  for name, a, b, ratio in rows:
    print(f"| {name} | {a:.1f} | {b:.1f} | {ratio:.2f}x |")
  for label, to_pmap in (("pmap -> jit", False), ("pmap -> pmap", True)):
    c_stock, total = handoff(stock, size, to_pmap)
    c_ours, _ = handoff(ours, size, to_pmap)
    print(
      f"| handoff {label}: bytes copied (of {total}) | {c_stock} | "
      f"{c_ours} | - |"
    )


if __name__ == "__main__":
  main()
