"""Deeper runs of the ambient-state differential harness.

Random cases (a program of the corpus under one to three ambient dimensions at
once, both orders chosen at random, one function or re-created closures),
each compared bit for bit with stock ``jax.jit`` in this process. Every
mismatch is shrunk to the fewest dimensions that still show it and printed
as one line plus the command that re-runs it::

  bazel run //packages/jit_cache:ambient_fuzz -- --seed 3 --cases 400
  bazel run //packages/jit_cache:ambient_fuzz -- --case 'axis_probe:axis_vmap_other_name:AB:same'
  bazel run //packages/jit_cache:ambient_fuzz -- --list

Exit status 1 when a mismatch was found. ``--keep-caches`` skips clearing
jaxworks' caches between cases (finds sharing across cases; a mismatch then
may need the cases before it to show).
"""

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(
  0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
)

# pylint: disable=g-import-not-at-top,wrong-import-position
import argparse
import time

import ambient_corpus as corpus
import ambient_harness as harness


def _parse(argv):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
  p.add_argument(
    "--cases",
    type=int,
    default=200,
    help="number of random cases (default 200)",
  )
  p.add_argument(
    "--max-dims",
    type=int,
    default=3,
    help="most dimensions combined in one case (default 3)",
  )
  p.add_argument(
    "--case",
    action="append",
    default=[],
    help="run this case key (as printed) instead; repeatable",
  )
  p.add_argument(
    "--keep-caches",
    action="store_true",
    help="do not clear jaxworks' caches between cases",
  )
  p.add_argument(
    "--no-shrink",
    action="store_true",
    help="print mismatches without shrinking them",
  )
  p.add_argument(
    "--list",
    action="store_true",
    help="list the programs and dimensions, then exit",
  )
  args = p.parse_args(argv)
  if args.cases < 0:
    p.error(f"--cases must be >= 0, got {args.cases}")
  if args.max_dims < 1:
    p.error(f"--max-dims must be >= 1, got {args.max_dims}")
  return args


def main(argv=None) -> int:
  args = _parse(argv)
  table = harness.dimensions()
  if args.list:
    print("programs:", " ".join(sorted(corpus.CORPUS)))
    print("dimensions:", " ".join(sorted(table)))
    return 0
  if args.case:
    cases = [harness.parse_case(k, table) for k in args.case]
  else:
    cases = list(harness.random_cases(args.seed, args.cases, args.max_dims))
  t0 = time.perf_counter()
  classes = {}
  for n, case in enumerate(cases, 1):
    found = harness.run_case(case, fresh=not args.keep_caches)
    if not found:
      continue
    first = found[0] if args.no_shrink else harness.shrink(found[0])
    print(first.line(), flush=True)
    print("  " + first.repro(), flush=True)
    cls = (
      first.case.program,
      first.case.dims,
      harness.diff(first.stock, first.ours),
    )
    classes.setdefault(cls, first)
    print(f"  [{n}/{len(cases)}]", flush=True)
  took = time.perf_counter() - t0
  print(
    f"{len(cases)} cases in {took:.1f} s; {len(classes)} distinct "
    f"mismatch classes (program, dimensions, first differing field):"
  )
  for (prog, dims, field), m in sorted(classes.items()):
    print(f"  {prog} under {'+'.join(dims)}: {field}: {m.repro()}")
  return 1 if classes else 0


if __name__ == "__main__":
  sys.exit(main())
