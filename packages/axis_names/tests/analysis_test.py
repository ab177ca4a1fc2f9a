"""used_axis_names: bottom-up analysis, memoization, binders, discovery."""

import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import gc
import threading

import jax
from jax import lax
from jax.extend.core import Primitive
from jax.extend.core import new_jaxpr_eqn
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from jaxworks.axis_names import used_axis_names
from jaxworks.axis_names._src import analysis

X = jnp.arange(8.0)


@functools.cache
def MESH():
  return jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))


def _closed(fn, *env):
  return jax.make_jaxpr(fn, axis_env=list(env) or [("i", 2), ("j", 2)])(X)


def test_closed_jaxpr_jaxpr_and_function_forms():
  fn = lambda x: lax.psum(x, "i") * lax.axis_index("j")
  closed = _closed(fn)
  assert used_axis_names(closed) == {"i", "j"}
  assert used_axis_names(closed.jaxpr) == {"i", "j"}
  assert used_axis_names(fn, X) == {"i", "j"}
  assert used_axis_names(fn, X, axis_sizes={"i": 4}) == {"i", "j"}


def test_function_kwargs_are_passed():
  def fn(x, *, name_scale):
    return lax.psum(x, "i") * name_scale

  assert used_axis_names(fn, X, name_scale=2.0) == {"i"}


def test_result_is_frozenset():
  assert isinstance(used_axis_names(_closed(lambda x: x)), frozenset)


def test_repeated_query_hits_the_cache():
  closed = _closed(lambda x: lax.psum(x, "i"))
  analysis.clear_cache()
  first = used_axis_names(closed)
  size = analysis.cache_size()
  assert size >= 1
  assert used_axis_names(closed) is first
  assert analysis.cache_size() == size


def test_sub_jaxprs_are_memoized_and_shared():
  inner = jax.jit(lambda v: lax.psum(v, "i"))
  closed = _closed(lambda x: inner(x) + inner(2 * x))
  analysis.clear_cache()
  used_axis_names(closed)
  subs = [s for e in closed.jaxpr.eqns for s in analysis.subjaxprs(e.params)]
  assert len(subs) == 2 and subs[0] is subs[1]  # JAX reuses the jaxpr
  assert analysis._NAMES.get(subs[0]) == {"i"}
  assert analysis.cache_size() == 2  # the top jaxpr and the shared one


def test_cache_holds_jaxprs_weakly():
  analysis.clear_cache()
  eqn_jaxpr = _closed(lambda x: lax.psum(x, "i")).jaxpr
  # Build a fresh Jaxpr object not held by any JAX cache.
  fresh = eqn_jaxpr.replace(eqns=list(eqn_jaxpr.eqns))
  used_axis_names(fresh)
  assert analysis._NAMES.get(fresh) is not None
  n = analysis.cache_size()
  del fresh
  gc.collect()
  assert analysis.cache_size() == n - 1


def test_weak_identity_cache_survives_id_reuse():
  cache = analysis.WeakIdentityCache()

  class Obj:
    pass

  a = Obj()
  cache.put(a, "a")
  key = id(a)
  del a
  gc.collect()
  # Whatever now lives at that id, it must not see "a".
  for _ in range(100):
    b = Obj()
    assert cache.get(b) is None
    if id(b) == key:
      break
  assert len(cache) == 0


def test_binder_shard_map_removes_its_manual_axes():
  fn = jax.shard_map(
    lambda v: lax.psum(v, "d") * lax.axis_index("outer"),
    mesh=MESH(),
    in_specs=P("d"),
    out_specs=P("d"),
    check_vma=False,
  )
  closed = jax.make_jaxpr(fn, axis_env=[("outer", 2)])(X)
  assert used_axis_names(closed) == {"outer"}
  body = closed.jaxpr.eqns[0].params["jaxpr"]
  assert used_axis_names(body) == {"d", "outer"}


def test_manual_type_flags():
  plain = _closed(lambda x: lax.psum(x, "i"))
  assert not analysis.has_manual_types(plain.jaxpr)
  fn = jax.shard_map(
    lambda v: v * 2, mesh=MESH(), in_specs=P("d"), out_specs=P("d")
  )
  top = jax.make_jaxpr(fn)(X).jaxpr
  body = top.eqns[0].params["jaxpr"]
  assert analysis.has_local_manual_types(body)
  assert analysis.has_manual_types(top)
  assert not analysis.has_local_manual_types(top)
  assert analysis.named_eqns(plain.jaxpr) == ((0, frozenset({"i"})),)


def test_binder_inside_jit_hides_names_but_not_the_collectives():
  sm = jax.shard_map(
    lambda v: lax.psum(v, "d"), mesh=MESH(), in_specs=P("d"), out_specs=P()
  )
  top = jax.make_jaxpr(jax.jit(sm))(X).jaxpr
  jit_body = top.eqns[0].params["jaxpr"].jaxpr
  assert used_axis_names(top) == used_axis_names(jit_body) == frozenset()
  assert analysis.uses_axes_anywhere(top)
  assert analysis.uses_axes_anywhere(jit_body)
  assert not analysis.uses_axes_anywhere(_closed(jnp.sin).jaxpr)


def test_pallas_grid_names_are_bound():
  from jax.experimental import pallas as pl

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * (
      lax.axis_index("g") + lax.axis_index("outer")
    ).astype(jnp.float32)

  fn = pl.pallas_call(
    kernel,
    out_shape=jax.ShapeDtypeStruct((8,), jnp.float32),
    grid=(("g", 2),),
    in_specs=[pl.BlockSpec((4,), lambda g: (g,))],
    out_specs=pl.BlockSpec((4,), lambda g: (g,)),
    interpret=True,
  )
  closed = jax.make_jaxpr(fn, axis_env=[("outer", 2)])(X)
  (eqn,) = closed.eqns
  assert analysis.binder_sizes(eqn) == {"g": 2}
  assert used_axis_names(eqn.params["jaxpr"]) == {"g", "outer"}
  assert used_axis_names(closed) == {"outer"}


def test_pmap_binds_axis_name():
  fn = jax.pmap(lambda v: lax.psum(v, "p") + lax.axis_index("p"), axis_name="p")
  assert used_axis_names(fn, X.reshape(8, 1)) == frozenset()
  fn2 = jax.pmap(
    lambda v: lax.psum(v, "p") * lax.axis_index("q"), axis_name="p"
  )
  assert used_axis_names(fn2, X.reshape(8, 1)) == {"q"}


def test_nesting_depth_50_traced():
  fn = lambda v: lax.psum(v, "i")
  for level in range(50):
    fn = (lambda f, lvl: jax.jit(lambda v: f(v) + lvl))(fn, level)
  closed = jax.make_jaxpr(fn, axis_env=[("i", 2)])(X)
  assert used_axis_names(closed) == {"i"}


def test_nesting_deeper_than_the_recursion_limit():
  import sys

  jaxpr = _closed(lambda x: lax.psum(x, "i")).jaxpr
  for _ in range(sys.getrecursionlimit() + 100):
    jaxpr = _hand_built({"body": jaxpr})
  analysis.clear_cache()
  assert used_axis_names(jaxpr) == {"i"}


_hop = Primitive("test_generic_hop")
_hop.multiple_results = True


def _hand_built(params):
  """One equation of a made-up higher-order primitive with ``params``."""
  closed = _closed(lambda x: x)
  inv = closed.jaxpr.invars
  out = closed.jaxpr.outvars
  eqn = new_jaxpr_eqn(inv, out, _hop, params, set())
  return closed.jaxpr.replace(eqns=[eqn])


def test_sub_jaxprs_found_generically_in_any_param_nesting():
  a = _closed(lambda x: lax.psum(x, "i"))
  b = _closed(lambda x: lax.axis_index("j") * x).jaxpr
  jaxpr = _hand_built({"stuff": (1, [a, ("text", b)]), "other": "i"})
  assert {id(s) for s in analysis.subjaxprs(jaxpr.eqns[0].params)} == {
    id(a.jaxpr),
    id(b),
  }
  assert used_axis_names(jaxpr) == {"i", "j"}


def test_xla_pmap_binder_rule():
  body = _closed(
    lambda x: lax.psum(x, "p") * lax.axis_index("q"), ("p", 2), ("q", 2)
  )
  closed = _closed(lambda x: x)
  prim = Primitive("xla_pmap")
  prim.multiple_results = True
  eqn = new_jaxpr_eqn(
    closed.jaxpr.invars,
    closed.jaxpr.outvars,
    prim,
    {"call_jaxpr": body.jaxpr, "axis_name": "p", "axis_size": 2},
    set(),
  )
  jaxpr = closed.jaxpr.replace(eqns=[eqn])
  assert used_axis_names(jaxpr) == {"q"}


def test_unknown_primitive_falls_back_to_effects():
  from jaxworks.axis_names._src import jax_internals

  closed = _closed(lambda x: x)
  prim = Primitive("test_opaque_collective")
  prim.multiple_results = True
  eqn = new_jaxpr_eqn(
    closed.jaxpr.invars,
    closed.jaxpr.outvars,
    prim,
    {},
    {jax_internals.NamedAxisEffect("z")},
  )
  assert used_axis_names(closed.jaxpr.replace(eqns=[eqn])) == {"z"}


def test_psum_positional_axes_are_not_names():
  assert used_axis_names(_closed(lambda x: lax.psum(x, ("i", 0)))) == {"i"}


def test_bad_input_names_the_api():
  with pytest.raises(TypeError, match=r"used_axis_names: expected a Jaxpr"):
    used_axis_names(42)
  closed = _closed(lambda x: x)
  with pytest.raises(TypeError, match="only for a callable"):
    used_axis_names(closed, X)
  with pytest.raises(ValueError, match=r"axis_sizes\['i'\] = 0"):
    used_axis_names(lambda x: x, X, axis_sizes={"i": 0})
  with pytest.raises(TypeError, match="must be a mapping"):
    used_axis_names(lambda x: x, X, axis_sizes=[("i", 2)])


def test_threads_agree():
  closeds = [_closed(lambda x, k=k: lax.psum(x, "i") + k) for k in range(8)]
  analysis.clear_cache()
  results, errors = [], []

  def work():
    try:
      for _ in range(50):
        for c in closeds:
          results.append(used_axis_names(c))
    except Exception as e:  # pragma: no cover - reported below
      errors.append(e)

  threads = [threading.Thread(target=work) for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors
  assert set(results) == {frozenset({"i"})}


def test_matches_a_naive_top_down_walk_on_random_programs():
  rng = np.random.default_rng(0)
  names = ["a", "b", "c"]

  def build(depth):
    if depth == 0 or rng.random() < 0.3:
      n = names[rng.integers(3)]
      return lambda v, n=n: lax.psum(v, n)
    kind = rng.integers(3)
    f, g = build(depth - 1), build(depth - 1)
    if kind == 0:
      return lambda v: jax.jit(f)(v) + g(v)
    if kind == 1:
      return lambda v: lax.cond(v[0] > 0, f, g, v)
    return lambda v: lax.scan(lambda c, w: (c + f(w), None), v, v[None])[0]

  def naive(jaxpr):
    out = set()
    for eqn in jaxpr.eqns:
      out.update(analysis.own_names(eqn))
      for sub in analysis.subjaxprs(eqn.params):
        out |= naive(sub)
    return out

  for _ in range(10):
    fn = build(4)
    closed = jax.make_jaxpr(fn, axis_env=[(n, 2) for n in names])(X)
    assert used_axis_names(closed) == naive(closed.jaxpr)
