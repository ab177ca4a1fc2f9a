"""Damaged artifacts whose manifest was re-hashed: refused at load, or exact.

The manifest's sha256 of exported.bin is updated after each damage, so only
the checks of the program itself stand between the damage and a call: the
load raises ArtifactError naming exported.bin, or the loaded program gives
exactly the undamaged results (also its gradient). Also: directory
permissions follow the umask.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses
import hashlib
import json
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks import stages_aot as sa

C = np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)
X = np.linspace(0, 1, 24, dtype=np.float32).reshape(3, 8)
W = np.linspace(-1, 1, 16, dtype=np.float32).reshape(8, 2)


def f(params, x, *, scale):
  return jnp.tanh(x @ params["w"] + C).sum(axis=1) * scale


ARGS = ({"w": W}, X)
KWARGS = {"scale": np.float32(3.0)}


def call_and_grad(exp):
  out = np.asarray(exp(*ARGS, **KWARGS))
  grad = jax.grad(lambda x: exp(ARGS[0], x, **KWARGS).sum())(X)
  return out, np.asarray(grad)


@pytest.fixture(scope="module")
def exported():
  return (
    sa.trace(f, *ARGS, **KWARGS)
    .lower(lowering_platforms=("cpu", "tpu"))
    .export(vjp_order=1)
  )


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, exported):
  path = tmp_path_factory.mktemp("damage") / "art"
  sa.save_artifact(exported, path)
  blob = (path / "exported.bin").read_bytes()
  manifest = (path / "manifest.json").read_text()
  return path, blob, manifest, call_and_grad(sa.load_artifact(path))


def write_rehashed(path, manifest_text, data):
  (path / "exported.bin").write_bytes(data)
  manifest = json.loads(manifest_text)
  manifest["files"]["exported.bin"] = {
    "sha256": hashlib.sha256(data).hexdigest(),
    "size": len(data),
  }
  (path / "manifest.json").write_text(json.dumps(manifest))


def check_damaged(artifact, data, outcomes):
  path, blob, manifest, (out, grad) = artifact
  write_rehashed(path, manifest, data)
  try:
    try:
      loaded = sa.load_artifact(path)
    except sa.ArtifactError as e:
      assert str(e).startswith("jaxworks.stages_aot.load_artifact: ")
      assert str(path / "exported.bin") in str(e) or "exported.bin" in str(e)
      outcomes["refused"] += 1
      return
    got_out, got_grad = call_and_grad(loaded)
    np.testing.assert_array_equal(got_out, out)
    np.testing.assert_array_equal(got_grad, grad)
    outcomes["same"] += 1
  finally:
    write_rehashed(path, manifest, blob)


def test_undamaged_artifact_equals_in_memory(artifact, exported):
  _, _, _, (out, grad) = artifact
  want_out, want_grad = call_and_grad(exported)
  np.testing.assert_array_equal(out, want_out)
  np.testing.assert_allclose(grad, want_grad, rtol=1e-6)


def test_manifest_describes_every_vjp_order(artifact):
  path, blob, manifest, _ = artifact
  m = json.loads(manifest)
  assert len(m["levels"]) == 2  # the program and its VJP
  loaded = sa.deserialize(blob)
  for level, exp in zip(m["levels"], (loaded, loaded.vjp())):
    assert (
      level["module_sha256"]
      == hashlib.sha256(exp.jax_exported.mlir_module_serialized).hexdigest()
    )
    assert level["inputs"] == [sa.format_aval(a) for a in exp.in_avals]
  assert m["levels"][1]["inputs"] == ["f32[8,2]", "f32[3,8]", "f32[]", "f32[3]"]
  assert m["in_tree"] == str(loaded.in_tree)


def test_fuzz_flipped_bytes_rehashed(artifact):
  blob = artifact[1]
  rng = np.random.default_rng(7)
  outcomes = {"refused": 0, "same": 0}
  for _ in range(60):
    damaged = bytearray(blob)
    damaged[int(rng.integers(len(blob)))] ^= int(rng.integers(1, 256))
    check_damaged(artifact, bytes(damaged), outcomes)
  assert outcomes["refused"] > 0 and outcomes["same"] > 0, outcomes


@pytest.mark.parametrize("level", [0, 1])  # the program's module, its VJP's
def test_changed_constant_is_refused(artifact, level):
  """The sign of the captured constant C[0, 0] flipped: a valid program that computes
  something else. Raw bytes cannot tell; the artifact's module digests do."""
  path, blob, manifest, (out, grad) = artifact
  # The flatbuffer is written back to front: the VJP's module comes first.
  assert blob.count(C.tobytes()) == 2
  start = blob.find(C.tobytes())
  if level == 0:
    start = blob.find(C.tobytes(), start + 1)
  damaged = bytearray(blob)
  damaged[start + 3] ^= 0x80  # the sign of C[0, 0]
  exp = sa.deserialize(bytes(damaged))  # a consistent program ...
  changed = call_and_grad(exp)
  assert not np.array_equal(
    changed[level], (out, grad)[level]
  )  # ... but another one
  outcomes = {"refused": 0, "same": 0}
  check_damaged(artifact, bytes(damaged), outcomes)
  assert outcomes == {"refused": 1, "same": 0}
  write_rehashed(path, manifest, bytes(damaged))
  try:
    with pytest.raises(
      sa.ArtifactError,
      match=rf"disagrees with exported.bin on levels\[{level}\]",
    ):
      sa.load_artifact(path)
  finally:
    write_rehashed(path, manifest, blob)


def test_fuzz_truncated_rehashed(artifact):
  blob = artifact[1]
  outcomes = {"refused": 0, "same": 0}
  for cut in [0, 7, 64] + list(range(300, len(blob), len(blob) // 8)):
    check_damaged(artifact, blob[:cut], outcomes)
  assert outcomes["refused"] > 0, outcomes


def test_vjp_module_changed_in_a_valid_way_is_refused(artifact, exported):
  """Another valid VJP (a different gradient) behind a re-hashed manifest."""
  path, blob, manifest, _ = artifact
  stock = sa.deserialize(blob).jax_exported
  other_vjp = jax.export.export(
    jax.jit(
      lambda p, x, s, ct: jax.vjp(
        lambda p, x, s: f(p, x, scale=s) * 2, p, x, s
      )[1](ct)
    ),
    platforms=("cpu", "tpu"),
  )({"w": W}, X, np.float32(3), np.ones(3, np.float32))
  hostile = dataclasses.replace(
    stock,
    _get_vjp=lambda _: dataclasses.replace(
      stock.vjp(), mlir_module_serialized=other_vjp.mlir_module_serialized
    ),
  )
  data = bytes(hostile.serialize(vjp_order=1))
  write_rehashed(path, manifest, data)
  try:
    with pytest.raises(
      sa.ArtifactError, match=r"disagrees with exported.bin on levels\[1\]"
    ):
      sa.load_artifact(path)
  finally:
    write_rehashed(path, manifest, blob)


def test_primal_module_changed_in_a_valid_way_is_refused(artifact):
  path, blob, manifest, _ = artifact
  stock = sa.deserialize(blob).jax_exported
  doubled = jax.export.export(
    jax.jit(lambda p, x, *, scale: f(p, x, scale=scale) * 2),
    platforms=("cpu", "tpu"),
  )(*ARGS, **KWARGS)
  hostile = dataclasses.replace(
    stock, mlir_module_serialized=doubled.mlir_module_serialized
  )
  data = bytes(hostile.serialize(vjp_order=1))
  write_rehashed(path, manifest, data)
  try:
    with pytest.raises(
      sa.ArtifactError, match=r"disagrees with exported.bin on levels\[0\]"
    ):
      sa.load_artifact(path)
    # A manifest of 0.1.0 has no levels: module.stablehlo.mlir still catches it.
    m = json.loads((path / "manifest.json").read_text())
    del m["levels"], m["in_tree"], m["out_tree"]
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(
      sa.ArtifactError,
      match=r"exported.bin holds a StableHLO module that differs from .*module.stablehlo.mlir",
    ):
      sa.load_artifact(path)
  finally:
    write_rehashed(path, manifest, blob)


def test_manifest_without_new_fields_still_loads(artifact):
  """Artifacts written by 0.1.0 (no levels / trees in the manifest) load."""
  path, blob, manifest, (out, _) = artifact
  m = json.loads(manifest)
  del m["levels"], m["in_tree"], m["out_tree"]
  (path / "manifest.json").write_text(json.dumps(m))
  try:
    np.testing.assert_array_equal(sa.load_artifact(path)(*ARGS, **KWARGS), out)
  finally:
    (path / "manifest.json").write_text(manifest)


@pytest.mark.parametrize(
  "umask, dir_mode, file_mode",
  [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600), (0o002, 0o775, 0o664)],
)
@pytest.mark.parametrize("overwrite", [False, True])
def test_permissions_follow_the_umask(
  tmp_path, exported, umask, dir_mode, file_mode, overwrite
):
  target = tmp_path / "art"
  if overwrite:
    sa.save_artifact(exported, target)
  old = os.umask(umask)
  try:
    sa.save_artifact(exported, target, overwrite=overwrite)
  finally:
    os.umask(old)
  assert stat.S_IMODE(target.stat().st_mode) == dir_mode
  for name in ("exported.bin", "manifest.json", "module.stablehlo.mlir"):
    assert stat.S_IMODE((target / name).stat().st_mode) == file_mode, name
  assert sorted(p.name for p in tmp_path.iterdir()) == [
    "art"
  ]  # no temporary left
