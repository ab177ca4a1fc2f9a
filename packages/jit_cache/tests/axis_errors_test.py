"""Axis-name mistakes under jit_cache.jit: axis_names' diagnostic, as an
instance of what stock raises."""

import functools

import child
import jax
import jax.numpy as jnp
import pytest

from jaxworks import axis_names
from jaxworks import jit_cache


def body(x):
  y = jax.lax.pmean(x, "btach")  # misspelled
  return y * 2


@functools.cache
def step():
  """The shard_map step over 8 devices (built on first use, not at import)."""
  mesh = jax.make_mesh(
    (8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  return jax.shard_map(
    body, mesh=mesh, in_specs=jax.P("batch"), out_specs=jax.P()
  )


@pytest.mark.parametrize("how", ["call", "trace", "lower", "eval_shape"])
def test_misspelled_axis_in_shard_map(how):
  x = jnp.arange(8.0)
  with pytest.raises(AssertionError) as stock:
    getattr(jax.jit(step()), how)(x) if how != "call" else jax.jit(step())(x)
  assert type(stock.value) is AssertionError  # stock: bare, no message
  f = jit_cache.jit(step())
  with pytest.raises(axis_names.AxisNameError) as info:
    getattr(f, how)(x) if how != "call" else f(x)
  e = info.value
  assert isinstance(e, AssertionError) and isinstance(e, NameError)
  assert (e.primitive, e.axis_name, e.bound) == ("pmean", "btach", ("batch",))
  msg = str(e)
  assert msg.startswith("jaxworks.jit_cache.jit: pmean uses axis name 'btach'")
  assert "axis_errors_test.py:" in msg and "(body)" in msg
  assert "did you mean 'batch'?" in msg
  assert msg.count("pmean uses") == 1 and "psum" not in msg
  assert e.__cause__ is not None


def test_unbound_axis_outside_any_binder():
  def f(x):
    return jax.lax.pmax(x, "data") + jax.lax.pmax(x, "data")

  x = jnp.ones(3)
  with pytest.raises(NameError) as stock:
    jax.jit(f)(x)
  assert type(stock.value) is NameError
  with pytest.raises(axis_names.AxisNameError) as info:
    jit_cache.jit(f)(x)
  assert isinstance(info.value, NameError)
  assert info.value.primitive == "pmax"
  assert len(info.value.problems) == 1  # one line: listed once


@pytest.mark.parametrize("how", ["call", "trace", "eval_shape"])
def test_an_unbound_name_runs_the_function_once_as_stock(how):
  """The diagnostic is read from the error JAX raised, not from tracing the
  user's function again (a function with side effects sees one call)."""
  calls = {"stock": 0, "ours": 0}

  def make(who):
    def f(x):
      calls[who] += 1
      return jax.lax.psum(x, "batchh") * 2

    return f

  x = jnp.ones(3)
  for who, jit, error in (
    ("stock", jax.jit, NameError),
    ("ours", jit_cache.jit, axis_names.AxisNameError),
  ):
    g = jit(make(who))
    with pytest.raises(error) as info:
      g(x) if how == "call" else getattr(g, how)(x)
  assert calls["ours"] == calls["stock"] == 1
  e = info.value
  assert (e.primitive, e.axis_name, e.bound) == ("psum", "batchh", ())
  assert "axis_errors_test.py:" in str(e)


def test_under_an_outer_trace_the_error_is_stocks():
  def f(x):
    return jax.lax.psum(x, "i")

  inner = jit_cache.jit(f)
  with pytest.raises(NameError) as info:
    jax.make_jaxpr(lambda v: inner(v) + 1)(jnp.ones(2))
  assert type(info.value) is NameError  # JAX's own, for the outer tracer


def test_a_call_that_works_imports_neither_axis_names_nor_jax_extend():
  """axis_names is imported for the first axis-name error; ``jax.extend``
  (which imports Pallas too) never by jit_cache's own path."""
  code = (
    "import sys, jax, jax.numpy as jnp\n"
    "from jaxworks import jit_cache\n"
    "f = jit_cache.jit(lambda x: jnp.sin(x) * 2)\n"
    "f(jnp.ones(3)).block_until_ready()\n"
    "f.lower(jnp.ones(3)).compile()\n"
    "print(sorted(m for m in sys.modules if m.startswith("
    "('jax.extend', 'jaxworks.axis_names._src.api', 'jax._src.pallas'))))\n"
    "def bad(x):\n"
    "  return jax.lax.psum(x, 'batch')\n"
    "try:\n"
    "  jit_cache.jit(bad)(1.0)\n"
    "except NameError as e:\n"
    "  print(type(e).__name__)\n"
  )
  lines = child.run("-c", code, timeout=120).stdout.strip().splitlines()
  assert lines[0] == "[]", lines
  assert lines[1] == axis_names.AxisNameError.__name__, lines
