"""jaxworks.pmap_chunked.pmap side by side with stock jax.pmap (one process).

Rows (jaxworks_bench rows, reference: stock jax.pmap):
  - dispatch, 1 / 10 args: per-call time of a cached pmap whose inputs are the
    outputs of the same kind of pmap (already laid out), median of repeats.
  - first call of a new program: trace + compile + run of a freshly created
    pmap whose program no earlier call compiled (a distinct constant each).
  - first call of a re-created closure of a program compiled once before in
    this process (in-process reuse): each repeat compiles a new program, then
    re-creates the identical closure and times that one's first call
    (jaxworks.jit_cache reuses the executable; jax.pmap compiles again).
Notes: handoff pmap -> jit / pmap -> pmap: bytes copied when a pmap output is
donated to jax.jit (or to a pmap); an output shard that reuses an input
shard's buffer proves the input was taken without copy or reshard.

On an accelerator (``--platform tpu``) the same rows over the devices
present (one chip: a pmap of one shard), fewer repeats.

Usage: pmap_chunked_bench.py [--quick] [--json PATH] [--platform P]
  [--budget-s S]
"""

import jaxworks_bench as jb

PROFILE = jb.configure_devices()  # before jax: 8 host CPU devices on cpu

import argparse  # noqa: E402
import itertools  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxworks.pmap_chunked import pmap  # noqa: E402

DISPATCH_GOAL = 1 / 1.2  # at most 1.2x the time of jax.pmap


def dispatch_pair(nargs, calls, repeats):
  """Per-call seconds (ours, stock) of a cached pmap, measured in alternation.

  Each side's inputs are outputs of its own kind of pmap (already laid out).
  """
  sides = []
  for make_pmap in (pmap, jax.pmap):
    ident = make_pmap(lambda x: x)
    base = ident(jnp.ones((jax.device_count(), 16)))
    args = [ident(base + i) for i in range(nargs)]
    fun = make_pmap(lambda *a: a[0] + a[-1])
    jax.block_until_ready(fun(*args))
    sides.append((fun, args))
  (f_ours, a_ours), (f_stock, a_stock) = sides
  return jb.median_pair(
    lambda: f_ours(*a_ours), lambda: f_stock(*a_stock), repeats, inner=calls
  )


_programs = itertools.count(1)


def make_closure(k, size):
  """A new Python function computing program number ``k``."""

  def f(v):
    return jnp.tanh(v * (k + 1)) @ jnp.ones((size, 4)) + jax.lax.psum(
      v.sum(), "i"
    )

  return f


def first_call(make_pmap, k, size):
  """Seconds of the first call of a freshly created pmap of program ``k``."""
  x = jnp.ones((jax.device_count(), size))
  fun = make_closure(k, size)
  return jb.per_call(lambda: make_pmap(fun, axis_name="i")(x))


def first_calls(make_pmap, size, repeats):
  """(new program, re-created closure of a program compiled before) seconds.

  Each repeat takes a program number no earlier call used: its first
  creation compiles it (the "new program" time), then an identical closure
  is created and called (the "re-created" time).
  """
  new, again = [], []
  for _ in range(repeats):
    k = next(_programs)
    new.append(first_call(make_pmap, k, size))
    again.append(first_call(make_pmap, k, size))
  return new, again


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


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="small sizes and few repeats (< 20 s)"
  )
  jb.add_arguments(parser)
  args = parser.parse_args(argv)
  calls, repeats = (200, 5) if args.quick else (500, 31)
  compile_repeats = 3 if args.quick else 7
  size = 64 if args.quick else 4096
  if PROFILE != "cpu" and not args.quick:  # compiles cost more on a chip
    calls, repeats, compile_repeats = 300, 15, 5

  report = jb.Report("pmap_chunked", "pmap_chunked_bench")
  report.finish_on_signal(args)
  report.section(
    "pmap rows", _rows, report, args, calls, repeats, compile_repeats, size
  )
  report.finish(args)
  return report.exit_status()


def _rows(report, args, calls, repeats, compile_repeats, size):
  del args
  for nargs in (1, 10):
    ours, stock = dispatch_pair(nargs, calls, repeats)
    report.add(
      f"dispatch of a cached pmap, {nargs} arg{'s' if nargs > 1 else ''}",
      ours,
      stock,
      "stock-jax",
      "jax.pmap",
      goal=DISPATCH_GOAL,
    )
  first_call(pmap, 0, size)  # warm up JAX itself (program 0 is never timed)
  first_call(jax.pmap, 0, size)
  timings = {}
  for r in range(compile_repeats):  # alternate which side goes first
    sides = (("ours", pmap), ("stock", jax.pmap))
    for name, make_pmap in sides[:: 1 if r % 2 == 0 else -1]:
      new, again = first_calls(make_pmap, size, 1)
      timings.setdefault(name, ([], []))
      timings[name][0].extend(new)
      timings[name][1].extend(again)
  (new_ours, again_ours), (new_stock, again_stock) = (
    timings["ours"],
    timings["stock"],
  )
  report.add(
    "first call of a new program: trace + compile + run",
    statistics.median(new_ours),
    statistics.median(new_stock),
    "stock-jax",
    "jax.pmap",
  )
  report.add(
    "first call of a re-created closure of a program compiled earlier "
    "(in-process reuse)",
    statistics.median(again_ours),
    statistics.median(again_stock),
    "stock-jax",
    "jax.pmap",
  )
  for label, to_pmap in (("pmap -> jit", False), ("pmap -> pmap", True)):
    c_stock, total = handoff(jax.pmap, size, to_pmap)
    c_ours, _ = handoff(pmap, size, to_pmap)
    report.note(
      f"Handoff {label} (output donated): bytes copied of {total}: "
      f"jaxworks {c_ours}, jax.pmap {c_stock}."
    )
  report.note(
    f"On {jax.device_count()} {jax.devices()[0].platform} device(s); "
    f"dispatch: {calls} calls x {repeats} repeats; first calls: "
    f"{compile_repeats} repeats."
  )


if __name__ == "__main__":
  sys.exit(main())
