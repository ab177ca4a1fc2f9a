"""deep (names in types/meshes/specs), context, tracing and rules helpers."""

import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AbstractMesh
from jax.sharding import AxisType
from jax.sharding import ManualAxisType
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import pytest

from jaxworks.axis_names._src import analysis
from jaxworks.axis_names._src import context
from jaxworks.axis_names._src import deep
from jaxworks.axis_names._src import rules
from jaxworks.axis_names._src import tracing


@functools.cache
def MANUAL():
  return AbstractMesh(
    (4, 2), ("i", "j"), axis_types=(AxisType.Manual, AxisType.Auto)
  )


@functools.cache
def AUTO():
  return AbstractMesh((4, 2), ("i", "j"), axis_types=(AxisType.Auto,) * 2)


def test_only_manual_mesh_axes_are_names():
  assert deep.names_of(MANUAL()) == {"i"}
  assert deep.names_of(AUTO()) == frozenset()
  assert deep.names_of(NamedSharding(MANUAL(), P("j"))) == {"i"}
  assert deep.names_of(P(("i", "j"), None)) == {"i", "j"}
  assert deep.names_of(ManualAxisType(varying=frozenset({"i"}))) == {"i"}
  assert deep.names_of((MANUAL(), [AUTO(), 3])) == {"i"}
  assert deep.names_of("i") == frozenset()


def test_rename_mesh_spec_and_sharing():
  m = deep.rename(MANUAL(), {"i": "k"})
  assert m.axis_names == ("k", "j") and m.axis_sizes == (4, 2)
  assert m.axis_types == MANUAL().axis_types
  assert deep.rename(AUTO(), {"i": "k"}) is AUTO()  # not manual: not a name
  assert deep.rename(MANUAL(), {"z": "k"}) is MANUAL()
  s = deep.rename(NamedSharding(MANUAL(), P("i", "j")), {"i": "k", "j": "q"})
  assert s.mesh.axis_names == ("k", "j") and s.spec == P("k", "j")
  mat = ManualAxisType(varying=frozenset({"i", "j"}))
  assert deep.rename(mat, {"i": "k"}).varying == {"k", "j"}
  spec = P("i", None, ("i", "j"))
  assert deep.rename(spec, {"i": "k"}) == P("k", None, ("k", "j"))
  t = (MANUAL(), 1)
  assert deep.rename(t, {"z": "w"}) is t


def test_rename_to_existing_mesh_axis_is_an_error():
  with pytest.raises(ValueError, match="duplicate axis names"):
    deep.rename(MANUAL(), {"i": "j"})


def test_rename_aval_inside_shard_map():
  mesh = jax.make_mesh((8,), ("i",), axis_types=(AxisType.Auto,))
  seen = {}

  def body(x):
    aval = jax.typeof(x)
    seen["aval"] = aval
    seen["renamed"] = deep.rename(aval, {"i": "k"})
    return x

  jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))(
    jnp.arange(8.0)
  )
  assert deep.names_of(seen["aval"]) == {"i"}
  r = seen["renamed"]
  assert r.shape == seen["aval"].shape and r.dtype == seen["aval"].dtype
  assert deep.names_of(r) == {"k"}
  assert r.sharding.mesh.axis_names == ("k",)


def test_old_names_inside_shard_map():
  mesh = jax.make_mesh((8,), ("k",), axis_types=(AxisType.Auto,))
  seen = {}

  def body(x):
    ctx = context.old_names({"i": "k"}, "api")
    seen.update(ctx=ctx, avals=context.arg_avals([x], ctx, "api"))
    with ctx.scope():
      seen["mesh"] = jax.sharding.get_abstract_mesh()
      seen["size"] = lax.axis_size("i")
    return x

  jax.shard_map(body, mesh=mesh, in_specs=P("k"), out_specs=P("k"))(
    jnp.arange(8.0)
  )
  ctx = seen["ctx"]
  assert ctx.env == {"i": 8} and ctx.forward == {"i": "k"}
  assert seen["mesh"].axis_names == ("i",) and seen["size"] == 8
  (a,) = seen["avals"]
  assert a.shape == (1,) and a.manual_axis_type.varying == {"i"}


def test_old_names_hide_a_mesh_axis_that_has_the_old_name():
  # {'i': 'k'} inside a mesh ('i', 'k'): the mesh's own 'i' is hidden.
  mesh = jax.make_mesh((4, 2), ("i", "k"), axis_types=(AxisType.Auto,) * 2)
  seen = {}

  def body(x):
    ctx = context.old_names({"i": "k"}, "api")
    seen.update(ctx=ctx, avals=context.arg_avals([x], ctx, "api"))
    with ctx.scope():
      seen["mesh"] = jax.sharding.get_abstract_mesh()
      seen["sizes"] = (lax.axis_size("i"), lax.axis_size(deep.hidden("i")))
    return x

  jax.shard_map(
    body, mesh=mesh, in_specs=P(("i", "k")), out_specs=P(("i", "k"))
  )(jnp.arange(8.0))
  h = deep.hidden("i")
  assert isinstance(h, deep.HiddenName) and h == deep.hidden("i")
  ctx = seen["ctx"]
  assert ctx.forward == {"i": "k", h: "i"}
  assert ctx.inverse == {"k": "i", "i": h}
  assert seen["mesh"].axis_names == (h, "i") and seen["sizes"] == (2, 4)
  assert seen["avals"][0].manual_axis_type.varying == {h, "i"}


def test_old_names_outside_any_binder():
  ctx = context.old_names({"i": "k"}, "api")
  assert ctx.env == {} and not ctx.mesh_changed
  assert context.arg_avals([jnp.ones(3)], ctx, "api")[0].shape == (3,)
  with pytest.raises(TypeError, match="api: argument leaf 0"):
    context.arg_avals(["text"], ctx, "api")


def test_trace_binds_free_names_with_placeholders():
  fn = lambda x: lax.psum(x, "a") + lax.axis_index("b")
  closed, placeholders = tracing.trace(fn, (jnp.ones(2),), {}, {"a": 4}, "api")
  assert set(placeholders) == {"b"}
  assert all(isinstance(e, NameError) for e in placeholders.values())
  assert analysis.jaxpr_axis_names(closed.jaxpr) == {"a", "b"}


def test_rules_param_helpers():
  assert rules.names_in_param(("i", 0, "j")) == ("i", "j")
  assert rules.names_in_param("i") == ("i",)
  assert rules.names_in_param(None) == ()
  assert rules.rename_in_param(("i", 0), {"i": "k"}) == ("k", 0)
  assert rules.rename_in_param("i", {"i": "k"}) == "k"
  assert rules.rename_in_param(1, {"i": "k"}) == 1


def test_rules_table_matches_jax_params():
  """Every table entry names a param the primitive really has."""
  fns = {
    "psum": lambda x: lax.psum(x, "i"),
    "pmax": lambda x: lax.pmax(x, "i"),
    "pmin": lambda x: lax.pmin(x, "i"),
    "axis_index": lambda x: x * lax.axis_index("i"),
    "ppermute": lambda x: lax.ppermute(x, "i", [(0, 1)]),
    "all_to_all": lambda x: lax.all_to_all(x, "i", 0, 0, tiled=True),
    "all_gather": lambda x: lax.all_gather(x, "i"),
    "reduce_scatter": lambda x: lax.psum_scatter(x, "i", tiled=True),
  }
  for prim, fn in fns.items():
    closed = jax.make_jaxpr(fn, axis_env=[("i", 2)])(jnp.ones(4))
    eqn = next(e for e in closed.eqns if e.primitive.name == prim)
    assert rules.names_in_param(eqn.params[rules.AXIS_PARAMS[prim]]) == (
      "i",
    ), prim
