"""check_axis_names against stock tracing on generated programs.

Programs nest ``jit`` (also a jitted function called twice), ``cond``,
``scan``, ``while_loop`` and the binders ``shard_map``, ``pmap`` and ``vmap``
(with ``axis_name``) around every primitive that reads an axis name, some of
which leave no equation behind (``axis_size``, ``psum`` of a constant). Axis
names are drawn from the names bound at that point and from misspellings of
them. ``check_axis_names`` must raise exactly when stock tracing raises for an
unbound name (a ``NameError``, or the bare ``AssertionError`` JAX raises
inside a ``shard_map``), and name what stock names.
"""

import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import pytest

# Private imports below: reads the unbound name out of stock JAX's NameError
# (the oracle).
from jaxworks.axis_names import AxisNameError
from jaxworks.axis_names import check_axis_names
from jaxworks.axis_names import collective_report
from jaxworks.axis_names._src import jax_internals

X = jnp.arange(8.0)
# Every size divides 8, so every collective's shape fits every bound name.
SIZES = {"a": 2, "b": 4}


@functools.cache
def MESH():
  return jax.make_mesh(
    (2,), ("m",), devices=jax.devices()[:2], axis_types=(AxisType.Auto,)
  )


TYPOS = {"a": "aa", "b": "B", "m": "mm", "p": "pp", "v": "vv"}


def _leaf(kind, n):
  """``v -> v'`` of the same shape, reading axis name ``n``."""
  return {
    "psum": lambda v: lax.psum(v, n),
    "pmean": lambda v: lax.pmean(v, n),
    "pmax": lambda v: lax.pmax(v, n),
    "pmin": lambda v: lax.pmin(v, n),
    "all_gather": lambda v: v + lax.all_gather(v, n).sum(0),
    "all_to_all": lambda v: lax.all_to_all(v, n, 0, 0, tiled=True),
    "ppermute": lambda v: lax.ppermute(v, n, [(0, 1), (1, 0)]),
    "psum_scatter": lambda v: v + lax.psum_scatter(v, n, tiled=True).sum(),
    "axis_index": lambda v: v + lax.axis_index(n),
    # No equation is left of these: JAX computes them from the axis size.
    "axis_size": lambda v: v * lax.axis_size(n),
    "psum_const": lambda v: v * lax.psum(1, n),
    "pmean_const": lambda v: v + lax.pmean(2.0, n),
    "pbroadcast": lambda v: lax.pbroadcast(v, (n,), 0),
    "pcast": lambda v: lax.pcast(v, n, to="varying"),
  }[kind]


COLLECTIVES = (
  "psum pmean pmax pmin all_gather all_to_all ppermute psum_scatter"
  " axis_index axis_size psum_const pmean_const pbroadcast".split()
)
WRAPPERS = ("jit", "jit_twice", "cond", "scan", "while", "seq")
BINDERS = {"shard_map": "m", "pmap": "p", "vmap": "v"}


@st.composite
def programs(draw, scope=("a", "b"), device=None, depth=0):
  """A program tree; ``scope`` are the names bound there, ``device`` the
  innermost device binder's name (pcast is only meaningful there)."""
  if depth >= 3 or draw(st.integers(0, 2)) == 0:
    kinds = list(COLLECTIVES)
    if device is not None:
      kinds.append("pcast")
    kind = draw(st.sampled_from(kinds))
    good = [device] if kind == "pcast" else list(scope)
    if kind == "pbroadcast" and "v" in scope:
      good.remove("v")  # stock's pbroadcast fails under vmap's own name
    # One leaf in five misspells a name, so that many programs are valid.
    if draw(st.integers(0, 4)) == 0:
      names = [*(TYPOS[s] for s in good), "typo"]
    else:
      names = good
    return (kind, draw(st.sampled_from(names)))
  options = list(WRAPPERS)
  # At most one device binder on a path (a pmap inside a shard_map is
  # refused by stock for reasons other than names), each binder once.
  options += [
    b
    for b, n in BINDERS.items()
    if n not in scope and (b == "vmap" or device is None)
  ]
  kind = draw(st.sampled_from(options))
  if kind in BINDERS:
    name = BINDERS[kind]
    inner = draw(
      programs((*scope, name), device if kind == "vmap" else name, depth + 1)
    )
    return (kind, inner)
  left = draw(programs(scope, device, depth + 1))
  right = draw(programs(scope, device, depth + 1))
  return (kind, left, right)


def build(p):
  kind = p[0]
  if kind in COLLECTIVES or kind == "pcast":
    return _leaf(kind, p[1])
  if kind in BINDERS:
    body = build(p[1])
    if kind == "shard_map":
      return jax.shard_map(
        body, mesh=MESH(), in_specs=P(), out_specs=P(), check_vma=False
      )
    stack = lambda v: jnp.broadcast_to(v, (2, *v.shape))
    mapped = (
      jax.pmap(body, axis_name="p")
      if kind == "pmap"
      else jax.vmap(body, axis_name="v")
    )
    return lambda v: mapped(stack(v))[0]
  f, g = build(p[1]), build(p[2])
  if kind == "jit":
    return jax.jit(lambda v: f(g(v)))
  if kind == "jit_twice":
    h = jax.jit(lambda v: f(g(v)))
    return lambda v: h(h(v))
  if kind == "cond":
    return lambda v: lax.cond(v[0] > 1, f, g, v)
  if kind == "scan":
    return lambda v: lax.scan(lambda c, _: (f(c), None), g(v), None, length=2)[
      0
    ]
  if kind == "while":
    return lambda v: lax.while_loop(
      lambda c: c[1] < 2, lambda c: (f(g(c[0])), c[1] + 1), (v, 0)
    )[0]
  return lambda v: f(v) + g(v)


def stock_rejects(f) -> str | None:
  """The unbound name stock reports (``"?"`` for the bare AssertionError
  inside a shard_map), None when stock traces ``f``."""
  try:
    jax.make_jaxpr(f, axis_env=list(SIZES.items()))(X)
  except NameError as e:
    return jax_internals.unbound_axis_name(e)
  except AssertionError:
    return "?"
  return None


FUZZ = settings(
  max_examples=80,
  deadline=None,
  derandomize=True,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FUZZ
@given(programs())
def test_check_raises_exactly_when_stock_tracing_does(p):
  f = build(p)
  rejected = stock_rejects(f)
  if rejected is None:
    check_axis_names(f, X, axis_sizes=SIZES)
    collective_report(f, X, axis_sizes=SIZES)
    return
  for call in (check_axis_names, collective_report):
    with pytest.raises(AxisNameError) as info:
      call(f, X, axis_sizes=SIZES)
    problems = info.value.problems
    assert problems and all(d.startswith("unbound") for *_, d in problems)
    if rejected != "?":
      assert rejected in {name for _, name, *_ in problems}
