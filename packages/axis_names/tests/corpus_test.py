"""used_axis_names agrees with JAX's own NamedAxisEffect on a corpus.

JAX 0.10.2 attaches ``NamedAxisEffect(name)`` to equations of most
collectives and propagates it up through higher-order primitives, removing
it at ``shard_map``. For every corpus function we compare our bottom-up
result with the effects JAX put on the traced jaxpr, at the top and at
every sub-jaxpr. Known, deliberate differences are listed in ``NO_EFFECT``
(primitives that need a bound axis name but carry no effect in JAX).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

from jaxworks.axis_names import used_axis_names
from jaxworks.axis_names._src import analysis, jax_internals

ENV = [("i", 4), ("j", 2), ("k", 2)]
X = jnp.arange(8.0)
MESH = jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)
MESH1 = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))

# Primitives that use an axis name but get no NamedAxisEffect in JAX 0.10.2
# (their abstract eval is not effectful); we report their names anyway.
NO_EFFECT = {"ppermute": "axis_name", "pbroadcast": "axis_name",
             "pvary": "axes"}
# Higher-order primitives whose effects JAX takes from only some of their
# sub-jaxprs: custom_linear_solve keeps the effects of ``solve`` and drops
# those of ``matvec`` (jax/_src/lax/control_flow/solves.py).
DROPS_EFFECTS = {"custom_linear_solve"}

CORPUS = {}


def case(fn):
  CORPUS[fn.__name__] = fn
  return fn


@case
def psum_i(x):
  return lax.psum(x, "i")


@case
def pmax_i(x):
  return lax.pmax(x, "i")


@case
def pmin_j(x):
  return lax.pmin(x, "j")


@case
def psum_two_axes(x):
  return lax.psum(x, ("i", "j"))


@case
def psum_named_and_positional(x):
  return lax.psum(x, ("i", 0))


@case
def psum_positional_only(x):
  return lax.psum(x, 0)


@case
def axis_index_i(x):
  return x * lax.axis_index("i")


@case
def all_gather_i(x):
  return lax.all_gather(x, "i")


@case
def all_gather_tiled_j(x):
  return lax.all_gather(x, "j", tiled=True)


@case
def psum_scatter_i(x):
  return lax.psum_scatter(x, "i", tiled=True)


@case
def all_to_all_j(x):
  return lax.all_to_all(x.reshape(2, 4), "j", 0, 0)


@case
def pmean_k(x):
  return lax.pmean(x, "k")


@case
def jit_psum(x):
  return jax.jit(lambda v: lax.psum(v, "i"))(x)


@case
def nested_jit(x):
  inner = jax.jit(lambda v: lax.pmax(v, "j"))
  return jax.jit(lambda v: inner(v) + lax.axis_index("k"))(x)


@case
def cond_one_branch(x):
  return lax.cond(x[0] > 0, lambda v: lax.psum(v, "i"), lambda v: v, x)


@case
def switch_three(x):
  return lax.switch(1, [lambda v: lax.psum(v, "i"),
                        lambda v: v * lax.axis_index("j"),
                        lambda v: v], x)


@case
def while_body(x):
  return lax.while_loop(lambda c: c[0] < 3,
                        lambda c: (c[0] + 1, lax.psum(c[1], "i")), (0, x))[1]


@case
def while_cond_axis_index(x):
  return lax.while_loop(lambda c: c[0] < lax.axis_index("k"),
                        lambda c: (c[0] + 1, c[1] * 2), (0, x))[1]


@case
def scan_body(x):
  def body(c, v):
    return c + lax.psum(v, "j"), v
  return lax.scan(body, 0.0, x)[0]


@case
def fori(x):
  return lax.fori_loop(0, 3, lambda i, v: lax.pmin(v, "i"), x)


@case
def remat_psum(x):
  return jax.checkpoint(lambda v: jnp.sin(lax.psum(v, "i")))(x)


@case
def custom_jvp_psum(x):
  @jax.custom_jvp
  def f(v):
    return lax.psum(v, "j")

  @f.defjvp
  def f_jvp(p, t):
    return f(p[0]), t[0]
  return f(x)


@case
def custom_vjp_psum(x):
  @jax.custom_vjp
  def f(v):
    return lax.psum(v, "k")
  f.defvjp(lambda v: (f(v), None), lambda _, g: (g,))
  return f(x)


@case
def linear_solve(x):
  def matvec(v):
    return 2.0 * v + 0.0 * lax.psum(v, "i")
  return lax.custom_linear_solve(matvec, x, lambda mv, b: b / 2.0)


@case
def lax_map(x):
  return lax.map(lambda v: v * lax.axis_index("j"), x)


@case
def vmap_binds_its_name(x):
  return jax.vmap(lambda v: lax.psum(v, "v"), axis_name="v")(x) + \
      lax.psum(x, "i")


@case
def grad_of_psum(x):
  return jax.grad(lambda v: lax.psum(v, "i").sum())(x)


@case
def jvp_all_gather(x):
  return jax.jvp(lambda v: lax.all_gather(v, "j"), (x,), (x,))[1]


@case
def shard_map_binds(x):
  return jax.shard_map(lambda v: lax.psum(v, "x"), mesh=MESH1,
                       in_specs=P("x"), out_specs=P())(x)


@case
def shard_map_free_outer_name(x):
  return jax.shard_map(lambda v: lax.psum(v, "x") * lax.axis_index("k"),
                       mesh=MESH1, in_specs=P("x"), out_specs=P("x"),
                       check_vma=False)(x)


@case
def shard_map_partial_manual(x):
  return jax.shard_map(lambda v: lax.psum(v, "x"), mesh=MESH,
                       in_specs=P("x"), out_specs=P(), axis_names={"x"})(x)


@case
def nested_shard_map(x):
  def outer(v):
    inner = jax.shard_map(lambda w: lax.psum(w, ("x", "y")),
                          mesh=jax.sharding.get_abstract_mesh(),
                          in_specs=P(None), out_specs=P(None),
                          axis_names={"y"}, check_vma=False)
    return lax.psum(inner(v), "x")
  return jax.shard_map(outer, mesh=MESH, in_specs=P("x"), out_specs=P(),
                       axis_names={"x"}, check_vma=False)(x)


@case
def pmap_binds(x):
  return jax.pmap(lambda v: lax.psum(v, "b") + lax.axis_index("b"),
                  axis_name="b")(x.reshape(8, 1))


@case
def pmap_free_outer_name(x):
  return jax.pmap(lambda v: lax.psum(v, "b") * lax.axis_index("k"),
                  axis_name="b")(x.reshape(8, 1))


@case
def scan_cond_jit_mix(x):
  def body(c, v):
    w = lax.cond(v > 0, lambda u: u * lax.axis_index("j"),
                 lambda u: lax.pmax(u, "i"), v)
    return c + w, w
  return jax.jit(lambda v: lax.scan(body, 0.0, v))(x)


@case
def no_collectives(x):
  return jnp.sin(x) @ x


@case
def ppermute_i(x):
  return lax.ppermute(x, "i", [(0, 1), (1, 0)])


@case
def shard_map_pcast_varying(x):
  return jax.shard_map(
      lambda v: lax.pcast(jnp.ones(2), "x", to="varying") * v, mesh=MESH1,
      in_specs=P("x"), out_specs=P("x"))(x)


def _trace(fn):
  return jax.make_jaxpr(fn, axis_env=ENV)(X)


def _walk(jaxpr, inside_binder=False):
  """Yields (jaxpr, inside_binder) for the jaxpr and all its sub-jaxprs."""
  yield jaxpr, inside_binder
  for eqn in jaxpr.eqns:
    binder = eqn.primitive.name == "shard_map"
    for sub in analysis.subjaxprs(eqn.params):
      yield from _walk(sub, inside_binder or binder)


def _groups(jaxpr, inside_binder=False):
  """Yields (jaxprs, inside_binder): the top jaxpr, then sub-jaxprs.

  The branches of one ``cond`` form one group: JAX gives every branch the
  union of all branches' effects, so only the union is comparable.
  """
  yield (jaxpr,), inside_binder
  for eqn in jaxpr.eqns:
    binder = inside_binder or eqn.primitive.name == "shard_map"
    subs = analysis.subjaxprs(eqn.params)
    if eqn.primitive.name == "cond":
      yield tuple(subs), binder
      for sub in subs:
        for group in _groups(sub, binder):
          if group[0] != (sub,):
            yield group
    else:
      for sub in subs:
        yield from _groups(sub, binder)


def _no_effect_names(jaxpr):
  """Names used by NO_EFFECT primitives anywhere below ``jaxpr``."""
  out = set()
  for j, _ in _walk(jaxpr):
    for eqn in j.eqns:
      param = NO_EFFECT.get(eqn.primitive.name)
      if param:
        p = eqn.params[param]
        out.update(p if isinstance(p, tuple) else (p,))
  return out


def _dropped_names(jaxpr):
  """Names JAX drops at a DROPS_EFFECTS primitive anywhere below ``jaxpr``."""
  out = set()
  for j, _ in _walk(jaxpr):
    for eqn in j.eqns:
      if eqn.primitive.name in DROPS_EFFECTS:
        for sub in analysis.subjaxprs(eqn.params):
          out |= used_axis_names(sub)
  return out


def test_corpus_is_large_enough():
  assert len(CORPUS) >= 30


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_top_level_agrees_with_jax_effects(name):
  closed = _trace(CORPUS[name])
  ours = used_axis_names(closed)
  jax_names = jax_internals.named_axis_effect_names(closed.effects)
  extra = _no_effect_names(closed.jaxpr) | _dropped_names(closed.jaxpr)
  assert jax_names <= ours
  assert ours - jax_names <= extra, (ours, jax_names)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_every_sub_jaxpr_agrees_with_jax_effects(name):
  closed = _trace(CORPUS[name])
  for jaxprs, inside_binder in _groups(closed.jaxpr):
    ours = frozenset().union(*map(used_axis_names, jaxprs))
    jax_names = frozenset().union(*(
        jax_internals.named_axis_effect_names(j.effects) for j in jaxprs))
    extra = set().union(*map(_no_effect_names, jaxprs))
    extra |= set().union(*map(_dropped_names, jaxprs))
    if inside_binder:
      # JAX's shard_map drops every mesh axis from the effects it lifts;
      # we drop only the axes it makes manual. Inside a shard_map body the
      # two agree on everything but the outer mesh's names.
      mesh_names = {"x", "y"}
      assert ours - mesh_names - extra == jax_names - mesh_names
    else:
      assert jax_names <= ours
      assert ours - jax_names <= extra


EXPECTED = {
    "psum_i": {"i"}, "psum_two_axes": {"i", "j"},
    "psum_positional_only": set(), "vmap_binds_its_name": {"i"},
    "shard_map_binds": set(), "shard_map_free_outer_name": {"k"},
    "nested_shard_map": set(), "pmap_binds": set(),
    "pmap_free_outer_name": {"k"}, "scan_cond_jit_mix": {"i", "j"},
    "ppermute_i": {"i"}, "no_collectives": set(),
    "while_cond_axis_index": {"k"}, "linear_solve": {"i"},
    "custom_vjp_psum": {"k"}, "shard_map_pcast_varying": set(),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_expected_names(name):
  assert used_axis_names(_trace(CORPUS[name])) == frozenset(EXPECTED[name])


def test_ppermute_is_reported_although_jax_has_no_effect():
  closed = _trace(ppermute_i)
  assert jax_internals.named_axis_effect_names(closed.effects) == frozenset()
  assert used_axis_names(closed) == {"i"}


def test_custom_linear_solve_matvec_names_are_kept():
  closed = _trace(linear_solve)
  assert jax_internals.named_axis_effect_names(closed.effects) == frozenset()
  assert used_axis_names(closed) == {"i"}


def test_function_form_matches_jaxpr_form():
  for name, fn in CORPUS.items():
    via_fn = used_axis_names(fn, X, axis_sizes=dict(ENV))
    assert via_fn == used_axis_names(_trace(fn)), name
