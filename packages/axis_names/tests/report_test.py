"""collective_report: counts, byte estimates, sources, table."""

import functools
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import inspect

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P
import pytest

from jaxworks.axis_names import AxisNameError
from jaxworks.axis_names import CollectiveReport
from jaxworks.axis_names import CollectiveStat
from jaxworks.axis_names import collective_report

X = jnp.ones(16, jnp.float32)  # 64 bytes


@functools.cache
def MESH():
  return jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)


def _line(fn, text):
  lines, start = inspect.getsourcelines(fn)
  return start + next(i for i, l in enumerate(lines) if text in l)


def train_step(x):
  g = lax.psum(x, "data")  # all-reduce
  g = lax.psum(g, "data")  # all-reduce again
  h = lax.all_gather(g[:4], "model")  # gather
  s = lax.psum_scatter(x, "data", tiled=True)  # scatter
  p = lax.ppermute(x, "data", [(0, 1), (1, 0)])

  def body(c, _):
    return c + lax.pmax(c, ("data", "model")), None

  c = lax.scan(body, x, None, length=5)[0]  # pmax x5
  return (
    g.sum() + h.sum() + s.sum() + p.sum() + c.sum() + lax.axis_index("data")
  )


SIZES = {"data": 4, "model": 2}


def _row(report, axes, prim):
  (row,) = [r for r in report.rows if r.axes == axes and r.primitive == prim]
  return row


def test_counts_bytes_and_sources():
  r = collective_report(train_step, X, axis_sizes=SIZES)
  assert isinstance(r, CollectiveReport)
  fname = os.path.basename(__file__)
  psum = _row(r, ("data",), "psum")
  assert psum.count == 2
  assert psum.bytes_per_call == 2 * (2 * 3 / 4 * 64)
  assert psum.sources == (
    f"{fname}:{_line(train_step, 'all-reduce')}",
    f"{fname}:{_line(train_step, 'all-reduce again')}",
  )
  gather = _row(r, ("model",), "all_gather")
  assert (gather.count, gather.bytes_per_call) == (1, 1 * 16)
  scatter = _row(r, ("data",), "reduce_scatter")
  assert scatter.bytes_per_call == 3 / 4 * 64
  perm = _row(r, ("data",), "ppermute")
  assert perm.bytes_per_call == 64 * 2 / 4
  pmax = _row(r, ("data", "model"), "pmax")
  assert pmax.count == 5
  assert pmax.bytes_per_call == 5 * 2 * 7 / 8 * 64
  idx = _row(r, ("data",), "axis_index")
  assert (idx.count, idx.bytes_per_call) == (1, 0)
  assert r.axis_sizes == SIZES
  assert set(r.axis_names) == {"data", "model"}
  assert {s.primitive for s in r.by_axis("model")} == {"all_gather", "pmax"}
  assert r.total_bytes == sum(s.bytes_per_call for s in r.rows)
  assert all(isinstance(s, CollectiveStat) for s in r.rows)


def test_str_is_a_table():
  text = str(collective_report(train_step, X, axis_sizes=SIZES))
  lines = text.splitlines()
  assert lines[0].split() == [
    "axes",
    "primitive",
    "count",
    "bytes/call",
    "sources",
  ]
  assert set(lines[1].replace(" ", "")) == {"-"}
  assert any(l.split()[:4] == ["data,model", "pmax", "5", "560"] for l in lines)
  assert str(collective_report(jnp.sin, X)) == "no collectives"


def test_shard_map_names_take_mesh_sizes():
  fn = jax.shard_map(
    lambda v: lax.psum(lax.psum(v, "x"), "y"),
    mesh=MESH(),
    in_specs=P(("x", "y")),
    out_specs=P(),
  )
  r = collective_report(fn, X)
  assert r.axis_sizes == {"x": 4, "y": 2}
  # per-device operand: 16 / 8 = 2 floats = 8 bytes
  assert _row(r, ("x",), "psum_invariant").bytes_per_call == 2 * 3 / 4 * 8
  assert _row(r, ("y",), "psum_invariant").bytes_per_call == 2 * 1 / 2 * 8


def test_unbound_name_is_an_axis_name_error():
  with pytest.raises(AxisNameError) as info:
    collective_report(train_step, X, axis_sizes={"data": 4})
  assert info.value.axis_name == "model"
  assert "collective_report" in str(info.value)


def test_jaxpr_input():
  closed = jax.make_jaxpr(train_step, axis_env=list(SIZES.items()))(X)
  r = collective_report(closed, axis_sizes=SIZES)
  assert _row(r, ("data", "model"), "pmax").count == 5


def test_all_to_all_ragged_and_group_bytes_by_hand():
  def fn(x):
    a = lax.all_to_all(x.reshape(4, 4), "data", 0, 0, tiled=True)
    ones = jnp.ones(4, jnp.int32)
    r = lax.ragged_all_to_all(
      x, jnp.zeros(16), 0 * ones, ones, 0 * ones, ones, axis_name="data"
    )
    g = lax.psum(x, "data", axis_index_groups=[[0, 1], [2, 3]])
    return a.sum() + r.sum() + g.sum()

  r = collective_report(fn, X, axis_sizes={"data": 4})
  # all_to_all: the operand (64 bytes) is split in 4, 3 parts leave.
  assert _row(r, ("data",), "all_to_all").bytes_per_call == 3 / 4 * 64
  # ragged_all_to_all: the operand only, not the output buffer or offsets.
  assert _row(r, ("data",), "ragged_all_to_all").bytes_per_call == 3 / 4 * 64
  # psum within groups of 2: 2 (2-1)/2 B.
  assert _row(r, ("data",), "psum").bytes_per_call == 2 * 1 / 2 * 64


def test_collectives_under_jit_of_shard_map_and_pmap_are_found():
  # No free name is left outside the binder, but the collectives still run.
  sm = jax.shard_map(
    lambda v: lax.psum(v, "x"),
    mesh=MESH(),
    in_specs=P("x"),
    out_specs=P(),
    axis_names={"x"},
  )
  row = _row(collective_report(jax.jit(sm), X), ("x",), "psum_invariant")
  assert (row.count, row.bytes_per_call) == (1, 2 * 3 / 4 * 16)
  pm = jax.pmap(lambda v: lax.all_gather(v, "b"), axis_name="b")
  row = _row(collective_report(pm, X.reshape(8, 2)), ("b",), "all_gather")
  assert (row.count, row.bytes_per_call) == (1, 7 * 8)
