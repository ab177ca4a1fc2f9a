"""Checkpoints in a bucket: moto's S3 server on 127.0.0.1, in a process of its own.

Rows (medians of ``--repeats``, each repeat timing both sides back to back):

* save: ``bt.save(url, tree)`` (blocking: the objects written, the record created)
  of a tree on one device and of one sharded in rows over 8 devices, against
  the raw client, obstore's ``put`` of the same bytes, one object per leaf,
  8 at once (goal: at least 0.8x its time).
* restore: ``bt.restore(url, target)`` onto one device and onto rows over 8
  devices (each object in one request, its header read first and its body
  streamed straight into restore's buffer), against the raw client's ``get``
  of the same objects, 8 at once, kept until all arrived (goal: at least
  0.8x); both run once before the repeats, and each timed call starts from
  freed memory handed back to the system (``jaxworks_bench.release_memory``:
  a get in a loop would otherwise reuse its last repeat's pages, which a
  restore, whose arrays are new memory, cannot). ``--restore-only``: these rows alone.
* orbax ``StandardCheckpointer`` writing the same tree to the same ``s3://``
  bucket (peer, goal 2x): measured where orbax reaches the bucket; else a note
  says why and which setting was tried.

Trees: ``--mib`` MiB (1024, the documented setting) in 16 leaves, and the same
in ``--leaves`` (1000) leaves. ``--quick``: 16 MiB, 100 leaves, one repeat. The
server runs in a child process, as a real server is not in the client's
process (moto in this process would share its interpreter lock with
restore's Python threads, while obstore's raw requests run in Rust); it
shares the 2 cores with the clients, so the figures say as much about moto
as about the clients; the ratios compare both sides on the same server.
"""

import argparse
import concurrent.futures
import logging
import os
import sys
import uuid

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jaxworks_bench as jb
import numpy as np

sys.path.insert(
  0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
)

import object_servers  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402

PACKAGE = "batched_transfer"
RAW = "obstore put of the same bytes (8 at once)"
RAW_GET = "obstore get of the same bytes (8 at once)"


def _drop(store, prefix):
  """Deletes every object under ``prefix`` (moto keeps them in memory)."""
  import obstore

  paths = [m["path"] for b in obstore.list(store, prefix=prefix) for m in b]
  for i in range(0, len(paths), 1000):
    obstore.delete(store, paths[i : i + 1000])


def rows(report, name, tree, repeats, store, pool, save=True):
  import obstore

  mesh = jax.make_mesh((8,), ("x",))
  places = {
    "one device": None,
    "rows over 8 devices": NamedSharding(mesh, P("x")),
  }
  mb = sum(x.nbytes for x in tree.values()) / 1e6
  gbs = {}
  for where, sharding in places.items() if save else ():
    placed = jax.device_put(tree, sharding or jax.devices()[0])
    jax.block_until_ready(placed)

    def setup(placed=placed):
      _drop(store, "save/")
      url = f"s3://bench/save/{uuid.uuid4().hex}"
      prefix = f"save/{uuid.uuid4().hex}"

      def ours():
        bt.save(url, placed)

      def raw():
        list(
          pool.map(
            lambda kv: obstore.put(
              store, f"{prefix}/{kv[0]}.npy", memoryview(kv[1]).cast("B")
            ),
            tree.items(),
          )
        )

      return ours, raw

    t_save, t_put = jb.median_pair(None, None, repeats, setup=setup)
    report.add(
      f"save to s3:// (moto), {name} -> {where} (vs raw put)",
      t_save,
      t_put,
      "naive",
      RAW,
      goal=0.8,
    )
    gbs[f"save {where}"] = mb / t_save
    gbs["put"] = mb / t_put
    del placed
  _drop(store, "save/")

  url = f"s3://bench/restore/{uuid.uuid4().hex}"
  bt.save(url, tree)
  prefix = f"raw/{uuid.uuid4().hex}"
  list(
    pool.map(
      lambda kv: obstore.put(
        store, f"{prefix}/{kv[0]}.npy", memoryview(kv[1]).cast("B")
      ),
      tree.items(),
    )
  )
  for where, sharding in places.items():
    target = {
      k: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
      for k, x in tree.items()
    }

    def ours(target=target):
      jax.block_until_ready(bt.restore(url, target))

    def raw():
      list(
        pool.map(
          lambda k: obstore.get(store, f"{prefix}/{k}.npy").bytes(), tree
        )
      )

    ours()  # the first restore's one-time costs (tracing, placement plans)
    raw()
    # Both sides start from freed memory handed back to the system, as a
    # process restoring once does (a raw get in a loop would otherwise reuse
    # the pages of its previous repeat, and skip zeroing new ones).
    t_restore, t_get = jb.median_pair(ours, raw, repeats, fresh=True)
    report.add(
      f"restore from s3:// (moto), {name} -> {where} (vs raw get)",
      t_restore,
      t_get,
      "naive",
      RAW_GET,
      goal=0.8,
    )
    gbs[f"restore {where}"] = mb / t_restore
    gbs["get"] = mb / t_get
  _drop(store, "restore/")
  _drop(store, "raw/")
  report.note(
    f"{name} on moto's S3 server: "
    + ", ".join(f"{k} {v:.0f} MB/s" for k, v in gbs.items())
    + "."
  )
  return url


def orbax_row(report, name, tree, repeats):
  """orbax's save to the same bucket, or a note saying why it cannot."""
  setting = (
    "ocp.StandardCheckpointer().save('s3://bench/...') with AWS_ENDPOINT_URL, "
    "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY and AWS_REGION set to the server"
  )
  try:
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()

    def setup():
      url = f"s3://bench/orbax/{uuid.uuid4().hex}"
      ours_url = f"s3://bench/ours/{uuid.uuid4().hex}"

      def theirs():
        ckptr.save(url, tree)
        ckptr.wait_until_finished()

      return (lambda: bt.save(ours_url, tree)), theirs

    t_ours, t_orbax = jb.median_pair(None, None, repeats, setup=setup)
  except Exception as e:  # the note says why orbax cannot
    text = str(e).strip()
    first = text.splitlines()[0][:200] if text else ""
    report.note(
      f"orbax StandardCheckpointer to s3:// ({name}): not measured: orbax "
      f"0.12.8 cannot reach the bucket: {type(e).__name__}: {first}. Tried: "
      f"{setting}. orbax opens s3:// paths through etils.epath, which needs "
      "fsspec's s3fs; s3fs needs aiobotocore, whose botocore pin conflicts "
      "with the locked botocore/boto3 (1.44.8, which moto and the S3 tests "
      "use), so it is not installed."
    )
    return
  report.add(
    f"save to s3:// (moto), {name} -> one device (vs orbax)",
    t_ours,
    t_orbax,
    "peer",
    "orbax StandardCheckpointer save to the same bucket",
    goal=2.0,
  )


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument(
    "--mib", type=int, default=1024, help="MiB per tree (1024 documented)"
  )
  p.add_argument("--leaves", type=int, default=1000)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument(
    "--restore-only", action="store_true", help="the restore rows alone"
  )
  jb.add_arguments(p)
  a = p.parse_args(argv)
  if a.quick:
    a.mib, a.leaves, a.repeats = 16, 100, 1
  logging.getLogger("werkzeug").setLevel(logging.ERROR)
  from obstore.store import S3Store

  report = jb.Report(PACKAGE)
  with object_servers.s3_server_process() as endpoint:
    object_servers.s3_bucket(endpoint, "bench")
    os.environ.update(object_servers.S3_ENV, AWS_ENDPOINT_URL=endpoint)
    store = S3Store(
      "bench", endpoint=endpoint, client_options={"allow_http": True}
    )
    rng = np.random.default_rng(0)
    n = a.mib * 2**20 // 4  # float32 values per tree
    big = {
      f"w{i:02d}": rng.standard_normal((64, n // 16 // 64), np.float32)
      for i in range(16)
    }
    per = n // a.leaves // 8 * 8
    many = {
      f"s{i:04d}": rng.standard_normal((8, per // 8), np.float32)
      for i in range(a.leaves)
    }
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      save = not a.restore_only
      rows(report, f"16 leaves, {a.mib} MiB", big, a.repeats, store, pool, save)
      rows(
        report,
        f"{a.leaves} leaves, {a.mib} MiB",
        many,
        a.repeats,
        store,
        pool,
        save,
      )
    if save:
      orbax_row(report, f"16 leaves, {a.mib} MiB", big, a.repeats)
  report.note(
    f"Sizes run: --mib {a.mib} --leaves {a.leaves} --repeats {a.repeats} "
    "(1024 MiB is the documented setting)."
  )
  report.finish(a)


if __name__ == "__main__":
  main()
