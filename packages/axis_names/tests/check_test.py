"""check_axis_names: unbound and mismatched names, with the user's file:line."""

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

from jaxworks import axis_names
from jaxworks.axis_names import AxisNameError
from jaxworks.axis_names import check_axis_names

X = jnp.arange(8.0)


@functools.cache
def MESH():
  return jax.make_mesh((4, 2), ("x", "y"), axis_types=(AxisType.Auto,) * 2)


HERE = os.path.abspath(__file__)


def _line_of(fn, text):
  lines, start = inspect.getsourcelines(fn)
  for off, line in enumerate(lines):
    if text in line:
      return start + off
  raise AssertionError(text)


def uses_batch(x):
  y = x * 2
  return lax.psum(y, "batch")  # the collective


def test_ok_returns_used_names():
  assert check_axis_names(uses_batch, X, axis_sizes={"batch": 8}) == {"batch"}


def test_unbound_name_error_names_everything():
  with pytest.raises(AxisNameError) as info:
    check_axis_names(uses_batch, X, axis_sizes={"data": 8})
  e = info.value
  assert isinstance(e, NameError)
  assert e.primitive == "psum"
  assert e.axis_name == "batch"
  assert e.bound == ("data",)
  line = _line_of(uses_batch, "# the collective")
  assert e.location.startswith(f"{HERE}:{line} ")
  msg = str(e)
  assert "jaxworks.axis_names.check_axis_names" in msg
  assert "psum uses axis name 'batch'" in msg
  assert f"{HERE}:{line}" in msg
  assert "bound axis names: ('data',)" in msg


def test_no_axis_sizes_means_nothing_bound():
  with pytest.raises(AxisNameError, match=r"bound axis names: \(\)"):
    check_axis_names(uses_batch, X)


def test_close_match_hint():
  with pytest.raises(AxisNameError, match=r"did you mean 'batch'\?"):
    check_axis_names(
      lambda x: lax.axis_index("bacth") * x, X, axis_sizes={"batch": 8}
    )


def test_all_problems_are_listed():
  def two(x):
    return lax.psum(x, "a") + lax.axis_index("b")

  with pytest.raises(AxisNameError) as info:
    check_axis_names(two, X, axis_sizes={"c": 2})
  assert [p[:2] for p in info.value.problems] == [
    ("psum", "a"),
    ("axis_index", "b"),
  ]
  assert "2 problems" in str(info.value)


def test_name_unbound_inside_shard_map_reports_mesh_names():
  def body(v):
    return lax.psum(v, "x") * lax.axis_index("z")  # z is free

  fn = jax.shard_map(
    body,
    mesh=MESH(),
    in_specs=P("x"),
    out_specs=P("x"),
    axis_names={"x"},
    check_vma=False,
  )
  with pytest.raises(AxisNameError) as info:
    check_axis_names(fn, X)
  e = info.value
  assert (e.primitive, e.axis_name, e.bound) == ("axis_index", "z", ("x",))
  assert e.location.startswith(f"{HERE}:{_line_of(body, 'z is free')} ")
  # Bound by the caller: fine.
  assert check_axis_names(fn, X, axis_sizes={"z": 2}) == {"z"}


def test_nested_in_control_flow_and_jit():
  def fn(x):
    return jax.jit(
      lambda v: lax.cond(
        v[0] > 0, lambda u: lax.pmax(u, "deep"), lambda u: u, v
      )
    )(x)

  with pytest.raises(AxisNameError) as info:
    check_axis_names(fn, X, axis_sizes={"i": 2})
  assert (info.value.primitive, info.value.axis_name) == ("pmax", "deep")
  assert info.value.location.startswith(HERE)


def test_ppermute_out_of_range_for_axis_size():
  def fn(x):
    return lax.ppermute(x, "i", [(0, 1), (1, 5)])

  with pytest.raises(
    AxisNameError,
    match=r"indices \[5\] outside the axis "
    r"of size 4",
  ):
    check_axis_names(fn, X, axis_sizes={"i": 4})
  assert check_axis_names(fn, X, axis_sizes={"i": 8}) == {"i"}


def test_axis_index_groups_must_partition_the_axis():
  def fn(x):
    return lax.psum(x, "i", axis_index_groups=[[0, 1], [2, 3]])

  with pytest.raises(AxisNameError, match=r"do not partition range\(8\)"):
    check_axis_names(fn, X, axis_sizes={"i": 8})
  assert check_axis_names(fn, X, axis_sizes={"i": 4}) == {"i"}


def test_mismatch_inside_shard_map_uses_mesh_size():
  fn = jax.shard_map(
    lambda v: lax.ppermute(v, "x", [(0, 7)]),
    mesh=MESH(),
    in_specs=P("x"),
    out_specs=P("x"),
    axis_names={"x"},
    check_vma=False,
  )
  with pytest.raises(AxisNameError, match="size 4"):
    check_axis_names(fn, X)


def test_jaxpr_input():
  closed = jax.make_jaxpr(uses_batch, axis_env=[("batch", 2)])(X)
  assert check_axis_names(closed, axis_sizes={"batch": 2}) == {"batch"}
  with pytest.raises(AxisNameError):
    check_axis_names(closed.jaxpr)
  with pytest.raises(TypeError, match="only for a callable"):
    check_axis_names(closed, X)


def test_non_string_axis_name_unbound():
  def fn(x):
    return lax.psum(x, ("t", 1.5))  # non-string name

  with pytest.raises(AxisNameError) as info:
    check_axis_names(fn, X, axis_sizes={"t": 2})
  assert isinstance(info.value.__cause__, NameError)
  assert info.value.location.startswith(
    f"{HERE}:{_line_of(fn, 'non-string name')} "
  )
  assert "bound axis names: ('t',)" in str(info.value)


def test_mismatch_inside_jit_of_shard_map_and_pmap():
  # jit(shard_map) uses no free name, but the walk must still descend.
  fn = jax.shard_map(
    lambda v: lax.ppermute(v, "x", [(0, 7)]),
    mesh=MESH(),
    in_specs=P("x"),
    out_specs=P("x"),
    axis_names={"x"},
    check_vma=False,
  )
  with pytest.raises(AxisNameError, match="outside the axis of size 4"):
    check_axis_names(jax.jit(fn), X)
  pm = jax.pmap(lambda v: lax.pbroadcast(v, "b", 9), axis_name="b")
  with pytest.raises(AxisNameError) as info:
    check_axis_names(pm, X.reshape(8, 1))
  assert (info.value.primitive, info.value.axis_name) == ("pbroadcast", "b")
  assert "source 9 is outside the axis of size 8" in str(info.value)


def uses_scatter(x):
  return lax.psum_scatter(x, "i", tiled=True)  # splits dimension 0


def test_operand_not_divisible_by_axis_size():
  # JAX raises a plain ValueError while tracing with size 3; we name the
  # collective, the axis, the bound names and the user's line.
  with pytest.raises(AxisNameError) as info:
    check_axis_names(uses_scatter, X, axis_sizes={"i": 3})
  e = info.value
  # As written (psum_scatter), not the primitive's name (reduce_scatter).
  assert (e.primitive, e.axis_name, e.bound) == ("psum_scatter", "i", ("i",))
  assert e.location.startswith(
    f"{HERE}:{_line_of(uses_scatter, 'splits dimension 0')} "
  )
  assert (
    "scatter_dimension=0 has size 8, not divisible by the axis size 3" in str(e)
  )
  assert isinstance(e.__cause__, ValueError)
  assert check_axis_names(uses_scatter, X, axis_sizes={"i": 4}) == {"i"}


def test_all_to_all_split_axis_not_divisible():
  def fn(x):
    return lax.all_to_all(x.reshape(2, 4), "i", 1, 0, tiled=True)

  with pytest.raises(
    AxisNameError,
    match=r"split_axis=1 has size 4, not "
    r"divisible by the axis size 3",
  ):
    check_axis_names(fn, X, axis_sizes={"i": 3})


def test_jaxpr_traced_for_another_axis_size():
  closed = jax.make_jaxpr(
    lambda x: lax.all_gather(x, "i"), axis_env=[("i", 2)]
  )(X)
  with pytest.raises(
    AxisNameError,
    match="traced for an axis of size 2, but the axis has size 4 here",
  ):
    check_axis_names(closed, axis_sizes={"i": 4})
  assert check_axis_names(closed, axis_sizes={"i": 2}) == {"i"}


def test_unrelated_trace_errors_pass_through():
  def broken(x):
    return lax.psum(x, "i") + jnp.ones(3)  # shapes (8,) and (3,)

  with pytest.raises(TypeError, match="add got incompatible shapes"):
    check_axis_names(broken, X, axis_sizes={"i": 2})


def test_bad_axis_sizes():
  with pytest.raises(ValueError, match=r"axis_sizes\['i'\] = -1"):
    check_axis_names(uses_batch, X, axis_sizes={"i": -1})
  with pytest.raises(TypeError, match="check_axis_names: expected a Jaxpr"):
    check_axis_names("not a function")


def test_error_class_is_both_stock_classes():
  assert issubclass(axis_names.AxisNameError, NameError)
  assert issubclass(axis_names.AxisNameError, AssertionError)


def _shard_mapped(collective):
  mesh = jax.make_mesh(
    (8,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,)
  )

  def body(x):
    y = collective(x, "btach")  # misspelled
    return y

  return jax.shard_map(
    body, mesh=mesh, in_specs=jax.P("batch"), out_specs=jax.P()
  )


def test_misspelled_name_inside_shard_map():
  f = _shard_mapped(jax.lax.pmean)
  x = jnp.arange(8.0)
  with pytest.raises(AssertionError):  # stock: a bare AssertionError
    jax.make_jaxpr(f)(x)
  with pytest.raises(axis_names.AxisNameError) as info:
    axis_names.check_axis_names(f, x)
  e = info.value
  assert isinstance(e, AssertionError) and isinstance(e, NameError)
  assert (e.primitive, e.axis_name, e.bound) == ("pmean", "btach", ("batch",))
  assert "check_test.py:" in e.location and "(body)" in e.location
  assert "did you mean 'batch'?" in str(e)
  assert str(e).count("btach") == 1  # listed once


def test_diagnose_outside_shard_map_names_what_was_written():
  def f(x):
    return jax.lax.pmean(x, "i") + jax.lax.pmean(x, "i")

  x = jnp.ones(3)
  with pytest.raises(NameError) as info:
    jax.make_jaxpr(f)(x)
  found = axis_names.diagnose(info.value, f, x, api="my.api")
  assert isinstance(found, axis_names.AxisNameError)
  # Two equations, one problem (same collective, name and line): once.
  assert str(found).startswith("my.api: pmean uses axis name 'i' at ")
  assert len(found.problems) == 1 and found.primitive == "pmean"
  assert axis_names.diagnose(ValueError("x"), f, x) is None


def reads_size(x):
  return x * lax.axis_size("bacth")  # size only


def psum_of_one(x):
  return x / lax.psum(1, "bacth")  # a constant


def pmean_of_const(x):
  return x + lax.pmean(2.0, "bacth")  # a constant


@pytest.mark.parametrize(
  ("fn", "marker", "written"),
  [
    (reads_size, "size only", "axis_size"),
    (psum_of_one, "a constant", "psum"),
    (pmean_of_const, "a constant", "pmean"),
  ],
)
def test_misspelled_name_that_leaves_no_equation(fn, marker, written):
  # JAX computes these from the axis size while tracing; nothing in the
  # jaxpr names the axis, but stock tracing raises NameError.
  with pytest.raises(NameError):
    jax.make_jaxpr(fn, axis_env=[("batch", 8)])(X)
  with pytest.raises(AxisNameError) as info:
    check_axis_names(fn, X, axis_sizes={"batch": 8})
  e = info.value
  assert (e.primitive, e.axis_name, e.bound) == (written, "bacth", ("batch",))
  assert e.location.startswith(f"{HERE}:{_line_of(fn, marker)} ")
  assert "did you mean 'batch'?" in str(e)
  assert len(e.problems) == 1
  assert check_axis_names(fn, X, axis_sizes={"bacth": 8}) == frozenset()


def test_size_only_use_inside_binders_names_their_axes():
  mesh = jax.make_mesh((2,), ("m",), devices=jax.devices()[:2])
  in_sm = jax.shard_map(
    lambda v: v * lax.axis_size("mm"),  # inside shard_map
    mesh=mesh,
    in_specs=P(),
    out_specs=P(),
  )
  in_vmap = lambda x: jax.vmap(lambda v: v * lax.psum(1, "vv"), axis_name="v")(
    x.reshape(2, 4)
  )
  in_jit_cond = jax.jit(
    lambda x: lax.cond(
      x[0] > 0, lambda v: v * lax.axis_size("i2"), lambda v: v, x
    )
  )
  for fn, name, bound in (
    (in_sm, "mm", ("i", "m")),
    (in_vmap, "vv", ("i", "v")),
    (in_jit_cond, "i2", ("i",)),
  ):
    with pytest.raises(AxisNameError) as info:
      check_axis_names(fn, X, axis_sizes={"i": 2})
    assert (info.value.axis_name, info.value.bound) == (name, bound)


def test_placeholder_that_breaks_a_shape_still_reports_the_name():
  # Bound with a placeholder size, the misspelled name makes all_to_all
  # fail on shapes; stock raised NameError for the name first.
  def fn(x):
    return lax.all_to_all(x.reshape(8, 1), "bacth", 0, 0) * lax.axis_size(
      "bacth"
    )

  with pytest.raises(NameError):
    jax.make_jaxpr(fn, axis_env=[("batch", 8)])(X)
  with pytest.raises(AxisNameError) as info:
    check_axis_names(fn, X, axis_sizes={"batch": 8})
  assert info.value.axis_name == "bacth"


def _nest(depth):
  """A jitted function called twice at every level: 2**depth psums."""
  f = lambda x: lax.psum(x, "i") * 2.0
  for _ in range(depth):
    g = jax.jit(f)
    f = (lambda g: lambda x: g(g(x)))(g)
  return f


def test_shared_sub_jaxprs_are_walked_once(monkeypatch):
  # Private imports below: counts the internal walk's calls (no public counter).
  from jaxworks.axis_names import collective_report
  from jaxworks.axis_names._src import analysis

  depth = 12
  closed = jax.make_jaxpr(_nest(depth), axis_env=[("i", 4)])(X)
  analysis.jaxpr_axis_names(closed.jaxpr)
  calls = []
  real = analysis.subjaxprs
  monkeypatch.setattr(
    analysis, "subjaxprs", lambda params: calls.append(1) or real(params)
  )
  assert check_axis_names(closed, axis_sizes={"i": 4}) == {"i"}
  # Each of the depth + 1 distinct jaxprs once (a few equations each), not
  # each of their 2**depth occurrences.
  assert len(calls) < 10 * (depth + 1)
  calls.clear()
  report = collective_report(closed, axis_sizes={"i": 4})
  assert len(calls) < 20 * (depth + 1)
  (row,) = report.rows
  assert (row.primitive, row.count) == ("psum", 2**depth)
  assert row.bytes_per_call == 2**depth * 2 * 3 / 4 * 32
  with pytest.raises(AxisNameError):
    check_axis_names(closed, axis_sizes={"j": 4})


def test_walk_summary_of_a_shared_sub_jaxpr_is_computed_once(monkeypatch):
  # Private imports below: counts the internal walk's calls (no public counter).
  from jaxworks.axis_names import collective_report
  from jaxworks.axis_names._src import analysis

  depth = 8
  f = _nest(depth)
  closed = jax.make_jaxpr(f, axis_env=[("i", 4)])(X)
  analysis.clear_cache()
  summarized = []
  real = analysis._summarize
  monkeypatch.setattr(
    analysis, "_summarize", lambda j: summarized.append(j) or real(j)
  )
  assert check_axis_names(closed, axis_sizes={"i": 4}) == {"i"}
  # The top jaxpr and one per level, each once however often it occurs.
  assert len(summarized) == depth + 1
  assert len({id(j) for j in summarized}) == depth + 1
  summarized.clear()
  check_axis_names(closed, axis_sizes={"i": 4})
  (row,) = collective_report(closed, axis_sizes={"i": 4}).rows
  assert row.count == 2**depth
  assert summarized == []  # later walks look the summaries up
  # A new trace of the same function: at most a new top jaxpr is
  # summarized; the jitted levels are JAX's cached jaxprs.
  check_axis_names(f, X, axis_sizes={"i": 4})
  assert len(summarized) <= 1
