"""Every package accepts every stage, checked against stock.

* ``batched_transfer.place_for`` takes a ``Compiled`` from each entry point
  (``jit_cache``, ``stages_aot`` single- and multi-platform, ``pmap_chunked``);
* ``stages_aot`` exports a ``jit_cache`` program and a ``pmap_chunked``
  program (export, serialize, deserialize, call);
* ``axis_names`` analyses the ``Traced``/``Lowered`` of each entry point.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks import axis_names
from jaxworks import batched_transfer as bt
from jaxworks import jit_cache
from jaxworks import pmap_chunked
from jaxworks import stages_aot

# Every device present: 8 host devices on the CPU target, one TPU chip.
N = jax.device_count()
W = np.arange(12, dtype=np.float32).reshape(3, 4) / 10
V = np.linspace(-1, 1, 4, dtype=np.float32)
XS = np.arange(N * 5, dtype=np.float32).reshape(N, 5)


def _mesh():
  """Every device present, one axis (built in the test, not at import)."""
  return jax.make_mesh((N,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))


# The platform JAX runs on here ("cpu"; "tpu" on a TPU machine).
DEFAULT = jax.export.default_export_platform()


def _affine(w, v):
  return jnp.tanh(w @ v) + 1.0


def _step(x):
  return x * 2.0 - jax.lax.pmean(x, "i")


def _pointers(x):
  return [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]


# -- place_for --------------------------------------------------------------


def _compiled_from_each_entry_point():
  yield "jit_cache", jit_cache.jit(_affine).lower(W, V).compile()
  yield "stages_aot", stages_aot.trace(_affine, W, V).lower().compile()
  multi = stages_aot.trace(_affine, W, V).lower(
    lowering_platforms=("cpu", "tpu")
  )
  yield (
    "stages_aot multi-platform",
    multi.compile(platform=DEFAULT if DEFAULT in ("cpu", "tpu") else "cpu"),
  )
  yield (
    "jit_cache from stock trace",
    jit_cache.Traced.from_traced(jax.jit(_affine).trace(W, V))
    .lower()
    .compile(),
  )


@pytest.mark.parametrize(
  "name,compiled", list(_compiled_from_each_entry_point())
)
def test_place_for_takes_a_compiled_from_each_entry_point(name, compiled):
  stock = jax.jit(_affine).lower(W, V).compile()
  assert isinstance(compiled, jit_cache.Compiled), name
  placed = bt.place_for(compiled, (W, V))
  assert [x.format for x in placed] == list(compiled.input_formats[0])
  assert [x.format for x in placed] == list(stock.input_formats[0])
  before = [_pointers(x) for x in placed]
  out = compiled(*placed)
  np.testing.assert_allclose(out, stock(W, V), rtol=1e-6)
  # The compiled program took the placed buffers as they were.
  assert [_pointers(x) for x in placed] == before
  with pytest.raises(
    TypeError, match="place_for: expected a jax.stages.Compiled"
  ):
    bt.place_for(compiled.as_text(), (W, V))


def test_place_for_takes_the_pmaps_compiled():
  compiled = pmap_chunked.pmap(_step, "i").lower(XS).compile()
  stock = jax.pmap(_step, "i").lower(XS).compile()
  assert isinstance(compiled, jit_cache.Compiled)
  (placed,) = bt.place_for(compiled, (XS,))
  assert placed.format == compiled.input_formats[0][0]
  assert placed.sharding == stock.input_shardings[0][0]
  before = _pointers(placed)
  out = pmap_chunked.pmap(_step, "i")(placed)
  np.testing.assert_allclose(out, stock(XS), rtol=1e-6)
  np.testing.assert_allclose(compiled(placed), stock(XS), rtol=1e-6)
  assert _pointers(placed) == before  # not donated, not copied


# -- stages_aot exports every package's program -------------------------------


def test_export_a_jit_cache_program():
  lowered = (
    jit_cache.jit(_affine).trace(W, V).lower(lowering_platforms=("tpu", "cuda"))
  )
  assert lowered.platforms == ("tpu", "cuda") and lowered.fun_name == "_affine"
  assert str(lowered.jaxpr) == str(jax.make_jaxpr(_affine)(W, V))
  exported = lowered.export()
  assert isinstance(exported, stages_aot.Exported)
  loaded = stages_aot.deserialize(exported.serialize())
  assert loaded.platforms == ("tpu", "cuda") and loaded.fun_name == "_affine"
  # A module for other platforms cannot run here; the cpu one is the same
  # program, exported the same way, and runs as stock's export does.
  here = jit_cache.jit(_affine).lower(W, V).export(vjp_order=1)
  loaded = stages_aot.deserialize(here.serialize())
  stock = jax.export.export(jax.jit(_affine))(W, V)
  np.testing.assert_allclose(loaded(W, V), stock.call(W, V), rtol=1e-6)
  ours = here.jax_exported
  assert (ours.in_avals, ours.out_avals) == (stock.in_avals, stock.out_avals)
  assert (ours.in_tree, ours.out_tree) == (stock.in_tree, stock.out_tree)
  assert ours.platforms == stock.platforms == (DEFAULT,)
  np.testing.assert_allclose(
    jax.grad(lambda v: loaded(W, v).sum())(V),
    jax.grad(lambda v: _affine(W, v).sum())(V),
    rtol=1e-5,
  )


def test_export_a_pmap_chunked_program():
  lowered = pmap_chunked.pmap(_step, "i").lower(XS)
  assert type(lowered) is jit_cache.Lowered and lowered.fun_name == "_step"
  exported = lowered.export()
  assert exported.nr_devices == N
  loaded = stages_aot.deserialize(exported.serialize())
  assert loaded.nr_devices == N and loaded.platforms == (DEFAULT,)
  (spec,) = (s.spec for s in loaded.in_shardings)
  x = jax.device_put(XS, jax.sharding.NamedSharding(_mesh(), spec))
  np.testing.assert_allclose(loaded(x), jax.pmap(_step, "i")(XS), rtol=1e-6)
  # Cross-platform: the same pmap program for tpu, from this host.
  tpu = (
    pmap_chunked.pmap(_step, "i").trace(XS).lower(lowering_platforms=("tpu",))
  )
  assert stages_aot.deserialize(tpu.export().serialize()).platforms == ("tpu",)


def test_export_of_every_entry_point_is_stages_aots():
  # One Lowered class, stages_aot's: export() needs no registration.
  exported = jit_cache.jit(_affine).lower(W, V).export(vjp_order=2)
  assert type(exported) is stages_aot.Exported
  assert (exported.fun_name, exported.vjp_order) == ("_affine", 2)
  assert isinstance(
    stages_aot.trace(_affine, W, V).lower().export(), stages_aot.Exported
  )


# -- axis_names analyses every stage -------------------------------------------


def _named_effects(closed_jaxpr):
  return frozenset(
    e.name
    for e in closed_jaxpr.effects
    if type(e).__name__ == "NamedAxisEffect"
  )


def _sharded_sum(x):
  body = lambda v: jax.lax.psum(v.sum(0, keepdims=True), "i") * 2.0
  return jax.shard_map(
    body,
    mesh=_mesh(),
    in_specs=jax.sharding.PartitionSpec("i"),
    out_specs=jax.sharding.PartitionSpec(),
  )(x)


def _report(obj):
  return sorted(
    (s.primitive, s.count, s.bytes_per_call)
    for s in axis_names.collective_report(obj).by_axis("i")
  )


def test_axis_names_analyses_every_traced_and_lowered():
  stock = jax.jit(_sharded_sum).trace(XS).jaxpr
  expected = _report(stock)
  assert len(expected) == 1 and expected[0][0].startswith("psum")
  stages = {
    "jit_cache Traced": jit_cache.jit(_sharded_sum).trace(XS),
    "jit_cache Lowered": jit_cache.jit(_sharded_sum).lower(XS),
    "stages_aot Traced": stages_aot.trace(_sharded_sum, XS),
    "stages_aot Lowered": stages_aot.trace(_sharded_sum, XS).lower(
      lowering_platforms=("cpu", "tpu")
    ),
    "stock Traced": jax.jit(_sharded_sum).trace(XS),
  }
  for name, obj in stages.items():
    # The name is bound by the shard_map: used nowhere free, as stock's
    # effects say; the report counts the one psum over it.
    assert axis_names.used_axis_names(obj) == _named_effects(obj.jaxpr), name
    assert axis_names.used_axis_names(obj) == frozenset(), name
    assert _report(obj) == expected, name
    axis_names.check_axis_names(obj)  # nothing unbound: no error
  # pmap_chunked's program: its body's pmean over the pmap axis, bound by
  # its shard_map, from both its stages.
  for obj in (
    pmap_chunked.pmap(_step, "i").trace(XS),
    pmap_chunked.pmap(_step, "i").lower(XS),
  ):
    assert axis_names.used_axis_names(obj) == _named_effects(obj.jaxpr)
    assert axis_names.used_axis_names(obj) == frozenset()
    (only,) = _report(obj)
    assert only[0].startswith("psum") and only[1] == 1
  with pytest.raises(TypeError, match="stock jax.stages.Lowered carries no"):
    axis_names.used_axis_names(jax.jit(_affine).lower(W, V))
