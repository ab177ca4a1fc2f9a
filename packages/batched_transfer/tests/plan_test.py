"""plan(tree, target): the groups, bytes, copies and zero-copy leaves, without moving anything."""

import jax
from jax.experimental.layout import Format
from jax.experimental.layout import Layout
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding
import jaxworks_testing as jwt
import numpy as np
import pytest

from jaxworks import batched_transfer as bt

# Private imports below: transfers patched to raise: plan must make none.
from jaxworks.batched_transfer._src import jax_internals
from jaxworks.batched_transfer._src import transfer


@pytest.fixture(scope="module")
def devices():
  return jax.devices()


def test_plan_describes_every_group(devices):
  jwt.require_devices(2)  # device ids 0 and 1 in the table
  on0 = jax.device_put(np.ones(4, np.float32), devices[0])
  on1 = jax.device_put(np.ones(8, np.float32), devices[1])
  tree = {
    "host": [np.zeros(4, np.float32), np.zeros(2, np.int8)],
    "on0": on0,
    "on1": on1,
    "scalar": 2.0,
  }
  p = bt.plan(tree, devices[1])
  assert [
    (
      g.kind,
      g.route,
      g.src_devices,
      g.dst_devices,
      g.paths,
      g.nbytes,
      g.zero_copy,
    )
    for g in p.groups
  ] == [
    (
      "numpy",
      "host->device",
      None,
      (1,),
      ("['host'][0]", "['host'][1]"),
      18,
      0,
    ),
    ("jax.Array", "batched copy", (0,), (1,), ("['on0']",), 16, 0),
    ("jax.Array", "already in place", (1,), (1,), ("['on1']",), 32, 1),
    ("scalar", "jax.device_put", None, (1,), ("['scalar']",), 4, 0),
  ]
  assert (p.num_leaves, p.nbytes, p.copies, p.zero_copy) == (5, 70, 4, 1)
  assert all(g.dst_memory_kind == "device" for g in p.groups)


def test_str_is_a_readable_table(devices):
  mesh = jwt.mesh((8,), ("x",))  # the table names 8 devices
  p = bt.plan(
    {"w": np.zeros((8, 128), np.float32), "b": jnp.zeros(8)},
    NamedSharding(mesh, P("x")),
  )
  assert str(p) == "\n".join(
    [
      "TransferPlan: 2 leaves in 2 groups, 4.0 KiB; 2 copied, 0 zero-copy",
      "  #  kind       route           leaves    bytes  zero-copy  relayout  from -> to",
      "  0  jax.Array  jax.device_put       1     32 B          0         0  [0] device -> [0-7] device",
      "  1  numpy      host->device         1  4.0 KiB          0         0  host -> [0-7] device",
    ]
  )


def test_zero_copy_rules(devices):
  jwt.require_devices(3)  # x on device 2, u on device 0: two groups
  x = jax.device_put(np.ones(3), devices[2])
  u = jnp.ones(3)  # uncommitted on device 0
  p = bt.plan([x, u, x], [None, devices[0], devices[2]])
  # x with no target: as is; u to its own device: batched copy sharing the buffer; x again.
  assert [(g.route, g.zero_copy, g.copies) for g in p.groups] == [
    ("already in place", 2, 0),
    ("batched copy", 1, 0),
  ]
  p = bt.plan([x], devices[2], may_alias=False)
  assert [(g.route, g.zero_copy, g.copies) for g in p.groups] == [
    ("batched copy", 0, 1)
  ]


def _forbid_transfers(monkeypatch):
  """Makes every way the package (or stock JAX) can move data raise; returns the calls seen.

  jax.transfer_guard("disallow") allows explicit transfers (device_put is one), so it cannot
  tell whether plan moved anything; these counters can.
  """
  calls = []

  def forbidden(name):
    def call(*args, **kwargs):
      calls.append(name)
      raise AssertionError(f"plan called {name}")

    return call

  for name in (
    "batched_device_put",
    "batched_copy",
    "stock_device_put",
    "stock_jit",
    "committed_array",
  ):
    monkeypatch.setattr(jax_internals, name, forbidden(name))
  monkeypatch.setattr(jax, "device_put", forbidden("jax.device_put"))
  monkeypatch.setattr(jax, "jit", forbidden("jax.jit"))
  monkeypatch.setattr(transfer, "execute", forbidden("transfer.execute"))
  return calls


def test_plan_moves_nothing(devices, monkeypatch):
  mesh = jwt.mesh((4, 2), ("a", "b"))  # 5 copies: each leaf moves
  on0 = jax.device_put(np.ones((8, 2)), devices[0])
  tree = [
    np.ones(3),
    on0,
    2.0,
    np.ones((8, 2), np.float32),
    jax.device_put(np.ones((8, 2)), NamedSharding(mesh, P("a"))),
  ]
  targets = [
    SingleDeviceSharding(devices[4]),
    devices[4],
    None,
    NamedSharding(mesh, P("b")),
    Format(Layout((0, 1)), NamedSharding(mesh, P("a", "b"))),
  ]
  pointers = [
    x.unsafe_buffer_pointer()
    if isinstance(x, jax.Array) and len(x.devices()) == 1
    else None
    for x in tree
  ]
  live = len(jax.live_arrays())
  calls = _forbid_transfers(monkeypatch)
  with jax.transfer_guard("disallow"):
    p = bt.plan(tree, targets)
  assert calls == []
  assert p.num_leaves == 5 and p.copies == 5
  assert len(jax.live_arrays()) == live  # no array was made
  assert on0.devices() == {devices[0]} and not on0.is_deleted()
  assert [
    x.unsafe_buffer_pointer()
    if isinstance(x, jax.Array) and len(x.devices()) == 1
    else None
    for x in tree
  ] == pointers


def test_the_transfer_counters_see_a_device_put(devices, monkeypatch):
  # The check above can fail: the same counters catch a device_put.
  calls = _forbid_transfers(monkeypatch)
  with pytest.raises(AssertionError, match="called"):
    bt.device_put([np.ones(3), jax.numpy.ones(2)], jwt.device(4))
  assert calls


def test_plan_matches_what_device_put_does(devices):
  tree = [np.ones(2), jax.device_put(np.ones(2), devices[0]), 3]
  p = bt.plan(tree, devices[0])
  out = bt.device_put(tree, devices[0])
  assert out[1] is tree[1]  # the planned zero-copy leaf
  assert [g.route for g in p.groups] == [
    "host->device",
    "already in place",
    "jax.device_put",
  ]


def test_plan_rejects_mesh_dependent_targets():
  with pytest.raises(
    ValueError, match="jaxworks.batched_transfer.plan: PartitionSpec"
  ):
    bt.plan([np.ones(2)], P())
