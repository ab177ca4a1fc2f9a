"""Layouts: device_put to a Format, and place_for(compiled, tree) with no copy at call time."""

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

# Private imports below: the package's stock jit, patched to count calls.
from jaxworks.batched_transfer._src import jax_internals

COL_MAJOR = Layout(major_to_minor=(1, 0))


def buffers(x):
  return [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]


@pytest.fixture(scope="module")
def mesh():
  # (4, 2) on the CPU target's 8 devices, (1, 1) on one chip.
  return jwt.mesh_fit((4, 2), ("a", "b"))


@pytest.mark.parametrize("where", ["single", "named"])
def test_device_put_to_a_format_matches_stock(mesh, where):
  sharding = (
    SingleDeviceSharding(jwt.device(2))
    if where == "single"
    else NamedSharding(mesh, P("a", "b"))
  )
  target = Format(COL_MAJOR, sharding)
  tree = {
    "host": np.arange(32, dtype=np.float32).reshape(8, 4),
    "uncommitted": jnp.arange(16.0).reshape(8, 2),
  }
  out = bt.device_put(tree, target)
  ref = jax.device_put(tree, target)
  for k in tree:
    assert out[k].format == ref[k].format
    assert out[k].format.sharding == sharding
    assert out[k].format.layout.major_to_minor == (1, 0)
    assert out[k].committed
    np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(ref[k]))


def test_format_target_for_an_array_on_other_devices(mesh):
  # Stock jax.device_put relayouts with a jit that sees the committed input on device 5 and
  # the output on the target devices, and refuses; here the array moves first, then relayouts.
  jwt.require_devices(2)  # an array on one device of several
  target = Format(COL_MAJOR, NamedSharding(mesh, P("a", "b")))
  x = jax.device_put(np.arange(32, dtype=np.int32).reshape(8, 4), jwt.device(5))
  with pytest.raises(ValueError, match="incompatible devices"):
    jax.device_put(x, target)
  y = bt.device_put(x, target)
  assert (
    y.format.layout.major_to_minor == (1, 0) and y.sharding == target.sharding
  )
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
  assert not x.is_deleted()


def test_relayout_is_one_jit_per_destination(mesh, monkeypatch):
  jits = []
  real_jit = jax_internals.stock_jit

  def counting_jit(*args, **kwargs):
    jits.append(kwargs.get("out_shardings"))
    return real_jit(*args, **kwargs)

  # The package calls stock jit bound at import (never jax.jit looked up at call time).
  monkeypatch.setattr(jax_internals, "stock_jit", counting_jit)
  d = jwt.devices(2)  # two destinations
  tree = [np.ones((4, 4), np.float32) * k for k in range(10)]
  targets = [
    Format(COL_MAJOR, SingleDeviceSharding(d[k % 2])) for k in range(10)
  ]
  out = bt.device_put(tree, targets)
  assert len(jits) == 2 and all(len(f) == 5 for f in jits)
  assert all(
    o.format.layout.major_to_minor == (1, 0) and o.sharding == t.sharding
    for o, t in zip(out, targets)
  )


def test_a_format_with_the_default_layout_needs_no_relayout(monkeypatch):
  d = jwt.device(1)
  default = jax.device_put(np.ones((4, 4), np.float32), d).format
  monkeypatch.setattr(jax, "jit", None)  # any jit call would fail
  out = bt.device_put([np.zeros((4, 4), np.float32)] * 3, default)
  assert all(o.format == default for o in out)
  p = bt.plan(
    [np.zeros((4, 4), np.float32)], Format(COL_MAJOR, default.sharding)
  )
  assert p.groups[0].relayouts == 1


def test_already_in_format_is_zero_copy():
  d = jwt.device(3)
  fmt = Format(COL_MAJOR, SingleDeviceSharding(d))
  x = jax.device_put(np.ones((2, 3), np.float32), fmt)
  assert bt.device_put(x, fmt) is x
  assert bt.plan(x, fmt).zero_copy == 1


def _train_step_compiled(mesh, donate):
  named = NamedSharding(mesh, P("a", "b"))
  formats = {"w": Format(COL_MAJOR, named), "b": Format(Layout((0, 1)), named)}

  def step(params):
    return {"w": params["w"] + 1, "b": params["b"] * 2}

  tree = {
    "w": np.arange(64, dtype=np.float32).reshape(8, 8),
    "b": np.ones((8, 2), np.float32),
  }
  jitted = jax.jit(
    step,
    in_shardings=(formats,),
    out_shardings=formats,
    donate_argnums=0 if donate else (),
  )
  return jitted.lower(tree).compile(), tree


def test_place_for_lands_exactly_in_input_formats(mesh):
  compiled, tree = _train_step_compiled(mesh, donate=True)
  placed = bt.place_for(compiled, tree, argnum=0)
  want = compiled.input_formats[0][0]
  assert {k: v.format for k, v in placed.items()} == want
  before = {k: buffers(v) for k, v in placed.items()}
  out = compiled(placed)
  # The outputs alias the donated inputs: the executable got our buffers, not copies.
  assert {k: buffers(v) for k, v in out.items()} == before
  np.testing.assert_array_equal(np.asarray(out["w"]), tree["w"] + 1)


def test_plain_placement_would_not_do(mesh):
  compiled, tree = _train_step_compiled(mesh, donate=False)
  stock = jax.device_put(
    tree, NamedSharding(mesh, P("a", "b"))
  )  # default layouts
  with pytest.raises(ValueError, match="input layouts that disagree"):
    compiled(stock)


def test_place_for_positional_arguments_and_scalars():
  f = jax.jit(lambda x, y, s: x + s * y.sum(), donate_argnums=(0,))
  x, y = np.ones((3, 4), np.float32), np.ones((4, 2), np.float32)
  compiled = f.lower(x, y, 2.0).compile()
  placed = bt.place_for(compiled, [x, y, 2.0])
  assert isinstance(placed, tuple) and len(placed) == 3
  assert [a.format for a in placed] == list(compiled.input_formats[0])
  assert placed[2].weak_type
  out = compiled(*placed)
  np.testing.assert_array_equal(np.asarray(out), x + 16)
  # Donation consumed our array itself: had the call copied it first, the copy would have
  # been donated and ours would still be alive.
  assert placed[0].is_deleted()


def test_place_for_keyword_arguments():
  f = jax.jit(lambda x, *, scale: x * scale)
  compiled = f.lower(np.ones(4, np.float32), scale=np.float32(2)).compile()
  args, kwargs = bt.place_for(
    compiled, ((np.ones(4, np.float32),), {"scale": np.float32(3)})
  )
  np.testing.assert_array_equal(
    np.asarray(compiled(*args, **kwargs)), 3 * np.ones(4)
  )


@pytest.mark.parametrize(
  "tree, text",
  [
    (
      {"w": np.ones((8, 8), np.float32), "b": np.ones((8, 3), np.float32)},
      r"leaf at \['b'\] is float32\[8, 3\] but the compiled function's argument 0 expects "
      r"float32\[8, 2\]",
    ),
    (
      {"w": np.ones((8, 8), np.int32), "b": np.ones((8, 2), np.float32)},
      r"leaf at \['w'\] is int32\[8, 8\] but .* expects float32\[8, 8\]",
    ),
    ({"w": np.ones((8, 8), np.float32)}, r"missing \['b'\]"),
    (
      {
        "w": np.ones((8, 8), np.float32),
        "b": np.ones((8, 2), np.float32),
        "c": np.ones(1),
      },
      r"unexpected \['c'\]",
    ),
  ],
)
def test_place_for_mismatch_names_the_tree_path(mesh, tree, text):
  compiled, _ = _train_step_compiled(mesh, donate=False)
  with pytest.raises(ValueError, match=text) as info:
    bt.place_for(compiled, tree, argnum=0)
  assert "jaxworks.batched_transfer.place_for" in str(info.value)


def test_place_for_argnum_out_of_range(mesh):
  compiled, tree = _train_step_compiled(mesh, donate=False)
  with pytest.raises(
    ValueError, match="argnum 3 is out of range .* 1 positional"
  ):
    bt.place_for(compiled, tree, argnum=3)
