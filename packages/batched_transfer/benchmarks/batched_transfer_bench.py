"""Side-by-side benchmark of jaxworks.batched_transfer against stock JAX.

Prints three markdown tables (medians of interleaved repeats, one process):
  1. device_put of 10/100/1000 leaves: numpy -> one device, device -> device,
     numpy -> NamedSharding; jaxworks vs jax.device_put of the list and vs a
     per-leaf jax.device_put loop.
  2. grouping 10k/100k leaves: the C++ pass vs the same algorithm in Python.
  3. restore of a directory of .npy files in GB/s vs reading them with numpy.

Run: python batched_transfer_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402  (XLA_FLAGS must be set first)
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402
import numpy as np  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402
from jaxworks.batched_transfer._src import grouping  # noqa: E402


def interleaved_medians(fns: dict, repeats: int) -> dict:
  """Median seconds of each fn, running them in rotating order each round."""
  times = {k: [] for k in fns}
  names = list(fns)
  for k in names:  # warm up caches and compilations
    jax.block_until_ready(fns[k]())
  for r in range(repeats):
    for k in names[r % len(names) :] + names[: r % len(names)]:
      t0 = time.perf_counter()
      jax.block_until_ready(fns[k]())
      times[k].append(time.perf_counter() - t0)
  return {k: statistics.median(v) for k, v in times.items()}


def transfer_table(sizes, repeats) -> list[str]:
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("x",))
  named = NamedSharding(mesh, P("x"))
  rows = [
    "| case | leaves | jaxworks ms | jax.device_put(list) ms | per-leaf loop ms | "
    "jaxworks / list | loop / jaxworks |",
    "|---|---:|---:|---:|---:|---:|---:|",
  ]
  rng = np.random.default_rng(0)
  for n in sizes:
    host = [rng.standard_normal((8, 32)).astype(np.float32) for _ in range(n)]
    on0 = jax.block_until_ready(jax.device_put(host, devices[0]))
    cases = [
      ("numpy -> one device", host, devices[1]),
      ("device -> device", on0, devices[2]),
      ("numpy -> NamedSharding", host, named),
    ]
    for name, tree, target in cases:
      reps = max(5, repeats * 100 // max(n, 100))
      m = interleaved_medians(
        {
          "ours": lambda: bt.device_put(tree, target),
          "list": lambda: jax.device_put(tree, target),
          "loop": lambda: [jax.device_put(x, target) for x in tree],
        },
        reps,
      )
      rows.append(
        f"| {name} | {n} | {m['ours'] * 1e3:.2f} | {m['list'] * 1e3:.2f} | "
        f"{m['loop'] * 1e3:.2f} | {m['ours'] / m['list']:.2f}x | "
        f"{m['loop'] / m['ours']:.2f}x |"
      )
  return rows


def grouping_table(sizes, repeats) -> list[str]:
  """C++ pass vs the straightforward Python loop (same keys, same byte counts).

  Inputs: numpy leaves of a checkpoint going to one device; jax.Arrays on 8
  devices drawn from a pool of 1000 (each single-device jax.Array has its own
  sharding object, so each such object recurs n / 1000 times, as in a tree
  whose leaves share shardings); a mix of both with per-leaf targets; and n
  distinct single-device jax.Arrays (no sharding object recurs: the worst case
  for the C++ pass's caches).
  """
  devices = jax.devices()
  rng = np.random.default_rng(1)
  host_pool = [
    np.zeros(int(k) + 1, np.float32) for k in rng.integers(0, 64, 1000)
  ]
  dev_pool = []
  for d in devices:
    dev_pool += jax.device_put([np.ones(4, np.float32)] * 125, d)
  jax.block_until_ready(dev_pool)
  shardings = [SingleDeviceSharding(d) for d in devices[:4]] + [None]
  default = SingleDeviceSharding(devices[0])
  rows = [
    "| leaves | input | C++ ms | pure Python ms | speedup | groups |",
    "|---:|---|---:|---:|---:|---:|",
  ]
  for n in sizes:
    picks = rng.integers(0, 2, n)
    inputs = [
      ("numpy", [host_pool[i % 1000] for i in range(n)], [shardings[1]] * n),
      ("jax.Array", [dev_pool[i % 1000] for i in range(n)], [shardings[1]] * n),
      (
        "mixed, per-leaf targets",
        [
          host_pool[i % 1000] if p else dev_pool[i % 1000]
          for i, p in enumerate(picks)
        ],
        [shardings[k] for k in rng.integers(0, len(shardings), n)],
      ),
      (
        "jax.Array, all distinct",
        jax.block_until_ready(
          jax.device_put([np.ones(4, np.float32)] * n, devices[2])
        ),
        [shardings[1]] * n,
      ),
    ]
    for name, leaves, dsts in inputs:
      m = interleaved_medians(
        {
          "cpp": lambda: grouping.group_leaves(leaves, dsts, default),
          "py": lambda: grouping.group_leaves_python(leaves, dsts, default),
        },
        repeats,
      )
      groups = len(grouping.group_leaves(leaves, dsts, default))
      rows.append(
        f"| {n} | {name} | {m['cpp'] * 1e3:.2f} | {m['py'] * 1e3:.2f} | "
        f"{m['py'] / m['cpp']:.1f}x | {groups} |"
      )
  return rows


def restore_table(total_bytes, files, repeats) -> list[str]:
  tmp = tempfile.mkdtemp(prefix="bt-bench-")
  try:
    per = total_bytes // files // 4
    tree = {f"t{k:03d}": np.full(per, k, np.float32) for k in range(files)}
    path = os.path.join(tmp, "ckpt")
    bt.save(path, tree)
    del tree
    names = sorted(n for n in os.listdir(path) if n.endswith(".npy"))
    like = {n[:-4]: jax.ShapeDtypeStruct((per,), np.float32) for n in names}
    nbytes = per * 4 * files
    device = jax.devices()[0]
    out = {}

    def ours():
      out["x"] = bt.restore(path, like, placement=device, progress=False)
      return out["x"]

    def numpy_read():
      return [np.load(os.path.join(path, n)) for n in names]

    m = interleaved_medians({"restore": ours, "numpy": numpy_read}, repeats)
    return [
      "| checkpoint | restore GB/s | numpy read GB/s | restore / numpy |",
      "|---|---:|---:|---:|",
      f"| {files} .npy files, {nbytes / 2**30:.2f} GiB | {nbytes / m['restore'] / 1e9:.2f} | "
      f"{nbytes / m['numpy'] / 1e9:.2f} | {m['numpy'] / m['restore']:.2f}x |",
    ]
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="small sizes, few repeats (< 20 s)"
  )
  args = parser.parse_args()
  start = time.perf_counter()
  print(
    f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
    f"jaxworks.batched_transfer {bt.__version__}{' (quick)' if args.quick else ''}\n"
  )
  if args.quick:
    transfer = transfer_table([10, 100], repeats=5)
    group = grouping_table([10_000], repeats=3)
    restore = restore_table(32 * 2**20, 8, repeats=2)
  else:
    transfer = transfer_table([10, 100, 1000], repeats=30)
    group = grouping_table([10_000, 100_000], repeats=7)
    restore = restore_table(2**30, 16, repeats=3)
  print(
    "device_put (goal: jaxworks / list <= 1.1x everywhere; loop / jaxworks >= 2x at 1000 "
    "leaves for numpy -> one device and device -> device)\n"
  )
  print("\n".join(transfer))
  print("\ngrouping (goal: C++ >= 10x pure Python)\n")
  print("\n".join(group))
  print("\nrestore of an .npy directory vs numpy reading the same files\n")
  print("\n".join(restore))
  print(f"\n(total {time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
  main()
