"""Training states come back as saved (points 3, 4 and custom
metadata): restore and metadata without a target rebuild every node of
the tree (optax states with their EmptyState() and MaskedNode(), named
tuples, tuples, empty containers, None; flax and equinox states as dicts
of their entries); Python scalars come back exactly (floats as float64,
ints of any size, a numpy Generator's state bit for bit); a target that
differs is refused naming the first differing path; custom metadata is
kept with a save. Checkpoints of 0.6 (records without the new fields)
still restore. orbax's StandardCheckpointer beside it where it compares.
"""

import collections
import json
import math
import os
import struct
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import equinox as eqx
from flax import linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import object_servers  # noqa: E402
import optax
import orbax.checkpoint as ocp
import pytest

from jaxworks import batched_transfer as bt

# Private: the record, edited to be one 0.6 wrote; what save takes for a leaf.
from jaxworks.batched_transfer._src.checkpoint import format
from jaxworks.batched_transfer._src.checkpoint.keys import (
  saved_leaf as _saved_leaf,
)


@pytest.fixture(params=["dir", "npz"])
def path(request, tmp_path):
  return str(tmp_path / ("ckpt" if request.param == "dir" else "ckpt.npz"))


def _params():
  k1, k2 = jax.random.split(jax.random.key(0))
  return {
    "dense": {"w": jax.random.normal(k1, (8, 4)), "b": jnp.zeros(4)},
    "out": {"w": jax.random.normal(k2, (4, 2))},
  }


def _optax_state(params):
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
  state = tx.init(params)
  # One step, so that mu, nu and count are not their initial values.
  grads = jax.tree.map(jnp.ones_like, params)
  _, state = tx.update(grads, state, params)
  return tx, state


def _same(got, want):
  """``got`` is ``want``: the same tree structure (node types included)
  and every leaf bit for bit (arrays and numpy scalars as jax.device_put
  places them, Python values as they are)."""
  assert jax.tree.structure(got) == jax.tree.structure(want), (
    jax.tree.structure(got),
    jax.tree.structure(want),
  )
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    if isinstance(w, (jax.Array, np.ndarray, np.generic)):
      ref = np.asarray(jax.device_put(w))
      assert np.asarray(g).dtype == ref.dtype
      assert np.asarray(g).tobytes() == ref.tobytes()
    else:
      assert type(g) is type(w) and g == w


def _paths(tree):
  """Every leaf's key, empty nodes and None included (the checkpoint's)."""
  is_leaf = lambda x: x is None or (isinstance(x, tuple) and not x)  # noqa: E731
  flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  return [
    "/".join(
      str(getattr(e, "key", getattr(e, "idx", getattr(e, "name", e))))
      for e in p
    )
    for p, _ in flat
  ]


# Point 3: optax states.


def test_an_optax_chain_state_restores_without_a_target(path):
  params = _params()
  _, opt_state = _optax_state(params)
  assert optax.EmptyState() in jax.tree.leaves(
    opt_state, is_leaf=lambda x: isinstance(x, optax.EmptyState)
  )
  tree = {"params": params, "opt_state": opt_state}
  bt.save(path, tree)
  # 0.6 raised "leaves of the target are missing" here.
  _same(bt.restore(path), tree)
  meta = bt.metadata(path)
  assert jax.tree.structure(meta) == jax.tree.structure(tree)
  assert meta["opt_state"][0] == optax.EmptyState()
  adam = meta["opt_state"][1][0]
  assert type(adam) is optax.ScaleByAdamState
  assert adam.mu["dense"]["w"].shape == (8, 4)
  # Onto the original tree, and onto jax.eval_shape of it.
  _same(bt.restore(path, tree), tree)
  _same(bt.restore(path, jax.eval_shape(lambda: tree)), tree)
  _same(bt.restore(path, meta), tree)


def test_an_optax_state_against_orbax(tmp_path):
  # orbax restores the same arrays at the same keys, but EmptyState as
  # None, named tuples as dicts and tuples as lists; jaxworks as saved.
  params = _params()
  _, opt_state = _optax_state(params)
  tree = {"params": params, "opt_state": opt_state}
  bt.save(tmp_path / "bt", tree)
  ours = bt.restore(tmp_path / "bt")
  with ocp.StandardCheckpointer() as ck:
    ck.save(tmp_path / "orbax", tree)
    ck.wait_until_finished()
    theirs = ck.restore(tmp_path / "orbax")
  assert theirs["opt_state"][0] is None
  assert ours["opt_state"][0] == optax.EmptyState()
  flat_ours = jax.tree_util.tree_leaves_with_path(ours)
  flat_theirs = jax.tree_util.tree_leaves_with_path(theirs)
  key = lambda p: [
    str(getattr(e, "key", getattr(e, "idx", getattr(e, "name", None))))
    for e in p
  ]  # noqa: E731
  assert [key(p) for p, _ in flat_ours] == [key(p) for p, _ in flat_theirs]
  for (_, a), (_, b) in zip(flat_ours, flat_theirs):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_an_optax_masked_state_keeps_its_masked_nodes(path):
  params = {"w": jnp.ones((2, 3)), "b": jnp.ones(3)}
  tx = optax.masked(optax.adam(1e-3), {"w": True, "b": False})
  state = tx.init(params)
  assert isinstance(state.inner_state[0].mu["b"], optax.MaskedNode)
  bt.save(path, {"opt": state})
  out = bt.restore(path)
  _same(out, {"opt": state})
  assert out["opt"].inner_state[0].mu["b"] == optax.MaskedNode()
  # The restored state is the optimizer's: an update runs on it.
  updates, _ = tx.update(jax.tree.map(jnp.ones_like, params), out["opt"])
  assert updates["b"] is not None


def test_the_manager_restores_an_optax_state_as_saved(tmp_path):
  params = _params()
  tx, opt_state = _optax_state(params)
  with bt.CheckpointManager(tmp_path / "run") as mgr:
    mgr.save(
      1, items={"params": params, "opt_state": opt_state, "data": {"i": 7}},
      blocking=True,
    )  # fmt: skip
    _same(
      mgr.restore(1),
      {"params": params, "opt_state": opt_state, "data": {"i": 7}},
    )
    out = mgr.restore(1, items={"opt_state": None})
    _same(out, {"opt_state": opt_state})
    meta = mgr.item_metadata(1)
    assert jax.tree.structure(meta["opt_state"]) == jax.tree.structure(
      opt_state
    )
    assert meta["data"] == {"i": 7}
  # The restored state continues training exactly as the saved one does.
  grads = jax.tree.map(jnp.ones_like, params)
  want, _ = tx.update(grads, opt_state, params)
  got, _ = tx.update(grads, out["opt_state"], params)
  _same(got, want)


# Named tuples whose class the program has not loaded; classes named in a
# record are data.


def _module_with_state(name):
  mod = types.ModuleType(name)
  mod.State = collections.namedtuple("State", ["count", "mu"])
  mod.State.__module__ = name
  mod.State.__qualname__ = "State"
  sys.modules[name] = mod
  return mod


def test_a_named_tuple_whose_class_is_not_loaded_comes_back_as_one_like_it(
  tmp_path,
):
  mod = _module_with_state("jaxworks_test_states_a")
  tree = {"s": mod.State(count=np.int32(3), mu=(np.ones(2), ()))}
  bt.save(tmp_path / "c", tree)
  _same(bt.restore(tmp_path / "c"), tree)  # its class, loaded
  del sys.modules["jaxworks_test_states_a"]
  out = bt.restore(tmp_path / "c")
  s = out["s"]
  assert type(s) is not mod.State and type(s).__name__ == "State"
  assert s._fields == ("count", "mu") and int(s.count) == 3
  assert s.mu[1] == () and isinstance(s.mu, tuple)
  # One class per name and fields: two restores share it (and their trees'
  # structures are equal).
  assert type(bt.restore(tmp_path / "c")["s"]) is type(s)
  assert "jaxworks_test_states_a" not in sys.modules  # nothing imported
  # Onto the original tree: its class.
  assert type(bt.restore(tmp_path / "c", tree)["s"]) is mod.State


def _edit_record(where, edit):
  rec = os.path.join(where, format.RECORD)
  with open(rec) as f:
    data = json.load(f)
  edit(data)
  with open(rec, "w") as f:
    json.dump(data, f)


def test_a_record_naming_other_classes_imports_and_runs_nothing(tmp_path):
  tree = {"s": collections.namedtuple("S", ["a"])(np.ones(2))}
  bt.save(tmp_path / "c", tree)

  def edit(data):
    data["nodes"]["s"]["class"] = "jaxworks_never_imported:S"
    data["nodes"]["t"] = {
      "type": "namedtuple",
      "class": "os:system",
      "fields": [],
    }

  _edit_record(tmp_path / "c", edit)
  out = bt.restore(tmp_path / "c")
  assert "jaxworks_never_imported" not in sys.modules
  assert type(out["s"]).__name__ == "S" and out["s"]._fields == ("a",)
  # A class that is loaded but is no named tuple with those fields is not
  # used (os.system is a function): a named tuple is made instead.

  def edit2(data):
    data["nodes"]["s"] = {
      "type": "namedtuple",
      "class": "os:system",
      "fields": ["a"],
    }

  _edit_record(tmp_path / "c", edit2)
  out = bt.restore(tmp_path / "c")
  assert type(out["s"]).__name__ == "system" and out["s"].a.shape == (2,)

  # Fields that cannot name a named tuple's: a dict of them.
  def edit3(data):
    data["nodes"]["s"] = {
      "type": "namedtuple",
      "class": "m:S",
      "fields": ["__class__"],
    }
    data["tree"] = [["s/__class__", "da"]]
    data["dtypes"] = {"s/__class__": data["dtypes"].pop("s/a")}
    data["shapes"] = {"s/__class__": data["shapes"].pop("s/a")}
    data["crc32c"] = {"s/__class__": data["crc32c"].pop("s/a")}
    data["shardings"] = {}

  os.makedirs(tmp_path / "c" / "s", exist_ok=True)
  os.rename(
    tmp_path / "c" / "s" / "a.npy", tmp_path / "c" / "s" / "__class__.npy"
  )
  _edit_record(tmp_path / "c", edit3)
  out = bt.restore(tmp_path / "c")
  assert type(out["s"]) is dict and out["s"]["__class__"].shape == (2,)


# Python containers.

Pair = collections.namedtuple("Pair", ["x", "y"])


def test_python_containers_come_back_as_saved(path):
  tree = {
    "tuple": (np.ones(1), (np.zeros(2),), ()),
    "list": [np.ones(1), [], [[]]],
    "dict": {"a": {}, "b": {"c": None}},
    "none": None,
    "empty_tuple": (),
    "ordered": collections.OrderedDict([("z", np.ones(1)), ("a", ())]),
    "nested_empty": ((), [{}], {"x": ()}),
    "pair": Pair(np.ones(1), None),
  }
  bt.save(path, tree)
  out = bt.restore(path)
  _same(out, tree)
  assert type(out["ordered"]) is collections.OrderedDict
  assert list(out["ordered"]) == ["z", "a"]
  meta = bt.metadata(path)
  assert jax.tree.structure(meta) == jax.tree.structure(tree)
  _same(bt.restore(path, tree), tree)
  _same(bt.restore(path, jax.eval_shape(lambda: tree)), tree)


def test_int_and_bool_dict_keys_come_back_as_saved(path):
  # Layer tables, a data loader's per-shard positions: dicts with int keys.
  tree = {
    "layers": {
      0: np.arange(2),
      10: {"x": np.ones(1)},
      2: [np.zeros(1), {5: 3}],
    },
    "od": collections.OrderedDict([(3, np.ones(1)), (1, None)]),
    "flags": {True: 1.5, False: {}},
    "neg": {-1: np.ones(1)},
  }
  bt.save(path, tree)
  out = bt.restore(path)
  _same(out, tree)
  assert jax.tree.structure(out) == jax.tree.structure(tree)
  assert list(out["od"]) == [3, 1]
  assert jax.tree.structure(bt.metadata(path)) == jax.tree.structure(tree)
  # A target lacking a leaf: the error names the path as jax writes it.
  short = {**tree, "layers": {0: tree["layers"][0], 2: tree["layers"][2]}}
  with pytest.raises(ValueError, match=r"\['layers'\]\[10\]\['x'\]"):
    bt.restore(path, short)


def test_float_dict_keys_come_back_as_saved(path):
  # Learning-rate or temperature tables keyed by a float; the float's
  # exact value comes back (its repr is its text), nan, inf and -0.0 too.
  tree = {
    "by_lr": {0.1: np.ones(2), 3e-4: {"x": np.zeros(1)}, 1e20: 7},
    "odd": {float("inf"): 1.0, -0.0: np.ones(1), 2.5: None},
    "mixed": {2: np.ones(1), 1.5: np.zeros(1), True: np.ones(2)},
  }
  bt.save(path, tree)
  out = bt.restore(path)
  _same(out, tree)
  assert jax.tree.structure(out) == jax.tree.structure(tree)
  keys = list(out["odd"])
  assert [type(k) for k in keys] == [float] * 3
  assert math.copysign(1.0, keys[[k == 0 for k in keys].index(True)]) < 0
  assert jax.tree.structure(bt.metadata(path)) == jax.tree.structure(tree)
  with pytest.raises(ValueError, match=r"\['by_lr'\]\[0.0003\]\['x'\]"):
    bt.restore(path, {**tree, "by_lr": {0.1: np.ones(2), 1e20: 7}})
  nan = {float("nan"): np.ones(1)}
  other = path.replace("ckpt", "nan")
  bt.save(other, nan)
  (k,) = bt.restore(other)
  assert isinstance(k, float) and math.isnan(k)


def test_a_record_with_int_and_bool_kinds_on_other_text_keeps_the_text():
  # A hostile or foreign record: kinds i and b on keys that are no int or
  # bool's text stay str keys; nothing raises but the mismatch of lengths.
  out = format.rebuild_tree(
    [("01/x", "id"), ("yes/y", "bd"), ("7/z", "id"), ("False/w", "bd")],
    lambda key: key,
  )
  assert out == {"01": {"x": "01/x"}, "yes": {"y": "yes/y"}, 7: {"z": "7/z"},
                 False: {"w": "False/w"}}  # fmt: skip
  floats = format.rebuild_tree(
    [("1.50/x", "rd"), ("pi/y", "rd"), ("0.25/z", "rd")], lambda key: key
  )
  assert floats == {"1.50": {"x": "1.50/x"}, "pi": {"y": "pi/y"},
                    0.25: {"z": "0.25/z"}}  # fmt: skip
  with pytest.raises(ValueError, match="does not match its kinds"):
    format.rebuild_tree([("1/x", "i")], lambda key: key)


@pytest.mark.parametrize(
  "tree",
  [(), [], {}, None, optax.EmptyState(), ((), None), {"a": ()}],
  ids=repr,
)
def test_a_tree_of_empty_nodes_alone(tmp_path, tree):
  bt.save(tmp_path / "c", tree)
  _same(bt.restore(tmp_path / "c"), tree)
  assert jax.tree.structure(bt.metadata(tmp_path / "c")) == jax.tree.structure(
    tree
  )
  _same(bt.restore(tmp_path / "c", tree), tree)


# Save keeps the structure of the trees it saw last (keys.structure): each
# save must still record its own tree's.


def test_trees_alike_but_for_their_empty_nodes_keep_their_own(tmp_path):
  # With save's leaves, None and EmptyState() are both leaves: one treedef.
  a = {"w": np.ones(2), "s": None, "t": ()}
  b = {"w": np.ones(2), "s": optax.EmptyState(), "t": []}
  assert jax.tree.structure(a, is_leaf=_saved_leaf) == jax.tree.structure(
    b, is_leaf=_saved_leaf
  )
  for i, tree in enumerate([a, b, a, b]):
    bt.save(tmp_path / str(i), tree)
    out = bt.restore(tmp_path / str(i))
    _same(out, tree)
    assert type(out["s"]) is type(tree["s"])
    assert type(out["t"]) is type(tree["t"])


def test_dict_keys_equal_as_values_name_their_own_files(tmp_path):
  # {1: x}, {1.0: x} and {True: x} have equal treedefs (1 == 1.0 == True)
  # but name the files "1", "1.0" and "True".
  for i, key in enumerate([1, 1.0, True, 1]):
    path = tmp_path / str(i)
    bt.save(path, {key: np.arange(3) + i})
    assert f"{key}.npy" in os.listdir(path)
    out = bt.restore(path)
    # int, bool and float keys come back as saved, each of its own type.
    assert list(out) == [key]
    assert type(list(out)[0]) is type(key)
    np.testing.assert_array_equal(list(out.values())[0], np.arange(3) + i)


class _UnhashableAux:
  """A pytree node whose auxiliary data is a list (not hashable)."""

  def __init__(self, x, names):
    self.x, self.names = x, names


jax.tree_util.register_pytree_with_keys(
  _UnhashableAux,
  lambda n: (((jax.tree_util.GetAttrKey("x"), n.x),), list(n.names)),
  lambda names, kids: _UnhashableAux(kids[0], names),
)


def test_a_node_with_unhashable_aux_data_saves_every_time(tmp_path):
  for i in range(3):
    tree = {"n": _UnhashableAux(np.full(2, i), ["a"])}
    bt.save(tmp_path / str(i), tree)
    assert os.listdir(tmp_path / str(i) / "n") == ["x.npy"]
    out = bt.restore(tmp_path / str(i), tree)
    np.testing.assert_array_equal(out["n"].x, np.full(2, i))


def test_a_key_that_cannot_name_a_file_is_refused_every_time(tmp_path):
  for i in range(2):
    with pytest.raises(ValueError, match="cannot name a file"):
      bt.save(tmp_path / str(i), {"a/b": np.ones(1)})
    assert not os.path.exists(tmp_path / str(i))


# Equinox and flax.


def test_an_equinox_modules_arrays(path):
  model = eqx.nn.MLP(3, 2, 8, 2, key=jax.random.key(1))
  arrays, static = eqx.partition(model, eqx.is_array)
  bt.save(path, arrays)
  # Onto the module's arrays (as eval_shape gives them): the module again.
  abstract = eqx.filter(
    eqx.filter_eval_shape(lambda: model),
    lambda x: isinstance(x, jax.ShapeDtypeStruct),
  )
  out = bt.restore(path, abstract)
  again = eqx.combine(out, static)
  x = jnp.ones(3)
  assert np.asarray(again(x)).tobytes() == np.asarray(model(x)).tobytes()
  # Without a target: its entries as dicts, at the same keys, the layers a
  # tuple as the module holds them, and its None fields.
  plain = bt.restore(path)
  assert sorted(_paths(plain)) == sorted(_paths(arrays))
  assert type(plain["layers"]) is tuple and plain["activation"] is None
  w = plain["layers"][0]["weight"]
  assert np.asarray(w).tobytes() == np.asarray(model.layers[0].weight).tobytes()
  assert jax.tree.structure(bt.metadata(path)) == jax.tree.structure(plain)


def test_a_flax_nnx_state(path):
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(3, 4, rngs=rngs)
      self.bn = nnx.BatchNorm(4, rngs=rngs)

  model = Model(nnx.Rngs(0))
  state = nnx.state(model)
  bt.save(path, state)
  abstract = nnx.state(nnx.eval_shape(lambda: Model(nnx.Rngs(0))))
  out = bt.restore(path, abstract)
  _same(out, state)
  fresh = Model(nnx.Rngs(1))
  nnx.update(fresh, out)
  assert (
    np.asarray(fresh.linear.kernel[...]).tobytes()
    == np.asarray(model.linear.kernel[...]).tobytes()
  )
  # Without a target: dicts of its entries, at the same keys.
  plain = bt.restore(path)
  assert sorted(_paths(plain)) == sorted(_paths(state))
  assert sorted(plain) == ["bn", "linear"]
  assert plain["linear"]["kernel"]["value"].shape == (3, 4)


def test_flax_linen_variables(path):
  class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
      x = nn.Dense(4)(x)
      return nn.BatchNorm(use_running_average=not train)(x)

  variables = Net().init(jax.random.key(0), jnp.ones((2, 3)))
  assert sorted(variables) == ["batch_stats", "params"]
  bt.save(path, variables)
  _same(bt.restore(path), variables)
  _same(bt.restore(path, jax.eval_shape(lambda: variables)), variables)


# A target whose structure differs: the first differing path is named.


def test_a_target_that_differs_names_the_first_differing_path(path):
  bt.save(path, {"a": {"x": np.ones(1), "y": np.ones(1)}, "b": np.ones(1)})
  with pytest.raises(
    ValueError,
    match=r"first difference in tree order is at \['a'\]\['z'\]: the target "
    r"has a leaf there \(key 'a/z'\) where the checkpoint has the leaf "
    r"\['a'\]\['y'\]",
  ):
    bt.restore(path, {"a": {"x": np.ones(1), "z": np.ones(1)}, "b": np.ones(1)})
  with pytest.raises(
    ValueError,
    match=r"first difference in tree order is at \['a'\]\['y'\]: the "
    r"checkpoint has a leaf there \(key 'a/y'\) where the target has the "
    r"leaf \['b'\]",
  ):
    bt.restore(path, {"a": {"x": np.ones(1)}, "b": np.ones(1)})


def test_another_optimizers_state_names_the_first_differing_path(tmp_path):
  params = _params()
  _, opt_state = _optax_state(params)
  bt.save(tmp_path / "c", {"opt_state": opt_state})
  other = optax.adamw(1e-3).init(params)  # no clipping: one node fewer
  with pytest.raises(
    ValueError,
    match=r"first difference in tree order is at \['opt_state'\]\[0\]\.count",
  ):
    bt.restore(tmp_path / "c", {"opt_state": other})


# Point 4: Python scalars exactly.


def _bits(x):
  if isinstance(x, float):
    return struct.pack("<d", x)
  if isinstance(x, complex):
    return struct.pack("<dd", x.real, x.imag)
  return x


_SCALARS = {
  "lr": 0.1,
  "tiny": 5e-324,
  "neg_zero": -0.0,
  "inf": float("inf"),
  "nan": float("nan"),
  "nan_payload": struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000123))[0],
  "huge_float": 1e300,  # past float32's range
  "step": 3,
  "tokens": 2**40,
  "huge_int": -(2**200),
  "digits": 10**5000,  # past Python's int -> str digit limit
  "flag": True,
  "z": complex(0.1, -1e-300),
  "name": "run-42",
  "none": None,
}


@pytest.mark.parametrize("x64", [False, True])
def test_python_scalars_come_back_exactly(path, x64):
  with jax.enable_x64(x64):
    bt.save(path, _SCALARS)
    for out in (bt.restore(path), bt.metadata(path)):
      assert sorted(out) == sorted(_SCALARS)
      for k, want in _SCALARS.items():
        assert type(out[k]) is type(want), k
        assert _bits(out[k]) == _bits(want), (k, out[k])
    # Onto an array target: the array jax.device_put makes of the value.
    target = {
      k: v
      for k, v in _SCALARS.items()
      if k not in ("tokens", "huge_int", "digits")
    }
    target["tokens"] = target["huge_int"] = target["digits"] = 0
    got = bt.restore(
      path, jax.eval_shape(lambda: {"lr": 0.1}), partial_restore=True
    )
    ref = jax.device_put(0.1)
    assert jax.typeof(got["lr"]) == jax.typeof(ref)
    assert np.asarray(got["lr"]).tobytes() == np.asarray(ref).tobytes()
    out = bt.restore(path, target)
    assert out["tokens"] == 2**40 and out["digits"] == 10**5000
    assert jax.typeof(out["lr"]) == jax.typeof(ref)


def test_python_scalars_against_orbax(tmp_path):
  tree = {"lr": 0.1, "tokens": 2**40, "step": 3, "flag": True}
  bt.save(tmp_path / "bt", tree)
  with ocp.StandardCheckpointer() as ck:
    ck.save(tmp_path / "orbax", tree)
    ck.wait_until_finished()
    theirs = ck.restore(tmp_path / "orbax")
  ours = bt.restore(tmp_path / "bt")
  assert ours == theirs == tree
  assert {k: type(v) for k, v in ours.items()} == {
    k: type(v) for k, v in theirs.items()
  }


def test_a_numpy_generator_and_a_data_iterator_state_round_trip(tmp_path):
  rng = np.random.default_rng(1234)
  rng.random(17)
  data = {
    "epoch": 3,
    "index": 12_345_678_901,
    "seed": 2**63 + 5,
    "shuffle": True,
    "files": ("a.tfrecord", "b.tfrecord"),
    "position": None,
    "mix": [0.1, 0.2, 0.7],
    "rng": rng.bit_generator.state,
  }
  assert data["rng"]["state"]["state"] > 2**64  # PCG64: 128-bit ints
  with bt.CheckpointManager(tmp_path / "run") as mgr:
    mgr.save(5, items={"w": np.ones(2), "data": data}, blocking=True)
    for out in (
      mgr.restore(5)["data"],
      mgr.restore(5, items={"data": None})["data"],
      mgr.item_metadata(5)["data"],
      mgr.restore(5, items={"data": None, "w": None})["data"],
    ):
      assert out == data
      assert jax.tree.structure(out) == jax.tree.structure(data)
      assert type(out["files"]) is tuple
      again = np.random.default_rng()
      again.bit_generator.state = out["rng"]
      assert again.random(5).tobytes() == rng.random(5).tobytes()
      rng.bit_generator.state = data["rng"]


# Custom metadata.


def test_custom_metadata_with_a_save(path):
  bt.save(path, {"w": np.ones(2)}, custom_metadata={"lr": 1e-3, "tags": ["a"]})
  assert bt.custom_metadata(path) == {"lr": 1e-3, "tags": ["a"]}
  bt.save(path, {"w": np.ones(2)}, overwrite=True)
  assert bt.custom_metadata(path) == {}  # as orbax: {} where none was


@pytest.mark.parametrize(
  "bad", [[1], {1: "a"}, {"x": np.float32(1)}, {"x": object()}], ids=repr
)
def test_custom_metadata_that_json_cannot_hold_is_refused_before_writing(
  path, bad
):
  with pytest.raises(TypeError, match=r"save: custom_metadata must"):
    bt.save(path, {"w": np.ones(2)}, custom_metadata=bad)
  assert not os.path.exists(path)


def test_the_managers_custom_metadata_as_orbax_names_it(tmp_path):
  custom = {"learning_rate": 0.001, "config": {"layers": 2}}
  with bt.CheckpointManager(tmp_path / "bt") as mgr:
    mgr.save(0, {"w": np.ones(2)}, custom_metadata=custom, blocking=True)
    mgr.save(1, {"w": np.ones(2)}, force=True, blocking=True)
    ours = mgr.metadata(0)
    assert mgr.metadata(1).custom_metadata == {}
  with ocp.CheckpointManager(tmp_path / "orbax") as omgr:
    omgr.save(
      0, args=ocp.args.StandardSave({"w": np.ones(2)}), custom_metadata=custom
    )
    omgr.wait_until_finished()
    theirs = omgr.metadata(0)
  assert ours.custom_metadata == theirs.custom_metadata == custom


# In a bucket (moto's S3 server, gcp-storage-emulator on 127.0.0.1): the
# same record, so the same tree; an int stored by value has no object.

s3_endpoint = object_servers.s3_endpoint
gcs_endpoint = object_servers.gcs_endpoint
url = object_servers.bucket_url


def test_a_bucket_checkpoint_comes_back_as_saved(url):
  params = _params()
  _, opt_state = _optax_state(params)
  tree = {"opt_state": opt_state, "tokens": 2**40, "lr": 0.1, "t": ((), None)}
  bt.save(url, tree, custom_metadata={"run": 7})
  _same(bt.restore(url), tree)
  assert jax.tree.structure(bt.metadata(url)) == jax.tree.structure(tree)
  assert bt.custom_metadata(url) == {"run": 7}
  _same(bt.restore(url, tree)["opt_state"], opt_state)


# Checkpoints of 0.6: records without nodes, scalars and custom metadata.


def _as_06(where):
  """Rewrites the record at ``where`` as 0.6 wrote it: no nodes, no exact
  scalars, empty named tuples not listed, tuples as the lists they read as."""

  def edit(data):
    nodes = data.pop("nodes", {})
    data.pop("scalars", None)
    data.pop("custom_metadata", None)
    data["format"] = 2
    data["tree"] = [
      e for e in data["tree"]
      if not (len(e) == 3 and nodes.get(e[0], {}).get("type") == "namedtuple")
    ]  # fmt: skip

  _edit_record(where, edit)


def test_a_checkpoint_of_0_6_still_restores(tmp_path):
  params = _params()
  _, opt_state = _optax_state(params)
  tree = {"params": params, "opt_state": opt_state, "lr": 0.1, "step": 7}
  bt.save(tmp_path / "c", tree)
  _as_06(tmp_path / "c")
  # Onto the original tree and eval_shape's: as 0.6 restored it.
  out = bt.restore(tmp_path / "c", tree)
  _same(out["params"], params)
  _same(out["opt_state"], opt_state)
  assert (
    np.asarray(out["lr"]).tobytes() == np.asarray(jax.device_put(0.1)).tobytes()
  )
  bt.restore(tmp_path / "c", jax.eval_shape(lambda: tree))
  # Without a target: the record has no nodes, so lists and dicts, the
  # EmptyState() 0.6 did not list as None (as orbax), the float as 0.6
  # stored it; every array at its key.
  plain = bt.restore(tmp_path / "c")
  assert plain["opt_state"][0] is None
  assert type(plain["opt_state"][1]) is list
  assert plain["lr"] == float(np.float32(0.1)) and plain["step"] == 7
  assert bt.custom_metadata(tmp_path / "c") == {}
  mu = plain["opt_state"][1][0]["mu"]
  assert (
    np.asarray(mu["dense"]["w"]).tobytes()
    == np.asarray(opt_state[1][0].mu["dense"]["w"]).tobytes()
  )
