"""Every PartitionSpec shape on 1-D and 2-D meshes (replicated axes included), every dtype, both
checkpoint formats: restore and device_put place exactly what jax.device_put places."""

# Every numpy and ml_dtypes type jax.device_put accepts on CPU (float6_* are not placeable).
from dtypes import DTYPES
import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jaxworks_testing as jwt
import ml_dtypes
import numpy as np
import pytest

from jaxworks import batched_transfer as bt

# (mesh shape, axis names, specs): every way to split or replicate a rank-2 array.
MESHES = [
  ((8,), ("x",), [P(), P("x"), P(None, "x"), P("x", None)]),
  (
    (4, 2),
    ("a", "b"),
    [
      P(),
      P("a"),
      P("b"),
      P(None, "a"),
      P(None, "b"),
      P("a", "b"),
      P("b", "a"),
      P(("a", "b")),
      P(("b", "a")),
      P(None, ("a", "b")),
      P("a", None),
    ],
  ),
  ((2, 4), ("a", "b"), [P("a"), P(None, "b"), P("b", "a")]),
]
SHAPE = (8, 16)


def shardings():
  out = {}
  for m, (shape, names, specs) in enumerate(MESHES):
    # On fewer devices (one chip), meshes of the same rank over those.
    mesh = jwt.mesh_fit(shape, names)
    for k, spec in enumerate(specs):
      out[f"m{m}_s{k}"] = NamedSharding(mesh, spec)
  return out


def values(dtype, n):
  # Small integers are exact in every dtype above except float8_e8m0fnu (powers of two).
  base = np.arange(int(np.prod(SHAPE)), dtype=np.int64).reshape(SHAPE) + n
  if dtype == ml_dtypes.float8_e8m0fnu:
    return np.exp2((base % 8).astype(np.float32)).astype(dtype)
  if dtype == np.bool_:
    return base % 3 == 0
  return (base % 4).astype(dtype)


def assert_same_as_stock(out, ref):
  assert jax.typeof(out) == jax.typeof(ref)  # shape, dtype, weak type, sharding
  assert out.sharding == ref.sharding and out.committed == ref.committed
  for a, b in zip(out.addressable_shards, ref.addressable_shards):
    assert a.device == b.device and a.index == b.index
    # Bytes, not values: NaN payloads and every ml_dtype compare exactly.
    assert np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes()


@pytest.mark.parametrize("fmt", ["npz", "dir"])
@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
def test_restore_onto_every_spec(tmp_path, fmt, dtype):
  jwt.require_dtype(dtype)
  targets = shardings()
  tree = {k: values(dtype, n) for n, k in enumerate(targets)}
  path = tmp_path / ("c.npz" if fmt == "npz" else "c")
  bt.save(path, tree)
  like = {
    k: jax.ShapeDtypeStruct(SHAPE, dtype, sharding=s)
    for k, s in targets.items()
  }
  out = bt.restore(path, like)
  for k, s in targets.items():
    assert_same_as_stock(out[k], jax.device_put(tree[k], s))


@pytest.mark.parametrize("dtype", DTYPES, ids=[d.name for d in DTYPES])
def test_device_put_onto_every_spec(dtype):
  jwt.require_dtype(dtype)
  targets = shardings()
  tree = {k: values(dtype, n) for n, k in enumerate(targets)}
  out, ref = bt.device_put(tree, targets), jax.device_put(tree, targets)
  for k in targets:
    assert_same_as_stock(out[k], ref[k])


def test_partly_replicated_restore(tmp_path):
  # A restore onto a sharding that replicates the array over one mesh axis
  # places it as jax.device_put does.
  mesh = jwt.mesh_fit((4, 2), ("a", "b"))
  w = np.arange(32, dtype=np.float32).reshape(8, 4)
  bt.save(tmp_path / "c.npz", {"w": w})
  for spec in (P("a"), P(None, "b")):
    s = NamedSharding(mesh, spec)
    out = bt.restore(
      tmp_path / "c.npz",
      {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=s)},
    )
    assert_same_as_stock(out["w"], jax.device_put(w, s))


def test_each_replica_has_its_own_buffer(tmp_path):
  # Devices that hold the same index must not share one buffer (a donation on one would
  # change the other).
  mesh = jwt.mesh((4, 2), ("a", "b"))
  s = NamedSharding(mesh, P("a"))
  bt.save(tmp_path / "c", {"w": np.ones((8, 4), np.float32)})
  out = bt.restore(
    tmp_path / "c", {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=s)}
  )
  pointers = [
    x.data.unsafe_buffer_pointer() for x in out["w"].addressable_shards
  ]
  assert len(set(pointers)) == len(pointers) == 8
