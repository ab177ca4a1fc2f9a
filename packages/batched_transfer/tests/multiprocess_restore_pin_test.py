"""Two processes (jax.distributed on 127.0.0.1) restoring one checkpoint
onto a sharding over both while it is overwritten: every process reads the
same save, whole (a collective restore agrees on the record's save_id), or
both read the path again; never one global array made of two saves. A
read that fails on one process fails on every process, without a
collective that would leave the others waiting."""

import textwrap

from multiprocess_util import run_two
import numpy as np

from jaxworks import batched_transfer as bt

WORKER = textwrap.dedent(
  """
  import sys
  pid, port, base = int(sys.argv[1]), sys.argv[2], sys.argv[3]
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                             num_processes=2, process_id=pid,
                             initialization_timeout=60)
  from jaxworks import batched_transfer as bt
  # Private: the distributed key-value store (to order the race), the
  # reader's one open of a file and the local open (hooked), the reaper.
  from jax._src import distributed
  from jaxworks.batched_transfer._src.checkpoint import commit
  from jaxworks.batched_transfer._src.checkpoint import reader
  from jaxworks.batched_transfer._src.checkpoint import restore_files

  kv = distributed.global_state.client
  path = f"{base}/ckpt"

  def tree(k):
    return {f"a{i}": np.full((8, 4), 100 * k + i, np.float32)
            for i in range(4)}

  if pid == 0:  # process 0 opens save 1 and holds it
    real_open = restore_files.open_directory

    def opened(*args):
      out = real_open(*args)
      restore_files.open_directory = real_open
      kv.key_value_set("test/p0-opened", "1")
      return out

    restore_files.open_directory = opened
  else:  # process 1 read save 1's record; then save 2 replaces it
    real_file = reader.open_file

    def open_file(name, dir_fd=None):
      if name.endswith(".npy"):
        reader.open_file = real_file
        kv.blocking_key_value_get("test/p0-opened", 60_000)
        bt.save(path, tree(2), overwrite=True, collective=False)
        commit.REAPER.wait()  # save 1's files are gone
      return real_file(name, dir_fd)

    reader.open_file = open_file

  mesh = jax.make_mesh((8,), ("x",))
  rows = NamedSharding(mesh, P("x"))
  like = {k: jax.ShapeDtypeStruct((8, 4), np.float32, sharding=rows)
          for k in tree(1)}
  out = bt.restore(path, like)
  for k, x in out.items():
    assert not x.is_fully_addressable
    for shard in x.addressable_shards:  # this process's rows: save 2's
      np.testing.assert_array_equal(
          np.asarray(shard.data), tree(2)[k][shard.index])
  # Both processes' rows together: one save, not a mix.
  total = jax.jit(lambda t: sum(jnp.sum(v) for v in t.values()))(out)
  assert float(total) == sum(float(v.sum()) for v in tree(2).values()), total
  print("WORKER-OK", pid, flush=True)
  """
)


def test_a_collective_restore_reads_one_save_on_every_process(tmp_path):
  bt.save(
    str(tmp_path / "ckpt"),
    {f"a{i}": np.full((8, 4), 100 + i, np.float32) for i in range(4)},
  )
  run_two(WORKER, str(tmp_path))


FAILING_READER = textwrap.dedent(
  """
  import errno, sys
  pid, port, base = int(sys.argv[1]), sys.argv[2], sys.argv[3]
  import jax
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                             num_processes=2, process_id=pid,
                             initialization_timeout=60)
  from jaxworks import batched_transfer as bt
  # Private: the reader's read of an array's data (hooked).
  from jaxworks.batched_transfer._src.checkpoint import reader

  if pid == 1:  # its disk fails the read of the last array's data, once
    real_read = reader.Files.read

    def read(self, s):
      if s.where.endswith("a3.npy'"):
        reader.Files.read = real_read
        raise OSError(errno.EIO, "injected read error")
      return real_read(self, s)

    reader.Files.read = read

  mesh = jax.make_mesh((8,), ("x",))
  # Whole arrays read by each process, placed over both processes' devices.
  rows = NamedSharding(mesh, P("x"))
  like = {f"a{i}": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=rows)
          for i in range(4)}
  try:
    bt.restore(f"{base}/ckpt", like, barrier_timeout_s=100)
  except OSError as err:  # this process's own error
    assert pid == 1 and "injected read error" in str(err), err
  except RuntimeError as err:  # the other's, posted to this one
    assert pid == 0, err
    assert "failed on process 1" in str(err), err
    assert "injected read error" in str(err), err
  else:
    raise AssertionError("the restore returned")
  out = bt.restore(f"{base}/ckpt", like)  # the next restore of both is whole
  for k, x in out.items():
    for shard in x.addressable_shards:
      want = np.full((8, 4), 100 + int(k[1:]), np.float32)[shard.index]
      np.testing.assert_array_equal(np.asarray(shard.data), want)
  print("WORKER-OK", pid, flush=True)
  """
)


def test_a_read_that_fails_on_one_process_fails_on_both(tmp_path):
  """Process 1's read fails while process 0 reads whole: process 0 raises
  process 1's error (posted on the restore's board) instead of waiting in a
  collective check of the values it placed, which process 1 never joins."""
  bt.save(
    str(tmp_path / "ckpt"),
    {f"a{i}": np.full((8, 4), 100 + i, np.float32) for i in range(4)},
  )
  run_two(FAILING_READER, str(tmp_path), timeout=90)
