"""Two processes on 127.0.0.1 (jax.distributed, 4 CPU devices each): a global tree placed with
a NamedSharding that spans both, by device_put and by restore, including partly replicated
shardings (every PartitionSpec shape on a 2-D mesh) of several dtypes from both formats."""

import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import ml_dtypes
from multiprocess_util import free_port
import numpy as np

from jaxworks import batched_transfer as bt

WORKER = textwrap.dedent("""
    import sys
    process_id, port, ckpt, ckpt2 = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=process_id, initialization_timeout=60)
    from jaxworks import batched_transfer as bt

    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = jax.make_mesh((8,), ("x",))
    rows, replicated = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    rng = np.random.default_rng(0)  # the same values on both processes
    tree = {"w": rng.standard_normal((16, 4)).astype(np.float32),
            "b": np.arange(8, dtype=np.int32), "r": np.ones((3, 3), np.float32)}
    target = {"w": rows, "b": rows, "r": replicated}

    def check(out):
      for k, x in out.items():
        assert not x.is_fully_addressable and x.shape == tree[k].shape, k
        assert x.sharding == target[k], k
        assert len(x.addressable_shards) == 4, k
        for shard in x.addressable_shards:
          assert shard.device.process_index == process_id
          np.testing.assert_array_equal(np.asarray(shard.data), tree[k][shard.index])
      # A computation over both processes' shards.
      total = jax.jit(lambda t: jnp.sum(t["w"]) + jnp.sum(t["b"]) + jnp.sum(t["r"]))(out)
      np.testing.assert_allclose(float(total), tree["w"].sum() + 28 + 9, rtol=1e-5)

    out = bt.device_put(tree, target)
    check(out)
    ref = jax.device_put(tree, target)
    for k in tree:
      assert jax.typeof(out[k]) == jax.typeof(ref[k]), k

    plan = bt.plan(tree, target)
    assert [g.dst_devices for g in plan.groups] == [tuple(d.id for d in mesh.devices.flat)], plan

    like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, target)
    check(bt.restore(ckpt, like, max_inflight_bytes=64))

    # Partly replicated shardings over both processes (mesh axis "a" spans them), every
    # PartitionSpec shape, several dtypes, both formats: restore and device_put.
    import ml_dtypes
    mesh2 = jax.make_mesh((4, 2), ("a", "b"))
    specs = [P(), P("a"), P("b"), P(None, "a"), P(None, "b"), P("a", "b"), P("b", "a"),
             P(("a", "b")), P(None, ("a", "b"))]
    dtypes = [np.float32, jnp.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.int4, np.int8]
    for fmt in ("npz", "dir"):
      for dtype in dtypes:
        values = {f"s{k}": (np.arange(64).reshape(8, 8) % 4 + k).astype(dtype)
                  for k in range(len(specs))}
        shardings = {f"s{k}": NamedSharding(mesh2, s) for k, s in enumerate(specs)}
        like2 = {k: jax.ShapeDtypeStruct((8, 8), dtype, sharding=shardings[k]) for k in values}
        name = np.dtype(dtype).name
        restored = bt.restore(f"{ckpt2}/{name}.{fmt}" if fmt == "npz" else f"{ckpt2}/{name}",
                              like2, max_inflight_bytes=100)
        placed, ref = bt.device_put(values, shardings), jax.device_put(values, shardings)
        for out in (restored, placed):
          for k, x in out.items():
            assert jax.typeof(x) == jax.typeof(ref[k]) and x.sharding == shardings[k], (k, name)
            assert len(x.addressable_shards) == 4
            if out is restored:  # copies: every device its own buffer
              pointers = {sh.data.unsafe_buffer_pointer() for sh in x.addressable_shards}
              assert len(pointers) == 4, (k, name)
            for sh in x.addressable_shards:
              assert sh.device.process_index == process_id
              assert np.asarray(sh.data).tobytes() == values[k][sh.index].tobytes(), (k, name)

    # Host values must agree across processes (as jax.device_put requires): one check per call.
    try:
      bt.device_put([np.full(8, process_id, np.int32)], rows)
    except AssertionError as err:
      assert ("jaxworks.batched_transfer.device_put: numpy values placed on shardings that "
              "span all processes must be equal on every process") in str(err), err
    else:
      raise SystemExit("differing host values were not detected")
    print("WORKER-OK", process_id, flush=True)
""")


def test_two_processes_place_a_global_tree(tmp_path):
  rng = np.random.default_rng(0)
  ckpt = str(tmp_path / "ckpt.npz")
  bt.save(
    ckpt,
    {
      "w": rng.standard_normal((16, 4)).astype(np.float32),
      "b": np.arange(8, dtype=np.int32),
      "r": np.ones((3, 3), np.float32),
    },
  )
  ckpt2 = str(tmp_path / "partly_replicated")
  os.makedirs(ckpt2)
  for dtype in (
    np.float32,
    jnp.bfloat16,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.int4,
    np.int8,
  ):
    values = {
      f"s{k}": (np.arange(64).reshape(8, 8) % 4 + k).astype(dtype)
      for k in range(9)
    }
    name = np.dtype(dtype).name
    bt.save(os.path.join(ckpt2, name + ".npz"), values)
    bt.save(os.path.join(ckpt2, name), values)
  env = dict(os.environ)
  env.update(
    JAX_PLATFORMS="cpu",
    XLA_FLAGS="--xla_force_host_platform_device_count=4",
    PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
  )
  port = str(free_port())
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", WORKER, str(i), port, ckpt, ckpt2],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=180)[0])
  finally:
    for p in procs:  # never leave a worker behind
      if p.poll() is None:
        p.kill()
        p.communicate()
  for i, (p, text) in enumerate(zip(procs, outputs)):
    assert p.returncode == 0 and f"WORKER-OK {i}" in text, (
      f"process {i}:\n{text[-4000:]}"
    )
