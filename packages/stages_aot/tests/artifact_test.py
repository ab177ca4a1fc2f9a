"""Artifact directories: manifest contents, and loading damaged artifacts."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import hashlib
import json
import re

from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jaxlib
import jaxworks_testing as jwt
import numpy as np
import pytest

from jaxworks import stages_aot as sa

W = np.linspace(-1, 1, 128 * 16, dtype=np.float32).reshape(128, 16)


def f(x, w):
  return jnp.tanh(x @ w).sum(axis=1)


@pytest.fixture(scope="module")
def exported():
  specs = sa.arg_specs("f32[b,128]", "f32[128,16]")
  return (
    sa.trace(f, *specs)
    .lower(lowering_platforms=("cpu", "tpu"))
    .export(vjp_order=1)
  )


@pytest.fixture
def artifact_dir(tmp_path, exported):
  sa.save_artifact(exported, tmp_path / "art")
  return tmp_path / "art"


def read_manifest(d):
  return json.loads((d / "manifest.json").read_text())


def write_manifest(d, manifest):
  (d / "manifest.json").write_text(json.dumps(manifest))


def test_manifest_contents(artifact_dir, exported):
  m = read_manifest(artifact_dir)
  assert sorted(p.name for p in artifact_dir.iterdir()) == [
    "exported.bin",
    "manifest.json",
    "module.stablehlo.mlir",
  ]
  assert m["fun_name"] == "f" and m["platforms"] == ["cpu", "tpu"]
  assert m["calling_convention_version"] == exported.calling_convention_version
  assert (
    m["vjp_order"] == 1
    and m["nr_devices"] == 1
    and m["uses_shape_polymorphism"]
  )
  assert [
    (v["name"], v["aval"], v["shape"], v["dtype"], v["sharding"])
    for v in m["inputs"]
  ] == [
    ("args[0]", "f32[b,128]", ["b", 128], "float32", None),
    ("args[1]", "f32[128,16]", [128, 16], "float32", None),
  ]
  assert [(v["name"], v["aval"]) for v in m["outputs"]] == [("out", "f32[b]")]
  assert (
    m["versions"]["jax"] == jax.__version__
    and m["versions"]["jaxlib"] == jaxlib.__version__
  )
  assert m["versions"]["jaxworks.stages_aot"] == sa.__version__
  for name in ("exported.bin", "module.stablehlo.mlir"):
    data = (artifact_dir / name).read_bytes()
    assert m["files"][name] == {
      "sha256": hashlib.sha256(data).hexdigest(),
      "size": len(data),
    }
  assert (
    artifact_dir / "module.stablehlo.mlir"
  ).read_text() == exported.mlir_text()
  # The VJP part is re-exported at each serialize() (its source locations
  # differ); the primal program is stored exactly.
  stored = sa.deserialize((artifact_dir / "exported.bin").read_bytes())
  assert stored.mlir_text() == exported.mlir_text() and stored.vjp_order == 1


def test_load_and_run_equals_original(artifact_dir):
  art = sa.load_artifact(artifact_dir)
  present = sa.present_platforms()  # ("cpu",) here; a TPU machine has both
  assert (
    art.fun_name == "f"
    and art.platforms == ("cpu", "tpu")
    and art.runnable_platforms
    == tuple(p for p in ("cpu", "tpu") if p in present)
  )
  x = np.ones((3, 128), np.float32)
  np.testing.assert_allclose(art(x, W), f(x, W), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
    jax.grad(lambda a: art.exported(a, W).sum())(x),
    jax.grad(lambda a: f(a, W).sum())(x),
    rtol=1e-5,
    atol=1e-5,
  )
  summary = art.summary()
  marks = ", ".join(
    f"{p} ({'present' if p in present else 'not present'})"
    for p in ("cpu", "tpu")
  )
  assert f"platforms           {marks}" in summary
  assert "args[0]  f32[b,128]" in summary


def test_sharded_manifest(tmp_path):
  mesh = jwt.mesh(
    (4, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  spec = jax.ShapeDtypeStruct(
    (8, 4), jnp.float32, sharding=NamedSharding(mesh, P("x", "y"))
  )
  exp = sa.trace(lambda a: a * 2, spec).lower().export()
  art = sa.save_artifact(exp, tmp_path / "sharded")
  (inp,) = art.manifest["inputs"]
  assert inp["sharding"] == {
    "spec": ["x", "y"],
    "mesh_axis_names": ["x", "y"],
    "mesh_axis_sizes": [4, 2],
    "memory_kind": inp["sharding"]["memory_kind"],
  }
  assert art.manifest["nr_devices"] == 8
  assert (
    "P('x', 'y') mesh(x=4, y=2)"
    in sa.load_artifact(tmp_path / "sharded").summary()
  )


def test_truncated_program(artifact_dir):
  path = artifact_dir / "exported.bin"
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])
  with pytest.raises(
    sa.ArtifactError,
    match=rf"exported.bin is truncated: {len(data) // 2} bytes, the manifest says {len(data)}",
  ):
    sa.load_artifact(artifact_dir)


def test_corrupted_program_same_size(artifact_dir):
  path = artifact_dir / "exported.bin"
  data = bytearray(path.read_bytes())
  data[len(data) // 3] ^= 0xFF
  path.write_bytes(bytes(data))
  with pytest.raises(
    sa.ArtifactError,
    match=r"exported.bin is corrupted: sha256 [0-9a-f]{64} does not match the manifest",
  ):
    sa.load_artifact(artifact_dir)


def test_edited_stablehlo_text(artifact_dir):
  path = artifact_dir / "module.stablehlo.mlir"
  path.write_text(path.read_text().replace("tanh", "tanx"))
  with pytest.raises(
    sa.ArtifactError, match="module.stablehlo.mlir is corrupted"
  ):
    sa.load_artifact(artifact_dir)


def test_missing_file(artifact_dir):
  (artifact_dir / "exported.bin").unlink()
  with pytest.raises(
    sa.ArtifactError,
    match="exported.bin is missing; copy the whole artifact directory",
  ):
    sa.load_artifact(artifact_dir)


def test_truncated_manifest(artifact_dir):
  text = (artifact_dir / "manifest.json").read_text()
  (artifact_dir / "manifest.json").write_text(text[: len(text) // 2])
  with pytest.raises(
    sa.ArtifactError,
    match="manifest.json is not valid JSON .* truncated or corrupted",
  ):
    sa.load_artifact(artifact_dir)


def test_edited_manifest_platforms(artifact_dir):
  m = read_manifest(artifact_dir)
  m["platforms"] = ["cpu"]
  write_manifest(artifact_dir, m)
  with pytest.raises(
    sa.ArtifactError,
    match=r"disagrees with exported.bin on platforms: manifest \['cpu'\], program \['cpu', 'tpu'\]",
  ):
    sa.load_artifact(artifact_dir)


def test_edited_manifest_avals(artifact_dir):
  m = read_manifest(artifact_dir)
  m["inputs"][0]["aval"] = "f32[b,64]"
  write_manifest(artifact_dir, m)
  with pytest.raises(
    sa.ArtifactError, match="disagrees with exported.bin on inputs"
  ):
    sa.load_artifact(artifact_dir)


def test_edited_manifest_hash(artifact_dir):
  m = read_manifest(artifact_dir)
  m["files"]["exported.bin"]["sha256"] = "0" * 64
  write_manifest(artifact_dir, m)
  with pytest.raises(sa.ArtifactError, match="exported.bin is corrupted"):
    sa.load_artifact(artifact_dir)


@pytest.mark.parametrize(
  "version, hint", [(99, "upgrade jax"), (1, "re-export it with this jax")]
)
def test_unsupported_calling_convention(artifact_dir, version, hint):
  m = read_manifest(artifact_dir)
  m["calling_convention_version"] = version
  write_manifest(artifact_dir, m)
  lo = jax.export.minimum_supported_calling_convention_version
  hi = jax.export.maximum_supported_calling_convention_version
  with pytest.raises(
    sa.ArtifactError,
    match=rf"uses calling convention version {version}, but this jax supports versions {lo}..{hi}; {hint}",
  ):
    sa.load_artifact(artifact_dir)


@pytest.mark.parametrize(
  "edit, match",
  [
    (lambda m: m.pop("fun_name"), "lacks the field 'fun_name'"),
    (
      lambda m: m.update(vjp_order="1"),
      "field 'vjp_order' is '1', expected a int",
    ),
    (
      lambda m: m.update(format="other"),
      "has format 'other', expected 'jaxworks.stages_aot.artifact'",
    ),
    (
      lambda m: m.update(format_version=7),
      "has format_version 7; this jaxworks.stages_aot",
    ),
    (
      lambda m: m["files"].update({"../x": {"sha256": "0", "size": 1}}),
      "outside the artifact directory",
    ),
    (
      lambda m: m.update(vjp_order=3),
      "disagrees with exported.bin on vjp_order: manifest 3, program 1",
    ),
    (
      lambda m: m["inputs"][1].update(sharding={}),
      r"disagrees with exported.bin on inputs\[1\]: manifest \{.*'sharding': \{\}",
    ),
    (
      lambda m: m["outputs"][0].pop("name"),
      r"disagrees with exported.bin on outputs\[0\]",
    ),
    (
      lambda m: m.update(uses_shape_polymorphism=False),
      "on uses_shape_polymorphism: manifest False, program True",
    ),
  ],
)
def test_bad_manifest_fields(artifact_dir, edit, match):
  m = read_manifest(artifact_dir)
  edit(m)
  write_manifest(artifact_dir, m)
  with pytest.raises(sa.ArtifactError, match=match):
    sa.load_artifact(artifact_dir)


def test_unreadable_file(artifact_dir, monkeypatch):
  real = os.open

  def refusing_open(path, *args, **kwargs):
    if os.fspath(path).endswith("exported.bin"):
      raise PermissionError(13, "Permission denied", os.fspath(path))
    return real(path, *args, **kwargs)

  monkeypatch.setattr(os, "open", refusing_open)
  with pytest.raises(
    sa.ArtifactError,
    match=r"cannot read .*exported.bin \(\[Errno 13\] Permission denied.*check its permissions",
  ):
    sa.load_artifact(artifact_dir)


JSON = st.recursive(
  st.none()
  | st.booleans()
  | st.integers(-3, 3)
  | st.sampled_from(["", "cpu", "f32[b,128]", "b"]),
  lambda inner: (
    st.lists(inner, max_size=3)
    | st.dictionaries(
      st.sampled_from(["spec", "name", "aval", "x"]), inner, max_size=3
    )
  ),
  max_leaves=6,
)


def _json_paths(value, path=()):
  yield path
  items = (
    value.items()
    if isinstance(value, dict)
    else enumerate(value)
    if isinstance(value, list)
    else ()
  )
  for key, child in items:
    yield from _json_paths(child, path + (key,))


@settings(
  max_examples=40,
  deadline=None,
  suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.data())
def test_fuzz_edited_manifest_is_refused_or_loads(artifact_dir, data):
  """Any edit of manifest.json (that keeps it JSON) loads, or raises ArtifactError; never anything else."""
  original = (artifact_dir / "manifest.json").read_text()
  m = json.loads(original)
  paths = [p for p in _json_paths(m) if p]
  path = data.draw(st.sampled_from(paths))
  parent = m
  for key in path[:-1]:
    parent = parent[key]
  if data.draw(st.booleans()):
    parent[path[-1]] = data.draw(JSON)
  elif isinstance(parent, dict):
    del parent[path[-1]]
  else:
    parent.pop(path[-1])
  write_manifest(artifact_dir, m)
  try:
    art = sa.load_artifact(artifact_dir, require_platform=False)
    assert "function            f" in art.summary()
  except sa.ArtifactError as e:
    assert str(e).startswith("jaxworks.stages_aot.load_artifact: ")
  finally:
    (artifact_dir / "manifest.json").write_text(original)


def test_not_an_artifact(tmp_path):
  with pytest.raises(sa.ArtifactError, match="is not a directory"):
    sa.load_artifact(tmp_path / "nope")
  with pytest.raises(
    sa.ArtifactError,
    match="has no manifest.json, so it is not a stages_aot artifact",
  ):
    sa.load_artifact(tmp_path)


def test_platform_availability(tmp_path):
  present = sa.present_platforms()
  # Two platforms this host lacks (on a TPU machine, not the TPU).
  absent = ("tpu", "cuda") if "tpu" not in present else ("cuda", "rocm")
  exp = (
    sa.trace(jnp.sin, np.ones(3, np.float32))
    .lower(lowering_platforms=absent)
    .export()
  )
  sa.save_artifact(exp, tmp_path / "tpu")
  expected = f"it was exported for {absent!r}, and this host has {present!r}; re-export with --platform"
  with pytest.raises(
    sa.ArtifactError, match="cannot load artifact .*" + re.escape(expected)
  ):
    sa.load_artifact(tmp_path / "tpu")
  art = sa.load_artifact(tmp_path / "tpu", require_platform=False)
  assert art.runnable_platforms == ()
  assert (
    f"{absent[0]} (not present), {absent[1]} (not present)" in art.summary()
  )
  with pytest.raises(sa.ArtifactError, match="cannot call artifact"):
    art(np.ones(3, np.float32))


def test_save_refuses_to_clobber(tmp_path, exported):
  other = tmp_path / "other"
  other.mkdir()
  (other / "notes.txt").write_text("mine")
  with pytest.raises(
    sa.ArtifactError, match="exists and is not empty; pass overwrite=True"
  ):
    sa.save_artifact(exported, other)
  with pytest.raises(
    sa.ArtifactError, match="refusing to overwrite .* it has no manifest.json"
  ):
    sa.save_artifact(exported, other, overwrite=True)
  assert (other / "notes.txt").read_text() == "mine"
  with pytest.raises(
    TypeError, match="save_artifact: expected a jaxworks.stages_aot.Exported"
  ):
    sa.save_artifact(exported.jax_exported, tmp_path / "x")


def test_overwrite_replaces_an_artifact(tmp_path, exported):
  target = tmp_path / "art"
  sa.save_artifact(exported, target)
  cos = sa.trace(jnp.cos, np.ones(2, np.float32)).lower().export()
  sa.save_artifact(cos, target, overwrite=True)
  assert sa.load_artifact(target).fun_name == "cos"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
