"""Differential test: renamed collective programs against hand-written ones.

Hypothesis builds random programs from collectives (``psum``, ``pmean``,
``pmax``, ``all_gather``, ``ppermute``, ``axis_index``, ``all_to_all``) and
``custom_vjp``/``custom_jvp`` functions whose rules use collectives too, over
two axis names, renames them with a random one-to-one mapping, and runs the
renamed function under ``vmap``, ``pmap`` or ``shard_map`` binding the new
names (the ``shard_map`` mesh has a third axis, sometimes named like an old
name). Stock JAX running the program written by hand with the new names is
the oracle: outputs and gradients agree bit for bit, or both raise the same
exception class.
"""

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
import numpy as np
import pytest

from jaxworks.axis_names import rename_axes

OLD = ("a", "b")
POOL = ("a", "b", "c", "d")
SIZE = 2  # every axis has 2 members
WIDTH = 4  # per-member vector length
COLLECTIVES = (
  "psum",
  "pmean",
  "pmax",
  "all_gather",
  "ppermute",
  "axis_index",
  "all_to_all",
)

axis = st.integers(0, 1)
collective = st.tuples(st.sampled_from(COLLECTIVES), axis)
custom_step = st.one_of(
  # custom_vjp: primal collective, backward-rule collective
  st.tuples(st.just("vjp"), collective, collective),
  # custom_jvp: primal collective, tangent-rule collective
  st.tuples(st.just("jvp"), collective, collective),
)
step = st.one_of(collective, st.tuples(st.just("sin")), custom_step)


@st.composite
def programs(draw):
  """2 to 4 steps, at least one of them a custom_vjp/custom_jvp."""
  prog = draw(st.lists(step, min_size=1, max_size=3))
  at = draw(st.integers(0, len(prog)))
  return [*prog[:at], draw(custom_step), *prog[at:]]


def apply(op, x, names):
  kind, k = op
  n = names[k]
  if kind == "psum":
    return lax.psum(x, n)
  if kind == "pmean":
    return lax.pmean(x, n)
  if kind == "pmax":
    return lax.pmax(x, n)
  if kind == "all_gather":
    return lax.all_gather(x, n, tiled=True).reshape(SIZE, WIDTH).mean(0)
  if kind == "ppermute":
    return lax.ppermute(x, n, [(i, (i + 1) % SIZE) for i in range(SIZE)])
  if kind == "axis_index":
    return x + lax.axis_index(n).astype(x.dtype)
  if kind == "all_to_all":
    return lax.all_to_all(x, n, 0, 0, tiled=True)
  raise AssertionError(kind)


def build(prog, names):
  """The program as a function of one (WIDTH,) vector, using ``names``."""

  def custom(kind, primal_op, rule_op):
    if kind == "vjp":

      @jax.custom_vjp
      def f(x):
        return apply(primal_op, x, names) * jnp.cos(x)

      def fwd(x):
        return f(x), x

      def bwd(x, g):
        return (apply(rule_op, g * jnp.sin(x), names) + g,)

      f.defvjp(fwd, bwd)
      return f

    @jax.custom_jvp
    def h(x):
      return apply(primal_op, x, names) + jnp.sin(x)

    @h.defjvp
    def h_jvp(primals, tangents):
      (x,), (t,) = primals, tangents
      return h(x), apply(rule_op, t * jnp.cos(x), names) + t

    return h

  fns = []
  for s in prog:
    if s[0] == "sin":
      fns.append(jnp.sin)
    elif s[0] in ("vjp", "jvp"):
      fns.append(custom(*s))
    else:
      fns.append(lambda x, op=s: apply(op, x, names))

  def fn(x):
    for f in fns:
      x = f(x)
    return x

  return fn


def same(a, b):
  for x, y in zip(
    jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True
  ):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def agree(run, renamed, ref, other_run):
  """``run(renamed)`` equals ``run(ref)`` bit for bit, or both raise alike.

  One documented exception: a custom rule that JAX traces where a ``vmap``
  axis it uses is not in the axis environment (``grad`` outside the
  ``vmap``). Stock JAX raises ``NameError`` when the rule needs the axis
  size in Python (``pmean``, ``all_gather``); the renamed rule is traced
  with the sizes of the function's own trace and runs. Its result is then
  checked against stock JAX computing the same function another way
  (``other_run``: the same program under ``shard_map``).
  """
  try:
    expected = run(ref)
  except NameError as e:
    if "unbound axis name" not in str(e):
      raise
    try:
      got = run(renamed)
    except NameError:
      return  # both raise alike
    np.testing.assert_allclose(
      np.asarray(got), np.asarray(other_run(ref)), rtol=2e-6, atol=1e-6
    )
    return
  except Exception as e:  # stock JAX is the oracle, errors included
    with pytest.raises(type(e)):
      run(renamed)
    return
  same(run(renamed), expected)


XS = jnp.arange(SIZE * SIZE * WIDTH, dtype=jnp.float32) / 7.0 - 1.0


def under_vmap(fn, new):
  f = jax.vmap(jax.vmap(fn, axis_name=new[1]), axis_name=new[0])
  return lambda x: f(x.reshape(SIZE, SIZE, WIDTH))


def under_pmap(fn, new):
  f = jax.pmap(jax.vmap(fn, axis_name=new[1]), axis_name=new[0])
  return lambda x: f(x.reshape(SIZE, SIZE, WIDTH))


def under_shard_map(fn, new, extra):
  # A 2x2x2 mesh: the two new names plus a third axis (possibly called
  # like an old name), over which the data is replicated.
  mesh = jax.make_mesh(
    (SIZE, SIZE, 2), (*new, extra), axis_types=(AxisType.Auto,) * 3
  )
  return jax.shard_map(
    fn, mesh=mesh, in_specs=P(tuple(new)), out_specs=P(tuple(new))
  )


def transformed(fn, how, new, extra):
  if how == "vmap":
    f = under_vmap(fn, new)
  elif how == "pmap":
    f = under_pmap(fn, new)
  else:
    f = under_shard_map(fn, new, extra)
  return f


@settings(
  max_examples=20,
  deadline=None,
  derandomize=True,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
  prog=programs(),
  new=st.permutations(POOL),
  how=st.sampled_from(["vmap", "pmap", "shard_map"]),
)
def test_renamed_program_matches_hand_written(prog, new, how):
  new_a, new_b, extra = new[0], new[1], new[2]
  mapping = {"a": new_a, "b": new_b}
  renamed = rename_axes(build(prog, OLD), mapping)
  ref = build(prog, (new_a, new_b))

  def run(fn, how=how):
    f = transformed(fn, how, (new_a, new_b), extra)
    return jax.jit(f)(XS).reshape(-1)

  def run_grad(fn, how=how):
    f = transformed(fn, how, (new_a, new_b), extra)
    return jax.jit(jax.grad(lambda x: f(x).sum()))(XS)

  agree(run, renamed, ref, lambda fn: run(fn, "shard_map"))
  agree(run_grad, renamed, ref, lambda fn: run_grad(fn, "shard_map"))
