"""Artifact directories never harm a user's files, and read only their own.

* ``save_artifact(overwrite=True)`` replaces only a directory that holds
  nothing but an artifact of this package; anything else (a web app's
  ``manifest.json``, an artifact with a file of the user's beside it, a
  symbolic link) is refused and left exactly as it was.
* ``load_artifact`` opens each file inside the directory without following
  links, refuses what is not a regular file, and reads through the
  descriptor no more than the size the manifest records.
* What is exported is written and read back: typed PRNG keys, pytrees whose
  auxiliary data prints with an object address, every VJP order it writes.

A property test writes artifacts into directories that already hold other
files, links, FIFOs and sparse files, and asserts that nothing outside the
artifact changed.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import json
import pathlib
import shutil
import tempfile

from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Private imports below: a fallback path (no renameat2 exchange) and the
# vjp-order limit.
from jaxworks import stages_aot as sa
from jaxworks.stages_aot._src import artifact as artifact_module
from jaxworks.stages_aot._src import validate


def f(x):
  return jnp.sin(x) * 2.0


@pytest.fixture(scope="module")
def exported():
  return sa.trace(f, jax.ShapeDtypeStruct((3,), jnp.float32)).lower().export()


@pytest.fixture(scope="module")
def exported_cos():
  return (
    sa.trace(jnp.cos, jax.ShapeDtypeStruct((3,), jnp.float32)).lower().export()
  )


def snapshot(root: pathlib.Path) -> dict:
  """Every entry under ``root``: kind, size, content digest, link target."""
  out = {}
  for dirpath, dirnames, filenames in os.walk(root):
    for name in dirnames + filenames:
      p = pathlib.Path(dirpath) / name
      st = os.lstat(p)
      rel = str(p.relative_to(root))
      if p.is_symlink():
        out[rel] = ("link", os.readlink(p))
      elif p.is_fifo():
        out[rel] = ("fifo",)
      elif p.is_dir():
        out[rel] = ("dir",)
      elif st.st_size > (1 << 20):  # sparse stand-ins: size and mtime
        out[rel] = ("big", st.st_size, st.st_mtime_ns)
      else:
        out[rel] = ("file", p.read_bytes())
  return out


def test_overwrite_refuses_a_directory_whose_manifest_is_not_ours(
  tmp_path, exported
):
  """A web app's manifest.json beside the user's files."""
  app = tmp_path / "app"
  app.mkdir()
  (app / "manifest.json").write_text('{"name": "my app", "icons": []}')
  (app / "index.html").write_text("<html></html>")
  before = snapshot(tmp_path)
  with pytest.raises(sa.ArtifactError, match="refusing to overwrite"):
    sa.save_artifact(exported, app, overwrite=True)
  assert snapshot(tmp_path) == before


def test_overwrite_refuses_an_artifact_with_a_users_file_beside_it(
  tmp_path, exported, exported_cos
):
  art = tmp_path / "art"
  sa.save_artifact(exported, art)
  (art / "notes.txt").write_text("mine")
  before = snapshot(tmp_path)
  with pytest.raises(sa.ArtifactError, match="'notes.txt'.*move that file"):
    sa.save_artifact(exported_cos, art, overwrite=True)
  assert snapshot(tmp_path) == before


def test_overwrite_refuses_a_symbolic_link_destination(
  tmp_path, exported, exported_cos
):
  art = tmp_path / "art"
  sa.save_artifact(exported, art)
  link = tmp_path / "latest"
  link.symlink_to(art)
  before = snapshot(tmp_path)
  with pytest.raises(sa.ArtifactError, match="symbolic link"):
    sa.save_artifact(exported_cos, link, overwrite=True)
  assert snapshot(tmp_path) == before
  # Loading through a link to the directory is fine.
  assert sa.load_artifact(link).fun_name == "f"


def test_overwrite_replaces_only_the_artifact(tmp_path, exported, exported_cos):
  art = tmp_path / "art"
  sa.save_artifact(exported, art)
  (tmp_path / "neighbour.txt").write_text("untouched")
  sa.save_artifact(exported_cos, art, overwrite=True)
  assert sa.load_artifact(art).fun_name == "cos"
  assert (tmp_path / "neighbour.txt").read_text() == "untouched"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "neighbour.txt"]


def test_overwrite_without_an_atomic_exchange(
  tmp_path, exported, exported_cos, monkeypatch
):
  """Where renameat2 has no exchange, the old artifact stays until the new
  one is in place, and the result is the same."""
  monkeypatch.setattr(artifact_module, "_exchange", lambda a, b: False)
  art = tmp_path / "art"
  sa.save_artifact(exported, art)
  sa.save_artifact(exported_cos, art, overwrite=True)
  assert sa.load_artifact(art).fun_name == "cos"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_a_huge_sparse_file_is_refused_without_reading_it(
  tmp_path, exported, monkeypatch
):
  art = tmp_path / "art"
  sa.save_artifact(exported, art)
  recorded = json.loads((art / "manifest.json").read_text())["files"]
  size = recorded["exported.bin"]["size"]
  os.unlink(art / "exported.bin")
  with open(art / "exported.bin", "wb") as fh:
    fh.truncate(1 << 30)  # 1 GiB, sparse
  read = []
  real_read = os.read

  def counting_read(fd, n):
    data = real_read(fd, n)
    read.append(len(data))
    return data

  monkeypatch.setattr(os, "read", counting_read)
  with pytest.raises(sa.ArtifactError, match="longer than recorded"):
    sa.load_artifact(art, isolate=True)
  assert sum(read) <= max(v["size"] for v in recorded.values()) + 1
  assert size < (1 << 20)


def test_a_file_growing_after_its_check_is_refused(
  tmp_path, exported, monkeypatch
):
  art = tmp_path / "art"
  sa.save_artifact(exported, art)
  real_fstat = os.fstat

  def fstat_then_grow(fd):
    st = real_fstat(fd)
    if os.readlink(f"/proc/self/fd/{fd}").endswith("exported.bin"):
      with open(art / "exported.bin", "ab") as fh:
        fh.write(b"x" * 4096)
    return st

  monkeypatch.setattr(os, "fstat", fstat_then_grow)
  with pytest.raises(sa.ArtifactError, match="exported.bin is longer"):
    sa.load_artifact(art)


@pytest.mark.parametrize("kind", ["outside", "inside"])
def test_a_symlinked_file_is_not_followed(tmp_path, exported, kind):
  art = tmp_path / "art"
  sa.save_artifact(exported, art)
  real = tmp_path / "elsewhere.bin"
  shutil.copy(art / "exported.bin", real)
  os.unlink(art / "exported.bin")
  if kind == "inside":  # even a link to a copy inside the directory
    shutil.copy(real, art / "copy.bin")
    os.symlink("copy.bin", art / "exported.bin")
  else:
    os.symlink(real, art / "exported.bin")
  with pytest.raises(sa.ArtifactError, match="exported.bin is a symbolic"):
    sa.load_artifact(art)


def test_a_load_asks_for_no_more_than_the_files_hold(
  tmp_path, exported, monkeypatch
):
  """Each read asks for about a file's size: a read allocates what it asks
  for, and a manifest of 2 KB cost a 16 MiB buffer."""
  art = tmp_path / "art"
  sa.save_artifact(exported, art)
  sizes = {p.name: p.stat().st_size for p in art.iterdir()}
  asked = []
  real_read = os.read

  def recording_read(fd, n):
    asked.append(n)
    return real_read(fd, n)

  monkeypatch.setattr(os, "read", recording_read)
  sa.load_artifact(art)
  assert asked and max(asked) <= max(max(sizes.values()) + 1, 1 << 16), asked


def test_a_manifest_of_many_reads_loads(tmp_path, exported):
  """A manifest longer than one read (padded with JSON whitespace)."""
  art = tmp_path / "art"
  sa.save_artifact(exported, art)
  text = (art / "manifest.json").read_text()
  (art / "manifest.json").write_text(text + " " * (3 << 16))
  x = np.linspace(0, 1, 3, dtype=np.float32)
  np.testing.assert_array_equal(sa.load_artifact(art)(x), exported(x))


def test_a_file_is_not_an_artifact_directory(tmp_path, exported):
  art = tmp_path / "art"
  sa.save_artifact(exported, art)
  with pytest.raises(
    sa.ArtifactError, match=r"load_artifact: .*manifest.json is not a directory"
  ):
    sa.load_artifact(art / "manifest.json")


def test_a_loaded_program_shares_what_deserialize_compiled(tmp_path):
  """load_artifact keys its callables by the sha256 the manifest checked,
  deserialize by the one it computes: the same bytes share one callable
  (and so JAX's caches), the VJP's too; the module digests written again
  are the ones loaded."""
  exp = (
    sa.trace(jnp.sin, jax.ShapeDtypeStruct((3,), jnp.float32))
    .lower()
    .export(vjp_order=1)
  )
  sa.save_artifact(exp, tmp_path / "a")
  loaded = sa.load_artifact(tmp_path / "a").exported
  again = sa.deserialize((tmp_path / "a" / "exported.bin").read_bytes())
  assert loaded._flat() is again._flat()
  assert loaded.vjp()._flat() is again.vjp()._flat()
  sa.save_artifact(loaded, tmp_path / "b")
  manifests = [
    json.loads((tmp_path / d / "manifest.json").read_text()) for d in "ab"
  ]
  assert manifests[0]["levels"] == manifests[1]["levels"]
  assert len(manifests[0]["levels"]) == 2


def test_a_fifo_is_refused_without_blocking(tmp_path, exported):
  art = tmp_path / "art"
  sa.save_artifact(exported, art)
  os.unlink(art / "exported.bin")
  os.mkfifo(art / "exported.bin")
  with pytest.raises(sa.ArtifactError, match="not a regular file"):
    sa.load_artifact(art)


def test_a_symlinked_manifest_is_not_followed(tmp_path, exported):
  art = tmp_path / "art"
  sa.save_artifact(exported, art)
  os.rename(art / "manifest.json", tmp_path / "m.json")
  os.symlink(tmp_path / "m.json", art / "manifest.json")
  with pytest.raises(sa.ArtifactError, match="manifest.json is a symbolic"):
    sa.load_artifact(art)


#: What a directory may already hold before an artifact is written into it.
ENTRIES = st.lists(
  st.tuples(
    st.sampled_from(
      [
        "manifest.json",
        "exported.bin",
        "module.stablehlo.mlir",
        "index.html",
        "sub",
      ]
    ),
    st.sampled_from(["file", "webmanifest", "link", "fifo", "sparse", "dir"]),
  ),
  max_size=3,
  unique_by=lambda e: e[0],
)


def _populate(d: pathlib.Path, entries, outside: pathlib.Path):
  d.mkdir()
  for name, kind in entries:
    p = d / name
    if kind == "file":
      p.write_bytes(b"user data " + name.encode())
    elif kind == "webmanifest":
      p.write_text('{"name": "app"}')
    elif kind == "link":
      p.symlink_to(outside)
    elif kind == "fifo":
      os.mkfifo(p)
    elif kind == "sparse":
      with open(p, "wb") as fh:
        fh.truncate(1 << 30)
    else:
      p.mkdir()
      (p / "inner.txt").write_text("inner")


@settings(
  max_examples=40,
  deadline=None,
  derandomize=True,
  suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(entries=ENTRIES, overwrite=st.booleans(), prior=st.booleans())
def test_nothing_outside_the_artifact_changes(
  exported, exported_cos, entries, overwrite, prior
):
  root = pathlib.Path(tempfile.mkdtemp())
  try:
    outside = root / "outside.txt"
    outside.write_text("outside")
    target = root / "target"
    if prior:  # an artifact of ours, then the user's entries beside it
      sa.save_artifact(exported, target)
      for name, _ in entries:
        p = target / name
        if p.exists() or p.is_symlink():
          p.unlink()
      _populate_into = target
      target_tmp = root / "staging"
      _populate(target_tmp, entries, outside)
      for p in target_tmp.iterdir():
        os.rename(p, _populate_into / p.name)
      target_tmp.rmdir()
    else:
      _populate(target, entries, outside)
    before = snapshot(root)
    ours = {"manifest.json", "exported.bin", "module.stablehlo.mlir"}
    try:
      sa.save_artifact(exported_cos, target, overwrite=overwrite)
    except sa.ArtifactError:
      assert snapshot(root) == before  # refused: nothing changed at all
      return
    # Written: the target is exactly the new artifact, all else unchanged.
    assert sa.load_artifact(target).fun_name == "cos"
    after = snapshot(root)
    rest = lambda snap: {
      k: v for k, v in snap.items() if k.split("/")[0] != "target"
    }
    assert rest(after) == rest(before)
    assert {p.name for p in target.iterdir()} == ours
    # Only an empty directory, or one holding only our artifact, is replaced.
    held = {k.split("/", 1)[1] for k in before if k.startswith("target/")}
    assert held <= ours
    assert not held or overwrite
  finally:
    shutil.rmtree(root)


def test_typed_prng_keys_export_save_load_and_call_as_stock(tmp_path):
  def g(key, x):
    return jax.random.normal(key, x.shape) + x, jax.random.split(key)

  key = jax.random.key(0)
  x = jnp.ones(3, jnp.float32)
  exp = sa.trace(g, key, x).lower().export()
  assert "key<fry>[]" in repr(exp)
  sa.save_artifact(exp, tmp_path / "art")
  loaded = sa.load_artifact(tmp_path / "art")
  stock = jax.export.deserialize(
    jax.export.export(jax.jit(g))(key, x).serialize()
  )
  got, want = loaded.call(key, x), stock.call(key, x)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  assert got[1].dtype == want[1].dtype
  np.testing.assert_array_equal(
    jax.random.key_data(got[1]), jax.random.key_data(want[1])
  )
  manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
  assert manifest["inputs"][0]["dtype"] == "key<fry>"


class Box:
  """A pytree node whose auxiliary data prints with its object address."""

  def __init__(self, value, meta):
    self.value = value
    self.meta = meta


class Meta:
  def __eq__(self, other):
    return isinstance(other, Meta)

  def __hash__(self):
    return 0


jax.tree_util.register_pytree_node(
  Box, lambda b: ((b.value,), b.meta), lambda meta, ch: Box(ch[0], meta)
)
jax.export.register_pytree_node_serialization(
  Box,
  serialized_name="artifact_files_test.Box",
  serialize_auxdata=lambda meta: b"",
  deserialize_auxdata=lambda data: Meta(),
)


def test_a_tree_whose_aux_data_prints_an_address_round_trips(tmp_path):
  def h(box):
    return Box(box.value * 2.0, box.meta)

  arg = Box(jnp.ones(2, jnp.float32), Meta())
  exp = sa.trace(h, arg).lower().export()
  sa.save_artifact(exp, tmp_path / "art")
  loaded = sa.load_artifact(tmp_path / "art")
  out = loaded.call(Box(jnp.full(2, 3.0, jnp.float32), Meta()))
  np.testing.assert_array_equal(np.asarray(out.value), [6.0, 6.0])
  stock = jax.export.deserialize(exp.jax_exported.serialize())
  assert str(stock.in_tree) != str(exp.in_tree)  # the address differs


def test_every_vjp_order_written_is_read_back(tmp_path):
  limit = validate.MAX_VJP_LEVELS
  lowered = sa.trace(jnp.sin, jax.ShapeDtypeStruct((), jnp.float32)).lower()
  with pytest.raises(ValueError, match=f"vjp_order={limit + 1} is more than"):
    lowered.export(vjp_order=limit + 1)
  with pytest.raises(ValueError, match="vjp_order <= "):
    sa.Exported(lowered.export().jax_exported, vjp_order=limit + 1)
  exp = lowered.export(vjp_order=2)
  sa.save_artifact(exp, tmp_path / "art")
  assert sa.load_artifact(tmp_path / "art").exported.vjp_order == 2
