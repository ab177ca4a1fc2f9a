"""jaxworks.stages_aot of jaxworks.pmap_chunked functions: trace, lower, compile, export, artifacts.

A pmap_chunked function is jit_cache.jit(shard_map(...)) over an 8-device mesh; its stages enter stages_aot through
`stages_aot.trace(pmapped, ...)` (which uses the pmap's own `trace`) or `stages_aot.Traced.from_traced`. Every
result is compared with the pmap's own call and with stock jax.pmap.

An exported 8-device program must be called with inputs on 8 devices (as for stock jax.export; host arrays make a
1-device call, which jax rejects): `_on_devices` places them with batched_transfer on the exported shardings,
whose abstract mesh is made concrete with this host's devices.
"""

import json

import jax
import jax.numpy as jnp
import jaxworks_testing as jwt
import numpy as np
import pytest

from jaxworks import axis_names
from jaxworks import batched_transfer as bt
from jaxworks import pmap_chunked
from jaxworks import stages_aot

# Every device present: 8 host devices on the CPU target, one TPU chip.
N = jax.device_count()


def _normalize(v):
  return v / jax.lax.psum(jnp.abs(v).sum(), "i") + jax.lax.axis_index("i")


def _on_devices(exported, *args):
  """`args` placed (one batched transfer) on the exported program's input shardings, on this host's devices."""
  shardings = []
  for s in exported.in_shardings:
    mesh = s.mesh
    devices = np.array(jax.devices()[: mesh.size]).reshape(mesh.axis_sizes)
    shardings.append(
      jax.sharding.NamedSharding(
        jax.sharding.Mesh(devices, mesh.axis_names), s.spec
      )
    )
  return bt.device_put(tuple(args), tuple(shardings))


@pytest.fixture(scope="module")
def case():
  x = np.random.default_rng(0).normal(size=(N, 16)).astype(np.float32)
  f = pmap_chunked.pmap(_normalize, "i")
  expected = jax.pmap(_normalize, "i")(x)
  return f, x, expected


def test_trace_lower_compile_run(case):
  f, x, expected = case
  traced = stages_aot.trace(f, x)
  assert traced.fun_name == "_normalize"
  assert (
    axis_names.used_axis_names(traced.jaxpr) == frozenset()
  )  # the shard_map binds 'i'
  here = jax.export.default_export_platform()  # "cpu"; "tpu" on a TPU
  lowered = traced.lower(lowering_platforms=(here,))
  assert lowered.platforms == (here,) and lowered.jaxpr is traced.jaxpr
  compiled = lowered.compile()
  assert compiled.platform == here
  out = compiled(x)
  np.testing.assert_allclose(out, f(x), rtol=1e-6)
  np.testing.assert_allclose(out, expected, rtol=1e-6)
  assert compiled.input_shardings[0][0].spec == jax.P("i")
  assert compiled.input_shardings[0][0].num_devices == N


def test_from_traced_of_the_pmaps_own_trace(case):
  f, x, expected = case
  traced = stages_aot.Traced.from_traced(f.trace(x))
  lowered = traced.lower(lowering_platforms=("tpu", "cpu"))
  assert lowered.platforms == ("tpu", "cpu")
  assert "_platform_index" in lowered.as_text()
  np.testing.assert_allclose(lowered.compile()(x), expected, rtol=1e-6)


def test_export_for_cpu_and_tpu_serialize_and_call(case):
  f, x, expected = case
  exported = (
    stages_aot.trace(f, x).lower(lowering_platforms=("cpu", "tpu")).export()
  )
  assert exported.platforms == ("cpu", "tpu")
  assert exported.nr_devices == N
  assert exported.in_shardings[0].spec == jax.P("i")
  loaded = stages_aot.deserialize(exported.serialize())
  xs = _on_devices(loaded, x)
  np.testing.assert_allclose(loaded(*xs), expected, rtol=1e-6)
  # Stock jax.export of stock jax.pmap agrees on the program's interface and result.
  stock = jax.export.export(
    jax.jit(jax.pmap(_normalize, "i")), platforms=("cpu", "tpu")
  )(x)
  assert stock.nr_devices == exported.nr_devices
  assert [a.shape for a in stock.in_avals] == [
    a.shape for a in exported.in_avals
  ]
  np.testing.assert_allclose(stock.call(*xs), loaded(*xs), rtol=1e-6)
  if N > 1:  # (on one device, host arrays are what it was exported for)
    with pytest.raises(ValueError, match=f"exported for {N} devices"):
      loaded(x)  # host arrays: a 1-device call


def test_artifact_round_trip(case, tmp_path):
  f, x, expected = case
  exported = (
    stages_aot.trace(f, x).lower(lowering_platforms=("cpu", "tpu")).export()
  )
  art = stages_aot.save_artifact(exported, tmp_path / "normalize")
  manifest = json.loads((tmp_path / "normalize" / "manifest.json").read_text())
  assert manifest["fun_name"] == "_normalize"
  assert manifest["platforms"] == ["cpu", "tpu"]
  assert manifest["inputs"][0]["aval"] == f"f32[{N},16]"
  loaded = stages_aot.load_artifact(art.path)
  present = stages_aot.present_platforms()  # a TPU machine has both
  assert loaded.runnable_platforms == tuple(
    p for p in ("cpu", "tpu") if p in present
  )
  xs = _on_devices(loaded.exported, x)
  np.testing.assert_allclose(loaded(*xs), expected, rtol=1e-6)
  np.testing.assert_allclose(loaded(*xs), f(x), rtol=0, atol=0)


def test_tpu_only_artifact_is_inspectable_not_runnable(case, tmp_path):
  f, x, _ = case
  # A platform this host lacks: the TPU, or on a TPU machine a GPU.
  absent = "tpu" if "tpu" not in stages_aot.present_platforms() else "cuda"
  exported = stages_aot.trace(f, x).lower(lowering_platforms=(absent,)).export()
  stages_aot.save_artifact(exported, tmp_path / "tpu_only")
  with pytest.raises(stages_aot.ArtifactError, match=absent):
    stages_aot.load_artifact(tmp_path / "tpu_only")
  art = stages_aot.load_artifact(tmp_path / "tpu_only", require_platform=False)
  assert art.platforms == (absent,) and art.runnable_platforms == ()


def test_pytree_and_broadcast_arguments(tmp_path):
  def step(params, batch):
    grad = jax.lax.pmean(batch["x"].T @ batch["y"], "i")
    return {"w": params["w"] - 0.1 * grad}, jax.lax.psum(batch["y"].sum(), "i")

  rng = np.random.default_rng(1)
  params = {"w": rng.normal(size=(4, 3)).astype(np.float32)}
  batch = {
    "x": rng.normal(size=(N, 5, 4)).astype(np.float32),
    "y": rng.normal(size=(N, 5, 3)).astype(np.float32),
  }
  f = pmap_chunked.pmap(step, "i", in_axes=(None, 0), out_axes=(None, None))
  exported = (
    stages_aot.trace(f, params, batch)
    .lower(lowering_platforms=("cpu", "tpu"))
    .export()
  )
  loaded = stages_aot.load_artifact(
    stages_aot.save_artifact(exported, tmp_path / "step").path
  )
  # The exported program is the pmap's flat program: one input per leaf of (params, batch).
  out = loaded(*_on_devices(loaded.exported, *jax.tree.leaves((params, batch))))
  stock = jax.pmap(step, "i", in_axes=(None, 0), out_axes=(None, None))(
    params, batch
  )
  assert jax.tree.structure(out) == jax.tree.structure(stock)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(stock)):
    np.testing.assert_allclose(a, b, rtol=1e-5)


def test_nested_pmap_exports_one_2d_mesh_program():
  jwt.require_devices(8)  # a 2 x 4 mesh
  inner = pmap_chunked.pmap(
    lambda v: jax.lax.psum(v, "j") * 10 + jax.lax.psum(v, "i"), "j"
  )
  f = pmap_chunked.pmap(inner, "i")
  x = np.arange(2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3)
  expected = f(x)
  exported = (
    stages_aot.trace(f, x).lower(lowering_platforms=("cpu", "tpu")).export()
  )
  assert exported.nr_devices == 8
  loaded = stages_aot.deserialize(exported.serialize())
  out = loaded(*_on_devices(loaded, x))
  np.testing.assert_allclose(out, expected, rtol=1e-6)
  ref = x.sum(axis=1, keepdims=True) * 10 + x.sum(axis=0, keepdims=True)
  np.testing.assert_allclose(out, ref, rtol=1e-6)
