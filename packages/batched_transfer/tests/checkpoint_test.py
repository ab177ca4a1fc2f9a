"""save / restore: round trips, validation before placement, streaming, progress."""

import io
import os
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from jaxworks import batched_transfer as bt
from jaxworks.batched_transfer._src import checkpoint


def sample_tree():
  rng = np.random.default_rng(0)
  return {
      "params": {"w": rng.standard_normal((8, 4)).astype(np.float32),
                 "b": np.arange(4, dtype=np.int32)},
      "layers": [np.ones((2, 3), jnp.bfloat16), np.asfortranarray(rng.random((3, 5)))],
      "step": np.array(7, np.int64),
      "empty": np.zeros((0, 3), np.float16),
      "on_device": jax.device_put(np.arange(6, dtype=np.uint8), jax.devices()[3]),
  }


def like(tree, sharding=None):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=sharding), tree)


@pytest.fixture(params=["npz", "dir"])
def path(request, tmp_path):
  return str(tmp_path / ("ckpt.npz" if request.param == "npz" else "ckpt"))


@pytest.mark.parametrize("x64", [False, True])
def test_round_trip(path, x64):
  with jax.enable_x64(x64):
    tree = sample_tree()
    bt.save(path, tree)
    out = bt.restore(path, like(tree), placement=jax.devices()[2])
    ref = jax.device_put(tree, jax.devices()[2])  # float64 -> float32 unless x64, as in JAX
  assert jax.tree.structure(out) == jax.tree.structure(tree)
  for got, want, stock in zip(jax.tree.leaves(out), jax.tree.leaves(tree), jax.tree.leaves(ref)):
    assert isinstance(got, jax.Array) and got.devices() == {jax.devices()[2]}
    assert jax.typeof(got) == jax.typeof(stock)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want).astype(got.dtype))


def test_placement_comes_from_the_target_leaves(tmp_path):
  mesh = jax.make_mesh((4, 2), ("a", "b"))
  tree = {"w": np.arange(32, dtype=np.float32).reshape(8, 4), "b": np.ones(8, np.float32)}
  bt.save(tmp_path / "c.npz", tree)
  target = {"w": jax.ShapeDtypeStruct((8, 4), np.float32,
                                      sharding=NamedSharding(mesh, P("a", "b"))),
            "b": jax.device_put(np.zeros(8, np.float32), Format(Layout((0,)),
                                                                SingleDeviceSharding(
                                                                    jax.devices()[6])))}
  out = bt.restore(tmp_path / "c.npz", target)
  assert out["w"].sharding == target["w"].sharding
  assert out["b"].devices() == {jax.devices()[6]}
  np.testing.assert_array_equal(np.asarray(out["w"]), tree["w"])


def test_lone_array_and_layout_placement(tmp_path):
  x = np.arange(12, dtype=np.float32).reshape(3, 4)
  bt.save(tmp_path / "x", x)
  assert sorted(os.listdir(tmp_path / "x")) == ["jaxworks_dtypes.json", "leaf.npy"]
  fmt = Format(Layout((1, 0)), SingleDeviceSharding(jax.devices()[1]))
  y = bt.restore(tmp_path / "x", jax.ShapeDtypeStruct(x.shape, x.dtype), placement=fmt)
  assert y.format.layout.major_to_minor == (1, 0)
  np.testing.assert_array_equal(np.asarray(y), x)


def test_npz_members_are_memory_mapped_and_compressed_ones_read(tmp_path, monkeypatch):
  tree = {"a": np.arange(1000, dtype=np.float64), "b": np.ones((4, 4), np.int16)}
  bt.save(tmp_path / "s.npz", tree)
  np.savez_compressed(tmp_path / "c.npz", **tree)  # written by numpy, deflated
  seen = []
  real = checkpoint.place

  def spy(leaves, target=None, **kwargs):
    seen.extend(type(x) for x in leaves)
    return real(leaves, target, **kwargs)

  monkeypatch.setattr(checkpoint, "place", spy)
  with jax.enable_x64(True):
    for name in ("s.npz", "c.npz"):
      out = bt.restore(tmp_path / name, like(tree))
      np.testing.assert_array_equal(np.asarray(out["a"]), tree["a"])
  assert seen == [np.memmap, np.memmap, np.ndarray, np.ndarray]


def test_directory_files_are_memory_mapped(tmp_path, monkeypatch):
  tree = {"a": {"deep": np.ones(5, np.float32)}}
  bt.save(tmp_path / "d", tree)
  assert os.path.isfile(tmp_path / "d" / "a" / "deep.npy")
  seen = []
  real = checkpoint.place
  monkeypatch.setattr(checkpoint, "place",
                      lambda leaves, target=None, **kw: seen.extend(map(type, leaves))
                      or real(leaves, target, **kw))
  bt.restore(tmp_path / "d", like(tree))
  assert seen == [np.memmap]


def test_streaming_is_bounded_by_max_inflight_bytes(tmp_path, monkeypatch):
  tree = [np.full(256, k, np.float32) for k in range(10)]  # 1 KiB each
  tree.append(np.zeros(2048, np.float32))  # 8 KiB: alone in its batch
  bt.save(tmp_path / "s.npz", tree)
  batches = []
  real = checkpoint.place

  def spy(leaves, target=None, **kwargs):
    batches.append(sum(x.nbytes for x in leaves))
    return real(leaves, target, **kwargs)

  monkeypatch.setattr(checkpoint, "place", spy)
  out = bt.restore(tmp_path / "s.npz", like(tree), max_inflight_bytes=3 * 1024)
  assert batches == [3072, 3072, 3072, 1024, 8192]
  assert [int(np.asarray(x)[0]) for x in out[:10]] == list(range(10))


@pytest.mark.parametrize("side, edit, text", [
    ("saved", lambda t: t["params"].pop("b"),
     r"1 leaves of the target are missing from .*: \['params'\]\['b'\] \(key 'params/b'\)"),
    ("saved", lambda t: t.update(extra=np.ones(1)),
     r"holds 1 arrays the target has no leaf for: extra"),
    ("target", lambda t: t["params"].update(w=np.ones((8, 5), np.float32)),
     r"leaf at \['params'\]\['w'\] \(key 'params/w'\) is stored as float32\[8, 4\] but the "
     r"target expects float32\[8, 5\]"),
    ("target", lambda t: t.update(step=np.array(7, np.int32)),
     r"leaf at \['step'\] .* stored as int64\[\] but the target expects int32\[\]"),
])
def test_mismatches_raise_before_anything_is_placed(path, monkeypatch, side, edit, text):
  saved, target_tree = sample_tree(), sample_tree()
  edit(saved if side == "saved" else target_tree)
  bt.save(path, saved)
  placed = []
  monkeypatch.setattr(checkpoint, "place", lambda *a, **k: placed.append(a))
  with pytest.raises(ValueError, match=text) as info:
    bt.restore(path, like(target_tree))
  assert "jaxworks.batched_transfer.restore" in str(info.value)
  assert placed == []


def test_unsplittable_placement_raises_before_placing(tmp_path, monkeypatch):
  bt.save(tmp_path / "c.npz", {"ok": np.ones(8), "bad": np.ones(6)})
  mesh = jax.make_mesh((8,), ("x",))
  placed = []
  monkeypatch.setattr(checkpoint, "place", lambda *a, **k: placed.append(a))
  with pytest.raises(ValueError, match=r"leaf at \['bad'\] with shape \(6,\) cannot be placed"):
    bt.restore(tmp_path / "c.npz", like({"ok": np.ones(8), "bad": np.ones(6)}),
               placement=NamedSharding(mesh, P("x")))
  assert placed == []


def test_failure_while_placing_leaves_nothing_behind(tmp_path, monkeypatch):
  tree = [np.ones(256, np.float32) for _ in range(4)]
  bt.save(tmp_path / "c.npz", tree)
  made = []
  real = checkpoint.place

  def flaky(leaves, target=None, **kwargs):
    if made:
      raise RuntimeError("device fell over")
    out = real(leaves, target, **kwargs)
    made.extend(out)
    return out

  monkeypatch.setattr(checkpoint, "place", flaky)
  with pytest.raises(RuntimeError, match="device fell over"):
    bt.restore(tmp_path / "c.npz", like(tree), max_inflight_bytes=2048)
  assert len(made) == 2 and all(x.is_deleted() for x in made)


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
  with pytest.raises(ValueError, match="max_inflight_bytes must be a positive int"):
    bt.restore(tmp_path / "junk.npz", like([np.ones(1)]), max_inflight_bytes=0)
  bt.save(tmp_path / "x.npz", [np.ones(1)])
  with pytest.raises(FileExistsError, match="pass overwrite=True"):
    bt.save(tmp_path / "x.npz", [np.ones(1)])
  with pytest.raises(ValueError, match="cannot name a file"):
    bt.save(tmp_path / "y.npz", {"a/b": np.ones(1)})
  with pytest.raises(ValueError, match=r"tree paths .*\.x and .*\.x both map to the key 'x'"):
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


@pytest.mark.parametrize("stream, progress, drawn", [
    (_Tty, None, True), (io.StringIO, None, False), (_Tty, False, False), (io.StringIO, True, True)])
def test_progress_bar_only_on_a_terminal(tmp_path, monkeypatch, stream, progress, drawn):
  bt.save(tmp_path / "c.npz", [np.ones(1024, np.float32)] * 4)
  err = stream()
  monkeypatch.setattr("sys.stderr", err)
  bt.restore(tmp_path / "c.npz", like([np.ones(1024, np.float32)] * 4), progress=progress)
  text = err.getvalue()
  assert ("restore [" in text and "100%" in text) == drawn
  assert (text == "") == (not drawn)


def test_restored_arrays_do_not_alias_the_files(tmp_path):
  # On CPU, jax.device_put aliases read-only numpy memory (a memory map) instead of copying;
  # restore copies, so rewriting a file in place cannot change (or fault) restored arrays.
  bt.save(tmp_path / "d", {"a": np.arange(4096, dtype=np.float32)})
  out = bt.restore(tmp_path / "d", like({"a": np.zeros(4096, np.float32)}))
  np.save(tmp_path / "d" / "a.npy", np.zeros(16, np.float32))  # truncates the same inode
  np.testing.assert_array_equal(np.asarray(out["a"]), np.arange(4096, dtype=np.float32))
