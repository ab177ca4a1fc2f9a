"""pmap semantics on the devices present (8 host devices on the CPU target, one
TPU chip), compared with stock jax.pmap / jax.vmap."""

import os
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads
import jaxworks_testing as jwt
import numpy as np
import pytest

import jaxworks.jit_cache
from jaxworks.pmap_chunked import CacheInfo
from jaxworks.pmap_chunked import pmap

# Every device present: 8 host devices on the CPU target, one TPU chip.
N = jax.device_count()


def _shard_shapes(a):
  return sorted({s.data.shape for s in a.addressable_shards})


def test_classic_semantics_rank_preserving_shards():
  x = jnp.arange(N * 100.0).reshape(N, 100)
  seen = []

  def f(v):
    seen.append(v.shape)
    return jnp.sin(v) * 2

  out = pmap(f, axis_name="i")(x)
  np.testing.assert_allclose(
    out, jax.pmap(lambda v: jnp.sin(v) * 2)(x), rtol=1e-6
  )
  assert seen == [(100,)]  # mapped axis removed inside
  assert out.shape == (N, 100)
  assert _shard_shapes(out) == [(1, 100)]  # [1, 100] per device
  assert isinstance(out.sharding, NamedSharding)
  assert out.sharding.spec == P("i")
  assert out.sharding.mesh.axis_names == ("i",)
  assert out.sharding.mesh.axis_types == (jax.sharding.AxisType.Auto,)
  assert list(out.sharding.mesh.devices.flat) == jax.devices()[:N]
  for shard in out.addressable_shards:  # device k holds row k
    k = jax.devices().index(shard.device)
    np.testing.assert_allclose(
      shard.data[0], np.sin(np.asarray(x[k])) * 2, rtol=1e-6
    )


def test_chunked_body_sees_size_one_axis():
  x = jnp.arange(N * 6.0).reshape(N, 2, 3)
  seen = []

  def f(v):
    seen.append(v.shape)
    return v * jax.lax.axis_index("i")

  out = pmap(f, "i", chunked=True)(x)
  assert seen == [(1, 2, 3)]
  expected = x * jnp.arange(N)[:, None, None]
  np.testing.assert_allclose(out, expected)
  assert _shard_shapes(out) == [(1, 2, 3)]
  # Same global arrays as chunked=False.
  classic = pmap(lambda v: v * jax.lax.axis_index("i"), "i")(x)
  np.testing.assert_allclose(out, classic)
  assert out.sharding == classic.sharding


def test_chunked_with_other_axes():
  x = jnp.arange(3 * N * 2.0).reshape(3, N, 2)
  seen = []

  def f(v, w):
    seen.append((v.shape, w.shape))
    return v + w.sum()

  out = pmap(f, "i", in_axes=(1, None), out_axes=1, chunked=True)(x, 10.0)
  assert seen == [((3, 1, 2), ())]
  np.testing.assert_allclose(out, x + 10.0)
  assert out.sharding.spec == P(None, "i")
  assert _shard_shapes(out) == [(3, 1, 2)]


def test_fewer_devices_than_available_uses_a_prefix():
  jwt.require_devices(4)  # 3 of them
  x = jnp.arange(3 * 4.0).reshape(3, 4)
  out = pmap(lambda v: v + 1)(x)
  np.testing.assert_allclose(out, x + 1)
  assert list(out.sharding.mesh.devices.flat) == jax.devices()[:3]


def test_devices_argument_picks_and_orders_devices():
  jwt.require_devices(4)
  devs = jax.devices()[::-1][:4]
  x = jnp.arange(4.0)
  out = pmap(lambda v: v * 10, "i", devices=devs)(x)
  np.testing.assert_allclose(out, x * 10)
  assert list(out.sharding.mesh.devices.flat) == devs
  by_device = {s.device: float(s.data[0]) for s in out.addressable_shards}
  assert [by_device[d] for d in devs] == [0.0, 10.0, 20.0, 30.0]


# Stock jax.pmap 0.10.2 mishandles negative axes (in_axes=-1 raises an
# IndivisibleError, out_axes=-1 returns a wrongly shaped array), so for those
# the reference is stock jax.pmap with the same axes counted from the front,
# which is what a negative axis means (as in classic pmap and jax.vmap).


def test_in_axes_none_nonzero_negative_and_pytrees():
  a = jnp.arange(3 * N * 1.0).reshape(3, N)
  b = {"w": jnp.arange(N * 2.0).reshape(2, N), "s": jnp.float32(0.5)}
  c = jnp.arange(4.0)

  def f(a, b, c):
    return a * b["s"] + b["w"].sum() + c.sum()

  in_axes = (1, {"w": -1, "s": None}, None)
  out = pmap(f, "i", in_axes=in_axes)(a, b, c)
  stock = jax.pmap(f, "i", in_axes=(1, {"w": 1, "s": None}, None))(a, b, c)
  np.testing.assert_allclose(out, stock)
  np.testing.assert_allclose(out, jax.vmap(f, in_axes=in_axes)(a, b, c))
  assert _shard_shapes(out) == _shard_shapes(stock)
  # Lists count as tuples, like vmap; a pytree prefix without negatives is
  # compared with stock pmap given the very same in_axes.
  out2 = pmap(f, "i", in_axes=[1, {"w": 1, "s": None}, None])(a, b, c)
  np.testing.assert_allclose(out2, stock)
  prefix = ((0, None), None)
  pair = (jnp.arange(N * 2.0).reshape(N, 2), jnp.float32(3.0))
  h = lambda p, q: p[0] * p[1] + q
  np.testing.assert_allclose(
    pmap(h, in_axes=prefix)(pair, jnp.ones(2)),
    jax.pmap(h, in_axes=prefix)(pair, jnp.ones(2)),
  )


def test_out_axes_none_nonzero_negative_and_pytrees():
  x = jnp.arange(N * 6.0).reshape(N, 2, 3)

  def f(v):
    return {"a": v, "b": (v.sum(0), jax.lax.psum(v.sum(), "i"))}

  out = pmap(f, "i", out_axes={"a": -1, "b": (1, None)})(x)
  stock = jax.pmap(f, "i", out_axes={"a": 2, "b": (1, None)})(x)
  jax.tree.map(np.testing.assert_allclose, out, stock)
  jax.tree.map(
    np.testing.assert_allclose,
    out,
    jax.vmap(f, out_axes={"a": -1, "b": (1, None)}, axis_name="i")(x),
  )
  assert jax.tree.map(jnp.shape, out) == jax.tree.map(jnp.shape, stock)
  assert out["a"].shape == (2, 3, N)
  assert out["a"].sharding.spec == P(None, None, "i")
  assert out["a"].sharding == stock["a"].sharding
  assert out["b"][0].sharding == stock["b"][0].sharding
  assert out["b"][1].sharding == stock["b"][1].sharding
  assert out["b"][1].shape == ()  # out_axes None: unmapped
  assert _shard_shapes(out["a"]) == _shard_shapes(stock["a"]) == [(2, 3, 1)]
  assert _shard_shapes(out["b"][0]) == _shard_shapes(stock["b"][0])
  # A non-negative pytree prefix: the very same out_axes as stock pmap.
  same = {"a": 1, "b": 0}
  jax.tree.map(
    np.testing.assert_allclose,
    pmap(f, "i", out_axes=same)(x),
    jax.pmap(f, "i", out_axes=same)(x),
  )


def _x(*shape):
  return jnp.arange(float(np.prod(shape))).reshape(shape)


# Calls whose outputs' shardings a program over one device used to get
# wrong: left to the compiler there, every output took the first input's
# sharding when of its rank, and P() when not (upstream pmap_test.py's
# testPartiallyMapped).
OUTPUT_SHARDING_CASES = {
  "out_axes=1": lambda p: p(lambda v: v * 2, "i", out_axes=1)(_x(N, 2)),
  "out_axes=2, rank 3": lambda p: p(lambda v: v + 1, out_axes=2)(_x(N, 2, 3)),
  "out_axes=1 from in_axes=1": lambda p: p(
    lambda v: v.T, in_axes=1, out_axes=1
  )(_x(3, N, 2)),
  "partially mapped": lambda p: p(lambda x, y: x, in_axes=(None, 0))(
    np.float32(3.0), _x(N, 4)
  ),
  "partially mapped, psum": lambda p: p(
    lambda x, y: x - jax.lax.psum(y, "i"), "i", in_axes=(None, 0)
  )(np.float32(3.0), _x(N, 4)),
  "a pytree of out_axes": lambda p: p(
    lambda v: {"a": v, "b": v.sum(), "c": (v[None], v)},
    "i",
    out_axes={"a": 1, "b": None, "c": (0, 1)},
  )(_x(N, 2)),
  "an unmapped output of the input's rank": lambda p: p(
    lambda v: jnp.ones(2), out_axes=None
  )(_x(N)),
}


@pytest.mark.parametrize("case", sorted(OUTPUT_SHARDING_CASES))
def test_output_shardings_equal_stock(case):
  got = OUTPUT_SHARDING_CASES[case](pmap)
  want = OUTPUT_SHARDING_CASES[case](jax.pmap)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert g.sharding == w.sharding, (g.sharding, w.sharding)
    assert len(g.sharding.spec) == len(w.sharding.spec)
    assert (g.shape, g.dtype, g.committed) == (w.shape, w.dtype, w.committed)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_lowered_output_shardings_equal_stock():
  x = _x(N, 2)
  got = pmap(lambda v: v * 2, "i", out_axes=1).lower(x).compile()
  want = jax.pmap(lambda v: v * 2, "i", out_axes=1).lower(x).compile()
  assert got.output_shardings == want.output_shardings


def test_negative_out_axes_have_the_sharding_of_their_twin():
  x = _x(N, 2, 3)
  out = pmap(lambda v: v * 2, "i", out_axes=-1)(x)
  assert out.sharding.spec == P(None, None, "i")
  assert out.committed
  again = pmap(lambda v: v * 2, "i", out_axes=2)(x)
  assert out.sharding == again.sharding
  np.testing.assert_array_equal(np.asarray(out), np.asarray(again))


def test_chunked_negative_out_axes():
  x = jnp.arange(2 * N * 1.0).reshape(2, N)
  out = pmap(lambda v: v * 2, "i", in_axes=-1, out_axes=-1, chunked=True)(x)
  np.testing.assert_allclose(
    out, jax.pmap(lambda v: v * 2, "i", in_axes=1, out_axes=1)(x)
  )
  assert out.sharding.spec == P(None, "i")


def test_keyword_arguments_are_mapped_over_axis_zero():
  x = jnp.arange(N * 2.0).reshape(N, 2)
  y = jnp.arange(N * 1.0)
  out = pmap(lambda a, *, b: a.sum() + b, "i", in_axes=None)(jnp.ones(3), b=y)
  np.testing.assert_allclose(out, y + 3)
  g = lambda a, b: a * b[0]
  np.testing.assert_allclose(pmap(g)(x, b=x), jax.pmap(g)(x, b=x))


def _traced_pmap(make_pmap, **kwargs):
  traces = []

  def f(power, v, name):
    traces.append((power, name))
    return v**power + len(name)

  return make_pmap(f, "i", **kwargs), traces


def test_static_broadcasted_argnums_matches_stock_pmap():
  x = jnp.arange(N * 1.0)
  kwargs = dict(in_axes=(None, 0, None), static_broadcasted_argnums=(0, 2))
  ours, our_traces = _traced_pmap(pmap, **kwargs)
  stock, stock_traces = _traced_pmap(jax.pmap, **kwargs)
  for args in [
    (2, x, "a"),
    (2, x, "a"),
    (3, x, "a"),
    (2, x, "bb"),
    (2, x + 1, "a"),
    (3, x, "a"),
  ]:
    np.testing.assert_allclose(ours(*args), stock(*args))
  # A new static value traces again; a seen one (or new data) does not.
  assert our_traces == stock_traces == [(2, "a"), (3, "a"), (2, "bb")]
  # An int works as well as a tuple (and in_axes defaults to 0 for all).
  h = lambda v, k: v + k
  np.testing.assert_allclose(
    pmap(h, static_broadcasted_argnums=1)(x, 5),
    jax.pmap(h, static_broadcasted_argnums=1)(x, 5),
  )


def _donation_run(make_pmap):
  """One call with donated, moved, unusable and kept inputs; what survives."""
  ident = make_pmap(lambda t: t)
  a = ident(jnp.arange(N * 3.0).reshape(N, 3))  # laid out, donated
  d = {
    "x": ident(jnp.ones((N, 3))),  # laid out, donated
    "y": ident(jnp.arange(N * 1.0)),
  }  # no output fits it
  moved = jnp.full((N, 3), 2.0)  # one device: moved
  keep = ident(jnp.full((N, 3), 5.0))  # not donated
  pointers = {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}

  def f(k, a, d, moved, host, keep):
    return (a * k, d["x"] + d["y"], moved * host, keep + 1)

  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Some donated buffers were not usable"
    out = make_pmap(
      f, static_broadcasted_argnums=0, donate_argnums=(1, 2, 3, 4)
    )(2.0, a, d, moved, np.full((N, 3), 3.0), keep)
  deleted = [x.is_deleted() for x in (a, d["x"], d["y"], moved, keep)]
  out_pointers = {
    s.data.unsafe_buffer_pointer() for s in out[0].addressable_shards
  }
  return out, deleted, out_pointers == pointers


def test_donate_argnums_matches_stock_pmap():
  out, deleted, reused = _donation_run(pmap)
  stock_out, stock_deleted, stock_reused = _donation_run(jax.pmap)
  jax.tree.map(np.testing.assert_allclose, out, stock_out)
  # Positions count static arguments too; a donated pytree donates its
  # leaves; an input that had to be moved is copied and the copy donated (the
  # caller's array survives); a buffer no output can use is not taken.
  # (On one device, `moved` is already in place, so it is donated as is.)
  assert deleted == stock_deleted == [True, True, False, N == 1, False]
  assert reused and stock_reused  # output written in a's buffers


def test_cache_hits_and_trace_count():
  traces = []

  def f(v):
    traces.append(v.shape)
    return v + 1

  g = pmap(f)
  x = jnp.zeros((N, 3))
  for _ in range(3):
    x = g(x)
  np.testing.assert_allclose(x, 3.0)
  assert traces == [(3,)]
  info = g.cache_info()
  assert type(info) is CacheInfo and CacheInfo is jaxworks.jit_cache.CacheInfo
  assert (info.hits, info.misses, info.entries, info.evictions) == (2, 1, 1, 0)
  # The program's own jit cache: one trace, one compile, served since.
  assert (info.traces, info.compiles + info.executable_reuses) == (1, 1)
  assert info.maxsize == 256
  g(jnp.zeros((N, 5)))  # new shape: same entry, retrace
  assert traces == [(3,), (5,)]
  jwt.require_devices(2)  # another mapped size
  g(jnp.zeros((N // 2, 5)))  # new size: new entry
  assert g.cache_info().entries == 2


def test_axis_size_without_mapped_arguments_raises_as_stock():
  for p in (pmap, jax.pmap):
    with pytest.raises(ValueError, match="at least one argument with a mapp"):
      p(lambda c: c + jax.lax.axis_index("i"), "i", in_axes=None, axis_size=4)(
        jnp.float32(1.0)
      )
    with pytest.raises(ValueError, match="at least one argument with a mapp"):
      p(lambda: jnp.ones(3), "i", axis_size=4)()


def test_lower_and_trace():
  f = pmap(lambda v: jax.lax.psum(v, "i"), "i")
  x = jnp.ones((N, 2))
  lowered = f.lower(x)
  text = lowered.as_text()
  assert "all-reduce" in text or "all_reduce" in text
  compiled = lowered.compile()
  arg = jax.device_put(
    x, NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("i",)), P("i"))
  )
  np.testing.assert_allclose(compiled(arg), np.full((N, 2), float(N)))
  traced = f.trace(jax.ShapeDtypeStruct((N, 2), jnp.float32))
  assert traced.jaxpr is not None


def test_inside_jit_and_grad():
  f = pmap(lambda v: jnp.sin(v) * jax.lax.psum(v, "i"), "i")
  x = jnp.arange(N * 1.0)
  out = jax.jit(lambda a: f(a) + 1)(x)
  np.testing.assert_allclose(out, np.sin(x) * x.sum() + 1, rtol=1e-5)
  g = jax.grad(lambda a: f(a).sum())(x)
  ref = jax.grad(
    lambda a: jax.pmap(lambda v: jnp.sin(v) * jax.lax.psum(v, "i"), "i")(
      a
    ).sum()
  )(x)
  np.testing.assert_allclose(g, ref, rtol=1e-5)


def test_decorator_form_and_metadata():
  @pmap
  def double(v):
    """Doubles."""
    return v * 2

  assert double.__name__ == "double" and double.__doc__ == "Doubles."
  np.testing.assert_allclose(double(jnp.ones(N)), 2.0)
  assert "double" in repr(double)


def test_program_is_traced_and_cached_by_jit_cache():
  f = pmap(lambda v: v * 3, "i")
  x = jnp.ones((N, 7))
  before = jaxworks.jit_cache.stats().traces
  f(x)
  assert jaxworks.jit_cache.stats().traces == before + 1
  f(x)
  f(x)
  assert jaxworks.jit_cache.stats().traces == before + 1
  assert isinstance(
    f._entries.values()[0].jitted, jaxworks.jit_cache.JitFunction
  )


def test_stats_sums_and_keeps_the_events_of_functions_that_died():
  import gc

  import jaxworks.pmap_chunked as pc

  assert not hasattr(pc, "PmapCacheInfo")  # the 0.2.0 alias is gone

  def run_and_drop():
    h = pmap(lambda v: v + 3)
    h(jnp.ones((N, 2)))
    h(jnp.ones((N, 2)))

  gc.collect()
  start = pc.stats()
  run_and_drop()
  gc.collect()  # h died
  dead = pc.stats()
  assert (dead.hits - start.hits, dead.misses - start.misses) == (1, 1)
  assert dead.compiles + dead.executable_reuses > (
    start.compiles + start.executable_reuses
  )

  g = pmap(lambda v: v * 2)
  gc.collect()  # no other pmapped function dies between the two snapshots
  before = pc.stats()
  g(jnp.ones((N, 2)))
  g(jnp.ones((N, 2)))
  after = pc.stats()
  assert type(after) is jaxworks.jit_cache.CacheInfo
  assert (after.hits - before.hits, after.misses - before.misses) == (1, 1)
  built = after.compiles + after.executable_reuses
  assert built - (before.compiles + before.executable_reuses) == 1


def test_second_order_grads_as_stock():
  # Upstream pmap_test.py's testCollectivePermuteCyclicGrad: under a
  # transformation the program runs without output shardings, as
  # jax.pmap's does (a transposed program would take them as the input
  # shardings of its cotangents).
  shift = [(i, (i + 1) % N) for i in range(N)]
  f = lambda v: jax.lax.ppermute(v, perm=shift, axis_name="i")
  y = np.pi + np.arange(N, dtype=np.float32)
  x = np.arange(N, dtype=np.float32)
  grads = []
  for p in (pmap, jax.pmap):
    g = lambda v, p=p: jnp.sum(y * p(f, "i")(v))
    grads.append(np.asarray(jax.grad(g)(x)))
    check_grads(g, (x,), 2, ["fwd", "rev"], 1e-2, 1e-2)
  np.testing.assert_array_equal(grads[0], grads[1])
  out = pmap(f, "i")(x)
  assert out.sharding == jax.pmap(f, "i")(x).sharding
