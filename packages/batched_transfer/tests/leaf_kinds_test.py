"""What save accepts, restore gives back: every leaf kind (arrays of every
dtype, numpy and Python scalars, str, None, jax.Arrays) in generated trees,
with a target and without one; everything else is refused by save with a
TypeError naming the tree path, before anything is written. Also partial
restore, restore without a target, and metadata."""

import collections
import datetime
import enum
import os
import struct

from dtypes import DTYPES
from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jaxworks_testing as jwt
import ml_dtypes  # noqa: F401  (np.dtype of its names)
import numpy as np
import pytest

from jaxworks import batched_transfer as bt

_SETTINGS = settings(
  max_examples=jwt.examples(60),
  deadline=None,
  derandomize=True,
  suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def _array(draw):
  dtype = draw(st.sampled_from(DTYPES))
  shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
  seed = draw(st.integers(0, 2**16))
  raw = np.random.default_rng(seed).integers(
    0, 256, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize, np.uint8
  )
  a = raw.view(dtype).reshape(shape) if raw.size else np.zeros(shape, dtype)
  if draw(st.booleans()) and a.ndim >= 2:
    a = np.asfortranarray(a)
  return a


@st.composite
def leaves(draw):
  kind = draw(
    st.sampled_from(
      ["array", "numpy scalar", "bool", "int", "float", "complex", "str",
       "none", "jax"]
    )
  )  # fmt: skip
  if kind == "array":
    return _array(draw)
  if kind == "numpy scalar":
    a = _array(draw).reshape(-1)
    return a[0] if a.size else np.float32(1.5)
  if kind == "bool":
    return draw(st.booleans())
  if kind == "int":  # of any size (JAX holds those of int32)
    return draw(st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers()))
  if kind == "float":  # float64 values: restore without a target keeps them
    return draw(st.floats())
  if kind == "complex":
    return complex(draw(st.floats()), draw(st.floats()))
  if kind == "str":
    return draw(st.text(max_size=20))
  if kind == "none":
    return None
  a = _array(draw)
  return jax.device_put(a, jwt.device(draw(st.integers(0, 7))))


_NAMES = st.text(
  st.characters(blacklist_characters="/\\\0", blacklist_categories=["Cs"]),
  min_size=1,
  max_size=6,
).filter(lambda s: s not in (".", "..") and not s.endswith(".npy"))

_Pair = collections.namedtuple("_Pair", ["first", "second"])
_Empty = collections.namedtuple("_Empty", [])

trees = st.recursive(
  st.one_of(leaves(), st.just(()), st.just(_Empty())),
  lambda sub: st.one_of(
    st.dictionaries(_NAMES, sub, max_size=4),
    st.lists(sub, max_size=3),
    st.tuples(sub, sub),
    st.builds(_Pair, sub, sub),
  ),
  max_leaves=8,
)


def _fits_jax(x):
  try:
    jax.device_put(x)
  except OverflowError:
    return False
  return True


def _same_leaf(got, want):
  """``got`` (restored) holds exactly ``want``'s value as JAX places it."""
  if want is None or isinstance(want, str):
    assert got == want and type(got) is str if want is not None else got is None
    return
  if type(want) is int and not _fits_jax(want):  # stored by value alone
    assert type(got) is int and got == want
    return
  ref = jax.device_put(want)
  assert jax.typeof(got) == jax.typeof(ref), (got, want)
  assert np.asarray(got).tobytes() == np.asarray(ref).tobytes()


def _as_saved(tree):
  """What restore without a target rebuilds: the tree's nodes as saved
  (dicts keyed by str), Python scalars exactly, arrays as placed."""
  if isinstance(tree, dict):
    return {str(k): _as_saved(v) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    items = [_as_saved(v) for v in tree]
    return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
  return tree


def _compare_as_saved(got, want):
  if isinstance(want, dict):
    assert isinstance(got, dict) and sorted(got) == sorted(want)
    for k in want:
      _compare_as_saved(got[k], want[k])
  elif isinstance(want, (list, tuple)):
    assert type(got) is type(want) and len(got) == len(want), (got, want)
    for g, w in zip(got, want):
      _compare_as_saved(g, w)
  elif isinstance(want, (bool, int, float, complex)) and not isinstance(
    want, np.generic
  ):  # exactly, bit for bit
    assert type(got) is type(want)
    if isinstance(want, complex):
      assert struct.pack("<dd", got.real, got.imag) == struct.pack(
        "<dd", want.real, want.imag
      )
    elif isinstance(want, float):
      assert struct.pack("<d", got) == struct.pack("<d", want)
    else:
      assert got == want
  else:
    _same_leaf(got, want)


@pytest.mark.parametrize("fmt", ["dir", "ckpt.npz"])
@_SETTINGS
@given(tree=trees)
def test_every_leaf_kind_save_accepts_restores(tmp_path_factory, fmt, tree):
  path = os.path.join(tmp_path_factory.mktemp("c"), fmt)
  if jax.tree.leaves(tree) == [] and tree is not None:
    pass  # an empty tree is a checkpoint too
  bt.save(path, tree)
  # With the tree itself as the target (orbax's restore(path, state) idiom).
  got = bt.restore(path, tree)
  flat_got = jax.tree.leaves(got, is_leaf=lambda x: x is None)
  flat_want = jax.tree.leaves(tree, is_leaf=lambda x: x is None)
  assert len(flat_got) == len(flat_want)
  for g, w in zip(flat_got, flat_want):
    _same_leaf(g, w)
  # Without a target: the tree as saved.
  _compare_as_saved(bt.restore(path), _as_saved(tree))


class _Thing:
  pass


@pytest.mark.parametrize(
  "leaf, what",
  [
    (b"bytes", "bytes"),
    (np.array(["a", "bc"]), "dtype <U2"),
    (np.array([b"a"]), "dtype |S1"),
    (np.array([1, "a"], dtype=object), "dtype object"),
    (np.array(["2024-01-01"], dtype="datetime64[D]"), "dtype datetime64"),
    (np.zeros(2, dtype="V4"), "dtype |V4"),
    (np.zeros(2, dtype=[("a", "i4")]), "dtype"),
    (datetime.date(2024, 1, 1), "date"),
    (_Thing(), "_Thing"),
    ({1, 2}, "set"),
  ],
)
@pytest.mark.parametrize("fmt", ["dir", "c.npz"])
def test_what_save_cannot_store_is_refused_naming_the_path(
  tmp_path, leaf, what, fmt
):
  path = tmp_path / fmt
  with pytest.raises(
    TypeError, match=rf"save: the leaf at \['cfg'\]\[1\] .*{what}"
  ):
    bt.save(path, {"w": np.ones(3), "cfg": [1, leaf]})
  assert not os.listdir(tmp_path)  # nothing written, no temporaries


def test_a_str_leaf_is_stored_by_value_and_restores(tmp_path):
  # A str leaf is stored in the record (no run.npy), and the checkpoint
  # restores, with a target that leaves it out too.
  tree = {"w": np.arange(4.0, dtype=np.float32), "run": "exp-42", "step": 7,
          "seed": None, "lr": 0.5}  # fmt: skip
  for fmt in ("d", "c.npz"):
    bt.save(tmp_path / fmt, tree)
    assert "run.npy" not in (os.listdir(tmp_path / fmt) if fmt == "d" else [])
    out = bt.restore(tmp_path / fmt)
    assert out["run"] == "exp-42" and out["seed"] is None
    assert type(out["step"]) is int and out["step"] == 7
    assert type(out["lr"]) is float and out["lr"] == 0.5
    np.testing.assert_array_equal(np.asarray(out["w"]), tree["w"])
    only_w = bt.restore(
      tmp_path / fmt, {"w": jax.ShapeDtypeStruct((4,), np.float32)},
      partial_restore=True,
    )  # fmt: skip
    assert list(only_w) == ["w"]
    with pytest.raises(ValueError, match="partial_restore=True"):
      bt.restore(tmp_path / fmt, {"w": jax.ShapeDtypeStruct((4,), np.float32)})


def test_manager_saves_str_leaves(tmp_path):
  mgr = bt.CheckpointManager(tmp_path / "run")
  mgr.save(1, {"w": np.ones(2, np.float32), "run": "exp-42"}, blocking=True)
  out = mgr.restore(1)
  assert out["run"] == "exp-42"


def test_partial_restore_of_a_subtree(tmp_path):
  state = {
    "params": {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.int32)},
    "opt_state": [np.full(4, 2.0, np.float32)],
    "step": 3,
  }
  bt.save(tmp_path / "c", state)
  params = jax.eval_shape(lambda: state["params"])
  out = bt.restore(tmp_path / "c", {"params": params}, partial_restore=True)
  assert set(out) == {"params"} and set(out["params"]) == {"w", "b"}
  np.testing.assert_array_equal(np.asarray(out["params"]["w"]), np.ones((2, 3)))
  # A leaf the checkpoint lacks is still an error with partial_restore.
  with pytest.raises(ValueError, match=r"missing from .*\['params'\]\['c'\]"):
    bt.restore(
      tmp_path / "c",
      {"params": dict(params, c=jax.ShapeDtypeStruct((1,), np.float32))},
      partial_restore=True,
    )


def test_restore_without_target_and_metadata(tmp_path):
  mesh = jwt.mesh_fit((8,), ("x",))
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  state = {
    "w": jax.device_put(np.arange(16.0, dtype=np.float32).reshape(8, 2), rows),
    "h": np.ones(3, ml_dtypes.bfloat16),
    "layers": [np.zeros(2, np.int8), (np.ones(1, np.uint16), "relu")],
    "none": None,
  }
  bt.save(tmp_path / "c", state)
  meta = bt.metadata(tmp_path / "c")
  assert meta["w"] == jax.ShapeDtypeStruct((8, 2), np.float32, sharding=rows)
  assert meta["h"].sharding is None  # a numpy leaf has none
  assert meta["h"].dtype == ml_dtypes.bfloat16
  assert meta["layers"][1][1] == "relu" and meta["none"] is None
  out = bt.restore(tmp_path / "c")
  # The nodes as saved: a list, and a tuple in it (0.6: a list).
  assert type(out["layers"]) is list and type(out["layers"][1]) is tuple
  assert out["layers"][1][1] == "relu" and out["none"] is None
  np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(state["w"]))
  assert out["w"].devices() == {jwt.device(0)} and not out["w"].committed
  placed = bt.restore(tmp_path / "c", placement=jwt.device(2))
  assert placed["h"].devices() == {jwt.device(2)}
  # Onto the saved shardings: restore(path, metadata(path)).
  again = bt.restore(tmp_path / "c", meta)
  assert again["w"].sharding == rows and again["layers"][1][1] == "relu"


def test_metadata_shardings_of_every_kind(tmp_path):
  mesh = jwt.mesh_fit(
    (2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
  )
  shardings = {
    "single": jax.sharding.SingleDeviceSharding(jwt.device(5)),
    "tiles": jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("a", "b")
    ),
    "joint": jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(("a", "b"), None)
    ),
    "replicated": jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec()
    ),
  }
  tree = {
    k: jax.device_put(np.ones((8, 4), np.float32), s)
    for k, s in shardings.items()
  }
  bt.save(tmp_path / "c", tree)
  meta = bt.metadata(tmp_path / "c")
  for k, s in shardings.items():
    assert meta[k].sharding == s, k
  out = bt.restore(tmp_path / "c", meta)
  for k, s in shardings.items():
    assert out[k].sharding == s, k


class _Color(enum.IntEnum):
  RED = 1


def test_python_scalar_subclasses_come_back_as_their_base_type(tmp_path):
  bt.save(tmp_path / "c", {"c": _Color.RED, "t": True})
  out = bt.restore(tmp_path / "c")
  assert type(out["c"]) is int and out["c"] == 1 and out["t"] is True


def test_a_str_where_an_array_is_stored_and_back(tmp_path):
  bt.save(tmp_path / "c", {"a": np.ones(2), "s": "x"})
  with pytest.raises(ValueError, match=r"\['s'\] .* stored .* as the str 'x'"):
    bt.restore(
      tmp_path / "c",
      {"a": jax.ShapeDtypeStruct((2,), np.float32),
       "s": jax.ShapeDtypeStruct((), np.float32)},
    )  # fmt: skip
  with pytest.raises(TypeError, match=r"target leaf at \['a'\] is 'x'"):
    bt.restore(tmp_path / "c", {"a": "x", "s": "x"})
