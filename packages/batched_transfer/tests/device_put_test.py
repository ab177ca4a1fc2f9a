"""device_put equals jax.device_put on a broad corpus, with one batched call per group."""

import threading

import jax
from jax.experimental.layout import Format
import jax.numpy as jnp
from jax.sharding import AbstractMesh
from jax.sharding import AxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding
import jaxworks_testing as jwt
import numpy as np
import pytest

from jaxworks import batched_transfer as bt

# Private imports below: JAX's batched put patched to count and fail.
from jaxworks.batched_transfer._src import jax_internals
from jaxworks.batched_transfer._src import transfer


def assert_same_as_stock(out, ref):
  assert jax.tree.structure(out) == jax.tree.structure(ref)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    assert type(a) is type(b)
    assert jax.typeof(a) == jax.typeof(
      b
    )  # shape, dtype, weak type, sharding in the type
    assert a.sharding == b.sharding
    assert a.committed == b.committed
    assert a.format == b.format
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def corpus(devices):
  return {
    "f32": np.arange(12, dtype=np.float32).reshape(4, 3),
    "f64": np.linspace(0, 1, 8),  # canonicalized to float32 without x64
    "i64": np.arange(4, dtype=np.int64),
    "bf16": np.arange(4, dtype=jnp.bfloat16),
    "bool": np.array([True, False, True, True]),
    "zero_d": np.array(3.5, np.float32),
    "empty": np.zeros((0, 4), np.float32),
    "strided": np.arange(32, dtype=np.float32).reshape(4, 8)[:, ::2],
    "fortran": np.asfortranarray(np.arange(8, dtype=np.int32).reshape(2, 4)),
    "scalars": [1, 2.5, True, 1 + 2j, np.float32(1.5), np.int16(3)],
    "uncommitted": jnp.arange(4.0),
    "committed": jax.device_put(
      np.ones((2, 2), np.float32), devices[3 % len(devices)]
    ),
    "weak": jnp.asarray(2.0),
    "none": None,
    "nested": ({"a": np.zeros(2, np.uint8)}, [np.ones(1, np.complex64)]),
  }


@pytest.fixture(scope="module")
def devices():
  return jax.devices()


def dev(devices, i):
  """The i-th device; with fewer devices (one TPU chip), one of those."""
  return devices[i % len(devices)]


@pytest.mark.parametrize(
  "make_target",
  [
    lambda d: None,
    lambda d: dev(d, 1),
    lambda d: SingleDeviceSharding(dev(d, 2)),
    lambda d: NamedSharding(
      jax.make_mesh((min(2, len(d)),), ("x",), devices=jwt.pick(d, 4, 5)), P()
    ),
    lambda d: SingleDeviceSharding(d[0], memory_kind="pinned_host"),
  ],
  ids=[
    "none",
    "device",
    "single_device_sharding",
    "named_replicated",
    "pinned_host",
  ],
)
def test_corpus_matches_jax_device_put(devices, make_target):
  target = make_target(devices)
  tree = corpus(devices)
  assert_same_as_stock(
    bt.device_put(tree, target), jax.device_put(tree, target)
  )


def test_corpus_matches_with_x64(devices):
  with jax.enable_x64(True):
    tree = corpus(devices)
    for target in (None, dev(devices, 1)):
      assert_same_as_stock(
        bt.device_put(tree, target), jax.device_put(tree, target)
      )


def test_sharded_arrays_match(devices):
  jwt.require_devices(8)
  mesh = jax.make_mesh((4, 2), ("a", "b"))
  target = NamedSharding(mesh, P("a", "b"))
  tree = [
    np.arange(32.0).reshape(8, 4),
    jax.device_put(np.ones((8, 4)), devices[6]),
    jax.device_put(
      np.ones((8, 4)), NamedSharding(mesh, P("a"))
    ),  # needs a reshard
    jax.device_put(
      np.ones((8, 4)),
      NamedSharding(
        jax.make_mesh((4, 2), ("a", "b"), devices=devices[::-1]), P("a", "b")
      ),
    ),  # other device order
    jnp.ones((8, 2)),
  ]
  assert_same_as_stock(
    bt.device_put(tree, target), jax.device_put(tree, target)
  )


def test_prefix_tree_targets(devices):
  tree = {"a": [np.ones(2), np.zeros(3)], "b": (jnp.ones(4), 2.0), "c": None}
  target = {
    "a": dev(devices, 1),
    "b": (SingleDeviceSharding(dev(devices, 2)), None),
    "c": None,
  }
  assert_same_as_stock(
    bt.device_put(tree, target), jax.device_put(tree, target)
  )


def test_empty_and_leafless_trees(devices):
  for tree in ([], {}, None, {"a": None, "b": []}):
    d = dev(devices, 1)
    assert bt.device_put(tree, d) == jax.device_put(tree, d)


def test_partition_spec_and_memory_space_targets_go_to_jax(devices):
  jwt.require_devices(8)
  mesh = jax.make_mesh((2, 4), ("a", "b"))
  tree = [np.ones((4, 4)), jnp.zeros((2, 4))]
  with jax.set_mesh(mesh):
    assert_same_as_stock(
      bt.device_put(tree, P("a")), jax.device_put(tree, P("a"))
    )
  host = jax.memory.Space.Host
  assert_same_as_stock(bt.device_put(tree, host), jax.device_put(tree, host))


def test_one_batched_call_per_group(devices, monkeypatch):
  jwt.require_devices(3)  # arrays on two devices, moved to a third
  calls = {"copy": 0, "host": 0, "jax": 0}
  real_copy, real_put, real_jax = (
    jax_internals.batched_copy,
    jax_internals.batched_device_put,
    transfer._put_with_jax,
  )

  def copy(*args):
    calls["copy"] += 1
    return real_copy(*args)

  def put(*args):
    calls["host"] += 1
    return real_put(*args)

  def delegated(*args):
    calls["jax"] += 1
    return real_jax(*args)

  monkeypatch.setattr(jax_internals, "batched_copy", copy)
  monkeypatch.setattr(jax_internals, "batched_device_put", put)
  monkeypatch.setattr(transfer, "_put_with_jax", delegated)
  on0 = [
    jax.device_put(np.full(3, k, np.float32), devices[0]) for k in range(50)
  ]
  on2 = [
    jax.device_put(np.full(3, k, np.float32), devices[2]) for k in range(50)
  ]
  host = [np.full(3, k, np.float32) for k in range(50)]
  tree = {"on0": on0, "on2": on2, "host": host, "scalars": [1.0, 2.0]}
  out = bt.device_put(tree, devices[1])
  # Two device groups (from 0, from 2): two batched copies; one host put per array (jaxlib
  # has no many-arrays host-to-device call); one jax.device_put for the scalar group.
  assert calls == {"copy": 2, "host": 50, "jax": 1}
  assert_same_as_stock(out, jax.device_put(tree, devices[1]))


def test_already_placed_arrays_are_returned_as_is(devices):
  x = jax.device_put(np.ones(3), dev(devices, 1))
  y = jnp.ones(3)  # uncommitted
  out = bt.device_put({"x": x, "y": y}, {"x": dev(devices, 1), "y": None})
  assert out["x"] is x and out["y"] is y
  z = bt.device_put(
    y, devices[0]
  )  # same device, now committed: shares the buffer
  assert z.committed and not y.committed
  assert z.unsafe_buffer_pointer() == y.unsafe_buffer_pointer()


def test_may_alias_false_copies(devices):
  x = jax.device_put(np.ones(3), dev(devices, 1))
  for target in (None, dev(devices, 1)):
    y = bt.device_put(x, target, may_alias=False)
    assert y is not x and y.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
    ref = jax.device_put(x, target, may_alias=False)
    assert_same_as_stock(y, ref)


def test_donation_matches_stock(devices):
  def fresh():
    return [
      jax.device_put(np.arange(4.0), devices[0]),
      np.arange(3.0),
      jnp.ones(2),
    ]

  for target in (
    devices[0],
    dev(devices, 1),
    SingleDeviceSharding(devices[0]),
  ):
    mine, theirs = fresh(), fresh()
    out = bt.device_put(mine, target, donate=True)
    ref = jax.device_put(theirs, target, donate=True)
    assert_same_as_stock(out, ref)
    assert [getattr(x, "is_deleted", lambda: False)() for x in mine] == [
      getattr(x, "is_deleted", lambda: False)() for x in theirs
    ]


def test_cross_device_donation_to_a_sharding_leaves_the_input_usable(devices):
  jwt.require_devices(2)
  # jax.device_put(x, SingleDeviceSharding(other), donate=True) in jaxlib 0.10.2 (CPU) leaves
  # x in a state that crashes on x.is_deleted(); here donation is best effort: a plain copy.
  x = jax.device_put(np.arange(4.0), devices[0])
  y = bt.device_put(x, SingleDeviceSharding(devices[1]), donate=True)
  assert not x.is_deleted()
  np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert y.devices() == {devices[1]}


def test_per_leaf_donate_and_may_alias(devices):
  x = jax.device_put(np.ones(2), devices[0])
  out = bt.device_put([x, x], devices[0], may_alias=[True, False])
  assert (
    out[0] is x and out[1].unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
  )


def test_under_jit_and_grad_it_is_jax_device_put(devices):
  f = jax.jit(lambda a: bt.device_put(a, devices[0]) * 2)
  np.testing.assert_array_equal(f(np.ones(3)), 2 * np.ones(3))
  g = jax.grad(lambda a: (bt.device_put(a, devices[0]) ** 2).sum())
  np.testing.assert_array_equal(g(np.ones(3)), 2 * np.ones(3))


def test_transfer_guard_sees_explicit_transfers(devices):
  with jax.transfer_guard("disallow"):
    out = bt.device_put(
      [np.ones(2), jax.device_put(np.ones(2), devices[0])], dev(devices, 1)
    )
  assert [x.devices() for x in out] == [{dev(devices, 1)}] * 2
  with jax.transfer_guard("disallow_explicit"):
    with pytest.raises(Exception, match="[Dd]isallowed"):
      bt.device_put(np.ones(2), dev(devices, 1))


def _large_leaves(devices):
  """Host leaves of PARALLEL_PUT_BYTES and more (put from the put pool),
  with a small one between them, onto one device and a sharding."""
  n = transfer.PARALLEL_PUT_BYTES // 4
  rng = np.random.default_rng(0)
  sharded = (
    NamedSharding(jwt.mesh((len(devices),), ("x",)), P("x"))
    if len(devices) > 1
    else devices[0]
  )
  leaves = [
    rng.random(n, dtype=np.float32),
    np.arange(3, dtype=np.int32),
    rng.random(n + 8, dtype=np.float32),
    rng.integers(0, 9, (len(devices) * 8, n // 8), dtype=np.int32),
  ]
  targets = [dev(devices, 1), dev(devices, 1), devices[0], sharded]
  return leaves, targets


def test_large_host_leaves_are_put_from_the_pool(devices, monkeypatch):
  leaves, targets = _large_leaves(devices)
  put = jax_internals.batched_device_put
  threads = []

  def spy(*args):
    threads.append(threading.current_thread().name)
    return put(*args)

  monkeypatch.setattr(jax_internals, "batched_device_put", spy)
  out = bt.device_put(leaves, targets)
  monkeypatch.undo()
  assert_same_as_stock(out, jax.device_put(leaves, targets))
  pooled = [t for t in threads if t.startswith("jaxworks-device-put")]
  assert len(pooled) == 3 and len(threads) == 4, threads
  # One large leaf alone is put on the calling thread.
  threads.clear()
  monkeypatch.setattr(jax_internals, "batched_device_put", spy)
  bt.device_put(leaves[:2], targets[:2])
  assert threads == [threading.current_thread().name] * 2


def test_large_host_leaves_keep_the_callers_transfer_guard(devices):
  leaves, targets = _large_leaves(devices)
  with jax.transfer_guard("disallow"):  # explicit: allowed on every thread
    out = bt.device_put(leaves, targets)
  assert_same_as_stock(out, jax.device_put(leaves, targets))
  with jax.transfer_guard("disallow_explicit"):
    with pytest.raises(Exception, match="[Dd]isallowed"):
      bt.device_put(leaves, targets)
  with jax.transfer_guard_host_to_device("disallow_explicit"):
    with pytest.raises(Exception, match="[Dd]isallowed"):
      bt.device_put([leaves[0], leaves[2]], dev(devices, 1))
  # The pool's threads keep no level of the call they served.
  bt.device_put([leaves[0], leaves[2]], dev(devices, 1))


def test_deleted_input_raises_like_stock(devices):
  x = jax.device_put(np.ones(2), devices[0])
  x.delete()
  with pytest.raises(RuntimeError, match="deleted"):
    bt.device_put(x, dev(devices, 1))


@pytest.mark.parametrize(
  "kwargs, text",
  [
    (dict(device="cpu:0"), "target must be None, a jax.Device"),
    (dict(device=3), "target must be None, a jax.Device"),
    (dict(device=[None]), "target must be a pytree prefix of the value"),
    (dict(src=[None]), "src must be a pytree prefix of the value"),
    (dict(donate=True, may_alias=True), "may_alias=True and donate=True"),
    (
      dict(
        donate={"a": True, "b": [True, False]}, may_alias={"a": True, "b": None}
      ),
      "for the leaf at ['a']",
    ),
    (
      dict(device=Format(jax.experimental.layout.Layout.AUTO)),
      "needs a concrete sharding",
    ),
    (
      dict(
        device=NamedSharding(
          AbstractMesh((8,), ("x",), axis_types=(AxisType.Explicit,)), P()
        )
      ),
      "is over an AbstractMesh",
    ),
  ],
)
def test_bad_arguments_raise_stocks_class_and_name_the_api(kwargs, text):
  tree = {"a": np.ones(2), "b": [np.ones(2), np.ones(2)]}
  with pytest.raises(Exception) as theirs:
    jax.device_put(tree, **kwargs)
  with pytest.raises(Exception) as info:
    bt.device_put(tree, **kwargs)
  assert isinstance(
    info.value, type(theirs.value)
  )  # stock's class (or a subclass)
  assert "jaxworks.batched_transfer.device_put" in str(info.value)
  assert text in str(info.value)
  # Stock's own words follow (code may match them, as JAX's own tests do).
  assert str(theirs.value) in str(info.value)


@pytest.mark.parametrize(
  "kwargs",
  [
    dict(donate=1),
    dict(may_alias="yes"),
    dict(donate=0, may_alias=0),
    dict(src="anything"),
    dict(donate=[1, 0], may_alias=None),
  ],
)
def test_flags_and_src_are_read_as_stock_reads_them(devices, kwargs):
  # jax.device_put reads donate/may_alias by truth value and ignores src eagerly.
  def fresh():
    return [
      jax.device_put(np.arange(3.0), devices[0]),
      jax.device_put(np.ones(2), devices[0]),
    ]

  def shares(outs, ins):  # whether each result reuses its input's buffer
    return [
      not x.is_deleted()
      and y.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
      for y, x in zip(outs, ins)
    ]

  mine, theirs = fresh(), fresh()
  out = bt.device_put(mine, devices[0], **kwargs)
  ref = jax.device_put(theirs, devices[0], **kwargs)
  assert_same_as_stock(out, ref)
  assert [x.is_deleted() for x in mine] == [x.is_deleted() for x in theirs]
  assert shares(out, mine) == shares(ref, theirs)


def test_empty_tree_with_conflicting_flags_is_accepted_like_stock():
  for kwargs in (
    dict(donate=True, may_alias=True),
    dict(device="cpu:0"),
    dict(device=Format(jax.experimental.layout.Layout.AUTO)),
  ):
    assert jax.device_put([], **kwargs) == []
    assert bt.device_put([], **kwargs) == []
  for f in (
    jax.device_put,
    bt.device_put,
  ):  # the prefix structure is still checked
    with pytest.raises(ValueError):
      f([], [None])


def test_several_errors_raise_what_stock_raises_first(devices):
  jwt.require_devices(8)
  mesh = jax.make_mesh((8,), ("x",))
  rows = NamedSharding(mesh, P("x"))
  cases = [
    (
      [np.ones(8), np.arange(3, dtype=">i2")],
      "cpu:0",
    ),  # a bad leaf before a bad target
    ([np.ones(6), "abc"], rows),  # a bad leaf before an unsplittable shape
    ([np.ones(6), 1.0], [rows, rows]),  # leaf order, not group order
    ([1.0, np.ones(6)], [rows, rows]),
    ([jax.device_put(np.ones(6), devices[1]), np.ones(8), np.float32(2)], rows),
  ]
  for tree, target in cases:
    with pytest.raises(Exception) as theirs:
      jax.device_put(tree, target)
    with pytest.raises(Exception) as mine:
      bt.device_put(tree, target)
    assert isinstance(mine.value, type(theirs.value)), (
      tree,
      mine.value,
      theirs.value,
    )
    assert "jaxworks.batched_transfer.device_put" in str(mine.value)


def test_a_spec_longer_than_the_rank_is_stocks_class():
  # jax.device_put fails on an internal assertion; this package's error is an
  # AssertionError too (and a ValueError, like its other placement errors).
  n = len(jax.devices())  # 8 on the CPU target
  s = NamedSharding(jax.make_mesh((n,), ("x",)), P(None, "x"))
  for x in (np.ones(8), 2.0, jnp.ones(())):
    with pytest.raises(AssertionError):
      jax.device_put(x, s)
    with pytest.raises(AssertionError) as info:
      bt.device_put(x, s)
    assert isinstance(
      info.value, ValueError
    ) and "shards more than the leaf's" in str(info.value)


def test_unsplittable_shape_names_the_tree_path(devices):
  jwt.require_devices(8)  # a shape of 6 does not split 8 ways
  mesh = jax.make_mesh((8,), ("x",))
  tree = {"ok": np.ones(8), "params": {"w": np.ones(6)}}
  with pytest.raises(
    ValueError, match=r"\['params'\]\['w'\] with shape \(6,\)"
  ):
    bt.device_put(tree, NamedSharding(mesh, P("x")))
  moved = {"w": jax.device_put(np.ones(6), devices[0])}
  with pytest.raises(ValueError, match=r"\['w'\] with shape \(6,\)"):
    bt.device_put(moved, NamedSharding(mesh, P("x")))


def test_unsupported_host_values_get_jax_errors(devices):
  for bad in (np.array(["a", "b"], dtype=object), np.ma.masked_array([1.0])):
    with pytest.raises(Exception) as mine:
      bt.device_put([bad], devices[0])
    with pytest.raises(Exception) as theirs:
      jax.device_put([bad], devices[0])
    assert type(mine.value) is type(theirs.value)


def test_default_device_context_is_honoured(devices):
  tree = [np.ones(3), 2.0, jnp.ones(2)]
  with jax.default_device(dev(devices, 5)):
    out, ref = bt.device_put(tree), jax.device_put(tree)
  assert_same_as_stock(out, ref)
  assert out[0].devices() == {dev(devices, 5)} and not out[0].committed


def test_prng_keys_take_the_jax_route(devices):
  keys = {
    "k": jax.random.key(0),
    "split": jax.random.split(jax.random.key(1), 4),
  }
  out = bt.device_put(keys, dev(devices, 2))
  ref = jax.device_put(keys, dev(devices, 2))
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    assert jax.typeof(a) == jax.typeof(b) and a.sharding == b.sharding
    np.testing.assert_array_equal(
      jax.random.key_data(a), jax.random.key_data(b)
    )
  assert bt.plan(keys, dev(devices, 2)).groups[0].route == "jax.device_put"
