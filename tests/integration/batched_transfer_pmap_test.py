"""jaxworks.batched_transfer feeding jaxworks.pmap_chunked: placed inputs go in without a copy.

The proof of "no copy on the way in" is buffer identity through donation: a donated input that the pmap took as
it is comes back as the output's buffer; had the pmap moved it first, the output would live in the moved copy.
Each program donates one input to one output of its shape (which XLA aliases reliably; with several donated
inputs XLA:CPU's buffer assignment decides which outputs alias, for stock jax.pmap alike), and buffers are
8 x 4 KiB (XLA:CPU does not alias tiny ones). On CPU a host array whose memory happens to be suitably aligned is
placed zero-copy (the device buffer *is* the numpy memory, for jax.device_put alike), and such a buffer cannot be
donated; host data here therefore starts 4 bytes into an allocation, so every placed buffer belongs to XLA.
Results are compared with stock jax.pmap.
"""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jaxworks_testing as jwt
import numpy as np
import pytest

from jaxworks import batched_transfer as bt
from jaxworks import pmap_chunked

# Every device present: 8 host devices on the CPU target, one TPU chip.
N = jax.device_count()
COLS = 1024


@pytest.fixture(scope="module")
def rows():
  mesh = Mesh(np.array(jax.devices()[:N]), ("i",), axis_types=(AxisType.Auto,))
  return NamedSharding(mesh, P("i"))


def _pointers(x):
  return [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]


def _data(seed=0, cols=COLS):
  """Random float32 host data that cannot be placed zero-copy (its address is not 16-byte aligned)."""
  values = np.random.default_rng(seed).normal(size=(N, cols)).astype(np.float32)
  raw = np.empty(values.nbytes + 4, np.uint8)
  out = raw[4:].view(np.float32).reshape(values.shape)
  out[...] = values
  assert out.ctypes.data % 16 != 0
  return out


def _step(v):
  return v * 2.0 - jax.lax.pmean(v, "i")


def _stock(x):
  return jax.pmap(_step, "i")(x)


def test_device_put_then_donated_pmap_reuses_the_placed_buffers(rows):
  host = _data()
  x = bt.device_put(host, rows)
  assert bt.plan(x, rows).zero_copy == 1  # already where the pmap wants it
  before = _pointers(x)
  out = pmap_chunked.pmap(_step, "i", donate_argnums=0)(x)
  assert x.is_deleted()
  assert (
    _pointers(out) == before
  )  # no copy on the way in, the output is the input's memory
  np.testing.assert_allclose(out, _stock(host), rtol=1e-6)


def test_misplaced_input_is_moved_then_donated(rows):
  jwt.require_devices(2)  # an input on one device of several
  host = _data(1)
  x = bt.device_put(
    host, jax.devices()[0]
  )  # on one device: the pmap must move it
  plan = bt.plan(x, rows)
  assert plan.copies == 1 and plan.zero_copy == 0
  before = _pointers(x)
  out = pmap_chunked.pmap(_step, "i", donate_argnums=0)(x)
  assert set(_pointers(out)).isdisjoint(
    before
  )  # the output lives in the moved copy's memory
  np.testing.assert_allclose(out, _stock(host), rtol=1e-6)
  # As documented: an argument that has to be moved is copied and the copy donated; the caller's array stays.
  assert not x.is_deleted()
  np.testing.assert_array_equal(x, host)
  # Stock jax.pmap refuses an input committed to other devices instead of moving it.
  with pytest.raises(ValueError, match="does not match the sharding"):
    jax.pmap(_step, "i", donate_argnums=0)(
      bt.device_put(host, jax.devices()[0])
    )


def _update(w, g):
  return w - 0.1 * jax.lax.pmean(g, "i")


def test_place_for_the_pmaps_compiled_program(rows):
  f = pmap_chunked.pmap(_update, "i", donate_argnums=0)
  host = (_data(2), _data(3))
  compiled = f.lower(*host).compile()
  placed = bt.place_for(compiled, host)
  assert [x.format for x in placed] == list(compiled.input_formats[0])
  assert [x.sharding for x in placed] == [rows, rows]
  before = _pointers(placed[0])
  out = f(*placed)
  assert _pointers(out) == before
  np.testing.assert_allclose(out, jax.pmap(_update, "i")(*host), rtol=1e-6)
  # The stock Compiled takes the placed inputs as they are too.
  again = bt.place_for(compiled, host)
  np.testing.assert_allclose(compiled(*again), out, rtol=1e-6)


def test_restore_into_the_pmaps_formats_feeds_it_without_a_copy(tmp_path):
  params = {"w": _data(4), "b": _data(5)}
  bt.save(tmp_path / "ckpt", params)
  f = pmap_chunked.pmap(_update, "i", donate_argnums=0)
  formats = f.lower(params["w"], params["b"]).compile().input_formats[0]
  target = {
    "w": jax.ShapeDtypeStruct((N, COLS), np.float32, sharding=formats[0]),
    "b": jax.ShapeDtypeStruct((N, COLS), np.float32, sharding=formats[1]),
  }
  restored = bt.restore(tmp_path / "ckpt", target)
  assert (
    restored["w"].format == formats[0] and restored["b"].format == formats[1]
  )
  np.testing.assert_array_equal(restored["w"], params["w"])
  assert bt.plan([restored["w"], restored["b"]], list(formats)).zero_copy == 2
  out = f(restored["w"], restored["b"])
  assert restored["w"].is_deleted()
  np.testing.assert_allclose(
    out, jax.pmap(_update, "i")(params["w"], params["b"]), rtol=1e-6
  )
  # On CPU restored arrays hold the host buffers restore read into, as
  # jax.device_put of aligned numpy memory does, and XLA does not reuse such a
  # buffer for a donated input (README, "Where it differs"). The step's output
  # is XLA's own: the next donated step runs in place.
  before = _pointers(out)
  again = f(out, restored["b"])
  assert out.is_deleted() and _pointers(again) == before


def test_device_put_sharded_and_replicated_feed_pmap_as_they_are():
  devices = jax.devices()[:N]
  shards = list(_data(11))  # rows of one unaligned allocation
  sharded = pmap_chunked.device_put_sharded(shards, devices)
  replicated = pmap_chunked.device_put_replicated(
    np.arange(COLS, dtype=np.float32), devices
  )
  before = _pointers(sharded)
  out = pmap_chunked.pmap(lambda s, r: s + r, "i", donate_argnums=0)(
    sharded, replicated
  )
  assert _pointers(out) == before
  assert not replicated.is_deleted()
  expected = np.stack(shards) + np.arange(COLS, dtype=np.float32)
  np.testing.assert_array_equal(out, expected)
  stock = jax.pmap(lambda s, r: s + r)(
    np.stack(shards), np.tile(np.arange(COLS, dtype=np.float32), (N, 1))
  )
  np.testing.assert_array_equal(out, stock)


def test_a_tree_placed_in_one_batched_call_feeds_a_pmap(rows):
  tree = {"a": _data(6), "b": _data(7), "c": _data(8, cols=16)}
  placed = bt.device_put(tree, rows)
  plan = bt.plan(placed, rows)
  assert plan.zero_copy == 3 and plan.copies == 0
  f = pmap_chunked.pmap(
    lambda t: jax.tree.map(lambda v: v - jax.lax.pmean(v, "i"), t), "i"
  )
  out = f(placed)
  stock = jax.pmap(
    lambda t: jax.tree.map(lambda v: v - jax.lax.pmean(v, "i"), t), "i"
  )(tree)
  for k in tree:
    np.testing.assert_allclose(out[k], stock[k], rtol=1e-5, atol=1e-6)
    assert out[k].sharding == rows


def test_donating_a_pytree_argument(rows):
  tree = {"a": _data(9), "b": _data(10)}
  placed = bt.device_put(tree, rows)
  before = {k: _pointers(v) for k, v in placed.items()}
  out = pmap_chunked.pmap(
    lambda t: jax.tree.map(jnp.negative, t), "i", donate_argnums=0
  )(placed)
  assert {k: _pointers(v) for k, v in out.items()} == before
  assert all(v.is_deleted() for v in placed.values())
  for k in tree:
    np.testing.assert_array_equal(np.asarray(out[k]), -np.asarray(tree[k]))
