"""rename_axes: results under every transformation, sharing, and errors."""

import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
from jax import lax
from jax.extend.core import Primitive
from jax.extend.core import check_jaxpr
from jax.extend.core import new_jaxpr_eqn
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

# Private imports below: JAX's effects as the oracle, and traces staged by hand.
from jaxworks.axis_names import rename_axes
from jaxworks.axis_names import used_axis_names
from jaxworks.axis_names._src import analysis
from jaxworks.axis_names._src import jax_internals

X = jnp.arange(8.0)
AUTO = (AxisType.Auto,)


@functools.cache
def MESH_I():
  return jax.make_mesh((8,), ("i",), axis_types=AUTO)


@functools.cache
def MESH_K():
  return jax.make_mesh((8,), ("k",), axis_types=AUTO)


@functools.cache
def MESH_KJ():
  return jax.make_mesh((4, 2), ("k", "j"), axis_types=AUTO * 2)


@functools.cache
def MESH_IJ():
  return jax.make_mesh((4, 2), ("i", "j"), axis_types=AUTO * 2)


def step(x):
  """Code written for a mesh axis called 'i'."""
  y = lax.psum(x, "i") + lax.axis_index("i") * x
  z = lax.all_gather(y, "i", tiled=True)
  w = lax.ppermute(x, "i", [(a, (a + 1) % 8) for a in range(8)])
  return y * 2 + z[:1].sum() + w


def _ref(check_vma):
  return jax.shard_map(
    step, mesh=MESH_I(), in_specs=P("i"), out_specs=P("i"), check_vma=check_vma
  )(X)


@pytest.mark.parametrize("check_vma", [True, False])
def test_under_shard_map_with_new_name(check_vma):
  g = rename_axes(step, {"i": "k"})
  out = jax.jit(
    jax.shard_map(
      g, mesh=MESH_K(), in_specs=P("k"), out_specs=P("k"), check_vma=check_vma
    )
  )(X)
  np.testing.assert_allclose(out, _ref(check_vma))


def test_under_partial_manual_shard_map():
  g = rename_axes(lambda v: lax.psum(v, "i") * lax.axis_index("i"), {"i": "k"})
  ref = jax.shard_map(
    lambda v: lax.psum(v, "i") * lax.axis_index("i"),
    mesh=MESH_IJ(),
    in_specs=P("i"),
    out_specs=P("i"),
    axis_names={"i"},
  )(X)
  out = jax.shard_map(
    g, mesh=MESH_KJ(), in_specs=P("k"), out_specs=P("k"), axis_names={"k"}
  )(X)
  np.testing.assert_allclose(out, ref)


def test_under_pmap():
  g = rename_axes(step, {"i": "p"})
  out = jax.pmap(g, axis_name="p")(X.reshape(8, 1))
  ref = jax.pmap(step, axis_name="i")(X.reshape(8, 1))
  np.testing.assert_allclose(out, ref)


def test_under_vmap_and_jit():
  g = rename_axes(lambda v: lax.psum(v, "i") - lax.axis_index("i"), {"i": "v"})
  ref = jax.vmap(
    lambda v: lax.psum(v, "i") - lax.axis_index("i"), axis_name="i"
  )(X)
  np.testing.assert_allclose(jax.vmap(g, axis_name="v")(X), ref)
  np.testing.assert_allclose(jax.jit(jax.vmap(g, axis_name="v"))(X), ref)


def test_under_grad():
  g = rename_axes(step, {"i": "k"})

  def loss(fn, mesh, name):
    return lambda x: jax.shard_map(
      fn, mesh=mesh, in_specs=P(name), out_specs=P(name)
    )(x).sum()

  np.testing.assert_allclose(
    jax.grad(loss(g, MESH_K(), "k"))(X), jax.grad(loss(step, MESH_I(), "i"))(X)
  )
  h = rename_axes(lambda v: jnp.sin(v) * lax.psum(v, "i"), {"i": "v"})
  ref = jax.vmap(
    jax.grad(lambda v: jnp.sin(v) * lax.psum(v, "i")), axis_name="i"
  )(X)
  np.testing.assert_allclose(
    jax.vmap(jax.grad(h), axis_name="v")(X), ref, rtol=1e-6
  )


def test_pytree_args_and_outputs():
  def fn(d, scale):
    return {"s": lax.psum(d["a"], "i") * scale, "t": (d["b"],)}

  g = rename_axes(fn, {"i": "v"})
  out = jax.vmap(g, axis_name="v", in_axes=({"a": 0, "b": 0}, None))(
    {"a": X, "b": X + 1}, 2.0
  )
  np.testing.assert_allclose(out["s"], np.full(8, 2 * X.sum()))
  np.testing.assert_allclose(out["t"][0], X + 1)


def test_swap_is_simultaneous():
  fn = lambda v: lax.psum(v, "a") * 10 + lax.psum(v, "b")
  g = rename_axes(fn, {"a": "b", "b": "a"})
  closed = jax.make_jaxpr(g, axis_env=[("a", 2), ("b", 4)])(X)
  eqns = [e for e in closed.jaxpr.eqns if e.primitive.name == "psum"]
  assert [e.params["axes"] for e in eqns] == [("b",), ("a",)]
  assert used_axis_names(closed) == {"a", "b"}


def _program():
  """A jaxpr with sub-jaxprs using 'i', using 'j' only, and using nothing."""
  uses_i = jax.jit(lambda v: lax.psum(v, "i"))
  uses_j = jax.jit(lambda v: lax.pmax(v, "j"))
  plain = jax.jit(lambda v: jnp.sin(v))

  def fn(x):
    a = uses_j(x)
    b = plain(a)
    c = lax.cond(b[0] > 0, uses_i, plain, b)
    d = lax.scan(lambda carry, w: (carry + uses_j(w), None), c, c[None])[0]
    return uses_i(d) + jnp.cos(d)

  return jax.make_jaxpr(fn, axis_env=[("i", 2), ("j", 2)])(X)


def _sub_jaxprs(jaxpr):
  for eqn in jaxpr.eqns:
    for sub in analysis.subjaxprs(eqn.params):
      yield eqn, sub
      yield from _sub_jaxprs(sub)


def test_sharing_untouched_sub_jaxprs_and_equations():
  closed = _program()
  new = rename_axes(closed, {"i": "k"})
  assert used_axis_names(new) == {"k", "j"}
  old_subs = [s for _, s in _sub_jaxprs(closed.jaxpr)]
  new_subs = [s for _, s in _sub_jaxprs(new.jaxpr)]
  assert len(old_subs) == len(new_subs)
  shared = changed = 0
  for old, nw in zip(old_subs, new_subs):
    # JAX gives each cond branch the effects of all branches, so a branch
    # that uses no 'i' may still carry NamedAxisEffect('i'); that one is
    # rebuilt (effects only). Everything else without 'i' is shared.
    annotated = jax_internals.named_axis_effect_names(old.effects)
    if "i" in used_axis_names(old) or "i" in annotated:
      assert nw is not old
      assert used_axis_names(nw) == (used_axis_names(old) - {"i"}) | (
        {"k"} if "i" in used_axis_names(old) else set()
      )
      changed += 1
    else:
      assert nw is old  # reused by identity
      shared += 1
  assert shared >= 4 and changed >= 2
  for old_eqn, new_eqn in zip(closed.jaxpr.eqns, new.jaxpr.eqns):
    touched = "i" in analysis.eqn_axis_names(old_eqn)
    assert (new_eqn is old_eqn) == (not touched)

  # The renamed program is well typed (checked where 'k' and 'j' are bound)
  # and JAX's own effects follow the rename.
  def typecheck(x):
    check_jaxpr(new.jaxpr)
    return x

  jax.vmap(jax.vmap(typecheck, axis_name="j"), axis_name="k")(jnp.zeros((2, 2)))
  assert jax_internals.named_axis_effect_names(new.effects) == {"k", "j"}


def test_renamed_jaxpr_computes_the_same():
  closed = _program()
  new = rename_axes(closed, {"i": "k"})
  f_old = lambda x: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, x)[0]
  f_new = lambda x: jax.core.eval_jaxpr(new.jaxpr, new.consts, x)[0]
  xs = jnp.arange(16.0).reshape(2, 8)
  ref = jax.vmap(jax.vmap(f_old, axis_name="j"), axis_name="i")(
    xs.reshape(2, 1, 8).repeat(2, 1)
  )
  out = jax.vmap(jax.vmap(f_new, axis_name="j"), axis_name="k")(
    xs.reshape(2, 1, 8).repeat(2, 1)
  )
  np.testing.assert_allclose(out, ref)


def test_unaffected_jaxpr_is_returned_as_is_and_results_are_cached():
  closed = _program()
  assert rename_axes(closed, {"zzz": "k"}) is closed
  assert rename_axes(closed.jaxpr, {"i": "i"}) is closed.jaxpr
  a = rename_axes(closed.jaxpr, {"i": "k"})
  assert rename_axes(closed.jaxpr, {"i": "k"}) is a


def test_names_bound_inside_are_not_renamed():
  inner = jax.shard_map(
    lambda v: lax.psum(v, "i"), mesh=MESH_I(), in_specs=P("i"), out_specs=P()
  )
  closed = jax.make_jaxpr(
    lambda x: inner(x) * lax.axis_index("k"), axis_env=[("k", 2)]
  )(X)
  assert rename_axes(closed, {"i": "z"}) is closed
  new = rename_axes(closed, {"k": "m"})
  assert used_axis_names(new) == {"m"}
  assert new.jaxpr.eqns[0] is closed.jaxpr.eqns[0]  # the shard_map is shared


def test_deep_rename_of_types_inside_shard_map_body():
  closed = jax.make_jaxpr(
    jax.shard_map(
      lambda v: lax.psum(v, "i") * lax.axis_index("i"),
      mesh=MESH_I(),
      in_specs=P("i"),
      out_specs=P("i"),
    )
  )(X)
  body = closed.jaxpr.eqns[0].params["jaxpr"]
  assert "V:i" in str(body)
  new = rename_axes(body, {"i": "k"})
  assert "V:k" in str(new) and "V:i" not in str(new)
  assert all(e.ctx.cur_abstract_mesh.axis_names == ("k",) for e in new.eqns)
  assert used_axis_names(new) == {"k"}


def test_error_not_one_to_one():
  with pytest.raises(ValueError, match="one-to-one"):
    rename_axes(step, {"i": "k", "j": "k"})


def test_error_merge_with_kept_name():
  closed = jax.make_jaxpr(
    lambda v: lax.psum(v, "i") + lax.psum(v, "j"), axis_env=[("i", 2), ("j", 2)]
  )(X)
  with pytest.raises(ValueError, match="would merge two axes"):
    rename_axes(closed, {"i": "j"})


def test_error_capture_by_inner_binder():
  def fn(x):
    inner = jax.shard_map(
      lambda v: lax.psum(v, ("k", "i")),
      mesh=MESH_K(),
      in_specs=P("k"),
      out_specs=P(),
      check_vma=False,
    )
    return inner(x)

  closed = jax.make_jaxpr(fn, axis_env=[("i", 2)])(X)
  assert used_axis_names(closed) == {"i"}
  with pytest.raises(ValueError, match=r"would capture 'k' inside shard_map"):
    rename_axes(closed, {"i": "k"})


def test_error_opaque_primitive():
  closed = jax.make_jaxpr(lambda x: x)(X)
  prim = Primitive("test_opaque_collective_rename")
  prim.multiple_results = True
  eqn = new_jaxpr_eqn(
    closed.jaxpr.invars,
    closed.jaxpr.outvars,
    prim,
    {},
    {jax_internals.NamedAxisEffect("z")},
  )
  jaxpr = closed.jaxpr.replace(eqns=[eqn])
  with pytest.raises(ValueError, match="no rule for which of its params"):
    rename_axes(jaxpr, {"z": "w"})


def test_error_bad_mapping_and_fun():
  with pytest.raises(TypeError, match="mapping must be a dict"):
    rename_axes(step, [("i", "k")])
  with pytest.raises(TypeError, match="not a valid axis name"):
    rename_axes(step, {"i": 3})
  with pytest.raises(TypeError, match="fun must be callable"):
    rename_axes(5, {"i": "k"})


def test_function_without_the_name_runs_eagerly():
  g = rename_axes(lambda v: jnp.sin(v) * lax.psum(v, "j"), {"i": "k"})
  out = jax.vmap(g, axis_name="j")(X)
  np.testing.assert_allclose(out, jnp.sin(X) * X.sum(), rtol=1e-6)


def test_pallas_grid_names_shadow_a_rename():
  from jax.experimental import pallas as pl

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * (
      lax.axis_index("g") + lax.axis_index("k")
    ).astype(jnp.float32)

  fn = pl.pallas_call(
    kernel,
    out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
    grid=(("g", 2),),
    in_specs=[pl.BlockSpec((4,), lambda g: (g,))],
    out_specs=pl.BlockSpec((4,), lambda g: (g,)),
    interpret=True,
  )
  closed = jax.make_jaxpr(fn, axis_env=[("k", 2)])(X)
  assert rename_axes(closed, {"g": "z"}) is closed  # bound by the grid
  new = rename_axes(closed, {"k": "m"})
  assert used_axis_names(new) == {"m"}
  assert used_axis_names(new.eqns[0].params["jaxpr"]) == {"g", "m"}
  with pytest.raises(
    ValueError,
    match=r"would capture 'g' inside "
    r"pallas_call",
  ):
    rename_axes(closed, {"k": "g"})


def _staged_program(name):
  """Collectives at the top, in a jit called twice, a cond, a scan and a
  custom_vjp: code written for axis ``name``."""

  @jax.custom_vjp
  def total(v):
    return lax.psum(v, name)

  total.defvjp(lambda v: (total(v), None), lambda _, g: (lax.pmean(g, name),))
  inner = jax.jit(lambda v: lax.psum(v, name) * lax.axis_index(name))

  def body(x):
    y = jnp.sin(x) * 2.0 + lax.axis_index(name)
    y = inner(inner(y)) + total(y)
    y = lax.cond(
      y[0] > 0,
      lambda v: lax.ppermute(v, name, [(a, (a + 1) % 8) for a in range(8)]),
      lambda v: v * lax.axis_index(name),
      y,
    )
    y, _ = lax.scan(
      lambda c, _: (c * 0.5 + lax.axis_index(name), None), y, None, 3
    )
    return y

  return body


def _traced_over_k(f, check_vma=True):
  """``jit(shard_map(f))`` over MESH_K's "k", traced on X."""
  g = jax.jit(
    jax.shard_map(
      f, mesh=MESH_K(), in_specs=P("k"), out_specs=P("k"), check_vma=check_vma
    )
  )
  return g.trace(X)


@pytest.mark.parametrize("check_vma", [True, False])
def test_traced_rename_equals_stock_jaxpr(check_vma):
  """Under a staging trace the renamed equations are emitted into the
  caller's jaxpr directly: the jaxpr is the one stock JAX traces from the
  function written with the new names, equation for equation."""
  stock = _traced_over_k(_staged_program("k"), check_vma)
  ours = _traced_over_k(
    rename_axes(_staged_program("i"), {"i": "k"}), check_vma
  )
  assert str(ours.jaxpr) == str(stock.jaxpr)
  check_jaxpr(ours.jaxpr.jaxpr)
  np.testing.assert_array_equal(
    ours.lower().compile()(X), stock.lower().compile()(X)
  )
  # make_jaxpr with the new name bound: another staging trace.
  closed = jax.make_jaxpr(
    rename_axes(_staged_program("i"), {"i": "k"}), axis_env=[("k", 8)]
  )(X)
  closed_stock = jax.make_jaxpr(_staged_program("k"), axis_env=[("k", 8)])(X)
  assert str(closed) == str(closed_stock)


def test_traced_rename_leaks_no_tracer():
  """The rename keeps none of its inner trace's tracers past that trace
  (JAX's leak checker, which stock's own program passes, finds none)."""
  with jax.checking_leaks():
    stock = _traced_over_k(_staged_program("k"))
    ours = _traced_over_k(rename_axes(_staged_program("i"), {"i": "k"}))
  assert str(ours.jaxpr) == str(stock.jaxpr)


def test_traced_rename_keeps_source_lines():
  """Equations emitted by the rename keep the user's file:line."""

  def f(x):
    return lax.psum(x, "i")

  line = f.__code__.co_firstlineno + 1
  closed = jax.make_jaxpr(rename_axes(f, {"i": "k"}), axis_env=[("k", 8)])(X)
  (eqn,) = [e for e in closed.eqns if e.primitive.name == "psum"]
  assert eqn.params["axes"] == ("k",)
  _, at, func = jax_internals.user_location(eqn.source_info)
  assert (at, func.rsplit(".", 1)[-1]) == (line, "f")


def _typed_body(name):
  """A shard_map body over ``name`` in which every type names the axis:
  scalar literals used many times (``0.0`` and ``-0.0`` told apart), a
  primitive with two outputs, one JAX can constant-fold, collectives."""

  def body(x):
    for _ in range(3):
      x = jnp.sin(x) * 1.5 + x * 0.0 - x * -0.0
      x, y = lax.sort((x, -x), num_keys=1)
      x = x + y.astype(jnp.bfloat16).astype(jnp.float32)
      x = lax.psum(x, name) * jnp.float32(np.nan)
    return jnp.where(jnp.isnan(x), 2.0, x)

  return body


@pytest.mark.parametrize("check_vma", [True, False])
def test_traced_rename_equals_stock_when_every_type_names_the_axis(check_vma):
  """The staged rename shares one renamed literal per scalar value and
  emits the equations whose types alone change (most of them) directly;
  the jaxpr is still stock's, bit for bit."""

  def traced(f):
    g = jax.shard_map(
      f, mesh=MESH_K(), in_specs=P("k"), out_specs=P("k"), check_vma=check_vma
    )
    return jax.jit(g).trace(X)

  stock = traced(_typed_body("k"))
  ours = traced(rename_axes(_typed_body("i"), {"i": "k"}))
  assert str(ours.jaxpr) == str(stock.jaxpr)
  text = str(ours.jaxpr)
  assert "-0.0" in text and " 0.0" in text
  check_jaxpr(ours.jaxpr.jaxpr)
  np.testing.assert_array_equal(
    ours.lower().compile()(X), stock.lower().compile()(X)
  )


C = jnp.arange(8.0) + 1.0  # a constant the functions below close over


def _with_constants(name):
  def f(x):
    return jnp.sin(C) * x + lax.psum(jnp.cos(C) + x, name) * 2.0

  return f


def test_traced_rename_keeps_constants_bound():
  """Equations whose input is a constant are staged with the tracer that
  keeps the constant in the caller's jaxpr (a captured array, an array
  argument inside ``jit``)."""

  def traced(f):
    g = jax.shard_map(f, mesh=MESH_K(), in_specs=P("k"), out_specs=P("k"))
    return jax.jit(g).trace(X)

  stock = traced(_with_constants("k"))
  ours = traced(rename_axes(_with_constants("i"), {"i": "k"}))
  assert str(ours.jaxpr) == str(stock.jaxpr)
  check_jaxpr(ours.jaxpr.jaxpr)
  np.testing.assert_array_equal(
    ours.lower().compile()(X), stock.lower().compile()(X)
  )
  g = rename_axes(_with_constants("i"), {"i": "k"})
  closed = jax.make_jaxpr(lambda: g(X), axis_env=[("k", 8)])()
  want = jax.make_jaxpr(lambda: _with_constants("k")(X), axis_env=[("k", 8)])()
  assert str(closed) == str(want)
  with jax_internals.extend_axis_env([("k", 8)]):
    check_jaxpr(closed.jaxpr)
  assert len(closed.consts) == len(want.consts) == 2


def _with_dead_code(name):
  def f(x):
    jnp.cos(x) * 3.0  # unused
    return lax.psum(jnp.sin(x) * 2.0, name) + x

  return f


@pytest.mark.parametrize("auto_dce", [True, False])
def test_traced_rename_into_a_trace_that_drops_dead_code(auto_dce):
  """Staged into a trace that drops dead equations as it goes (JAX's
  ``linearize`` tangent traces), the rename drops the same ones as stock;
  a trace that keeps them keeps them."""
  src = jax_internals.current_source_info()
  dbg = jax.make_jaxpr(lambda x: x)(X).jaxpr.debug_info  # one in, one out

  def staged(f):
    trace = jax_internals._pe.DynamicJaxprTrace(dbg, auto_dce=auto_dce)
    x = trace.new_arg(jax.core.ShapedArray(X.shape, X.dtype), src)
    with (
      jax_internals._core.set_current_trace(trace),
      jax_internals.extend_axis_env([("k", 8)]),
    ):
      y = f(x)
    jaxpr, _ = trace.to_jaxpr([y], dbg, src)
    return jaxpr

  ours = staged(rename_axes(_with_dead_code("i"), {"i": "k"}))
  stock = staged(_with_dead_code("k"))
  assert str(ours) == str(stock)
  assert ("cos" in str(ours)) == (not auto_dce)
