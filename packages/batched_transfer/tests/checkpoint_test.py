"""save / restore: round trips, validation before placement, streaming, progress."""

import io
import os
import threading
import zipfile

import jax
from jax.experimental.layout import Format
from jax.experimental.layout import Layout
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding
import jaxworks_testing as jwt
import ml_dtypes
import numpy as np
import pytest

from jaxworks import batched_transfer as bt

# Private imports below: restore's steps patched to fail; a damaged record.
from jaxworks.batched_transfer._src.checkpoint import format
from jaxworks.batched_transfer._src.checkpoint import reader
from jaxworks.batched_transfer._src.checkpoint import restore_files
from jaxworks.batched_transfer._src.checkpoint.prefetch import THREAD_NAME


def sample_tree():
  rng = np.random.default_rng(0)
  return {
    "params": {
      "w": rng.standard_normal((8, 4)).astype(np.float32),
      "b": np.arange(4, dtype=np.int32),
    },
    "layers": [
      np.ones((2, 3), jnp.bfloat16),
      np.asfortranarray(rng.random((3, 5))),
    ],
    "step": np.array(7, np.int64),
    "empty": np.zeros((0, 3), np.float16),
    "on_device": jax.device_put(np.arange(6, dtype=np.uint8), jwt.device(3)),
  }


def like(tree, sharding=None):
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      np.shape(x), np.asarray(x).dtype, sharding=sharding
    ),
    tree,
  )


@pytest.fixture(params=["npz", "dir"])
def path(request, tmp_path):
  return str(tmp_path / ("ckpt.npz" if request.param == "npz" else "ckpt"))


@pytest.mark.parametrize("x64", [False, True])
def test_round_trip(path, x64):
  if x64:
    jwt.require_x64()
  with jax.enable_x64(x64):
    tree = sample_tree()
    bt.save(path, tree)
    out = bt.restore(path, like(tree), placement=jwt.device(2))
    ref = jax.device_put(
      tree, jwt.device(2)
    )  # float64 -> float32 unless x64, as in JAX
  assert jax.tree.structure(out) == jax.tree.structure(tree)
  for got, want, stock in zip(
    jax.tree.leaves(out), jax.tree.leaves(tree), jax.tree.leaves(ref)
  ):
    assert isinstance(got, jax.Array) and got.devices() == {jwt.device(2)}
    assert jax.typeof(got) == jax.typeof(stock)
    np.testing.assert_array_equal(
      np.asarray(got), np.asarray(want).astype(got.dtype)
    )


def test_placement_comes_from_the_target_leaves(tmp_path):
  mesh = jwt.mesh_fit((4, 2), ("a", "b"))
  tree = {
    "w": np.arange(32, dtype=np.float32).reshape(8, 4),
    "b": np.ones(8, np.float32),
  }
  bt.save(tmp_path / "c.npz", tree)
  target = {
    "w": jax.ShapeDtypeStruct(
      (8, 4), np.float32, sharding=NamedSharding(mesh, P("a", "b"))
    ),
    "b": jax.device_put(
      np.zeros(8, np.float32),
      Format(Layout((0,)), SingleDeviceSharding(jwt.device(6))),
    ),
  }
  out = bt.restore(tmp_path / "c.npz", target)
  assert out["w"].sharding == target["w"].sharding
  assert out["b"].devices() == {jwt.device(6)}
  np.testing.assert_array_equal(np.asarray(out["w"]), tree["w"])


def test_lone_array_and_layout_placement(tmp_path):
  x = np.arange(12, dtype=np.float32).reshape(3, 4)
  bt.save(tmp_path / "x", x)
  assert sorted(os.listdir(tmp_path / "x")) == [
    "jaxworks_dtypes.json",
    "leaf.npy",
  ]
  fmt = Format(Layout((1, 0)), SingleDeviceSharding(jwt.device(1)))
  y = bt.restore(
    tmp_path / "x", jax.ShapeDtypeStruct(x.shape, x.dtype), placement=fmt
  )
  assert y.format.layout.major_to_minor == (1, 0)
  np.testing.assert_array_equal(np.asarray(y), x)


@pytest.mark.parametrize(
  "side, edit, text",
  [
    (
      "saved",
      lambda t: t["params"].pop("b"),
      r"1 leaves of the target are missing from .*: \['params'\]\['b'\] \(key 'params/b'\)",
    ),
    (
      "saved",
      lambda t: t.update(extra=np.ones(1)),
      r"holds 1 leaves the target has no leaf for: extra; .*partial_restore=True",
    ),
    (
      "target",
      lambda t: t["params"].update(w=np.ones((8, 5), np.float32)),
      r"leaf at \['params'\]\['w'\] \(key 'params/w'\) is stored in .*ckpt.* as "
      r"float32\[8, 4\] but the target expects shape \[8, 5\]",
    ),
  ],
)
def test_mismatches_raise_before_anything_is_placed(
  path, monkeypatch, side, edit, text
):
  saved, target_tree = sample_tree(), sample_tree()
  edit(saved if side == "saved" else target_tree)
  bt.save(path, saved)
  placed = []
  monkeypatch.setattr(restore_files, "place", lambda *a, **k: placed.append(a))
  with pytest.raises(ValueError, match=text) as info:
    bt.restore(path, like(target_tree))
  assert "jaxworks.batched_transfer.restore" in str(info.value)
  assert placed == []


def test_unsplittable_placement_raises_before_placing(tmp_path, monkeypatch):
  bt.save(tmp_path / "c.npz", {"ok": np.ones(8), "bad": np.ones(6)})
  mesh = jwt.mesh((8,), ("x",))  # 6 rows do not split 8 ways
  placed = []
  monkeypatch.setattr(restore_files, "place", lambda *a, **k: placed.append(a))
  with pytest.raises(
    ValueError, match=r"leaf at \['bad'\] with shape \(6,\) cannot be placed"
  ):
    bt.restore(
      tmp_path / "c.npz",
      like({"ok": np.ones(8), "bad": np.ones(6)}),
      placement=NamedSharding(mesh, P("x")),
    )
  assert placed == []


def test_failure_while_placing_leaves_nothing_behind(tmp_path, monkeypatch):
  tree = [np.ones(256, np.float32) for _ in range(4)]
  bt.save(tmp_path / "c.npz", tree)
  made = []
  real = restore_files.place

  def flaky(leaves, target=None, **kwargs):
    if made:
      raise RuntimeError("device fell over")
    out = real(leaves, target, **kwargs)
    made.extend(out)
    return out

  monkeypatch.setattr(restore_files, "place", flaky)
  with pytest.raises(RuntimeError, match="device fell over"):
    # batches of 2 leaves (half the budget): the first is placed, then the second fails
    bt.restore(tmp_path / "c.npz", like(tree), max_inflight_bytes=4096)
  assert len(made) == 2 and all(x.is_deleted() for x in made)
  assert not [t for t in threading.enumerate() if t.name == THREAD_NAME]


@jax.tree_util.register_pytree_with_keys_class
class _TwoX:
  """A pytree node whose two children have the same key name."""

  def __init__(self, a, b):
    self.a, self.b = a, b

  def tree_flatten_with_keys(self):
    key = jax.tree_util.GetAttrKey("x")
    return ((key, self.a), (key, self.b)), None

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(*children)


def test_bad_paths_and_arguments(tmp_path):
  with pytest.raises(FileNotFoundError, match="no checkpoint at"):
    bt.restore(tmp_path / "nope", like([np.ones(1)]))
  (tmp_path / "junk.npz").write_bytes(b"not a zip")
  with pytest.raises(ValueError, match="is not a readable .npz file"):
    bt.restore(tmp_path / "junk.npz", like([np.ones(1)]))
  with pytest.raises(
    ValueError, match="max_inflight_bytes must be a positive int"
  ):
    bt.restore(tmp_path / "junk.npz", like([np.ones(1)]), max_inflight_bytes=0)
  bt.save(tmp_path / "x.npz", [np.ones(1)])
  with pytest.raises(FileExistsError, match="pass overwrite=True"):
    bt.save(tmp_path / "x.npz", [np.ones(1)])
  with pytest.raises(ValueError, match="cannot name a file"):
    bt.save(tmp_path / "y.npz", {"a/b": np.ones(1)})
  with pytest.raises(
    ValueError, match=r"tree paths .*\.x and .*\.x both map to the key 'x'"
  ):
    bt.save(tmp_path / "y.npz", _TwoX(np.ones(1), np.ones(2)))
  (tmp_path / "mixed").mkdir()
  (tmp_path / "mixed" / "notes.txt").write_text("mine")
  with pytest.raises(FileExistsError, match="not an .npy file"):
    bt.save(tmp_path / "mixed", [np.ones(1)], overwrite=True)
  assert (tmp_path / "mixed" / "notes.txt").read_text() == "mine"


def test_overwrite_replaces(tmp_path):
  bt.save(tmp_path / "d", {"a": np.ones(2), "b": np.ones(2)})
  bt.save(tmp_path / "d", {"a": np.zeros(3)}, overwrite=True)
  out = bt.restore(tmp_path / "d", like({"a": np.zeros(3)}))
  np.testing.assert_array_equal(np.asarray(out["a"]), np.zeros(3))


def test_npz_is_readable_by_numpy(tmp_path):
  tree = {"params": {"w": np.arange(3.0)}}
  bt.save(tmp_path / "c.npz", tree)
  with np.load(tmp_path / "c.npz") as z:
    np.testing.assert_array_equal(z["params/w"], np.arange(3.0))
  with zipfile.ZipFile(tmp_path / "c.npz") as zf:
    assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())


class _Tty(io.StringIO):
  def isatty(self):
    return True


@pytest.mark.parametrize(
  "stream, progress, drawn",
  [
    (_Tty, None, True),
    (io.StringIO, None, False),
    (_Tty, False, False),
    (io.StringIO, True, True),
  ],
)
def test_progress_bar_only_on_a_terminal(
  tmp_path, monkeypatch, stream, progress, drawn
):
  bt.save(tmp_path / "c.npz", [np.ones(1024, np.float32)] * 4)
  err = stream()
  monkeypatch.setattr("sys.stderr", err)
  bt.restore(
    tmp_path / "c.npz", like([np.ones(1024, np.float32)] * 4), progress=progress
  )
  text = err.getvalue()
  assert ("restore [" in text and "100%" in text) == drawn
  assert (text == "") == (not drawn)


def test_restored_arrays_do_not_alias_the_files(tmp_path):
  # On CPU, jax.device_put aliases numpy memory (a memory map too) instead of copying;
  # restore reads into buffers of its own, so rewriting a file in place cannot change (or
  # fault) restored arrays.
  bt.save(tmp_path / "d", {"a": np.arange(4096, dtype=np.float32)})
  out = bt.restore(tmp_path / "d", like({"a": np.zeros(4096, np.float32)}))
  np.save(
    tmp_path / "d" / "a.npy", np.zeros(16, np.float32)
  )  # truncates the same inode
  np.testing.assert_array_equal(
    np.asarray(out["a"]), np.arange(4096, dtype=np.float32)
  )


# ----------------------------------------------------------------------------- data integrity


def _npy_bytes(a):
  buf = io.BytesIO()
  np.save(buf, a)
  return buf.getvalue()


def _no_placement(monkeypatch):
  placed = []
  monkeypatch.setattr(restore_files, "place", lambda *a, **k: placed.append(a))
  return placed


@pytest.mark.parametrize(
  "compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED]
)
@pytest.mark.parametrize("cut", [16, -8], ids=["short", "long"])
def test_npz_member_whose_data_disagrees_with_its_header(
  tmp_path, monkeypatch, compression, cut
):
  # A member whose data is shorter or longer than its header says is refused
  # (not restored filled with the next member's bytes).
  a, b = np.arange(8, dtype=np.float32), np.full(4, 7, np.float32)
  data = _npy_bytes(a)
  data = data[:-cut] if cut > 0 else data + b"\0" * -cut
  path = tmp_path / "c.npz"
  with zipfile.ZipFile(path, "w", compression=compression) as zf:
    zf.writestr("a.npy", data)
    zf.writestr("b.npy", _npy_bytes(b))
  if cut > 0:
    with (
      pytest.raises(ValueError),
      np.load(path) as z,
    ):  # numpy refuses the short member too
      z["a"]
  placed = _no_placement(monkeypatch)
  with pytest.raises(ValueError) as info:
    bt.restore(path, like({"a": a, "b": b}))
  text = str(info.value)
  assert "jaxworks.batched_transfer.restore" in text and "['a']" in text
  assert (
    f"member 'a.npy' of {str(path)!r} holds {32 - cut} bytes of data but its header "
    "(float32[8]) needs 32" in text
  )
  assert placed == []


def test_truncated_npy_names_the_file_the_leaf_and_the_api(
  tmp_path, monkeypatch
):
  # A truncated .npy raises a ValueError naming the file, the leaf and the API.
  bt.save(
    tmp_path / "d",
    {"params": {"w": np.arange(64, dtype=np.float32)}, "b": np.ones(2)},
  )
  file = tmp_path / "d" / "params" / "w.npy"
  file.write_bytes(file.read_bytes()[:-10])
  placed = _no_placement(monkeypatch)
  with pytest.raises(ValueError) as info:
    bt.restore(
      tmp_path / "d",
      like({"params": {"w": np.zeros(64, np.float32)}, "b": np.ones(2)}),
    )
  text = str(info.value)
  assert text.startswith(
    "jaxworks.batched_transfer.restore: the leaf at ['params']['w']"
  )
  assert (
    repr(str(file)) in text and "holds 246 bytes of data but its header" in text
  )
  assert "truncated or damaged" in text
  assert placed == []


def test_a_file_that_changes_after_validation_gets_a_clear_error(
  tmp_path, monkeypatch
):
  bt.save(tmp_path / "d", {"w": np.arange(64, dtype=np.float32)})
  file = tmp_path / "d" / "w.npy"
  real = reader.load

  def shrink_then_load(api, where, key, s, files):
    file.write_bytes(file.read_bytes()[:100])
    return real(api, where, key, s, files)

  monkeypatch.setattr(reader, "load", shrink_then_load)
  with pytest.raises(
    ValueError,
    match=r"restore: the leaf at \['w'\] \(key 'w'\): reading .*"
    r"w\.npy' failed: .*the file changed or is damaged",
  ):
    bt.restore(tmp_path / "d", like({"w": np.zeros(64, np.float32)}))


from dtypes import ML_DTYPES  # noqa: E402


def test_every_ml_dtype_round_trips_under_its_exact_name(path):
  # Every ml_dtypes type (float8_e5m2 and the other 1-byte ones included)
  # restores under its exact name, not as '<f1' or raw V1 bytes.
  tree = {
    d.name: (np.arange(12) % 2).astype(d).reshape(3, 4) for d in ML_DTYPES
  }
  bt.save(path, tree)
  out = bt.restore(path, like(tree))
  for name, x in tree.items():
    assert out[name].dtype == x.dtype
    assert np.asarray(out[name]).tobytes() == x.tobytes()


@pytest.mark.parametrize(
  "saved, wanted",
  [
    (ml_dtypes.float8_e4m3fn, ml_dtypes.int4),
    (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz),
    (ml_dtypes.int4, ml_dtypes.uint4),
    (jnp.bfloat16, np.float16),
    (ml_dtypes.float8_e5m2, np.int8),
  ],
)
def test_another_dtype_is_a_cast_like_numpy_astype(path, saved, wanted):
  # orbax restores onto the target's dtype; so does restore (numpy's astype
  # of the stored values, ml_dtypes included).
  x = (np.arange(8) % 5).astype(saved)
  bt.save(path, {"x": x})
  out = bt.restore(path, {"x": jax.ShapeDtypeStruct((8,), wanted)})
  ref = jax.device_put(x.astype(np.float32).astype(wanted))  # exact: 0..4
  assert jax.typeof(out["x"]) == jax.typeof(ref)
  assert np.asarray(out["x"]).tobytes() == np.asarray(ref).tobytes()


def test_raw_void_data_without_a_dtype_record_is_refused(tmp_path):
  # An .npz numpy wrote (a directory without a record is no checkpoint).
  np.savez(
    tmp_path / "d.npz", x=np.zeros(4, ml_dtypes.float8_e4m3fn)
  )  # numpy: '<V1'
  with pytest.raises(
    ValueError,
    match=r"stored in member 'x\.npy' of .* as raw 1-byte values with no "
    "dtype record",
  ):
    bt.restore(
      tmp_path / "d.npz",
      {"x": jax.ShapeDtypeStruct((4,), ml_dtypes.float8_e4m3fn)},
    )


@pytest.mark.parametrize(
  "record",
  [
    b"not json",
    b'{"format": 99, "dtypes": {}}',
    b'{"format": 1, "dtypes": {"x": "float77"}}',
    b'{"format": 1, "dtypes": {"x": "int8"}}',
  ],
)
def test_a_damaged_dtype_record_is_refused(tmp_path, record):
  bt.save(tmp_path / "d", {"x": np.zeros(4, np.float32)})
  (tmp_path / "d" / format.RECORD).write_bytes(record)
  with pytest.raises(
    ValueError, match="jaxworks.batched_transfer.restore: .*(damaged|knows)"
  ):
    bt.restore(tmp_path / "d", {"x": jax.ShapeDtypeStruct((4,), np.float32)})


def test_big_endian_input_raises_like_stock(tmp_path):
  # Big-endian input raises as stock device_put does (TypeError), instead of
  # placing values of an invalid dtype.
  x = np.arange(4, dtype=">f4")
  for tree in (x, [np.ones(2, np.float32), x], np.array(1.5, ">f8")):
    with pytest.raises(Exception) as theirs:
      jax.device_put(tree, jwt.device(1))
    with pytest.raises(Exception) as mine:
      bt.device_put(tree, jwt.device(1))
    assert type(mine.value) is type(theirs.value) is TypeError
    assert "non-native byte order" in str(mine.value)
  with pytest.raises(
    TypeError, match=r"save: the leaf at \['w'\] has non-native byte order"
  ):
    bt.save(tmp_path / "c.npz", {"w": x})
  assert not os.path.exists(tmp_path / "c.npz")
  # A big-endian numpy scalar is accepted by both.
  s = np.array(2.5, ">f4")[()]
  assert float(bt.device_put(s)) == float(jax.device_put(s)) == 2.5


def test_big_endian_npy_files_from_elsewhere_restore_their_values(tmp_path):
  x = np.arange(6, dtype=">i4").reshape(2, 3)
  np.savez(tmp_path / "d.npz", x=x)
  out = bt.restore(
    tmp_path / "d.npz", {"x": jax.ShapeDtypeStruct((2, 3), np.int32)}
  )
  np.testing.assert_array_equal(np.asarray(out["x"]), x)
  # A directory of such files has no record: it is no checkpoint.
  (tmp_path / "d").mkdir()
  np.save(tmp_path / "d" / "x.npy", x)
  with pytest.raises(FileNotFoundError, match=r"holds no 'jaxworks_dtypes"):
    bt.restore(tmp_path / "d")


@pytest.mark.parametrize("x64", [False, True])
def test_python_scalars_are_saved_as_jax_places_them(path, x64):
  # Python scalars are saved as jax.device_put places them, so a restore into
  # jax.eval_shape's tree (float32 with x64 off) works, and a Python scalar
  # in the target is a leaf of its dtype and weak type.
  with jax.enable_x64(x64):
    state = {
      "lr": 0.1,
      "step": 3,
      "flag": True,
      "z": 1 + 2j,
      "w": np.ones(2, np.float32),
    }
    bt.save(path, state)
    ref = jax.device_put(state)
    for target in (jax.eval_shape(lambda: state), state):
      out = bt.restore(path, target)
      for k in state:
        assert jax.typeof(out[k]) == jax.typeof(ref[k]), (
          k
        )  # dtype and weak type
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(ref[k]))
      assert out["lr"].weak_type and not out["w"].weak_type


def test_python_int_too_large_for_int32_is_saved_by_value(tmp_path):
  # Stock refuses to place it; save keeps it exactly (0.6 raised
  # OverflowError), with no array: restore gives the int back, also onto a
  # Python int target leaf, and refuses an array target leaf, naming it.
  with pytest.raises(OverflowError):
    jax.device_put(2**40)
  bt.save(tmp_path / "c.npz", {"n": 2**40, "m": -(2**200)})
  assert bt.restore(tmp_path / "c.npz") == {"n": 2**40, "m": -(2**200)}
  assert bt.metadata(tmp_path / "c.npz") == {"n": 2**40, "m": -(2**200)}
  out = bt.restore(tmp_path / "c.npz", {"n": 0, "m": 0})
  assert out == {"n": 2**40, "m": -(2**200)} and type(out["n"]) is int
  with pytest.raises(ValueError, match=r"\['n'\] .* as the Python int 1099"):
    bt.restore(
      tmp_path / "c.npz",
      {"n": jax.ShapeDtypeStruct((), np.int32), "m": 0},
    )


def test_numpy_64_bit_data_restores_into_jax_canonical_targets(tmp_path):
  # numpy data keeps its dtype on disk; a target with the dtype JAX gives it (what jax.eval_shape
  # reports with x64 off) gets what jax.device_put gives.
  state = {
    "w": np.linspace(0, 1, 7),
    "n": np.arange(3),
    "c": np.ones(2, np.complex128),
  }
  bt.save(tmp_path / "c.npz", state)
  for target in (jax.eval_shape(lambda: state), like(state)):
    out = bt.restore(tmp_path / "c.npz", target)
    ref = jax.device_put(state)
    for k in state:
      assert jax.typeof(out[k]) == jax.typeof(ref[k])
      assert np.asarray(out[k]).tobytes() == np.asarray(ref[k]).tobytes()
  with jax.enable_x64(True):  # float32 is then a cast of float64 data
    out = bt.restore(
      tmp_path / "c.npz",
      {
        "w": jax.ShapeDtypeStruct((7,), np.float32),
        "n": jax.ShapeDtypeStruct((3,), np.int64),
        "c": jax.ShapeDtypeStruct((2,), np.complex128),
      },
    )
    assert out["w"].dtype == np.float32 and out["n"].dtype == np.int64
    assert (
      np.asarray(out["w"]).tobytes() == state["w"].astype(np.float32).tobytes()
    )


def test_a_target_leaf_without_shape_and_dtype_is_named(tmp_path):
  bt.save(tmp_path / "c.npz", {"w": np.ones(3)})
  with pytest.raises(
    TypeError,
    match=r"restore: the target leaf at \['w'\] is 'abc' of type "
    "str, which has no shape and dtype",
  ):
    bt.restore(tmp_path / "c.npz", {"w": "abc"})


def test_a_target_sharding_over_an_abstract_mesh_is_refused_before_placing(
  tmp_path, monkeypatch
):
  # jax.eval_shape of a ShapeDtypeStruct gives its sharding an AbstractMesh (no devices).
  mesh = jwt.mesh_fit((4, 2), ("a", "b"))
  bt.save(tmp_path / "c.npz", {"w": np.ones((8, 4), np.float32)})
  like_w = jax.eval_shape(
    lambda: jax.ShapeDtypeStruct(
      (8, 4), np.float32, sharding=NamedSharding(mesh, P("a"))
    )
  )
  placed = _no_placement(monkeypatch)
  with pytest.raises(
    ValueError,
    match=r"restore: the target .* is over an AbstractMesh.*"
    r"the placement of the leaf at \['w'\]",
  ):
    bt.restore(tmp_path / "c.npz", {"w": like_w})
  assert placed == []


@pytest.mark.parametrize("fmt", ["npy", "npz"])
@pytest.mark.parametrize(
  "shape, spec",
  [((0, 8), P(None, "x")), ((8, 0), P("x")), ((0, 8), P("x")), ((0,), P())],
)
def test_restore_empty_array_onto_a_sharding(tmp_path, fmt, shape, spec):
  """Zero-size shards (views at one address) restore like stock device_put.

  Found by the differential test: they crashed with bad_function_call.
  """
  mesh = jwt.mesh_fit((8,), ("x",))
  value = np.zeros(shape, np.bool_)
  path = tmp_path / ("ckpt.npz" if fmt == "npz" else "ckpt")
  bt.save(path, {"w": value})
  sharding = NamedSharding(mesh, spec)
  target = {"w": jax.ShapeDtypeStruct(shape, value.dtype, sharding=sharding)}
  got = bt.restore(path, target)["w"]
  want = jax.device_put(value, sharding)
  assert got.shape == want.shape and got.dtype == want.dtype
  assert got.sharding == want.sharding
  assert [s.data.shape for s in got.addressable_shards] == [
    s.data.shape for s in want.addressable_shards
  ]
  # And device_put itself, which takes the same host route.
  put = bt.device_put(value, sharding)
  assert put.sharding == want.sharding and put.shape == want.shape
