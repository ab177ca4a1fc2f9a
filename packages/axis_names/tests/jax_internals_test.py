"""Every private JAX name used by jaxworks.axis_names still behaves as used."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

from jaxworks.axis_names._src import jax_internals as ji

X = jnp.arange(8.0)


def test_named_axis_effect_is_what_jax_attaches():
  closed = jax.make_jaxpr(lambda x: lax.psum(x, "i"), axis_env=[("i", 2)])(X)
  (eff,) = closed.eqns[0].effects
  assert type(eff) is ji.NamedAxisEffect and eff.name == "i"
  assert ji.is_named_axis_effect(eff)
  assert ji.NamedAxisEffect("i") == eff
  assert ji.named_axis_effect_names(closed.effects) == {"i"}
  assert ji.named_axis_effect_names(set()) == frozenset()


def user_fn(x):
  return lax.psum(x, "i")  # marker line


def test_user_location():
  closed = jax.make_jaxpr(user_fn, axis_env=[("i", 2)])(X)
  file_name, line, fn = ji.user_location(closed.eqns[0].source_info)
  lines, start = inspect.getsourcelines(user_fn)
  assert os.path.abspath(file_name) == os.path.abspath(__file__)
  assert line == start + 1 and fn == "user_fn"
  assert ji.user_location(None) is None


@pytest.mark.parametrize("fn", [
    lambda x: lax.psum(x, "nope"),
    lambda x: lax.axis_index("nope") * x,
    lambda x: lax.all_gather(x, "nope"),
    lambda x: lax.ppermute(x, "nope", [(0, 1)]),
])
def test_unbound_axis_name_parses_jax_errors(fn):
  with pytest.raises(NameError) as info:
    jax.make_jaxpr(fn)(X)
  assert ji.unbound_axis_name(info.value) == "nope"


def test_unbound_axis_name_ignores_other_errors():
  assert ji.unbound_axis_name(NameError("name 'x' is not defined")) is None
  assert ji.unbound_axis_name(ValueError("unbound axis name: i")) is None


def test_eqn_context_mesh_and_replacement():
  mesh = jax.make_mesh((8,), ("i",), axis_types=(AxisType.Auto,))
  closed = jax.make_jaxpr(jax.shard_map(lambda v: v * 2, mesh=mesh,
                                        in_specs=P("i"), out_specs=P("i")))(X)
  body = closed.eqns[0].params["jaxpr"]
  ctx = body.eqns[0].ctx
  m = ji.eqn_context_mesh(ctx)
  assert m.axis_names == ("i",) and m.manual_axes == ("i",)
  renamed = m.update(axis_names=("k",))
  new_ctx = ji.eqn_context_with_mesh(ctx, renamed)
  assert ji.eqn_context_mesh(new_ctx) is renamed
  assert new_ctx.compute_type == ctx.compute_type
  assert new_ctx.threefry_partitionable == ctx.threefry_partitionable
  assert ji.eqn_context_with_mesh(ctx, m) is ctx
  with new_ctx.manager:
    assert jax.sharding.get_abstract_mesh() == renamed


def test_literal_value_with_aval():
  closed = jax.make_jaxpr(lambda x: x * 2.0)(X)
  lit = closed.eqns[0].invars[1]
  aval = lit.aval.update(weak_type=False)
  val = ji.literal_value_with_aval(lit.val, aval)
  assert val.aval is aval
  np.testing.assert_array_equal(np.asarray(val), np.asarray(lit.val))
  assert ji.literal_value_with_aval(3, aval) == 3
