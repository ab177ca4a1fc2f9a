"""used_axis_names agrees with JAX's own NamedAxisEffect on a corpus.

JAX 0.10.2 attaches ``NamedAxisEffect(name)`` to the equations of most
collectives and propagates it up through higher-order primitives, removing
it at binders (``shard_map``). For every corpus function we compare our
bottom-up result with the effects JAX put on the traced jaxpr, at the top
and at every sub-jaxpr, and with a hand-written expected answer.

The comparison is exact except for the divergences in ``DIVERGES``: for each
of them the test computes exactly which names JAX leaves out (and why), and
checks both that they explain the whole difference and that the difference
really occurs. Every other corpus function must agree exactly.
"""

import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
from jax import lax
from jax.custom_batching import custom_vmap
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import pytest

# Private imports below: JAX's NamedAxisEffect names (the oracle) and the
# per-equation walk.
from jaxworks.axis_names import used_axis_names
from jaxworks.axis_names._src import analysis
from jaxworks.axis_names._src import jax_internals

ENV = [("i", 4), ("j", 2), ("k", 2)]
X = jnp.arange(8.0)


@functools.cache
def MESH():
  return jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)


@functools.cache
def MESH1():
  return jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))


CORPUS = {}  # name -> (function, the free names it uses, by hand)


def case(*expected):
  def register(fn):
    CORPUS[fn.__name__] = (fn, frozenset(expected))
    return fn

  return register


# -- collectives and axis queries -------------------------------------------


@case("i")
def psum_i(x):
  return lax.psum(x, "i")


@case("i")
def pmax_i(x):
  return lax.pmax(x, "i")


@case("j")
def pmin_j(x):
  return lax.pmin(x, "j")


@case("i", "j")
def psum_two_axes(x):
  return lax.psum(x, ("i", "j"))


@case("i")
def psum_named_and_positional(x):
  return lax.psum(x, ("i", 0))


@case()
def psum_positional_only(x):
  return lax.psum(x, 0)


@case("i")
def psum_index_groups(x):
  return lax.psum(x, "i", axis_index_groups=[[0, 1], [2, 3]])


@case("i")
def axis_index_i(x):
  return x * lax.axis_index("i")


@case("i")
def all_gather_i(x):
  return lax.all_gather(x, "i")


@case("j")
def all_gather_tiled_j(x):
  return lax.all_gather(x, "j", tiled=True)


@case("i")
def psum_scatter_i(x):
  return lax.psum_scatter(x, "i", tiled=True)


@case("j")
def all_to_all_j(x):
  return lax.all_to_all(x.reshape(2, 4), "j", 0, 0)


@case("i")
def pswapaxes_i(x):
  return lax.pswapaxes(x.reshape(4, 2), "i", 0)


@case("i")
def ragged_all_to_all_i(x):
  ones = jnp.ones(4, jnp.int32)
  return lax.ragged_all_to_all(
    x, jnp.zeros(8), 0 * ones, ones, 0 * ones, ones, axis_name="i"
  )


@case("k")
def pmean_k(x):
  return lax.pmean(x, "k")


@case("i")
def ppermute_i(x):
  return lax.ppermute(x, "i", [(0, 1), (1, 0)])


@case("i")
def pshuffle_i(x):
  return lax.pshuffle(x, "i", [1, 0, 3, 2])


@case("i")
def pbroadcast_i(x):
  return lax.pbroadcast(x, "i", 0)


@case()
def no_collectives(x):
  return jnp.sin(x) @ x


# -- higher-order primitives -------------------------------------------------


@case("i")
def jit_psum(x):
  return jax.jit(lambda v: lax.psum(v, "i"))(x)


@case("j", "k")
def nested_jit(x):
  inner = jax.jit(lambda v: lax.pmax(v, "j"))
  return jax.jit(lambda v: inner(v) + lax.axis_index("k"))(x)


@case("i")
def cond_one_branch(x):
  return lax.cond(x[0] > 0, lambda v: lax.psum(v, "i"), lambda v: v, x)


@case("i", "j")
def switch_three(x):
  return lax.switch(
    1,
    [
      lambda v: lax.psum(v, "i"),
      lambda v: v * lax.axis_index("j"),
      lambda v: v,
    ],
    x,
  )


@case("i", "k")
def platform_dependent(x):
  return lax.platform_dependent(
    x, cpu=lambda v: lax.psum(v, "i"), default=lambda v: v * lax.axis_index("k")
  )


@case("i")
def while_body(x):
  return lax.while_loop(
    lambda c: c[0] < 3, lambda c: (c[0] + 1, lax.psum(c[1], "i")), (0, x)
  )[1]


@case("k")
def while_cond_axis_index(x):
  return lax.while_loop(
    lambda c: c[0] < lax.axis_index("k"), lambda c: (c[0] + 1, c[1] * 2), (0, x)
  )[1]


@case("j")
def scan_body(x):
  def body(c, v):
    return c + lax.psum(v, "j"), v

  return lax.scan(body, 0.0, x)[0]


@case("i")
def fori(x):
  return lax.fori_loop(0, 3, lambda i, v: lax.pmin(v, "i"), x)


@case("j")
def lax_map(x):
  return lax.map(lambda v: v * lax.axis_index("j"), x)


@case("i", "j")
def scan_cond_jit_mix(x):
  def body(c, v):
    w = lax.cond(
      v > 0, lambda u: u * lax.axis_index("j"), lambda u: lax.pmax(u, "i"), v
    )
    return c + w, w

  return jax.jit(lambda v: lax.scan(body, 0.0, v))(x)


@case("i")
def remat_psum(x):
  return jax.checkpoint(lambda v: jnp.sin(lax.psum(v, "i")))(x)


@case("k")
def remat_policy(x):
  return jax.checkpoint(
    lambda v: jnp.sin(lax.pmax(v, "k")),
    policy=jax.checkpoint_policies.nothing_saveable,
  )(x)


@case("i")
def grad_remat_scan(x):
  # Partial evaluation of a scan under remat emits a ``closed_call``.
  def body(c, v):
    return c * jnp.sin(lax.psum(v, "i")), c

  return jax.grad(jax.checkpoint(lambda v: lax.scan(body, 1.0, v)[0]))(x)


@case("j")
def custom_jvp_psum(x):
  @jax.custom_jvp
  def f(v):
    return lax.psum(v, "j")

  @f.defjvp
  def f_jvp(p, t):
    return f(p[0]), t[0]

  return f(x)


@case("k")
def custom_vjp_psum(x):
  @jax.custom_vjp
  def f(v):
    return lax.psum(v, "k")

  f.defvjp(lambda v: (f(v), None), lambda _, g: (g,))
  return f(x)


@case("i")
def custom_gradient_psum(x):
  @jax.custom_gradient
  def f(v):
    return lax.psum(v, "i"), lambda g: g

  return f(x)


@case("j")
def custom_vmap_psum(x):
  @custom_vmap
  def f(v):
    return lax.psum(v, "j")

  @f.def_vmap
  def f_vmap(axis_size, in_batched, v):
    return f(v), True

  return f(x)


@case("i")
def linear_solve(x):
  def matvec(v):
    return 2.0 * v + 0.0 * lax.psum(v, "i")

  return lax.custom_linear_solve(matvec, x, lambda mv, b: b / 2.0)


# -- transformations ----------------------------------------------------------


@case("i")
def vmap_binds_its_name(x):
  return jax.vmap(lambda v: lax.psum(v, "v"), axis_name="v")(x) + lax.psum(
    x, "i"
  )


@case("i")
def grad_of_psum(x):
  return jax.grad(lambda v: lax.psum(v, "i").sum())(x)


@case("j")
def jvp_all_gather(x):
  return jax.jvp(lambda v: lax.all_gather(v, "j"), (x,), (x,))[1]


@case("i")
def vjp_all_to_all(x):
  fn = lambda v: lax.all_to_all(v.reshape(4, 2), "i", 0, 0, tiled=True)
  return jax.vjp(fn, x)[1](jnp.ones((4, 2)))[0]


@case("i")
def hessian_psum(x):
  return jax.hessian(lambda v: (lax.psum(v, "i") ** 2).sum())(x).sum(0)


# -- binders --------------------------------------------------------------


@case()
def shard_map_binds(x):
  return jax.shard_map(
    lambda v: lax.psum(v, "x"), mesh=MESH1(), in_specs=P("x"), out_specs=P()
  )(x)


@case("k")
def shard_map_free_outer_name(x):
  return jax.shard_map(
    lambda v: lax.psum(v, "x") * lax.axis_index("k"),
    mesh=MESH1(),
    in_specs=P("x"),
    out_specs=P("x"),
    check_vma=False,
  )(x)


@case()
def shard_map_partial_manual(x):
  return jax.shard_map(
    lambda v: lax.psum(v, "x"),
    mesh=MESH(),
    in_specs=P("x"),
    out_specs=P(),
    axis_names={"x"},
  )(x)


@case()
def shard_map_pcast_varying(x):
  return jax.shard_map(
    lambda v: lax.pcast(jnp.ones(2), "x", to="varying") * v,
    mesh=MESH1(),
    in_specs=P("x"),
    out_specs=P("x"),
  )(x)


@case()
def nested_shard_map(x):
  def outer(v):
    inner = jax.shard_map(
      lambda w: lax.psum(w, ("x", "y")),
      mesh=jax.sharding.get_abstract_mesh(),
      in_specs=P(None),
      out_specs=P(None),
      axis_names={"y"},
      check_vma=False,
    )
    return lax.psum(inner(v), "x")

  return jax.shard_map(
    outer,
    mesh=MESH(),
    in_specs=P("x"),
    out_specs=P(),
    axis_names={"x"},
    check_vma=False,
  )(x)


@case()
def nested_shard_map_outer_name_inside(x):
  # The outer body uses 'x' only inside the inner shard_map, which binds 'y'.
  def outer(v):
    return jax.shard_map(
      lambda w: lax.psum(w, "x"),
      mesh=jax.sharding.get_abstract_mesh(),
      in_specs=P(None),
      out_specs=P(None),
      axis_names={"y"},
      check_vma=False,
    )(v)

  return jax.shard_map(
    outer,
    mesh=MESH(),
    in_specs=P("x"),
    out_specs=P("x"),
    axis_names={"x"},
    check_vma=False,
  )(x)


@case()
def pmap_binds(x):
  return jax.pmap(
    lambda v: lax.psum(v, "b") + lax.axis_index("b"), axis_name="b"
  )(x.reshape(8, 1))


@case("k")
def pmap_free_outer_name(x):
  return jax.pmap(
    lambda v: lax.psum(v, "b") * lax.axis_index("k"), axis_name="b"
  )(x.reshape(8, 1))


def _pallas(kernel):
  return pl.pallas_call(
    kernel,
    out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
    grid=(("g", 2),),
    in_specs=[pl.BlockSpec((4,), lambda g: (g,))],
    out_specs=pl.BlockSpec((4,), lambda g: (g,)),
    interpret=True,
  )


@case()
def pallas_grid_name(x):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + lax.axis_index("g").astype(jnp.float32)

  return _pallas(kernel)(x)


@case("k")
def pallas_outer_name_in_kernel(x):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * (
      lax.axis_index("g") + lax.axis_index("k")
    ).astype(jnp.float32)

  return _pallas(kernel)(x)


@case()
def pallas_core_map(x):
  mesh = pltpu.create_tensorcore_mesh("core", num_cores=2)

  def stateful(refs):
    x_ref, o_ref = refs

    @pl.core_map(mesh, interpret=True)
    def _():
      o_ref[...] = x_ref[...] + lax.axis_index("core").astype(jnp.float32)

  return pl.run_state(stateful)((x, jnp.zeros_like(x)))[1]


# ---------------------------------------------------------------------------
# Where JAX 0.10.2's effects and the names actually used differ. Each entry:
# the reason, and a function of a jaxpr giving exactly the names JAX leaves
# out below it for that reason.

# Primitives that need their axis name bound (tracing them unbound raises)
# but get no NamedAxisEffect: their abstract eval is not effectful.
NO_EFFECT = {
  "ppermute": "axis_name",
  "pbroadcast": "axis_name",
  "pvary": "axes",
}


def _walk(jaxpr):
  """The jaxpr and every sub-jaxpr below it, with their equations."""
  yield jaxpr
  for eqn in jaxpr.eqns:
    for sub in analysis.subjaxprs(eqn.params):
      yield from _walk(sub)


def _eqns_below(jaxpr):
  for j in _walk(jaxpr):
    yield from j.eqns


def _no_effect_names(jaxpr):
  out = set()
  for eqn in _eqns_below(jaxpr):
    param = NO_EFFECT.get(eqn.primitive.name)
    if param:
      p = eqn.params[param]
      out.update(p if isinstance(p, tuple) else (p,))
  return out


def _linear_solve_dropped(jaxpr):
  # custom_linear_solve's abstract eval returns ``jaxprs.solve.effects``
  # only (jax/_src/lax/control_flow/solves.py): names used by matvec,
  # vecmat or transpose_solve alone are dropped.
  out = set()
  for eqn in _eqns_below(jaxpr):
    if eqn.primitive.name == "custom_linear_solve":
      jaxprs = eqn.params["jaxprs"]
      for field in ("matvec", "vecmat", "transpose_solve"):
        j = getattr(jaxprs, field)
        if j is not None:
          out |= used_axis_names(j)
  return out


def _outer_manual_dropped(jaxpr):
  # A nested shard_map: JAX filters every axis of its mesh out of the
  # effects it lifts; only ``newly_manual_axes`` are bound there, the others
  # are bound by the enclosing shard_map and still used at this level.
  out = set()
  for eqn in _eqns_below(jaxpr):
    if eqn.primitive.name == "shard_map":
      p = eqn.params
      outer = set(p["mesh"].axis_names) - set(p["newly_manual_axes"])
      out |= used_axis_names(p["jaxpr"]) & outer
  return out


def _pallas_kernel_dropped(jaxpr):
  # pallas_call's effects come from ``interpret`` only; names a kernel uses
  # beyond its grid names (device axes, e.g. for remote DMAs) are dropped.
  out = set()
  for eqn in _eqns_below(jaxpr):
    if eqn.primitive.name == "pallas_call":
      grid = set(eqn.params["grid_mapping"].grid_names or ())
      out |= used_axis_names(eqn.params["jaxpr"]) - grid
  return out


DIVERGES = {
  "ppermute_i": _no_effect_names,
  "pshuffle_i": _no_effect_names,
  "pbroadcast_i": _no_effect_names,
  "shard_map_pcast_varying": _no_effect_names,  # pvary in the body
  "linear_solve": _linear_solve_dropped,
  "nested_shard_map_outer_name_inside": _outer_manual_dropped,
  "pallas_outer_name_in_kernel": _pallas_kernel_dropped,
}


def _trace(fn):
  return jax.make_jaxpr(fn, axis_env=ENV)(X)


def _groups(jaxpr):
  """The top jaxpr, then every sub-jaxpr, each as a tuple of jaxprs.

  The branches of one ``cond`` form one group: JAX gives every branch the
  union of all branches' effects, so only the union is comparable.
  """
  yield (jaxpr,)
  for eqn in jaxpr.eqns:
    subs = analysis.subjaxprs(eqn.params)
    if eqn.primitive.name == "cond":
      yield tuple(subs)
      for sub in subs:
        for group in _groups(sub):
          if group != (sub,):
            yield group
    else:
      for sub in subs:
        yield from _groups(sub)


def _compare(jaxprs):
  """(ours, JAX's) names of a group of jaxprs."""
  ours = frozenset().union(*map(used_axis_names, jaxprs))
  theirs = frozenset().union(
    *(jax_internals.named_axis_effect_names(j.effects) for j in jaxprs)
  )
  return ours, theirs


def test_corpus_is_large_enough():
  assert len(CORPUS) >= 30


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_agrees_with_jax_effects_and_expected_names(name):
  fn, expected = CORPUS[name]
  closed = _trace(fn)
  assert used_axis_names(closed) == expected
  explain = DIVERGES.get(name)
  diverged = False
  for jaxprs in _groups(closed.jaxpr):
    ours, theirs = _compare(jaxprs)
    if explain is None:
      assert ours == theirs, (jaxprs, ours, theirs)
      continue
    dropped = set().union(*map(explain, jaxprs))
    # JAX never reports a name we do not, and what it leaves out is exactly
    # what the documented reason says it drops.
    assert theirs <= ours, (ours, theirs)
    assert ours - theirs <= dropped, (ours, theirs, dropped)
    diverged |= ours != theirs
  # A listed divergence must really occur (or the entry is stale).
  assert diverged == (explain is not None)


def test_no_effect_primitives_really_have_none():
  """The primitives in NO_EFFECT need the name bound but carry no effect."""
  fns = {
    "ppermute": lambda x: lax.ppermute(x, "i", [(0, 1)]),
    "pbroadcast": lambda x: lax.pbroadcast(x, "i", 0),
  }
  for prim, fn in fns.items():
    with pytest.raises(NameError):
      jax.make_jaxpr(fn)(X)
    (eqn,) = [e for e in _trace(fn).eqns if e.primitive.name == prim]
    assert not eqn.effects
    assert analysis.eqn_axis_names(eqn) == {"i"}
  body = _trace(shard_map_pcast_varying).eqns[0].params["jaxpr"]
  (pvary,) = [e for e in body.eqns if e.primitive.name == "pvary"]
  assert not pvary.effects and analysis.eqn_axis_names(pvary) == {"x"}


def test_corpus_covers_the_higher_order_primitives():
  """Each listed primitive holds a sub-jaxpr using a name in some case."""
  seen = set()
  for fn, _ in CORPUS.values():
    for eqn in _eqns_below(_trace(fn).jaxpr):
      if any(
        analysis.uses_axes_anywhere(s) for s in analysis.subjaxprs(eqn.params)
      ):
        seen.add(eqn.primitive.name)
  assert seen >= {
    "jit",
    "cond",
    "while",
    "scan",
    "remat2",
    "closed_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vmap_call",
    "custom_linear_solve",
    "shard_map",
    "pallas_call",
    "core_map",
    "run_state",
  }, seen


def test_function_form_matches_jaxpr_form():
  for name, (fn, expected) in CORPUS.items():
    assert used_axis_names(fn, X, axis_sizes=dict(ENV)) == expected, name
