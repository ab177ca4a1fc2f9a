"""Checkpoints in a bucket: moto's S3 server on 127.0.0.1, in this process.

Rows (medians of ``--repeats``; MB/s of array data):

* save: ``bt.save(url)`` (blocking: written locally, uploaded, record
  created) against the raw client, obstore's ``put`` of the same bytes, one
  object per leaf, 8 at once (goal: at least 0.8x its bandwidth).
* restore: ``bt.restore(url, target)`` onto one device, and rows over 8
  devices, against the raw client's ``get`` of the same objects, 8 at once
  (goal: at least 0.8x).
* orbax ``StandardCheckpointer`` writing the same tree to the same ``s3://``
  bucket (peer): the row says why where it cannot.

Trees: 16 leaves of ``--mib``/16 MiB each, and 1000 leaves of 16 KiB. The
server runs in this process (its Python threads share the 2 cores with the
clients), so the figures say as much about moto as about the clients.
"""

import argparse
import concurrent.futures
import logging
import os
import statistics
import sys
import time
import uuid

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

sys.path.insert(
  0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
)

import object_servers  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402


def median_s(fn, repeats):
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def rows(name, tree, repeats, store, pool):
  import obstore

  nbytes = sum(x.nbytes for x in tree.values())
  mb = nbytes / 1e6
  urls = iter(f"s3://bench/{name}-{uuid.uuid4().hex}" for _ in range(999))
  saved = []

  def save():
    url = next(urls)
    bt.save(url, tree)
    saved.append(url)

  def raw_put():
    prefix = uuid.uuid4().hex
    list(
      pool.map(
        lambda kv: obstore.put(
          store, f"raw/{prefix}/{kv[0]}.npy", memoryview(kv[1]).cast("B")
        ),
        tree.items(),
      )
    )
    return prefix

  t_save = median_s(save, repeats)
  t_put = median_s(raw_put, repeats)
  prefix = raw_put()
  print(
    f"{name}: save {mb / t_save:.0f} MB/s; raw put {mb / t_put:.0f} MB/s "
    f"(save {t_put / t_save:.2f}x of it, goal >= 0.8x)"
  )
  url = saved[-1]
  mesh = jax.make_mesh((8,), ("x",))
  for where, sharding in [
    ("one device", None),
    ("rows over 8 devices", NamedSharding(mesh, P("x"))),
  ]:
    target = {
      k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
      for k, x in tree.items()
    }

    def restore(target=target):
      jax.block_until_ready(bt.restore(url, target))

    def raw_get():
      list(
        pool.map(
          lambda k: obstore.get(store, f"raw/{prefix}/{k}.npy").bytes(), tree
        )
      )

    t_restore = median_s(restore, repeats)
    t_get = median_s(raw_get, repeats)
    print(
      f"{name}, restore {where}: {mb / t_restore:.0f} MB/s; raw get "
      f"{mb / t_get:.0f} MB/s (restore {t_get / t_restore:.2f}x of it, "
      "goal >= 0.8x)"
    )


def orbax_row(tree):
  try:
    import orbax.checkpoint as ocp

    t = time.perf_counter()
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(f"s3://bench/orbax-{uuid.uuid4().hex}", tree)
    ckptr.wait_until_finished()
    print(
      f"orbax StandardCheckpointer to s3://: {time.perf_counter() - t:.2f} s"
    )
  except Exception as e:  # the row says why orbax cannot
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    print(
      "orbax StandardCheckpointer to s3:// (AWS_ENDPOINT_URL set to the "
      f"server): not measured: {type(e).__name__}: {first}"
    )


def main():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--mib", type=int, default=256)
  p.add_argument("--repeats", type=int, default=3)
  a = p.parse_args()
  logging.getLogger("werkzeug").setLevel(logging.ERROR)
  from obstore.store import S3Store

  with object_servers.s3_server() as endpoint:
    object_servers.s3_bucket(endpoint, "bench")
    os.environ.update(object_servers.S3_ENV, AWS_ENDPOINT_URL=endpoint)
    store = S3Store(
      "bench", endpoint=endpoint, client_options={"allow_http": True}
    )
    rng = np.random.default_rng(0)
    big = {
      f"w{i:02d}": rng.standard_normal(
        (8, a.mib * 2**20 // 16 // 32), np.float32
      )
      for i in range(16)
    }
    small = {
      f"s{i:04d}": rng.standard_normal((8, 512), np.float32)
      for i in range(1000)
    }
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      rows(f"16 leaves, {a.mib} MiB", big, a.repeats, store, pool)
      rows("1000 leaves, 16 MiB", small, a.repeats, store, pool)
    orbax_row({"w": small["s0000"]})


if __name__ == "__main__":
  main()
