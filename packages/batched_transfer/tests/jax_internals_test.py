"""Every private JAX name in _src/jax_internals.py, checked against JAX 0.10.2's behaviour."""

import gc
import math
import threading
import weakref

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding
import jaxworks_testing as jwt
import numpy as np
import pytest

# Private imports below: its bindings to JAX's internals are the subject.
from jaxworks.batched_transfer._src import jax_internals as ji


def test_device_list_is_ordered_and_hashable():
  shape = jwt.fit((4, 2))  # (4, 2) on 8 devices, (1, 1) on one chip
  mesh = jax.make_mesh(
    shape, ("a", "b"), devices=jax.devices()[::-1][: math.prod(shape)]
  )
  s = NamedSharding(mesh, P("a"))
  dl = ji.device_list(s)
  assert list(dl) == list(mesh.devices.flat)
  assert hash(dl) == hash(ji.device_list(NamedSharding(mesh, P())))
  assert ji.DEVICE_LIST_ATTR == "_internal_device_list"


def test_attribute_names_read_what_the_public_properties_return():
  mesh = jwt.mesh_fit((4, 2), ("a", "b"))
  shardings = [
    SingleDeviceSharding(jwt.device(1)),
    SingleDeviceSharding(jwt.device(2), memory_kind="pinned_host"),
    NamedSharding(mesh, P("a")),
    NamedSharding(mesh, P(), memory_kind="unpinned_host"),
  ]
  for s in shardings:
    assert getattr(s, ji.MEMORY_KIND_ATTR) == s.memory_kind
    x = jax.device_put(np.ones((8, 2), np.float32), s)
    assert getattr(x, ji.SHARDING_ATTR) is x.sharding
    assert getattr(x, ji.ABSTRACT_VALUE_ATTR) == jax.typeof(x)
  # The C++ grouping reads these through the property getters when they are plain
  # properties (a third faster per leaf); other descriptors still work, only slower.
  for owner, name in [
    (ji.ArrayImpl, ji.SHARDING_ATTR),
    (ji.ArrayImpl, ji.ABSTRACT_VALUE_ATTR),
    (SingleDeviceSharding, ji.DEVICE_LIST_ATTR),
    (NamedSharding, ji.MEMORY_KIND_ATTR),
  ]:
    assert type(getattr(owner, name)) is property, (owner, name)


def test_array_impl_and_shaped_array():
  assert type(jnp.ones(2)) is ji.ArrayImpl
  assert ji.ShapedArray((2, 3), np.float32) == jax.typeof(
    jnp.ones((2, 3), np.float32)
  )


def test_copy_semantics_members():
  names = {"REUSE_INPUT", "ALWAYS_COPY", "DONATE_INPUT"}
  assert names <= set(dir(ji.ArrayCopySemantics))


def test_batched_device_put_places_shards():
  mesh = jwt.mesh_fit((8,), ("x",))
  s = NamedSharding(mesh, P("x"))
  x = np.arange(16, dtype=np.float32)
  index = s.addressable_devices_indices_map(x.shape)
  aval = ji.device_put_aval(ji.ShapedArray(x.shape, x.dtype), s)
  y = ji.batched_device_put(
    aval, s, [x[i] for i in index.values()], list(index), True
  )
  assert y.sharding == s and y.committed
  np.testing.assert_array_equal(np.asarray(y), x)
  assert jax.typeof(y) == jax.typeof(jax.device_put(x, s))


def test_batched_copy_keeps_committedness():
  s = SingleDeviceSharding(jwt.device(1))
  committed = jax.device_put(np.ones(2), jwt.device(0))
  uncommitted = jnp.ones(2)
  out = ji.batched_copy(
    [committed, uncommitted],
    [ji.device_list(s)] * 2,
    [s, s],
    [ji.ArrayCopySemantics.REUSE_INPUT] * 2,
  )
  assert [y.devices() for y in out] == [{jwt.device(1)}] * 2
  # The result keeps the input's committedness (device_put re-wraps it as committed).
  assert [y.committed for y in out] == [True, False]


def test_committed_array_shares_the_buffer():
  x = jnp.ones(3)
  s = SingleDeviceSharding(jwt.device(0))
  y = ji.committed_array(x, jax.typeof(x), s)
  assert y.committed and not x.committed
  assert y.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
  # With committed=False and a weak aval: what restore uses for weakly typed target leaves.
  z = ji.committed_array(
    x, jax.typeof(x).update(weak_type=True), s, committed=False
  )
  assert jax.typeof(z) == jax.typeof(jax.device_put(1.0)).update(shape=(3,))
  assert (
    not z.committed and z.unsafe_buffer_pointer() == x.unsafe_buffer_pointer()
  )


def test_explicit_device_put_scope_satisfies_the_transfer_guard():
  s = SingleDeviceSharding(jwt.device(1))
  x = np.ones(2, np.float32)
  aval = ji.ShapedArray(x.shape, x.dtype)
  with jax.transfer_guard("disallow"):
    with pytest.raises(Exception, match="[Dd]isallowed"):
      ji.batched_device_put(aval, s, [x], [jwt.device(1)], True)
    with ji.explicit_device_put_scope():
      ji.batched_device_put(aval, s, [x], [jwt.device(1)], True)


def test_host_to_device_guard_carries_a_level_to_another_thread():
  s = SingleDeviceSharding(jwt.device(1))
  x = np.ones(2, np.float32)
  aval = ji.ShapedArray(x.shape, x.dtype)
  assert ji.host_to_device_guard() is None
  with jax.transfer_guard_host_to_device("disallow_explicit"):
    level = ji.host_to_device_guard()
  assert level is not None
  errors = []

  def worker():
    try:
      with ji.guarded_as(level):
        ji.batched_device_put(aval, s, [x], [jwt.device(1)], True)
    except Exception as err:  # the caller's level, on this thread
      errors.append(err)
    # Afterwards this thread's own level is back (none: allowed).
    ji.batched_device_put(aval, s, [x], [jwt.device(1)], True)

  t = threading.Thread(target=worker)
  t.start()
  t.join()
  assert len(errors) == 1 and "isallowed" in str(errors[0])


def test_trace_state_clean():
  assert ji.trace_state_clean()
  seen = []
  jax.jit(lambda a: seen.append(ji.trace_state_clean()) or a)(1.0)
  assert seen == [False]


def test_enable_x64_follows_the_context():
  before = ji.enable_x64()
  with jax.enable_x64(not before):
    assert ji.enable_x64() is (not before)
  assert ji.enable_x64() is before


def test_default_device_follows_jax_default_device():
  assert ji.default_device() == jwt.device(0)
  with jax.default_device(jwt.device(3)):
    assert ji.default_device() == jwt.device(3)


def test_device_put_aval_carries_the_named_sharding():
  mesh = jwt.mesh_fit((8,), ("x",))
  aval = ji.device_put_aval(
    ji.ShapedArray((8,), np.float32), NamedSharding(mesh, P("x"))
  )
  assert aval.sharding.spec == P("x")
  single = ji.device_put_aval(
    ji.ShapedArray((8,), np.float32), SingleDeviceSharding(jwt.device(0))
  )
  assert single == ji.ShapedArray((8,), np.float32)


def test_default_layout_is_what_placement_gives():
  d = jwt.device(2)
  x = jax.device_put(np.ones((3, 4), np.float32), d)
  assert ji.default_layout(np.dtype(np.float32), (3, 4), d) == x.format.layout


def test_stock_callables_are_jaxs_own():
  # Bound at import from where JAX defines them; unswapped, they are the public names.
  assert jax_internals_is_stock(
    ji.stock_device_put, jax.device_put, "device_put"
  )
  assert jax_internals_is_stock(ji.stock_jit, jax.jit, "jit")


def jax_internals_is_stock(bound, public, name):
  return (
    bound is public
    and bound.__module__ == "jax._src.api"
    and bound.__name__ == name
  )


def test_release_dropped_host_buffers_frees_aliased_numpy_memory():
  jwt.skip_on_accelerator("only a CPU array aliases numpy memory")
  was_enabled = gc.isenabled()
  gc.disable()  # Python's gc would release it too (jaxlib's gc callback)
  try:
    raw = np.ones(2**16 + 16, np.float32)
    start = (-raw.ctypes.data % 64) // 4  # aligned: the CPU runtime aliases it
    host = raw[start : start + 2**16]
    alive = weakref.ref(raw)
    y = jax.device_put(host, jwt.device(0))
    assert y.unsafe_buffer_pointer() == host.ctypes.data
    jax.block_until_ready(y)
    del raw, host, y
    assert alive() is not None  # jaxlib still holds the numpy memory
    ji.release_dropped_host_buffers()
    assert alive() is None
  finally:
    if was_enabled:
      gc.enable()


def test_distributed_client_is_none_before_initialize():
  # One process, jax.distributed not initialized; the two-process use (key-value
  # store, barriers) is covered by multiprocess_save_test.
  assert ji.distributed_client() is None
  assert hasattr(ji._distributed.global_state, "client")
  for name in (
    "key_value_set",
    "blocking_key_value_get",
    "wait_at_barrier",
    "key_value_dir_get",
    "key_value_increment",
    "key_value_delete",
  ):
    assert hasattr(ji._jax.DistributedRuntimeClient, name), name


def test_device_keys_name_the_one_device_of_the_device_list():
  # DEVICE_KEYS: two shardings of such a type whose attribute is the same
  # device object have equal device lists, whatever their memory kinds.
  for typ, attr in ji.DEVICE_KEYS.items():
    for d in jax.devices()[:3]:
      a, b = typ(d), typ(d, memory_kind="pinned_host")
      assert getattr(a, attr) is getattr(b, attr) is d
      assert ji.device_list(a) == ji.device_list(b)
      assert list(ji.device_list(a)) == [d]
