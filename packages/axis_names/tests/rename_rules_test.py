"""rename_axes reaches custom rules and meshes that have both names.

Every renamed function is compared, bit for bit, with the same function
written by hand with the new names and run by stock JAX, under ``grad``,
``jvp``, ``vmap`` (with an axis name), ``shard_map`` and ``pmap`` (8 host
devices).
"""

import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from jaxworks.axis_names import rename_axes

X = jnp.arange(8.0) / 8 + 0.25
T = jnp.linspace(-1.0, 1.0, 8)
AUTO = (AxisType.Auto,)


@functools.cache
def MESH_K():
  return jax.make_mesh((8,), ("k",), axis_types=AUTO)


@functools.cache
def MESH_IK():
  return jax.make_mesh((4, 2), ("i", "k"), axis_types=AUTO * 2)


def agree(run, g, ref, stock_raises=None):
  """``run(g)`` equals ``run(ref)`` bit for bit.

  Where stock JAX is known to raise (``stock_raises``, an exception class),
  the renamed function must raise the same class.
  """
  if stock_raises is not None:
    with pytest.raises(stock_raises) as stock:
      run(ref)
    with pytest.raises(type(stock.value)):
      run(g)
    return
  same(run(g), run(ref))


def same(a, b):
  """Bit-for-bit equality of two pytrees of arrays, dtypes included."""
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    assert jnp.asarray(x).dtype == jnp.asarray(y).dtype
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# Functions written for an axis called ``name``; ``make(name)`` is also the
# hand-renamed stock version.


def vjp_fn(name):
  @jax.custom_vjp
  def f(x):
    return lax.psum(x, name) * jnp.sin(x)

  def fwd(x):
    return f(x), (x, lax.axis_index(name))

  def bwd(res, g):
    x, idx = res
    return (g * jnp.cos(x) + lax.psum(g, name) * 0.5 + idx.astype(g.dtype),)

  f.defvjp(fwd, bwd)
  return lambda x: jnp.tanh(f(x))


def vjp_only_bwd_fn(name):
  """The primal uses no axis name; only the backward rule does."""

  @jax.custom_vjp
  def f(x):
    return x * 3.0

  f.defvjp(lambda x: (f(x), x), lambda x, g: (g * x + lax.pmax(g, name),))
  return f


def vjp_symbolic_zeros_fn(name):
  @jax.custom_vjp
  def f(x, y):
    return lax.psum(x * y, name), x - y

  def fwd(x, y):
    return f(x.value, y.value), (x.value, y.value)

  def bwd(res, cts):
    x, y = res
    ct_a, ct_b = cts
    out = jnp.zeros_like(x)
    if type(ct_a) is not jax.custom_derivatives.SymbolicZero:
      out = out + lax.psum(ct_a * y, name)
    if type(ct_b) is not jax.custom_derivatives.SymbolicZero:
      out = out + ct_b * lax.axis_index(name).astype(x.dtype)
    return out, None

  f.defvjp(fwd, bwd, symbolic_zeros=True)
  return lambda x: f(x, jnp.cos(x))[0]  # the second output's ct is zero


def jvp_fn(name):
  @jax.custom_jvp
  def f(x):
    return lax.pmax(x, name) + jnp.sin(x)

  @f.defjvp
  def f_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return f(x), lax.psum(t * jnp.cos(x), name) + t

  return lambda x: f(x) * 2.0


def jvp_symbolic_zeros_fn(name):
  @jax.custom_jvp
  def f(x, y):
    return lax.psum(x * y, name)

  def f_jvp(primals, tangents):
    x, y = primals
    tx, ty = tangents
    terms = []  # psums: invariant, like the primal output
    if type(tx) is not jax.custom_derivatives.SymbolicZero:
      terms.append(lax.psum(tx * y, name))
    if type(ty) is not jax.custom_derivatives.SymbolicZero:
      terms.append(lax.psum(ty * x, name))
    return f(x, y), sum(terms[1:], terms[0])

  f.defjvp(f_jvp, symbolic_zeros=True)
  return lambda x: f(x, 2.0 * jnp.ones_like(x))


def nested_fn(name):
  """custom_vjp rules inside jit, scan, cond and remat."""
  inner = vjp_fn(name)

  def fn(x):
    y = jax.jit(inner)(x)
    y = lax.scan(lambda c, _: (inner(c) + c, None), y, None, length=2)[0]
    y = lax.cond(y.sum() > 0, inner, lambda v: -v, y)
    return jax.checkpoint(inner)(y)

  return fn


VJP_MAKERS = [vjp_fn, vjp_only_bwd_fn, vjp_symbolic_zeros_fn, nested_fn]
JVP_MAKERS = [jvp_fn, jvp_symbolic_zeros_fn]
MAKERS = VJP_MAKERS + JVP_MAKERS


def renamed_and_ref(make, mapping=None):
  mapping = mapping or {"i": "k"}
  return rename_axes(make("i"), mapping), make("k")


def loss(fn):
  return lambda x: fn(x).sum()


@pytest.mark.parametrize("make", MAKERS)
def test_grad_under_vmap(make):
  g, ref = renamed_and_ref(make)
  agree(lambda fn: jax.jit(jax.vmap(jax.grad(fn), axis_name="k"))(X), g, ref)


@pytest.mark.parametrize("make", MAKERS)
def test_grad_of_vmap(make):
  g, ref = renamed_and_ref(make)
  agree(
    lambda fn: jax.jit(jax.grad(loss(jax.vmap(fn, axis_name="k"))))(X), g, ref
  )


@pytest.mark.parametrize("make", JVP_MAKERS)
def test_jvp_under_vmap(make):
  g, ref = renamed_and_ref(make)
  jvp = lambda fn: jax.vmap(lambda x, t: jax.jvp(fn, (x,), (t,)), axis_name="k")
  agree(lambda fn: jvp(fn)(X, T), g, ref)
  lin = lambda fn: jax.vmap(
    lambda x, t: jax.linearize(fn, x)[1](t), axis_name="k"
  )
  agree(lambda fn: lin(fn)(X, T), g, ref)


@pytest.mark.parametrize("make", VJP_MAKERS)
def test_jvp_of_custom_vjp_raises_like_stock(make):
  g, ref = renamed_and_ref(make)
  run = lambda fn: jax.vmap(
    lambda x, t: jax.jvp(fn, (x,), (t,)), axis_name="k"
  )(X, T)
  with pytest.raises(TypeError) as stock:
    run(ref)
  with pytest.raises(type(stock.value)):
    run(g)


def _shard(fn, mesh, spec):
  # jit: one compile per program instead of one per eager primitive.
  return jax.jit(
    jax.shard_map(fn, mesh=mesh, in_specs=P(spec), out_specs=P(spec))
  )


@pytest.mark.parametrize("make", MAKERS)
def test_shard_map_grad_both_ways(make):
  g, ref = renamed_and_ref(make)
  agree(
    lambda fn: jax.jit(jax.grad(loss(_shard(fn, MESH_K(), "k"))))(X), g, ref
  )
  # grad inside the shard_map body
  inner = lambda fn: _shard(jax.grad(loss(fn)), MESH_K(), "k")
  agree(lambda fn: inner(fn)(X), g, ref)


@pytest.mark.parametrize("make", JVP_MAKERS)
def test_shard_map_jvp(make):
  g, ref = renamed_and_ref(make)
  run = lambda fn: jax.jvp(_shard(fn, MESH_K(), "k"), (X,), (T,))
  agree(run, g, ref)


@pytest.mark.parametrize("make", MAKERS)
def test_pmap_grad(make):
  g, ref = renamed_and_ref(make, {"i": "p"})
  ref = make("p")
  xs = X.reshape(8, 1)
  agree(lambda fn: jax.pmap(jax.grad(loss(fn)), axis_name="p")(xs), g, ref)


@pytest.mark.parametrize("make", [vjp_fn, vjp_only_bwd_fn, jvp_fn])
def test_mesh_with_old_and_new_name(make):
  # {'i': 'k'} inside a shard_map over a mesh that also has an axis 'i':
  # the function's 'i' means the mesh's 'k'.
  g, ref = renamed_and_ref(make)
  spec = ("i", "k")
  agree(lambda fn: _shard(fn, MESH_IK(), spec)(X), g, ref)
  agree(lambda fn: jax.grad(loss(_shard(fn, MESH_IK(), spec)))(X), g, ref)
  agree(lambda fn: _shard(jax.grad(loss(fn)), MESH_IK(), spec)(X), g, ref)


def both_names(a, b):
  """Uses two names; ``both_names('k', 'i')`` is the swap of ('i', 'k')."""
  inner = vjp_fn(a)

  def fn(x):
    return inner(x) * 10.0 + lax.psum(x, b) + lax.axis_index(a).astype(x.dtype)

  return fn


@pytest.mark.parametrize("check_vma", [True, False])
def test_swap_inside_a_mesh_with_both_names(check_vma):
  g = rename_axes(both_names("i", "k"), {"i": "k", "k": "i"})
  ref = both_names("k", "i")
  shard = lambda fn: jax.jit(
    jax.shard_map(
      fn,
      mesh=MESH_IK(),
      in_specs=P(("i", "k")),
      out_specs=P(("i", "k")),
      check_vma=check_vma,
    )
  )
  same(shard(g)(X), shard(ref)(X))
  same(jax.grad(loss(shard(g)))(X), jax.grad(loss(shard(ref)))(X))


def test_partial_manual_mesh_with_old_name_as_auto_axis():
  # The new name 'k' is manual, the old name 'i' is an Auto axis of the mesh.
  g, ref = renamed_and_ref(vjp_fn)
  shard = lambda fn: jax.shard_map(
    fn, mesh=MESH_IK(), in_specs=P("k"), out_specs=P("k"), axis_names={"k"}
  )
  same(jax.jit(shard(g))(X), jax.jit(shard(ref))(X))
  same(
    jax.jit(jax.grad(loss(shard(g))))(X), jax.jit(jax.grad(loss(shard(ref))))(X)
  )


def test_clash_with_a_name_the_function_keeps_is_a_clear_error():
  # The function uses 'k' itself and the mesh has it: {'i': 'k'} merges.
  g = rename_axes(both_names("i", "k"), {"i": "k"})
  with pytest.raises(
    ValueError, match=r"'k' becomes 'i'.*would merge two axes"
  ):
    _shard(g, MESH_IK(), ("i", "k"))(X)


def test_rule_capture_by_an_inner_shard_map_is_an_error():
  # The backward rule uses the free name 'i'; inside the function a
  # shard_map binds 'k', so renaming 'i' to 'k' would capture it.
  @jax.custom_vjp
  def f(x):
    return x * 2.0

  f.defvjp(lambda x: (f(x), None), lambda _, g: (lax.psum(g, "i"),))

  def fn(x):
    return jax.shard_map(f, mesh=MESH_K(), in_specs=P("k"), out_specs=P("k"))(x)

  g = rename_axes(fn, {"i": "k"})
  np.testing.assert_array_equal(
    jax.vmap(g, axis_name="k")(X[None]), 2 * X[None]
  )
  with pytest.raises(ValueError, match=r"would capture 'k' inside shard_map"):
    jax.vmap(jax.grad(loss(g)), axis_name="k")(X[None])


def test_renamed_jaxpr_carries_renamed_rules():
  # Renaming a jaxpr (not a function) also renames its rules.
  closed = jax.make_jaxpr(vjp_fn("i"), axis_env=[("i", 8)])(1.0)
  new = rename_axes(closed, {"i": "k"})
  run = lambda c: jax.vmap(
    jax.grad(lambda x: jax.core.eval_jaxpr(c.jaxpr, c.consts, x)[0]),
    axis_name="k",
  )(X)
  ref = jax.vmap(jax.grad(vjp_fn("k")), axis_name="k")(X)
  same(run(new), ref)
  with pytest.raises(NameError, match="unbound axis name: i"):
    run(closed)


def test_custom_vmap_rule_is_renamed():
  from jax import custom_batching

  def make(name):
    @custom_batching.custom_vmap
    def f(x):
      return x + 1.0

    @f.def_vmap
    def rule(axis_size, in_batched, xs):
      del axis_size
      return xs + lax.psum(xs, name), in_batched[0]

    return f

  g = rename_axes(make("i"), {"i": "k"})
  ref = make("k")
  run = lambda fn: jax.vmap(jax.vmap(fn), axis_name="k")(
    jnp.arange(16.0).reshape(8, 2)
  )
  agree(run, g, ref)


def test_error_for_unbound_new_name_names_it():
  # Called where the new name is not bound: a NameError in the user's
  # terms, as for the hand-renamed function (no placeholder size is
  # assumed for the trace).
  with pytest.raises(NameError):
    jax.vmap(vjp_fn("k"), axis_name="z")(X)
  g = rename_axes(vjp_fn("i"), {"i": "k"})
  with pytest.raises(
    NameError, match="uses axis 'i', renamed to 'k', which is not bound here"
  ):
    jax.vmap(g, axis_name="z")(X)
  # The backward rule alone uses the name: the error comes when it runs.
  g = rename_axes(vjp_only_bwd_fn("i"), {"i": "k"})
  np.testing.assert_array_equal(jax.vmap(g, axis_name="z")(X), X * 3.0)
  with pytest.raises(NameError, match="renamed to 'k'|unbound axis name: k"):
    jax.vmap(jax.grad(g), axis_name="z")(X)


def two_names_vjp_fn(outer, inner):
  @jax.custom_vjp
  def f(x):
    return lax.pmax(x, inner) * jnp.cos(x)

  f.defvjp(
    lambda x: (f(x), x), lambda x, g: (lax.psum(g * jnp.sin(x), outer) + g,)
  )
  return lambda x: lax.psum(f(x), inner)


def test_rule_traced_where_an_inner_vmap_axis_is_unbound():
  # grad of pmap('p') of vmap('j'): JAX traces the custom_vjp forward rule
  # while linearizing the pmap, where the vmap axis 'j' is not in the axis
  # environment; the rule is traced with the sizes of the function's trace.
  g = rename_axes(two_names_vjp_fn("i", "j"), {"i": "p"})
  ref = two_names_vjp_fn("p", "j")
  xs = X.reshape(2, 4)

  def run(fn):
    f = jax.pmap(jax.vmap(fn, axis_name="j"), axis_name="p")
    return jax.jit(jax.grad(lambda x: f(x).sum()))(xs)

  agree(run, g, ref)
  assert rename_axes(ref, {"i": "i"}) is ref  # identity: the function itself


def test_nested_renames_compose():
  # A renamed function renamed again, and one renamed inside another.
  g = rename_axes(rename_axes(vjp_fn("i"), {"i": "j"}), {"j": "k"})
  agree(
    lambda fn: jax.jit(jax.vmap(jax.grad(fn), axis_name="k"))(X), g, vjp_fn("k")
  )
  h = rename_axes(
    lambda x: rename_axes(vjp_fn("i"), {"i": "j"})(x) + lax.psum(x, "k"),
    {"j": "a", "k": "b"},
  )
  ref = lambda x: vjp_fn("a")(x) + lax.psum(x, "b")
  agree(
    lambda fn: jax.jit(
      jax.vmap(jax.vmap(jax.grad(fn), axis_name="b"), axis_name="a")
    )(X.reshape(2, 4)),
    h,
    ref,
  )


def variants_fn(name):
  """Collective variants a rename must reach, inside shard_map."""

  def fn(x):
    y = lax.pcast(jnp.full(x.shape, 2.0, x.dtype), name, to="varying") * x
    y = y + lax.psum_scatter(jnp.tile(x, 8), name, tiled=True)
    y = y + lax.pmin(lax.stop_gradient(x), name) + lax.psum(x, (name,))
    y = y + lax.all_to_all(jnp.tile(x, 8), name, 0, 0, tiled=True)[:1]
    return y * lax.axis_index(name).astype(x.dtype)

  return fn


def test_collective_variants_under_shard_map_and_grad():
  g, ref = renamed_and_ref(variants_fn)
  agree(lambda fn: _shard(fn, MESH_K(), "k")(X), g, ref)
  agree(
    lambda fn: jax.jit(jax.grad(loss(_shard(fn, MESH_K(), "k"))))(X), g, ref
  )


def test_custom_jvp_inside_while_loop_under_jvp():
  def make(name):
    inner = jvp_fn(name)
    return lambda x: lax.while_loop(
      lambda c: c[1] < 3, lambda c: (inner(c[0]), c[1] + 1), (x, 0)
    )[0]

  g, ref = renamed_and_ref(make)
  jvp = lambda fn: jax.jit(
    jax.vmap(lambda x, t: jax.jvp(fn, (x,), (t,)), axis_name="k")
  )
  agree(lambda fn: jvp(fn)(X, T), g, ref)


def test_pbroadcast_is_renamed_in_the_jaxpr():
  # No CPU lowering for pbroadcast: checked on the renamed jaxpr.
  body = lambda v: lax.pbroadcast(v, "i", source=1)
  closed = jax.make_jaxpr(
    jax.shard_map(
      body,
      mesh=jax.make_mesh((8,), ("i",), axis_types=AUTO),
      in_specs=P("i"),
      out_specs=P("i"),
    )
  )(X)
  inner = closed.jaxpr.eqns[0].params["jaxpr"]
  new = rename_axes(inner, {"i": "k"})
  (eqn,) = [e for e in new.eqns if e.primitive.name == "pbroadcast"]
  assert eqn.params["axis_name"] in ("k", ("k",))
  assert "V:k" in str(new) and "V:i" not in str(new)


def test_custom_lin_backward_rule_in_a_linearized_jaxpr():
  # jax.linearize of a custom_vjp leaves a custom_lin equation holding the
  # backward rule; transposing the renamed jaxpr runs that rule.
  def lin_of(name):
    f = vjp_fn(name)
    return lambda x, t: jax.linearize(f, x)[1](t)

  closed = jax.make_jaxpr(lin_of("i"), axis_env=[("i", 8)])(1.0, 1.0)
  assert "custom_lin" in [e.primitive.name for e in closed.jaxpr.eqns]
  new = rename_axes(closed, {"i": "k"})
  as_fn = lambda c: lambda x, t: jax.core.eval_jaxpr(c.jaxpr, c.consts, x, t)[0]
  run = lambda fn: jax.jit(
    jax.vmap(
      lambda x, t: jax.linear_transpose(lambda u: fn(x, u), t)(t)[0],
      axis_name="k",
    )
  )(X, T)
  agree(run, as_fn(new), lin_of("k"))
