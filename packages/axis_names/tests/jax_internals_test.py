"""Every private JAX name used by jaxworks.axis_names still behaves as used."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import inspect

import jax
from jax import lax
from jax.extend.core import JaxprEqn
from jax.extend.core import check_jaxpr
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

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


@pytest.mark.parametrize(
  "fn",
  [
    lambda x: lax.psum(x, "nope"),
    lambda x: lax.axis_index("nope") * x,
    lambda x: lax.all_gather(x, "nope"),
    lambda x: lax.ppermute(x, "nope", [(0, 1)]),
  ],
)
def test_unbound_axis_name_parses_jax_errors(fn):
  with pytest.raises(NameError) as info:
    jax.make_jaxpr(fn)(X)
  assert ji.unbound_axis_name(info.value) == "nope"


def test_unbound_axis_name_ignores_other_errors():
  assert ji.unbound_axis_name(NameError("name 'x' is not defined")) is None
  assert ji.unbound_axis_name(ValueError("unbound axis name: i")) is None


def test_eqn_context_mesh_and_replacement():
  mesh = jax.make_mesh((8,), ("i",), axis_types=(AxisType.Auto,))
  closed = jax.make_jaxpr(
    jax.shard_map(lambda v: v * 2, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
  )(X)
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


def test_axis_env_read_and_extended():
  assert "zz" not in ji.current_axis_sizes()
  with ji.extend_axis_env([("zz", 3), ("yy", 2)]):
    assert ji.current_axis_sizes()["zz"] == 3
    assert lax.axis_size("yy") == 2
    with ji.extend_axis_env([("zz", 5)]):  # a later binding overrides
      assert lax.axis_size("zz") == 5
  assert "zz" not in ji.current_axis_sizes()
  seen = {}

  def body(x):
    seen.update(ji.current_axis_sizes())
    return x

  jax.vmap(body, axis_name="vv")(X)
  assert seen["vv"] == 8


def test_symbolic_zeros_are_recognized_and_rebuilt():
  aval = jax.core.ShapedArray((3,), jnp.float32)
  other = jax.core.ShapedArray((4,), jnp.float32)
  sz = jax.custom_derivatives.SymbolicZero(aval)
  assert ji.is_zero(sz) and not ji.is_zero(X) and not ji.is_zero(None)
  again = ji.with_aval(sz, other)
  assert type(again) is type(sz) and again.aval is other
  assert ji.with_aval(sz, aval) is sz
  # The cotangent JAX passes for an unused output of a custom_vjp with
  # symbolic_zeros is such a zero, and its type is what is_zero accepts.
  seen = []

  @jax.custom_vjp
  def f(x):
    return x, x

  def bwd(_, cts):
    seen.extend(cts)
    return (jnp.ones(3),)

  f.defvjp(lambda x: (f(x.value), None), bwd, symbolic_zeros=True)
  jax.grad(lambda x: f(x)[0].sum())(jnp.ones(3))
  assert ji.is_zero(seen[1]) and not ji.is_zero(seen[0])


def test_rule_callables_are_wrapped_funs():
  @jax.custom_vjp
  def f(x):
    return x * 2

  f.defvjp(lambda x: (f(x), None), lambda _, g: (g,))
  (eqn,) = jax.make_jaxpr(f)(1.0).eqns
  bwd = eqn.params["bwd"]
  assert isinstance(bwd, ji.WrappedFun)
  wrapped = ji.wrap_rule(lambda *a: ["called", *a], bwd)
  assert isinstance(wrapped, ji.WrappedFun)
  assert wrapped.call_wrapped(1, 2) == ["called", 1, 2]
  assert wrapped.debug_info == bwd.debug_info


def _misspelled_in_shard_map():
  mesh = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,))
  return jax.shard_map(
    lambda x: lax.pmean(x, "btach"),
    mesh=mesh,
    in_specs=P("batch"),
    out_specs=P(),
  )


def test_unbound_in_shard_map_reads_stock_assertion():
  f = _misspelled_in_shard_map()
  with ji.traceback_filtering_off():
    with pytest.raises(AssertionError) as info:
      jax.jit(f)(X)
  assert ji.unbound_in_shard_map(info.value) == (("btach",), ("batch",))
  assert ji.unbound_in_shard_map(AssertionError()) is None
  assert ji.unbound_in_shard_map(NameError("x")) is None


def test_unfiltered_traceback_and_filtering_off():
  f = _misspelled_in_shard_map()
  before = jax.config.jax_traceback_filtering
  jax.config.update("jax_traceback_filtering", "remove_frames")
  try:
    with pytest.raises(AssertionError) as info:
      jax.jit(f)(X)
  finally:
    jax.config.update("jax_traceback_filtering", before)
  err = info.value
  assert ji.unfiltered_traceback(err) is err.__cause__.__traceback__
  assert ji.unbound_in_shard_map(err) == (("btach",), ("batch",))
  plain = ValueError()
  assert ji.unfiltered_traceback(plain) is plain.__traceback__
  with ji.traceback_filtering_off():
    assert jax.config.jax_traceback_filtering == "off"


def test_user_call_names_the_function_the_user_called():
  closed = jax.make_jaxpr(lambda x: lax.pmean(x, "i"), axis_env=[("i", 2)])(X)
  psum = next(e for e in closed.eqns if e.primitive.name == "psum")
  assert ji.user_call(psum.source_info) == "pmean"
  assert ji.user_call(None) is None


def test_axis_names_at_error_reads_the_axis_env_of_the_frame():
  def reads_size(x):
    return x * lax.axis_size("nope")

  def psum_of_const(x):
    return x * lax.psum(1, "nope")

  for fn in (reads_size, psum_of_const, lambda x: lax.psum(x, "nope")):
    with ji.traceback_filtering_off():
      with pytest.raises(NameError) as info:
        jax.make_jaxpr(fn, axis_env=[("i", 2), ("j", 4)])(X)
    assert ji.axis_names_at_error(info.value) == ("i", "j")
  # With JAX's frames removed (the default) the environment is gone.
  with pytest.raises(NameError) as info:
    jax.make_jaxpr(reads_size, axis_env=[("i", 2)])(X)
  assert ji.axis_names_at_error(info.value) is None
  assert ji.axis_names_at_error(ValueError()) is None


def test_eqn_adder_adds_finished_equations():
  """A finished equation added to a staging trace is in its jaxpr, in
  order with the equations JAX stages, as if JAX had staged it."""
  sin = jax.make_jaxpr(lax.sin)(X).eqns[0]
  src = ji.current_source_info()

  def f(x):
    trace = ji.current_staging_trace()
    add = ji.eqn_adder(trace)
    y = jnp.cos(x)
    out = ji.new_var(trace)(sin.outvars[0].aval)
    add(
      JaxprEqn(
        [y.val], [out], sin.primitive, sin.params, sin.effects, src, sin.ctx
      )
    )
    return jnp.cos(ji.var_tracer(trace, out, src)) * 2.0

  got = jax.make_jaxpr(f)(X)
  want = jax.make_jaxpr(lambda x: jnp.cos(lax.sin(jnp.cos(x))) * 2.0)(X)
  assert str(got) == str(want)
  check_jaxpr(got.jaxpr)
  assert got.eqns[1].params is sin.params and got.eqns[1].source_info is src
  np.testing.assert_array_equal(
    jax.core.eval_jaxpr(got.jaxpr, got.consts, X)[0],
    jax.core.eval_jaxpr(want.jaxpr, want.consts, X)[0],
  )
  # A trace that drops dead equations as it goes needs JAX's records.
  assert ji.eqn_adder(ji._pe.DynamicJaxprTrace(None, auto_dce=True)) is None


def test_var_tracer_and_constant_tracers():
  seen = {}

  def f(x):
    trace = ji.current_staging_trace()
    src = ji.current_source_info()
    const = ji.staged_arg(trace, X, src)
    lit = jax.make_jaxpr(lambda v: v * 2.0)(X).eqns[0].invars[1]
    t = ji.var_tracer(trace, lit, src)
    seen["lit"] = (t.val is lit, ji.is_constant_tracer(trace, t))
    seen["x"] = ji.is_constant_tracer(trace, x)
    seen["const"] = ji.is_constant_tracer(trace, const)
    again = ji.var_tracer(trace, x.val, src)
    seen["again"] = (again.val is x.val, again.aval == x.aval)
    return x + const + t

  closed = jax.make_jaxpr(f)(X)
  assert seen == {
    "lit": (True, False),
    "x": False,
    "const": True,
    "again": (True, True),
  }
  assert len(closed.consts) == 1


def test_has_fold_rule():
  convert = jax.make_jaxpr(lambda x: x.astype(jnp.int32))(X).eqns[0]
  assert ji.has_fold_rule(convert.primitive)
  assert not ji.has_fold_rule(jax.make_jaxpr(lax.sin)(X).eqns[0].primitive)
