"""Lowered.export(): serialize / deserialize, calls under jit, vmap and grad, symbolic shapes."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import re

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import jaxworks_testing as jwt
import numpy as np
import pytest

from jaxworks import stages_aot as sa

RNG = np.random.default_rng(0)
X = RNG.standard_normal((5, 128)).astype(np.float32)
W = RNG.standard_normal((128, 16)).astype(np.float32) / 10


def f(x, w):
  return jnp.tanh(x @ w).sum(axis=1)


def loss(x, w):
  return f(x, w).sum()


def roundtrip(fun, *specs, platforms=None, vjp_order=0, **kw):
  exported = (
    sa.trace(fun, *specs, **kw)
    .lower(lowering_platforms=platforms)
    .export(vjp_order=vjp_order)
  )
  return sa.deserialize(exported.serialize())


def without_locations(text):
  text = "\n".join(
    line for line in text.splitlines() if not line.startswith("#loc")
  )
  return re.sub(r"\s*loc\((?:[^()]|\([^()]*\))*\)", "", text)


def test_serialized_bytes_equal_jax_export():
  specs = sa.arg_specs("f32[b,128]", "f32[128,16]")
  for platforms in [("cpu",), ("cpu", "tpu", "cuda")]:
    stock = jax.export.export(jax.jit(f), platforms=platforms)(*specs)
    # Entered from a stock trace, the bytes are those of jax.export: this
    # package's frames do not even show up in the source locations.
    from_stock = (
      sa.Traced.from_traced(jax.jit(f).trace(*specs))
      .lower(lowering_platforms=platforms)
      .export()
    )
    assert from_stock.serialize() == bytes(stock.serialize())
    assert sa.trace(jax.jit(f), *specs).lower(
      lowering_platforms=platforms
    ).export().serialize() == bytes(stock.serialize())
    # Through trace() of the plain function, the same module up to locations.
    ours = sa.trace(f, *specs).lower(lowering_platforms=platforms).export()
    assert without_locations(ours.mlir_text()) == without_locations(
      stock.mlir_module()
    )
    assert "_src/stages.py" not in ours.mlir_text()


def test_exported_attributes():
  specs = sa.arg_specs("f32[b,128]", "f32[128,16]")
  exp = (
    sa.trace(f, *specs)
    .lower(lowering_platforms=("cpu", "tpu"))
    .export(vjp_order=1)
  )
  assert exp.fun_name == "f" and exp.platforms == ("cpu", "tpu")
  assert [sa.format_aval(a) for a in exp.in_avals] == [
    "f32[b,128]",
    "f32[128,16]",
  ]
  assert [sa.format_aval(a) for a in exp.out_avals] == ["f32[b]"]
  assert (
    exp.calling_convention_version
    == jax.config.jax_export_calling_convention_version
  )
  assert (
    exp.vjp_order == 1 and exp.uses_shape_polymorphism and exp.nr_devices == 1
  )
  assert exp.in_shardings == (None, None)
  assert isinstance(exp.jax_exported, jax.export.Exported)
  assert "_platform_index" in exp.mlir_text()
  assert (
    repr(exp)
    == "Exported(f(f32[b,128], f32[128,16]) -> (f32[b]), platforms=('cpu', 'tpu'), vjp_order=1)"
  )


@pytest.mark.parametrize(
  "platforms", [None, ("cpu", "tpu"), ("tpu", "cuda", "cpu")]
)
def test_deserialized_runs_equal_original_also_under_jit(platforms):
  loaded = roundtrip(f, X, W, platforms=platforms)
  expected = jax.jit(f)(X, W)
  np.testing.assert_array_equal(loaded(X, W), expected)
  np.testing.assert_array_equal(jax.jit(loaded)(X, W), expected)
  np.testing.assert_array_equal(
    jax.jit(lambda a, b: loaded(a, b) * 2)(X, W), expected * 2
  )


def test_deserialized_under_vmap():
  loaded = roundtrip(f, X, W)
  xs = np.stack([X, 2 * X, -X])
  ws = np.stack([W, W / 2, W * 3])
  np.testing.assert_allclose(
    jax.vmap(loaded, in_axes=(0, None))(xs, W),
    jax.vmap(f, in_axes=(0, None))(xs, W),
    rtol=1e-5,
    atol=1e-5,
  )
  np.testing.assert_allclose(
    jax.vmap(loaded)(xs, ws), jax.vmap(f)(xs, ws), rtol=1e-5, atol=1e-5
  )
  np.testing.assert_allclose(
    jax.jit(jax.vmap(loaded, in_axes=(None, 0)))(X, ws),
    jax.vmap(f, in_axes=(None, 0))(X, ws),
    rtol=1e-5,
    atol=1e-5,
  )


def test_symbolic_dimensions_b_128():
  with jwt.exact_matmuls():
    _symbolic_dimensions_b_128()


def _symbolic_dimensions_b_128():
  x_spec, w_spec = sa.arg_specs("f32[b,128]", "f32[128,16]")
  loaded = roundtrip(f, x_spec, w_spec, platforms=("cpu", "tpu"), vjp_order=1)
  for b in (1, 3, 7):
    x = RNG.standard_normal((b, 128)).astype(np.float32)
    out = loaded(x, W)
    assert out.shape == (b,)
    np.testing.assert_allclose(out, f(x, W), **jwt.tolerance(1e-5, 1e-5))
    np.testing.assert_allclose(
      jax.grad(lambda a: loaded(a, W).sum())(x),
      jax.grad(lambda a: f(a, W).sum())(x),
      **jwt.tolerance(1e-5, 1e-6),
    )
  with pytest.raises(Exception, match="128"):
    loaded(np.ones((2, 64), np.float32), W)


def test_vjp_order_1_gradient_equals_original():
  loaded = roundtrip(f, X, W, vjp_order=1)
  assert loaded.vjp_order == 1 and loaded.has_vjp()
  got = jax.grad(lambda x, w: loaded(x, w).sum(), argnums=(0, 1))(X, W)
  want = jax.grad(loss, argnums=(0, 1))(X, W)
  for g, e in zip(got, want):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
  got_jit = jax.jit(jax.grad(lambda x, w: loaded(x, w).sum(), argnums=1))(X, W)
  np.testing.assert_allclose(got_jit, want[1], rtol=1e-5, atol=1e-6)


def test_grad_under_vmap():
  loaded = roundtrip(f, X, W, vjp_order=1)
  xs = np.stack([X, 2 * X])
  got = jax.jit(
    jax.vmap(jax.grad(lambda x, w: loaded(x, w).sum()), in_axes=(0, None))
  )(xs, W)
  want = jax.vmap(jax.grad(loss), in_axes=(0, None))(xs, W)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_second_order_needs_vjp_order_2():
  g = lambda x: jnp.sin(x) * x
  x = np.linspace(0.0, 1.0, 5, dtype=np.float32)
  second = lambda h: jax.grad(lambda a: jax.grad(lambda b: h(b).sum())(a).sum())
  loaded2 = roundtrip(g, x, vjp_order=2)
  np.testing.assert_allclose(
    second(loaded2)(x), second(g)(x), rtol=1e-5, atol=1e-6
  )
  loaded1 = roundtrip(g, x, vjp_order=1)
  with pytest.raises(
    ValueError,
    match=r"cannot take derivatives of order 2 of the exported function '<lambda>': it was serialized with vjp_order=1; export it with Lowered.export\(vjp_order=2\)",
  ):
    second(loaded1)(x)


def test_grad_without_vjp_is_a_clear_error():
  loaded = roundtrip(f, X, W, vjp_order=0)
  assert loaded.vjp_order == 0 and not loaded.has_vjp()
  with pytest.raises(
    ValueError,
    match=r"cannot differentiate the exported function 'f': it was serialized with vjp_order=0; export it with Lowered.export\(vjp_order=1\) \(CLI: --vjp-order 1\)",
  ):
    jax.grad(lambda x: loaded(x, W).sum())(X)


def test_in_memory_export_is_differentiable_and_matches():
  exp = sa.trace(f, X, W).lower().export()
  np.testing.assert_allclose(
    jax.grad(lambda x: exp(x, W).sum())(X),
    jax.grad(loss)(X, W),
    rtol=1e-5,
    atol=1e-6,
  )


def test_pytrees_kwargs_and_integer_inputs():
  def g(params, n, *, bias):
    return {"y": params["a"] * n + bias, "n": n + 1}

  params = {"a": np.arange(3, dtype=np.float32)}
  loaded = roundtrip(g, params, np.int32(2), bias=np.float32(0.5), vjp_order=1)
  out = loaded(params, np.int32(2), bias=np.float32(0.5))
  np.testing.assert_array_equal(out["y"], [0.5, 2.5, 4.5])
  assert int(out["n"]) == 3
  grads = jax.grad(
    lambda p: loaded(p, np.int32(2), bias=np.float32(0.5))["y"].sum()
  )(params)
  np.testing.assert_array_equal(grads["a"], [2.0, 2.0, 2.0])
  with pytest.raises(
    ValueError,
    match=r"Exported.call: 'g' was exported for .*f32\[3\].* but was called with structure",
  ):
    loaded(params, np.int32(2))


def test_repeated_calls_reuse_the_executable():
  loaded = roundtrip(f, X, W)
  loaded(X, W)
  jitted = loaded._jitted
  before = jitted._cache_size()
  for _ in range(3):
    loaded(X, W)
  assert loaded._jitted is jitted and jitted._cache_size() == before == 1


def test_export_argument_errors():
  lowered = sa.trace(f, X, W).lower()
  with pytest.raises(
    ValueError, match=r"vjp_order must be an int >= 0, got -1"
  ):
    lowered.export(vjp_order=-1)
  with pytest.raises(
    ValueError, match=r"vjp_order must be an int >= 0, got True"
  ):
    lowered.export(vjp_order=True)
  with pytest.raises(
    TypeError,
    match="disabled_checks must hold jax.export.DisabledSafetyCheck objects, got 'x'",
  ):
    lowered.export(disabled_checks=["x"])
  with pytest.raises(
    TypeError, match="Exported: expected a jax.export.Exported, got int"
  ):
    sa.Exported(3)


def test_deserialize_rejects_non_bytes():
  with pytest.raises(
    TypeError, match="deserialize: expected bytes from Exported.serialize"
  ):
    sa.deserialize("abc")


def call_own_interface(exp):
  """Calls ``exp`` with zeros of its own input types; checks the output types."""
  zeros = [np.zeros(a.shape, a.dtype) for a in exp.in_avals]
  args, kwargs = exp.in_tree.unflatten(zeros)
  outs = exp.out_tree.flatten_up_to(exp(*args, **kwargs))
  assert [sa.format_aval(o) for o in outs] == [
    sa.format_aval(a) for a in exp.out_avals
  ]


SIN_BLOB = None


def sin_blob():
  global SIN_BLOB
  if SIN_BLOB is None:
    SIN_BLOB = roundtrip(jnp.sin, np.ones(3, np.float32)).serialize()
  return SIN_BLOB


@settings(max_examples=40, deadline=None)
@given(
  st.binary(max_size=300)
  | st.builds(
    lambda n, tail: sin_blob()[:n] + tail,
    st.integers(0, 64),
    st.binary(max_size=200),
  )
)
def test_fuzz_deserialize_garbage_never_crashes(blob):
  try:
    loaded = sa.deserialize(blob)
  except ValueError as e:
    assert "are not a valid serialized exported program" in str(e)
    return
  call_own_interface(loaded)  # what loads must run


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_fuzz_truncated_blobs(data):
  blob = sin_blob()
  cut = data.draw(st.integers(0, len(blob) - 1))
  try:
    loaded = sa.deserialize(bytes(blob[:cut]))
  except ValueError as e:
    assert "not a valid serialized exported program" in str(e)
    return
  # A prefix that still reads must be the same program.
  x = np.linspace(0, 1, 3, dtype=np.float32)
  np.testing.assert_array_equal(loaded(x), sa.deserialize(blob)(x))


def _compiles_of(fn):
  seen = []
  listener = lambda event, duration, **kw: (
    seen.append(event) if "backend_compile" in event else None
  )
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    fn()
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  return len(seen)


def test_a_reloaded_program_and_its_vjp_compile_once():
  """Loading the same bytes again (a server's reload) and differentiating
  compiles nothing new: the program and its VJP are shared by content; stock
  compiles its forward program again on every load."""

  def chain(v):
    for _ in range(20):
      v = jnp.sin(v) * 1.01
    return v

  x = jnp.linspace(-1.0, 1.0, 4, dtype=jnp.float32)
  blob = sa.trace(chain, x).lower().export(vjp_order=1).serialize()
  stock_blob = jax.export.export(jax.jit(chain))(x).serialize(vjp_order=1)

  def cycle(load):
    loaded = load()
    return jax.grad(lambda v: loaded.call(v).sum())(x)

  ours = lambda: cycle(lambda: sa.deserialize(blob))
  stock = lambda: cycle(lambda: jax.export.deserialize(stock_blob))
  np.testing.assert_allclose(ours(), stock(), rtol=1e-6)
  reloads_ours = [_compiles_of(ours) for _ in range(3)]
  reloads_stock = [_compiles_of(stock) for _ in range(3)]
  assert reloads_ours == [0, 0, 0]
  assert all(o <= s for o, s in zip(reloads_ours, reloads_stock))
  # Other bytes (another program) are not confused with these.
  other = sa.trace(jnp.cos, x).lower().export(vjp_order=1).serialize()
  got = jax.grad(lambda v: sa.deserialize(other).call(v).sum())(x)
  np.testing.assert_allclose(got, -jnp.sin(x), rtol=1e-6)
