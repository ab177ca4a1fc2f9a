"""plan(tree, target): the groups, bytes, copies and zero-copy leaves, without moving anything."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jaxworks import batched_transfer as bt


@pytest.fixture(scope="module")
def devices():
  return jax.devices()


def test_plan_describes_every_group(devices):
  on0 = jax.device_put(np.ones(4, np.float32), devices[0])
  on1 = jax.device_put(np.ones(8, np.float32), devices[1])
  tree = {"host": [np.zeros(4, np.float32), np.zeros(2, np.int8)], "on0": on0, "on1": on1,
          "scalar": 2.0}
  p = bt.plan(tree, devices[1])
  assert [(g.kind, g.route, g.src_devices, g.dst_devices, g.paths, g.nbytes, g.zero_copy)
          for g in p.groups] == [
              ("numpy", "host->device", None, (1,), ("['host'][0]", "['host'][1]"), 18, 0),
              ("jax.Array", "batched copy", (0,), (1,), ("['on0']",), 16, 0),
              ("jax.Array", "already in place", (1,), (1,), ("['on1']",), 32, 1),
              ("scalar", "jax.device_put", None, (1,), ("['scalar']",), 4, 0),
          ]
  assert (p.num_leaves, p.nbytes, p.copies, p.zero_copy) == (5, 70, 4, 1)
  assert all(g.dst_memory_kind == "device" for g in p.groups)


def test_str_is_a_readable_table(devices):
  mesh = jax.make_mesh((8,), ("x",))
  p = bt.plan({"w": np.zeros((8, 128), np.float32), "b": jnp.zeros(8)},
              NamedSharding(mesh, P("x")))
  assert str(p) == "\n".join([
      "TransferPlan: 2 leaves in 2 groups, 4.0 KiB; 2 copied, 0 zero-copy",
      "  #  kind       route           leaves    bytes  zero-copy  relayout  from -> to",
      "  0  jax.Array  jax.device_put       1     32 B          0         0  [0] device -> [0-7] device",
      "  1  numpy      host->device         1  4.0 KiB          0         0  host -> [0-7] device",
  ])


def test_zero_copy_rules(devices):
  x = jax.device_put(np.ones(3), devices[2])
  u = jnp.ones(3)  # uncommitted on device 0
  p = bt.plan([x, u, x], [None, devices[0], devices[2]])
  # x with no target: as is; u to its own device: batched copy sharing the buffer; x again.
  assert [(g.route, g.zero_copy, g.copies) for g in p.groups] == [
      ("already in place", 2, 0), ("batched copy", 1, 0)]
  p = bt.plan([x], devices[2], may_alias=False)
  assert [(g.route, g.zero_copy, g.copies) for g in p.groups] == [("batched copy", 0, 1)]


def test_plan_moves_nothing(devices):
  tree = [np.ones(3), jax.device_put(np.ones(3), devices[0])]
  with jax.transfer_guard("disallow"):  # no transfer of any kind, explicit or not
    p = bt.plan(tree, SingleDeviceSharding(devices[4]))
  assert p.num_leaves == 2
  assert tree[1].devices() == {devices[0]}


def test_plan_matches_what_device_put_does(devices):
  tree = [np.ones(2), jax.device_put(np.ones(2), devices[0]), 3]
  p = bt.plan(tree, devices[0])
  out = bt.device_put(tree, devices[0])
  assert out[1] is tree[1]  # the planned zero-copy leaf
  assert [g.route for g in p.groups] == ["host->device", "already in place", "jax.device_put"]


def test_plan_rejects_mesh_dependent_targets():
  with pytest.raises(ValueError, match="jaxworks.batched_transfer.plan: PartitionSpec"):
    bt.plan([np.ones(2)], P())
