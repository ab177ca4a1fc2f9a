"""device_put, plan and the grouping from many threads at once (shared caches, GIL-held C++)."""

import concurrent.futures

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from jaxworks import batched_transfer as bt


def _work(k):
  devices = jax.devices()
  mesh = jax.make_mesh((2,), ("x",), devices=devices[k % 4 * 2 : k % 4 * 2 + 2])
  rng = np.random.default_rng(k)
  tree = {
    "host": [rng.standard_normal((4, 2)).astype(np.float32) for _ in range(20)],
    "dev": [
      jax.device_put(np.full(4, j, np.int32), devices[(k + j) % 8])
      for j in range(20)
    ],
    "s": [k, float(k)],
  }
  results = []
  sharded = NamedSharding(mesh, P("x"))
  for target in (
    devices[k % 8],
    {"host": sharded, "dev": sharded, "s": None},
    None,
  ):
    out = bt.device_put(tree, target)
    ref = jax.device_put(tree, target)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
      results.append(
        a.sharding == b.sharding
        and jax.typeof(a) == jax.typeof(b)
        and np.array_equal(np.asarray(a), np.asarray(b))
      )
    results.append(bt.plan(tree, target).num_leaves == 42)
    # The grouping alone (no transfer): every leaf onto one replicated sharding.
    grouped = bt.plan(tree, NamedSharding(mesh, P()))
    results.append(grouped.num_leaves == 42 and len(grouped.groups) >= 1)
  return all(results)


def test_many_threads_agree_with_stock():
  with concurrent.futures.ThreadPoolExecutor(max_workers=8) as pool:
    assert all(pool.map(_work, range(16)))
