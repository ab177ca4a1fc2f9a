"""jaxworks.axis_names on the programs of the other packages: pmap_chunked, jit_cache and stages_aot.

Stock JAX's own answer to "which axis names does this program use" is the set of NamedAxisEffects on a jaxpr
(`named_effects` below); used_axis_names must agree with it on every program here (they only differ on primitives
JAX gives no effect, see the axis_names README), and the collective report must count what the code does.
"""

import jax
import numpy as np
import pytest

from jaxworks import axis_names
from jaxworks import jit_cache
from jaxworks import pmap_chunked
from jaxworks import stages_aot

N = 8


def named_effects(closed_jaxpr):
  return frozenset(
    e.name
    for e in closed_jaxpr.effects
    if type(e).__name__ == "NamedAxisEffect"
  )


def _step(v):
  total = jax.lax.psum(v.sum(), "i")
  gathered = jax.lax.all_gather(v, "i")
  return v / total + gathered.mean(0) * jax.lax.axis_index("i")


@pytest.fixture(autouse=True)
def _eight_devices():
  assert jax.device_count() >= N, (
    "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
  )


@pytest.fixture(scope="module")
def x():
  return np.random.default_rng(0).normal(size=(N, 16)).astype(np.float32)


def test_pmapped_program_uses_no_free_name_its_body_uses_i(x):
  f = pmap_chunked.pmap(_step, "i")
  program = f.trace(x).jaxpr
  assert (
    axis_names.used_axis_names(program) == frozenset() == named_effects(program)
  )
  body = axis_names.used_axis_names(_step, x[0], axis_sizes={"i": N})
  assert (
    body
    == {"i"}
    == named_effects(jax.make_jaxpr(_step, axis_env=[("i", N)])(x[0]))
  )
  # Stock jax.pmap's program agrees.
  stock = jax.make_jaxpr(jax.pmap(_step, "i"))(x)
  assert (
    axis_names.used_axis_names(stock) == frozenset() == named_effects(stock)
  )


def test_nested_pmap_body_uses_both_names():
  def body(v):
    return jax.lax.psum(v, "j") + jax.lax.psum(v, "i")

  f = pmap_chunked.pmap(pmap_chunked.pmap(body, "j"), "i")
  y = np.ones((2, 4, 3), np.float32)
  assert axis_names.used_axis_names(f.trace(y).jaxpr) == frozenset()
  inner_only = jax.make_jaxpr(
    lambda v: pmap_chunked.pmap(body, "j")(v), axis_env=[("i", 2)]
  )(y[0])
  assert (
    axis_names.used_axis_names(inner_only) == {"i"} == named_effects(inner_only)
  )
  assert axis_names.used_axis_names(
    body, y[0, 0], axis_sizes={"i": 2, "j": 4}
  ) == {"i", "j"}
  # stock jax.pmap 0.10.2 cannot nest pmaps; compare with the sums written out
  np.testing.assert_allclose(
    f(y), y.sum(1, keepdims=True) + y.sum(0, keepdims=True)
  )


def test_jit_cache_programs(x):
  inner = jit_cache.jit(lambda v: jax.lax.pmax(v, "i") - v)
  closed = jit_cache.make_jaxpr(lambda v: inner(v) * 2, axis_env=[("i", N)])(
    x[0]
  )
  assert axis_names.used_axis_names(closed) == {"i"} == named_effects(closed)
  # The same program traced by stock JAX.
  stock = jax.make_jaxpr(
    lambda v: jax.jit(lambda w: jax.lax.pmax(w, "i") - w)(v) * 2,
    axis_env=[("i", N)],
  )(x[0])
  assert named_effects(stock) == {"i"}
  # Under a pmap_chunked, jit_cache's inner entry is the one the pmap reuses.
  out = pmap_chunked.pmap(lambda v: inner(v) * 2, "i")(x)
  np.testing.assert_allclose(out, (x.max(0) - x) * 2, rtol=1e-6)


def test_stages_aot_stages_of_a_pmap(x):
  f = pmap_chunked.pmap(_step, "i")
  traced = stages_aot.trace(f, x)
  lowered = traced.lower(lowering_platforms=("cpu", "tpu"))
  assert (
    axis_names.used_axis_names(lowered.jaxpr)
    == frozenset()
    == named_effects(lowered.jaxpr)
  )
  # The program is one shard_map equation binding 'i'; its body is where 'i' is used.
  [eqn] = lowered.jaxpr.jaxpr.eqns
  assert eqn.primitive.name == "shard_map"
  assert axis_names.used_axis_names(eqn.params["jaxpr"]) == {"i"}


def test_collective_report_of_the_pmap_body(x):
  report = axis_names.collective_report(_step, x[0], axis_sizes={"i": N})
  rows = {(r.primitive, r.axes): r for r in report.rows}
  nbytes = x[0].nbytes
  assert rows[("psum", ("i",))].count == 1
  assert rows[("psum", ("i",))].bytes_per_call == pytest.approx(
    2 * (N - 1) / N * 4
  )  # a float32 scalar
  assert rows[("all_gather", ("i",))].count == 1
  assert rows[("all_gather", ("i",))].bytes_per_call == pytest.approx(
    (N - 1) * nbytes
  )
  assert report.total_bytes == pytest.approx(
    sum(r.bytes_per_call * r.count for r in report.rows)
  )
  text = str(report)
  assert (
    "psum" in text and "all_gather" in text and "axis_names_test.py" in text
  )


def test_renamed_body_runs_under_a_pmap_of_the_new_name(x):
  renamed = axis_names.rename_axes(_step, {"i": "data"})
  assert axis_names.used_axis_names(renamed, x[0], axis_sizes={"data": N}) == {
    "data"
  }
  ours = pmap_chunked.pmap(renamed, "data")(x)
  stock = jax.pmap(_step, "i")(x)
  np.testing.assert_allclose(ours, stock, rtol=1e-6)


def test_unbound_name_in_a_pmap_is_reported_by_axis_names(x):
  f = pmap_chunked.pmap(lambda v: jax.lax.psum(v, "j"), "i")
  with pytest.raises(axis_names.AxisNameError) as info:
    f(x)
  err = info.value
  assert (err.primitive, err.axis_name, err.bound) == ("psum", "j", ("i",))
  assert "axis_names_test.py" in err.location
  with pytest.raises(NameError):  # stock JAX raises a NameError too
    jax.pmap(lambda v: jax.lax.psum(v, "j"), "i")(x)
