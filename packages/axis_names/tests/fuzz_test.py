"""Property tests: random programs, random renames, arbitrary bad input."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

# Private imports below: JAX's own NamedAxisEffect names are the oracle (no
# public accessor).
from jaxworks.axis_names import AxisNameError
from jaxworks.axis_names import check_axis_names
from jaxworks.axis_names import rename_axes
from jaxworks.axis_names import used_axis_names
from jaxworks.axis_names._src import jax_internals

NAMES = ("a", "b", "c")
X = jnp.arange(4.0)
ENV = [(n, 2) for n in NAMES]

# A program is a small tree: leaves are collectives over a name, nodes are
# jit / cond / scan / remat / sequence.
leaf = st.tuples(
  st.sampled_from(["psum", "pmax", "axis_index", "none"]),
  st.sampled_from(NAMES),
)
program = st.recursive(
  leaf,
  lambda kids: st.tuples(
    st.sampled_from(["jit", "cond", "scan", "remat", "seq"]), kids, kids
  ),
  max_leaves=8,
)


def build(p):
  if p[0] == "psum":
    return lambda v: lax.psum(v, p[1])
  if p[0] == "pmax":
    return lambda v: lax.pmax(v, p[1])
  if p[0] == "axis_index":
    return lambda v: v + lax.axis_index(p[1])
  if p[0] == "none":
    return lambda v: v * 2.0
  kind, l, r = p
  f, g = build(l), build(r)
  if kind == "jit":
    return jax.jit(lambda v: f(g(v)))
  if kind == "cond":
    return lambda v: lax.cond(v[0] > 1, f, g, v)
  if kind == "scan":
    return lambda v: lax.scan(lambda c, _: (f(c), None), g(v), None, length=2)[
      0
    ]
  if kind == "remat":
    return jax.checkpoint(lambda v: f(g(v)))
  return lambda v: f(v) + g(v)


def expected(p):
  if p[0] in ("psum", "pmax", "axis_index"):
    return {p[1]}
  if p[0] == "none":
    return set()
  return expected(p[1]) | expected(p[2])


FUZZ = settings(
  max_examples=25,
  deadline=None,
  derandomize=True,
  suppress_health_check=[HealthCheck.too_slow],
)


@FUZZ
@given(program)
def test_random_programs_match_model_and_jax_effects(p):
  closed = jax.make_jaxpr(build(p), axis_env=ENV)(X)
  ours = used_axis_names(closed)
  assert ours == expected(p)
  assert ours == jax_internals.named_axis_effect_names(closed.effects)
  assert check_axis_names(closed, axis_sizes=dict(ENV)) == ours


def rename_program(p, mapping):
  """The same program written by hand with the new names."""
  if p[0] in ("psum", "pmax", "axis_index", "none"):
    return (p[0], mapping.get(p[1], p[1]))
  return (p[0], rename_program(p[1], mapping), rename_program(p[2], mapping))


def run_under(fn, names):
  """``fn`` under nested vmaps binding ``names`` (outermost first), jitted."""
  f = fn
  for n in reversed(names):
    f = jax.vmap(f, axis_name=n)
  return jax.jit(f)(jnp.broadcast_to(X, (2, 2, 2, 4)))


def assert_same(a, b):
  assert a.dtype == b.dtype and a.shape == b.shape
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@FUZZ
@given(program, st.permutations(("x", "y", "z")))
def test_random_renames(p, new_names):
  mapping = dict(zip(NAMES, new_names))
  closed = jax.make_jaxpr(build(p), axis_env=ENV)(X)
  renamed = rename_axes(closed, mapping)
  assert used_axis_names(renamed) == {mapping[n] for n in expected(p)}
  assert jax_internals.named_axis_effect_names(renamed.effects) == {
    mapping[n] for n in expected(p)
  }
  if not expected(p):
    assert renamed is closed
  new = [mapping[n] for n in NAMES]
  # The renamed jaxpr, the renamed function and the program written by hand
  # with the new names (stock JAX) agree bit for bit.
  ref = run_under(build(rename_program(p, mapping)), new)
  eval_renamed = lambda v: jax.core.eval_jaxpr(
    renamed.jaxpr, renamed.consts, v
  )[0]
  assert_same(run_under(eval_renamed, new), ref)
  assert_same(run_under(rename_axes(build(p), mapping), new), ref)
  # ... and so does the original under the old names.
  assert_same(run_under(build(p), list(NAMES)), ref)


junk = st.one_of(
  st.none(),
  st.integers(),
  st.text(max_size=5),
  st.lists(st.integers(), max_size=3),
  st.dictionaries(st.text(max_size=3), st.integers(), max_size=3),
  st.builds(object),
)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(junk, junk)
def test_arbitrary_input_is_a_clean_error(x, mapping):
  def rename_and_call():
    g = rename_axes(lambda v: v * 2.0, mapping)
    # A mapping that was accepted gives a working function.
    assert_same(g(X), X * 2.0)

  for call in (
    lambda: used_axis_names(x),
    rename_and_call,
    lambda: check_axis_names(lambda v: v, X, axis_sizes=mapping),
  ):
    try:
      call()
    except (TypeError, ValueError, AxisNameError) as e:
      assert "jaxworks.axis_names" in str(e)
