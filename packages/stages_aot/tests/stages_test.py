"""Traced -> Lowered -> Compiled: cross-platform lowering, Lowered's program, compile."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import re
import threading

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jaxworks_testing as jwt
import numpy as np
import pytest

from jaxworks import stages_aot as sa

# Linear algebra lowers to a different custom call on every platform, so the
# module text shows which platforms it targets.
PLATFORM_CALLS = {
  "cpu": "lapack_sgeqrf_ffi",
  "cuda": "cusolver_geqrf_ffi",
  "rocm": "hipsolver_geqrf_ffi",
  "tpu": "custom_call @Qr",
}


def qr_fun(x):
  q, r = jnp.linalg.qr(x)
  return q @ r + 1.0


X = jax.ShapeDtypeStruct((4, 4), jnp.float32)


def mlp(x, w, *, scale):
  return jnp.tanh(x @ w) * scale


def test_trace_carries_name_jaxpr_and_avals():
  x, w = np.ones((2, 3), np.float32), np.ones((3, 5), np.float32)
  traced = sa.trace(mlp, x, w, scale=2.0)
  assert traced.fun_name == "mlp"
  stock = jax.jit(mlp).trace(x, w, scale=2.0)
  assert str(traced.jaxpr) == str(stock.jaxpr)
  assert [e.primitive.name for e in traced.jaxpr.eqns][:2] == [
    "dot_general",
    "tanh",
  ]
  args, kwargs = traced.in_avals
  assert [a.shape for a in args] == [(2, 3), (3, 5)] and kwargs[
    "scale"
  ].shape == ()
  assert traced.out_info.shape == (2, 5)
  assert "f32[2,3]" in repr(traced)


def test_trace_counts_one_trace_per_call():
  calls = []

  def f(x):
    calls.append(1)
    return x * 2

  sa.trace(f, X)
  assert len(calls) == 1


def test_trace_keeps_options_of_a_jitted_function():
  f = jax.jit(lambda x, n: x * n, static_argnums=1, donate_argnums=0)
  traced = sa.trace(f, jnp.ones(3), 4)
  (eqn,) = traced.jaxpr.eqns
  assert eqn.primitive.name == "mul" and 4.0 in [
    getattr(v, "val", None) for v in eqn.invars
  ]
  lowered = traced.lower()
  assert lowered.args_info[0][0].donated


def test_from_traced_accepts_stock_traced_and_rejects_others():
  stock = jax.jit(mlp).trace(jnp.ones((2, 3)), jnp.ones((3, 5)), scale=1.0)
  traced = sa.Traced.from_traced(stock)
  assert isinstance(traced, sa.Traced) and isinstance(traced, jax.stages.Traced)
  assert traced.jaxpr is stock.jaxpr and traced.fun_name == stock.fun_name
  assert sa.Traced.from_traced(traced) is traced
  with pytest.raises(
    TypeError, match=r"Traced.from_traced: expected the result of .* got int"
  ):
    sa.Traced.from_traced(3)


def test_trace_rejects_non_callable():
  with pytest.raises(
    TypeError, match="stages_aot.trace: expected a function to trace, got str"
  ):
    sa.trace("f", X)


@pytest.mark.parametrize("platform", ["cpu", "cuda", "rocm", "tpu"])
def test_lower_for_each_platform_targets_it(platform):
  lowered = sa.trace(qr_fun, X).lower(lowering_platforms=(platform,))
  text = lowered.as_text()
  assert lowered.platforms == (platform,)
  assert PLATFORM_CALLS[platform] in text
  for other, call in PLATFORM_CALLS.items():
    if other != platform:
      assert call not in text, (platform, other)
  assert "_platform_index" not in text


@pytest.mark.parametrize(
  "platforms",
  [
    ("cpu", "tpu"),
    ("cuda", "rocm"),
    ("tpu", "cuda"),
    ("cpu", "cuda", "rocm", "tpu"),
  ],
)
def test_multi_platform_module_selects_platform_at_run_time(platforms):
  lowered = sa.trace(qr_fun, X).lower(lowering_platforms=platforms)
  text = lowered.as_text()
  assert lowered.platforms == platforms
  # The first argument is the platform index; case ops branch on it.
  main = re.search(r"func\.func public @main\((.*?)\) ->", text).group(1)
  assert main.startswith(
    '%arg0: tensor<i32> {jax.global_constant = "_platform_index"}'
  )
  assert "stablehlo.case" in text
  for p, call in PLATFORM_CALLS.items():
    assert (call in text) == (p in platforms), p


def test_lower_default_platform_is_default_backend():
  lowered = sa.trace(qr_fun, X).lower()
  # jax's name of the default backend for lowering ('gpu' spelled 'cuda' or 'rocm').
  assert lowered.platforms == (jax.export.default_export_platform(),)
  assert (
    lowered.as_text()
    == sa.trace(qr_fun, X).lower(lowering_platforms=lowered.platforms).as_text()
  )


@pytest.mark.parametrize(
  "bad, err, match",
  [
    (
      "tpu",
      TypeError,
      r"must be a tuple of platform names, got the string 'tpu'; write lowering_platforms=\('tpu',\)",
    ),
    ((), ValueError, "lowering_platforms is empty"),
    (("gpu",), ValueError, "'gpu' is ambiguous; write 'cuda' or 'rocm'"),
    (
      ("TPU",),
      ValueError,
      "unknown lowering platform 'TPU'; did you mean 'tpu'",
    ),
    (("cpu", "cpu"), ValueError, r"\['cpu'\] listed twice"),
    (
      ("metal",),
      ValueError,
      "unknown lowering platform 'metal'; use names from",
    ),
    ((3,), TypeError, "lowering platform 3 is not a string"),
  ],
)
def test_lower_rejects_bad_platforms(bad, err, match):
  with pytest.raises(err, match=match):
    sa.trace(qr_fun, X).lower(lowering_platforms=bad)


def test_lowered_public_attributes():
  x, w = jnp.ones((2, 3)), jnp.ones((3, 3))
  traced = sa.trace(jax.jit(mlp, donate_argnums=0), x, w, scale=3.0)
  lowered = traced.lower(lowering_platforms=("cpu", "tpu"))
  assert lowered.fun_name == "mlp"
  assert lowered.jaxpr is traced.jaxpr
  assert lowered.platforms == ("cpu", "tpu")
  (ax, aw), kw = lowered.in_avals
  assert (ax.shape, aw.shape, kw["scale"].shape) == ((2, 3), (3, 3), ())
  assert (
    lowered.out_info.shape == (2, 3) and lowered.out_info.dtype == jnp.float32
  )
  (ix, iw), _ = lowered.args_info
  assert ix.donated and not iw.donated
  assert "stablehlo.tanh" in lowered.as_text()
  assert "tanh" in lowered.as_text(dialect="hlo")
  cost = lowered.cost_analysis()
  assert cost["flops"] >= 2 * 2 * 3 * 3
  assert "platforms=('cpu', 'tpu')" in repr(lowered)


def test_compile_single_platform_matches_jit():
  x, w = (
    np.arange(6, dtype=np.float32).reshape(2, 3),
    np.full((3, 5), 0.1, np.float32),
  )
  compiled = (
    sa.trace(mlp, x, w, scale=2.0).lower(lowering_platforms=("cpu",)).compile()
  )
  assert compiled.platform == "cpu" and compiled.fun_name == "mlp"
  np.testing.assert_array_equal(
    compiled(x, w, scale=2.0), jax.jit(mlp)(x, w, scale=2.0)
  )
  assert compiled.cost_analysis()["flops"] > 0
  assert "tanh" in compiled.as_text()


def test_compile_for_default_backend_is_stock_compile_and_keeps_donation():
  f = jax.jit(lambda x: x * 2 + 1, donate_argnums=0)
  lowered = sa.trace(f, jnp.ones(4)).lower()
  x = jnp.arange(4.0)
  out = lowered.compile()(x)
  np.testing.assert_array_equal(out, [1.0, 3.0, 5.0, 7.0])
  assert x.is_deleted()  # donated, as jax.jit(...).lower().compile() does
  # Several platforms: compiled through the export, donation is not kept.
  y = jnp.arange(4.0)
  multi = (
    sa.trace(f, jnp.ones(4)).lower(lowering_platforms=("cpu", "tpu")).compile()
  )
  np.testing.assert_array_equal(multi(y), [1.0, 3.0, 5.0, 7.0])
  assert not y.is_deleted()


def test_compile_multi_platform_runs_the_multi_platform_module():
  x = (
    np.arange(16, dtype=np.float32).reshape(4, 4)
    + np.eye(4, dtype=np.float32) * 20
  )
  compiled = (
    sa.trace(qr_fun, X)
    .lower(lowering_platforms=("tpu", "cpu", "cuda"))
    .compile()
  )
  assert compiled.platform == "cpu" and compiled.lowered_for == (
    "tpu",
    "cpu",
    "cuda",
  )
  np.testing.assert_allclose(
    compiled(x), jax.jit(qr_fun)(x), rtol=1e-5, atol=1e-5
  )
  # The executable contains the cpu branch (LAPACK), not the others.
  hlo = compiled.as_text()
  assert "lapack_sgeqrf_ffi" in hlo and "cusolver" not in hlo


def test_compile_for_absent_platform_names_present_platforms():
  lowered = sa.trace(qr_fun, X).lower(lowering_platforms=("tpu", "rocm"))
  present = sa.present_platforms()
  with pytest.raises(ValueError) as info:
    lowered.compile()
  msg = str(info.value)
  assert "Lowered.compile: 'qr_fun' was lowered for ('tpu', 'rocm')" in msg
  assert f"platforms present on this host are {present}" in msg
  with pytest.raises(
    ValueError, match=r"lowered for \('tpu', 'rocm'\), not for 'cpu'"
  ):
    lowered.compile(platform="cpu")
  both = sa.trace(qr_fun, X).lower(lowering_platforms=("cpu", "tpu"))
  with pytest.raises(
    ValueError, match=r"platform 'tpu' is not present on this host \(present: "
  ):
    both.compile(platform="tpu")


def test_compile_refuses_symbolic_shapes():
  (x,) = sa.arg_specs("f32[b,4]")
  with pytest.raises(
    ValueError, match=r"lowered with symbolic dimensions \(f32\[b,4\]\)"
  ):
    sa.trace(jnp.sin, x).lower().compile()


def test_sharded_arguments_lower_compile_and_export():
  mesh = jwt.mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  sharding = NamedSharding(mesh, P("x"))
  x = jax.device_put(np.arange(16, dtype=np.float32).reshape(8, 2), sharding)
  spec = jax.ShapeDtypeStruct((8, 2), jnp.float32, sharding=sharding)
  lowered = sa.trace(lambda a: jnp.sin(a) * 2, spec).lower()
  compiled = lowered.compile()
  out = compiled(x)
  np.testing.assert_allclose(out, np.sin(np.asarray(x)) * 2, rtol=1e-6)
  assert compiled.input_shardings[0][0].is_equivalent_to(sharding, 2)
  exported = lowered.export()
  assert exported.nr_devices == 8
  (in_sharding,) = exported.in_shardings
  assert in_sharding.spec == P("x") and dict(in_sharding.mesh.shape) == {"x": 8}
  np.testing.assert_allclose(
    sa.deserialize(exported.serialize())(x), out, rtol=1e-6
  )


def test_concurrent_lower_and_export_agree():
  traced = sa.trace(qr_fun, X)
  results, errors = [None] * 4, []

  def work(i):
    try:
      results[i] = (
        traced.lower(lowering_platforms=("cpu", "tpu")).export().serialize()
      )
    except Exception as e:  # surfaced below
      errors.append(e)

  threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors
  assert all(r == results[0] for r in results)


def test_multi_platform_compile_keeps_shardings_kwargs_and_pytrees():
  mesh = jwt.mesh_fit(
    (4, 2), ("x", "y"), axis_types=(jax.sharding.AxisType.Auto,) * 2
  )
  sx, sy = NamedSharding(mesh, P("x")), NamedSharding(mesh, P(None, "y"))
  f = jax.jit(
    lambda a, b, *, c: (jnp.sin(a) * 2, {"s": a.sum() + b, "c": c * 2}),
    out_shardings=(sy, None),
  )
  x = jax.device_put(np.arange(16, dtype=np.float32).reshape(8, 2), sx)
  spec = jax.ShapeDtypeStruct((8, 2), jnp.float32, sharding=sx)
  compiled = (
    sa.trace(f, spec, jnp.float32(1), c=jnp.ones(3))
    .lower(lowering_platforms=("cpu", "tpu"))
    .compile()
  )
  out = compiled(x, jnp.float32(1), c=jnp.ones(3))
  ref = f(x, jnp.float32(1), c=jnp.ones(3))
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), out, ref
  )
  assert out[0].sharding == ref[0].sharding == sy
  assert compiled.input_shardings[0][0] == sx


def _placements():
  devices = jax.devices()
  x = np.arange(8, dtype=np.float32)
  mesh = lambda ds: jax.sharding.Mesh(np.array(ds), ("i",))
  return {
    "device 3": jax.device_put(x, jwt.device(3)),
    # (the second half of the devices; on one chip, that chip)
    "devices 4-7": jax.device_put(
      x, NamedSharding(mesh(devices[len(devices) // 2 :]), P("i"))
    ),
    "reversed": jax.device_put(x, NamedSharding(mesh(devices[::-1]), P("i"))),
    "uncommitted": jnp.asarray(x),
  }


@pytest.mark.parametrize("where", sorted(_placements()))
@pytest.mark.parametrize("platforms", [("cpu",), ("cpu", "tpu")])
def test_compile_runs_where_the_arguments_are(where, platforms):
  """As stock's compile: committed to one device, sharded over some devices
  or in another order, the program runs there, with stock's shardings."""
  x = _placements()[where]
  f = lambda v: v * 2 + 1
  want = jax.jit(f).trace(x).lower().compile()(x)
  compiled = sa.trace(f, x).lower(lowering_platforms=platforms).compile()
  got = compiled(x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert got.committed == want.committed
  assert got.sharding == want.sharding


def test_lower_export_compile_never_retrace_the_python_function():
  calls = []

  def f(x):
    calls.append(1)
    return jnp.sin(x) * 3

  traced = sa.trace(f, jnp.ones(4))
  lowered = traced.lower(lowering_platforms=("cpu", "tpu"))
  lowered.compile()
  exported = lowered.export(vjp_order=1)
  exported.serialize()
  traced.lower().compile()
  assert len(calls) == 1


def test_stock_traced_enters_with_export_parameters():
  stock = jax.jit(qr_fun).trace(X)
  lowered = sa.Traced.from_traced(stock).lower(
    lowering_platforms=("cpu", "tpu")
  )
  # The export lowering parameters only matter for Pallas/Mosaic kernels:
  # the module is stock's own cross-platform lowering.
  direct = stock.lower(lowering_platforms=("cpu", "tpu"))
  assert lowered.as_text() == direct.as_text()
  np.testing.assert_allclose(
    lowered.export()(np.eye(4, dtype=np.float32)),
    qr_fun(np.eye(4, dtype=np.float32)),
    rtol=1e-6,
  )
  # Constants stay in the module even where stock would hoist them into
  # arguments, so the lowering still exports.
  jax.config.update("jax_use_simplified_jaxpr_constants", True)
  try:
    relowered = sa.Traced.from_traced(jax.jit(qr_fun).trace(X)).lower(
      lowering_platforms=("cpu",)
    )
  finally:
    jax.config.update("jax_use_simplified_jaxpr_constants", False)
  np.testing.assert_allclose(
    relowered.export()(np.eye(4, dtype=np.float32)),
    qr_fun(np.eye(4, dtype=np.float32)),
    rtol=1e-6,
  )


def test_trace_of_a_plain_function_uses_stock_jit():
  # A function without ``trace`` is jitted with stock jax.jit.
  traced = sa.trace(mlp, jnp.ones((2, 3)), jnp.ones((3, 3)), scale=1.5)
  assert type(traced) is sa.Traced
  stock = jax.jit(mlp).trace(jnp.ones((2, 3)), jnp.ones((3, 3)), scale=1.5)
  assert str(traced.jaxpr) == str(stock.jaxpr)
  np.testing.assert_allclose(
    traced.lower().compile()(jnp.ones((2, 3)), jnp.ones((3, 3)), scale=1.5),
    mlp(jnp.ones((2, 3)), jnp.ones((3, 3)), scale=1.5),
    rtol=1e-6,
  )


def test_trace_of_anything_with_a_trace_method_uses_it():
  calls = []

  class Jitted:
    def __call__(self, x):
      return jax.jit(jnp.cos)(x)

    def trace(self, *args, **kwargs):
      calls.append((args, kwargs))
      return jax.jit(jnp.cos).trace(*args, **kwargs)

  traced = sa.trace(Jitted(), jnp.ones(3))
  assert len(calls) == 1 and type(traced) is sa.Traced
  assert traced.fun_name == "cos"


def test_lower_takes_stocks_parameters():
  # Traced.lower has stock's signature, JAX's private parameter included
  # (jax.export passes it to any Traced); lowering stays stock's.
  import inspect

  x = np.ones(3, np.float32)
  traced = sa.trace(lambda v: jnp.sin(v) * 2, x)
  params = lambda f: [  # noqa: E731
    (p.name, p.kind, p.default)
    for p in inspect.signature(f).parameters.values()
  ]
  assert params(traced.lower) == params(jax.jit(lambda v: v).trace(x).lower)
  assert "stablehlo.sine" in traced.lower().as_text()


def _committed_cases():
  x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(8, 4)
  mesh = jwt.mesh_fit((8,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))
  return {
    "numpy": x,
    "uncommitted jax array": jnp.asarray(x),
    "committed to a device": jax.device_put(x, jwt.device(0)),
    "sharded": jax.device_put(x, NamedSharding(mesh, P("i"))),
  }


@pytest.mark.parametrize("case", list(_committed_cases()))
@pytest.mark.parametrize(
  "platforms", [None, ("cpu",), ("cpu", "tpu"), ("cuda", "cpu")]
)
def test_compiled_outputs_committed_as_stock(case, platforms):
  """Stock compiles one platform; its committedness and sharding are the
  reference for every lowering of the same function and argument."""
  x = _committed_cases()[case]

  def f(v):
    return jnp.sin(v) * 2

  stock = jax.jit(f).trace(x).lower().compile()(x)
  kw = {} if platforms is None else {"lowering_platforms": platforms}
  ours = sa.trace(f, x).lower(**kw).compile()(x)
  assert ours.committed == stock.committed
  assert ours._committed == stock._committed
  np.testing.assert_array_equal(ours, stock)
  assert ours.sharding == stock.sharding


def test_multi_platform_compile_leaves_jax_export_call_as_stock():
  """The committedness fix copies the lowering: a jit of the same exported
  function (which JAX caches) keeps stock's committed outputs."""
  x = np.ones((8, 4), np.float32)
  lowered = sa.trace(jnp.sin, x).lower(lowering_platforms=("cpu", "tpu"))
  exp = lowered.export().jax_exported
  assert lowered.compile()(x).committed is False
  assert jax.jit(exp.call)(x).committed is True  # stock's own behaviour
  assert lowered.compile()(x).committed is False
