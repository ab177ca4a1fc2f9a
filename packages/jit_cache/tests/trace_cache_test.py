"""The trace cache: inner hits re-emit cached jaxprs; stages share it."""

import functools
import gc
import os
import weakref

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Private imports below: counts calls of JAX's own pjit._infer_params (no public
# hook).
from jaxworks.jit_cache import Traced
from jaxworks.jit_cache import eval_shape
from jaxworks.jit_cache import jit
from jaxworks.jit_cache import make_jaxpr
from jaxworks.jit_cache._src import jax_internals as ji


class Counting:
  """Counts executions of a Python function."""

  def __init__(self, fn):
    self.fn = fn
    self.n = 0
    self.__name__ = getattr(fn, "__name__", "counting")

  def __call__(self, *args, **kwargs):
    self.n += 1
    return self.fn(*args, **kwargs)


@pytest.fixture
def infer_params_calls(monkeypatch):
  """Counts calls of jax.jit's parameter inference (pjit._infer_params)."""
  pjit = ji._pjit  # jax._src.pjit, as jax_internals binds it
  calls = []
  original = pjit._infer_params

  def counting(*args, **kwargs):
    calls.append(1)
    return original(*args, **kwargs)

  monkeypatch.setattr(pjit, "_infer_params", counting)
  return calls


def test_inner_hit_skips_python_and_jax_inference(infer_params_calls):
  body = Counting(lambda x, y: x * y + 1.0)
  inner = jit(body)

  def make_outer():  # a new closure each time: jax cannot reuse its trace
    def outer(x):
      for _ in range(5):
        x = inner(x, x)
      return x

    return outer

  x = jnp.arange(3.0)
  want = jax.jit(make_outer())(x)  # traces inner once (miss), then 4 hits
  assert body.n == 1
  info = inner.cache_info()
  assert (info.misses, info.hits, info.traces) == (1, 4, 1)
  infer_params_calls.clear()
  jaxpr = jax.make_jaxpr(make_outer())(x)  # 5 hits, nothing traced again
  assert body.n == 1
  # One inference, for the outer function itself; none for the 5 inner calls
  # (stock jax.jit would count 6).
  assert len(infer_params_calls) == 1
  eqns = [e for e in jaxpr.eqns if e.primitive.name == "jit"]
  assert len(eqns) == 5
  assert all(e.params["jaxpr"] is eqns[0].params["jaxpr"] for e in eqns)
  assert inner.cache_info().hits == 9
  np.testing.assert_array_equal(jax.jit(make_outer())(x), want)


def test_inner_hit_under_grad_and_vmap():
  body = Counting(lambda x: jnp.sin(x) * x)
  inner = jit(body)
  x = jnp.arange(4.0)
  g1 = jax.grad(lambda v: inner(v).sum())(x)
  g2 = jax.grad(lambda v: inner(v).sum())(x + 1.0)  # same avals: hit
  v1 = jax.vmap(inner)(jnp.ones((3, 4)))
  ref = jax.jit(lambda x: jnp.sin(x) * x)
  np.testing.assert_allclose(g1, jax.grad(lambda v: ref(v).sum())(x))
  np.testing.assert_allclose(g2, jax.grad(lambda v: ref(v).sum())(x + 1.0))
  np.testing.assert_allclose(v1, jax.vmap(ref)(jnp.ones((3, 4))))
  assert body.n == 1  # every transformation reused the one jaxpr


def test_tracer_signature_is_abstract():
  """Tracers of different values (jvp tangents) share one entry."""
  body = Counting(lambda x: x * 2)
  inner = jit(body)
  for primal in (1.0, 2.0, -3.5):
    jax.jvp(inner, (jnp.float32(primal),), (jnp.float32(1.0),))
  assert body.n == 1


def test_different_avals_trace_again():
  body = Counting(lambda x: x + 1)
  inner = jit(body)
  jax.make_jaxpr(inner)(jnp.ones(3))
  jax.make_jaxpr(inner)(jnp.ones(4))
  jax.make_jaxpr(inner)(jnp.ones(3, jnp.int32))
  jax.make_jaxpr(inner)(1.0)  # weak f32[]
  jax.make_jaxpr(inner)(jnp.float32(1.0))  # strong f32[]
  assert body.n == 5


def test_leaf_kinds_with_equal_avals_share_the_trace():
  body = Counting(lambda x: x * 3)
  f = jit(body)
  a = f(jnp.ones(3, jnp.float32))
  b = f(np.ones(3, np.float32))  # numpy: another signature, same aval
  assert body.n == 1
  np.testing.assert_array_equal(a, b)
  info = f.cache_info()
  assert info.entries == 1 and info.hits == 1 and info.executables == 2


def test_eval_shape_then_call_traces_once():
  body = Counting(lambda x, y: {"out": x @ y, "n": jnp.sum(x)})
  f = jit(body)
  x, y = jnp.ones((4, 3)), jnp.ones((3, 2))
  shapes = f.eval_shape(x, y)
  assert shapes["out"].shape == (4, 2) and shapes["out"].dtype == jnp.float32
  assert eval_shape(f, x, y)["n"].shape == ()
  out = f(x, y)
  assert body.n == 1
  np.testing.assert_array_equal(out["out"], jnp.full((4, 2), 3.0))


def test_eval_shape_of_plain_function_is_cached_weakly():
  body = Counting(lambda x: x.T)
  sds = jax.ShapeDtypeStruct((2, 5), jnp.float32)
  assert eval_shape(body, sds).shape == (5, 2)
  assert eval_shape(body, sds).shape == (5, 2)
  assert body.n == 1
  assert jax.eval_shape(body.fn, sds) == eval_shape(body, sds)


def test_trace_then_call_share_the_cache():
  body = Counting(lambda x, n: x * n)
  f = jit(body, static_argnums=1)
  x = jnp.arange(3.0)
  traced = f.trace(x, 2)
  assert isinstance(traced, Traced)
  assert traced.fun_name == "<lambda>"
  assert traced.in_avals == ((jax.core.ShapedArray((3,), jnp.float32),), {})
  stock = jax.jit(body.fn, static_argnums=1).trace(x, 2)
  assert (
    traced.in_avals,
    traced.out_info,
    traced.fun_name,
    str(traced.jaxpr),
  ) == (stock.in_avals, stock.out_info, stock.fun_name, str(stock.jaxpr))
  kw = jit(lambda a, *, b: a * b).trace(x, b=2.0)
  assert kw.in_avals == jax.jit(lambda a, *, b: a * b).trace(x, b=2.0).in_avals
  assert traced.out_info.shape == (3,)
  assert [a.donated for a in jax.tree_util.tree_leaves(traced.args_info)] == [
    False
  ]
  lowered = f.lower(x, 2)
  assert isinstance(lowered, jax.stages.Lowered)
  np.testing.assert_array_equal(lowered.compile()(x), x * 2)
  np.testing.assert_array_equal(f(x, 2), x * 2)
  assert body.n == 1
  text = traced.lower().as_text()
  assert "stablehlo.multiply" in text or "multiply" in text


def test_trace_lower_cross_platform():
  f = jit(lambda x: jnp.sin(x) + 1)
  traced = f.trace(jnp.ones(4))
  lowered = traced.lower(lowering_platforms=("tpu",))
  assert isinstance(lowered, jax.stages.Lowered)
  assert "sine" in lowered.as_text()
  both = traced.lower(lowering_platforms=("cpu", "cuda"))
  assert isinstance(both, jax.stages.Lowered)


def test_trace_lower_takes_stocks_parameters_and_lowers_as_stock():
  """Traced.lower has stock's signature, JAX's private parameter included
  (jax.export passes it to any Traced), and honours it; the module equals
  stock's on these programs."""
  import inspect  # pylint: disable=g-import-not-at-top

  f = jit(jnp.sin)
  x = jnp.ones(4)
  traced = f.trace(x)
  params = lambda f: [  # noqa: E731
    (p.name, p.kind, p.default)
    for p in inspect.signature(f).parameters.values()
  ]
  assert params(traced.lower) == params(jax.jit(jnp.sin).trace(x).lower)
  for platforms in (None, ("cpu",), ("cpu", "cuda")):
    ours = traced.lower(lowering_platforms=platforms)
    stock = jax.jit(jnp.sin).trace(x).lower(lowering_platforms=platforms)
    assert ours.as_text() == stock.as_text()
    assert ours.platforms == (platforms or ("cpu",))


def test_lower_without_platforms_compiles_and_serializes_as_stock():
  """A lowering for this host is stock's own: its executable serializes as
  jax.jit's does, and refuses a closed-over ref with stock's ValueError
  (an export lowering made it a pytree error)."""
  from jax.experimental import serialize_executable as se  # pylint: disable=g-import-not-at-top

  x_ref = jax.new_ref(0)

  def f(x):
    x_ref[...] += x

  for wrap in (jit, jax.jit):
    with pytest.raises(ValueError, match="serialize with a closed-over"):
      se.serialize(wrap(f).lower(1).compile())
  g = jit(lambda v: jnp.sin(v) * 2)
  x = jnp.arange(4.0)
  blob, in_tree, out_tree = se.serialize(g.lower(x).compile())
  loaded = se.deserialize_and_load(
    blob, in_tree, out_tree, execution_devices=jax.devices()[:1]
  )
  np.testing.assert_array_equal(loaded(x), jax.jit(lambda v: jnp.sin(v) * 2)(x))


def test_source_locations_name_the_user_call_not_jit_cache():
  """Equations jit_cache emits carry the caller's line, as jax.jit's do."""
  from jax.extend import source_info_util  # pylint: disable=g-import-not-at-top

  inner = jit(lambda v: jnp.sin(v) * 2)
  stock = jax.jit(lambda v: jnp.sin(v) * 2)

  def outer(x):
    a, b = inner(x), stock(x)  # both calls on one line
    return a + b

  x = jnp.ones(3)
  for _ in range(2):  # a miss, then a hit re-emitting the cached jaxpr
    ours, theirs = [
      source_info_util.summarize(e.source_info).split(" ")[0]
      for e in jax.make_jaxpr(outer)(x).eqns[:2]
    ]
    file_line = lambda loc: loc.rsplit(":", 2)[:2]
    assert file_line(ours) == file_line(theirs), (ours, theirs)
    assert ours.startswith(__file__.rstrip("c")), ours
  text = jax.jit(outer).lower(x).as_text(debug_info=True)
  assert "jit_cache/_src" not in text and "test_source_locations" in text


def test_trace_does_not_close_over_tracers_but_make_jaxpr_does():
  """Upstream jax-ml/jax#21116: make_jaxpr keeps closed-over tracers as
  consts (so eval_jaxpr with .consts works); jit(f).trace makes them leading
  inputs instead."""
  seen = {}

  def f(x):
    def g(y):
      return x * y + 1.0

    closed = make_jaxpr(g)(1.0)
    seen["consts"] = [isinstance(c, jax.core.Tracer) for c in closed.consts]
    traced = jit(g).trace(1.0)
    seen["trace_consts"] = list(traced.jaxpr.consts)
    seen["trace_invars"] = len(traced.jaxpr.jaxpr.invars)
    from jax.extend import core as jex_core

    return jex_core.jaxpr_as_fun(closed)(2.0)[0]

  out = jax.jit(f)(3.0)
  assert float(out) == 7.0
  assert seen["consts"] == [True]
  assert seen["trace_consts"] == [] and seen["trace_invars"] == 2
  np.testing.assert_allclose(
    jax.vmap(f)(jnp.arange(3.0)), jnp.arange(3.0) * 2 + 1
  )
  ref = jax.make_jaxpr(lambda y: 3.0 * y + 1.0)(1.0)
  assert str(make_jaxpr(lambda y: 3.0 * y + 1.0)(1.0)) == str(ref)


def test_make_jaxpr_matches_jax_and_options():
  def f(x, n):
    return jnp.sum(x**n)

  ours = make_jaxpr(f, static_argnums=1)(jnp.ones(3), 2)
  theirs = jax.make_jaxpr(f, static_argnums=1)(jnp.ones(3), 2)
  assert str(ours) == str(theirs)
  jaxpr, shape = make_jaxpr(jnp.sin, return_shape=True)(jnp.ones(2))
  assert shape.shape == (2,) and "sin" in str(jaxpr)
  with_axis = make_jaxpr(lambda x: jax.lax.psum(x, "i"), axis_env=[("i", 4)])(
    1.0
  )
  assert "psum" in str(with_axis)


def test_closure_over_outer_tracer_is_not_cached():
  wrappers = []
  tracer_refs = []

  def outer(x):
    tracer_refs.append(weakref.ref(x))
    inner = jit(lambda y: x * y)  # closes over the outer trace's tracer
    wrappers.append(inner)
    return inner(1.0) + inner(2.0)

  np.testing.assert_allclose(jax.jit(outer)(2.0), 6.0)
  np.testing.assert_allclose(jax.grad(outer)(1.0), 3.0)
  for info in [w.cache_info() for w in wrappers]:
    assert info.entries == 0 and info.misses == 2  # tracer consts: not stored
  wrappers.clear()
  gc.collect()
  assert all(r() is None for r in tracer_refs)  # nothing kept them alive


def test_mutable_refs_defer_to_jax():
  f = jit(lambda r, x: r[...] + x)
  ref = jax.new_ref(jnp.ones(3)) if hasattr(jax, "new_ref") else None
  if ref is None:
    pytest.skip("no jax.new_ref")
  np.testing.assert_array_equal(f(ref, jnp.ones(3)), jnp.full(3, 2.0))


@pytest.mark.parametrize(
  "make",
  [
    lambda: lambda x: x + 1,
    lambda: functools.partial(lambda x, y: x + y, 1),
  ],
  ids=["function", "partial"],
)
def test_jit_computes_the_function_name_once(monkeypatch, make):
  """jit's path names the function once (argnums.fun_name) and hands the
  name on: the weak proxy and the counting wrapper reuse it."""
  from jaxworks.jit_cache._src import argnums  # pylint: disable=g-import-not-at-top

  real = argnums.fun_name
  calls = []
  depth = [0]

  def counting(fun):
    if not depth[0]:  # not fun_name's own recursion into a partial
      calls.append(fun)
    depth[0] += 1
    try:
      return real(fun)
    finally:
      depth[0] -= 1

  monkeypatch.setattr(argnums, "fun_name", counting)
  fun = make()
  f = jit(fun)
  assert len(calls) == 1 and calls[0] is fun
  assert f(jnp.float32(1.0)) == 2.0
  assert len(calls) == 1  # the first call (a trace) names nothing again
  assert f.trace(jnp.float32(1.0)).fun_name == real(fun)
