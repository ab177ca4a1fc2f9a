"""Every private JAX name in _src/jax_internals.py, checked against what we rely on."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np

from jaxworks.stages_aot._src import jax_internals


def f(x):
  return jnp.sin(x) @ x.T


SPEC = jax.ShapeDtypeStruct((3, 4), jnp.float32)


def test_stock_jit_is_jax_jit():
  # In a process that swapped nothing, the bound stock jit is jax.jit itself.
  assert jax_internals.stock_jit is jax.jit
  assert jax_internals.stock_jit(f)(np.ones((3, 4), np.float32)).shape == (3, 3)


def test_module_reader_imports_what_jax_extend_mlir_exposes():
  import jax.extend.mlir
  import jax.extend.mlir.ir
  from jaxlib import _jax
  import jaxlib.mlir.ir

  source = jax_internals.MODULE_READER_SOURCE
  assert (
    "from jaxlib import _jax" in source
    and "from jaxlib.mlir import ir" in source
  )
  assert (
    jax.extend.mlir.deserialize_portable_artifact
    is _jax.mlir.deserialize_portable_artifact
  )
  assert jax.extend.mlir.ir.Context is jaxlib.mlir.ir.Context
  assert jax.extend.mlir.ir.RankedTensorType is jaxlib.mlir.ir.RankedTensorType
  for name in (
    "IntegerAttr",
    "StringAttr",
    "TypeAttr",
    "FunctionType",
    "ShapedType",
  ):
    assert getattr(jax.extend.mlir.ir, name) is getattr(jaxlib.mlir.ir, name)
  # The child runs the source as a script and answers one JSON line.
  from jaxworks.stages_aot._src import module_reader

  exp = jax.export.export(jax.jit(f), platforms=("cpu", "tpu"))(SPEC)
  (answer,) = module_reader.describe_modules([exp.mlir_module_serialized])
  assert answer["attributes"] == {
    "mhlo.num_partitions": 1,
    "mhlo.num_replicas": 1,
  }
  assert [t["text"] for t in answer["inputs"]] == [
    "tensor<i32>",
    "tensor<3x4xf32>",
  ]
  assert answer["results"] == [
    {"text": "tensor<3x3xf32>", "shape": [3, 3], "element": "f32"}
  ]


def test_jax_extend_names_are_the_same_objects():
  import jax.extend.backend
  import jax.extend.source_info_util

  assert (
    jax_internals.register_source_exclusion
    is jax.extend.source_info_util.register_exclusion
  )
  assert jax_internals.backends is jax.extend.backend.backends
  assert set(jax_internals.backends()) >= {"cpu"}


# -- the stage family ------------------------------------------------------------


def test_lower_for_export_and_its_platforms():
  traced = jax.jit(f).trace(SPEC)
  lowered = jax_internals.lower_for_export(traced, ("cpu", "tpu"))
  assert type(lowered) is jax.stages.Lowered
  assert jax_internals.lowering_platforms(lowered) == ("cpu", "tpu")
  # The same module as stock's lowering for these platforms here.
  stock = traced.lower(lowering_platforms=("cpu", "tpu"))
  assert lowered.as_text() == stock.as_text()


def test_lowering_committed_and_with_committed():
  x = np.arange(12, dtype=np.float32).reshape(3, 4)
  uncommitted = jax.jit(f).trace(x).lower()
  committed = jax.jit(f).trace(jax.device_put(x, jax.devices()[0]))
  assert jax_internals.lowering_committed(uncommitted) is False
  assert jax_internals.lowering_committed(committed.lower()) is True
  assert uncommitted.compile()(x).committed is False
  flipped = jax_internals.with_committed(uncommitted, True)
  assert type(flipped) is jax.stages.Lowered
  assert flipped.compile()(x).committed is True
  # The original lowering (which JAX may cache and share) is unchanged.
  assert jax_internals.lowering_committed(uncommitted) is False
  assert uncommitted.compile()(x).committed is False


def test_lowering_devices():
  devices = jax.devices()
  x = np.arange(8, dtype=np.float32)
  assert jax_internals.lowering_devices(jax.jit(f).trace(x).lower()) is None
  on3 = jax.device_put(x, devices[3])
  lowered = jax.jit(lambda v: v * 2).trace(on3).lower()
  assert jax_internals.lowering_devices(lowered) == (devices[3],)
  mesh = jax.sharding.Mesh(np.array(devices[::-1][:4]), ("i",))
  sharded = jax.device_put(
    x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("i"))
  )
  lowered = jax.jit(lambda v: v * 2).trace(sharded).lower()
  assert jax_internals.lowering_devices(lowered) == tuple(devices[::-1][:4])


def test_export_lowered_equals_jax_export():
  traced = jax.jit(f).trace(SPEC)
  lowered = jax_internals.lower_for_export(traced, ("cpu", "cuda"))
  ours = jax_internals.export_lowered(
    lowered, traced.jaxpr, traced.fun_name, disabled_checks=()
  )
  stock = jax.export.export(jax.jit(f), platforms=("cpu", "cuda"))(SPEC)
  assert isinstance(ours, jax.export.Exported)
  assert ours.platforms == ("cpu", "cuda") and ours.fun_name == "f"
  assert bytes(ours.serialize()) == bytes(stock.serialize())
  x = np.arange(12, dtype=np.float32).reshape(3, 4)
  np.testing.assert_allclose(ours.call(x), f(x), rtol=1e-6)


def test_stage_as_shares_the_stock_state():
  class MyTraced(jax.stages.Traced):
    pass

  class MyCompiled(jax.stages.Compiled):
    pass

  traced = jax.jit(f).trace(SPEC)
  mine = jax_internals.stage_as(MyTraced, traced)
  assert type(mine) is MyTraced and mine.jaxpr is traced.jaxpr
  assert mine.in_tree == traced.in_tree and mine.out_avals == traced.out_avals
  compiled = traced.lower().compile()
  mc = jax_internals.stage_as(MyCompiled, compiled)
  x = np.ones((3, 4), np.float32)
  np.testing.assert_array_equal(mc(x), compiled(x))
  assert mc.input_formats == compiled.input_formats
  assert mc.runtime_executable() is compiled.runtime_executable()


def test_one_device_shardings_are_those_of_stock_compile():
  # A mesh of the first device (on any device count): stock's own compile
  # of the same lowering says which shardings its executable has.
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("i",))
  named = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("i"))
  x = jax.device_put(np.ones((8, 2), np.float32), named)
  g = lambda a, b, unused: (jnp.sin(a), a.sum() + b, {"t": a.T})
  lowered = jax.jit(g).trace(x, jnp.float32(1), 3.0).lower()
  ins, outs = jax_internals.one_device_shardings(lowered)
  compiled = lowered.compile()
  assert ins[:2] == list(compiled.input_shardings[0][:2])
  assert len(ins) == 2  # the unused argument is dropped at its end
  assert outs == jax.tree.leaves(compiled.output_shardings)
  assert outs[0] == named
  # Over more devices, or none fixed: None.
  assert (
    jax_internals.one_device_shardings(
      jax.jit(g).trace(np.ones(3), 1.0, 2.0).lower()
    )
    is None
  )
