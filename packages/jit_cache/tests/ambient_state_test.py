"""What JAX reads from context is part of the keys, and JAX's own callers of
a jaxworks stage work. Each case runs stock jax.jit and
jit_cache.jit side by side and compares results bit for bit."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import inspect
import struct

import jax
import jax.numpy as jnp
import jaxworks_testing as jwt
import numpy as np
import pytest

from jaxworks.jit_cache import jit

JITS = {"stock": jax.jit, "jaxworks": jit}


def _bits(x) -> bytes:
  a = np.asarray(x)
  return a.dtype.str.encode() + str(a.shape).encode() + a.tobytes()


def _both(run):
  """``run(jit_)`` for stock and jaxworks; asserts equal results."""
  out = {name: run(j) for name, j in JITS.items()}
  assert out["jaxworks"] == out["stock"], out
  return out["stock"]


# -- the concrete mesh ---------------------------------------------------------


def _mesh(devices):
  return jax.make_mesh(
    (len(devices),),
    ("i",),
    devices=devices,
    axis_types=(jax.sharding.AxisType.Explicit,),
  )


@pytest.mark.parametrize("second", ["other-devices", "reordered"])
def test_concrete_mesh_is_part_of_the_key(second):
  jwt.require_devices(8 if second == "other-devices" else 4)
  devs = jax.devices()
  first = _mesh(devs[:4])
  other = _mesh(devs[4:] if second == "other-devices" else devs[:4][::-1])

  def run(jit_):
    f = jit_(lambda x: x * 2)
    out = []
    for mesh in (first, other, first):
      with jax.set_mesh(mesh):
        y = f(jnp.arange(8.0))
      out.append(
        (
          [d.id for d in y.sharding.mesh.devices.flat],
          _bits(y),
        )
      )
    return out

  result = _both(run)
  assert result[0][0] != result[1][0]  # the case tells the meshes apart


def test_optimization_level_is_part_of_the_key():
  def run(jit_):
    f = jit_(lambda x: x + 1)
    f(jnp.ones(3))
    calls = []
    prev = jax.config.jax_optimization_level
    jax.config.update("jax_optimization_level", "O1")
    try:
      # A new key: the C++ dispatcher and the trace cache miss, as stock's.
      with jax.log_compiles(True):
        calls.append(_bits(f(jnp.ones(3))))
    finally:
      jax.config.update("jax_optimization_level", prev)
    return calls

  _both(run)
  f = jit(lambda x: x - 1)
  f(jnp.ones(3))
  prev = jax.config.jax_optimization_level
  jax.config.update("jax_optimization_level", "O1")
  try:
    f(jnp.ones(3))
  finally:
    jax.config.update("jax_optimization_level", prev)
  assert f.cache_info().entries == 2


# -- NaN payloads and signed zeros in closed-over constants --------------------

_NAN = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000000))[0]
_NEG_NAN = struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000000))[0]
_NAN_PAYLOAD = struct.unpack("<d", struct.pack("<Q", 0x7FF8000000000123))[0]


@pytest.mark.parametrize(
  "a,b",
  [(_NAN, _NEG_NAN), (0.0, -0.0), (_NAN, _NAN_PAYLOAD)],
  ids=["nan-sign", "zero-sign", "nan-payload"],
)
def test_recreated_closures_differing_in_float_bits(a, b):
  def run(jit_):
    def make(c):
      return jit_(lambda x: x * jnp.copysign(1.0, c))

    x = jnp.arange(3.0)
    return [_bits(make(a)(x)), _bits(make(b)(x)), _bits(make(a)(x))]

  out = _both(run)
  if a != a and b != b and struct.pack("<d", a)[7] != struct.pack("<d", b)[7]:
    assert out[0] != out[1]  # the signs really differ


# -- debug modes switched on after the function ran ----------------------------


@pytest.mark.parametrize("mode", ["debug_nans", "debug_infs"])
def test_debug_mode_after_first_call_raises_floating_point_error(mode):
  bad = {"debug_nans": -1.0, "debug_infs": 0.0}[mode]
  for name, jit_ in JITS.items():
    f = jit_(lambda x: jnp.log(x))  # pylint: disable=unnecessary-lambda
    f(jnp.ones(2))
    with getattr(jax, mode)(True):
      with pytest.raises(FloatingPointError):
        f(jnp.full(2, bad))
    assert np.isfinite(np.asarray(f(jnp.ones(2)))).all(), name


# -- crashes where stock works --------------------------------------------------


def test_closure_over_a_mutable_array_at_top_level():
  def run(jit_):
    ref = jax.new_ref(jnp.zeros(3))

    def step(x):
      ref[...] += x
      return ref[...] * 2

    f = jit_(step)
    out = [_bits(f(jnp.ones(3))), _bits(f(jnp.ones(3)))]
    return out + [_bits(ref[...])]

  _both(run)


def test_shape_dtype_struct_argument_is_a_type_error_naming_it():
  for name, jit_ in JITS.items():
    compiles = []
    f = jit_(lambda weights: weights * 2)
    with jax.log_compiles(True):
      with pytest.raises(TypeError, match="'weights'") as e:
        f(jax.ShapeDtypeStruct((3,), jnp.float32))
    assert "ShapeDtypeStruct" in str(e.value), name
    del compiles


class _EqRaises:
  def __hash__(self):
    return 7

  def __eq__(self, other):
    raise RuntimeError("no __eq__ for this static")


def test_static_argument_whose_eq_raises():
  def run(jit_):
    f = jit_(lambda x, s: x + 1, static_argnums=1)
    return _bits(f(jnp.ones(2), _EqRaises()))

  # Each side sees a static of equal hash from the other side's call in
  # stock's process-wide caches.
  assert run(jax.jit) == run(jit) == run(jit)


# -- JAX's own callers of a jaxworks stage --------------------------------------


def test_jax_export_of_a_jaxworks_jit_equals_stocks():
  spec = jax.ShapeDtypeStruct((4, 3), jnp.float32)

  def body(x):
    return jnp.sin(x) @ jnp.ones((3, 2)) + jnp.float32(3.0)

  out = {}
  for name, jit_ in JITS.items():
    exp = jax.export.export(jit_(body))(spec)
    out[name] = (exp.mlir_module(), exp.platforms, exp.fun_name)
    np.testing.assert_array_equal(
      exp.call(jnp.ones((4, 3))), jax.jit(body)(jnp.ones((4, 3)))
    )
  assert out["jaxworks"] == out["stock"]
  for platforms in (("cpu", "cuda"), ("tpu",)):
    texts = [
      jax.export.export(j(body), platforms=platforms)(spec).mlir_module()
      for j in JITS.values()
    ]
    assert texts[0] == texts[1]


def test_private_lowering_parameters_are_honoured():
  from jax.interpreters import mlir  # pylint: disable=g-import-not-at-top

  x = jnp.ones(3)
  params = mlir.LoweringParameters(for_export=True)
  texts = []
  for jit_ in JITS.values():
    traced = jit_(lambda v: v * 2 + jnp.arange(3.0)).trace(x)
    lowered = traced.lower(
      lowering_platforms=("cpu",), _private_parameters=params
    )
    texts.append(lowered.as_text())
  assert texts[0] == texts[1]


def test_signature_of_the_wrapper_is_stocks():
  def g(a, b=2, *args, c, **kw):
    return a

  class K:
    def m(self, x, y=1):
      return x

  for fun in (g, K().m, jnp.add, lambda *a: a):
    assert inspect.signature(
      jit(fun), follow_wrapped=False
    ) == inspect.signature(jax.jit(fun), follow_wrapped=False)
    assert inspect.signature(jit(fun)) == inspect.signature(jax.jit(fun))


def test_compile_with_device_assignment_of_an_abstract_mesh_lowering():
  amesh = jax.sharding.AbstractMesh(
    (2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,)
  )
  spec = jax.ShapeDtypeStruct(
    (8,), jnp.float32, sharding=jax.NamedSharding(amesh, jax.P("x"))
  )
  devices = tuple(jwt.devices(2))
  results = []
  for jit_ in JITS.values():
    with jax.sharding.use_abstract_mesh(amesh):
      lowered = (
        jit_(lambda v: v * 3).trace(spec).lower(lowering_platforms=("tpu",))
      )
    compiled = lowered.compile(device_assignment=devices)
    arr = jax.device_put(
      jnp.arange(8.0),
      jax.NamedSharding(
        jax.sharding.Mesh(np.array(devices), ("x",)), jax.P("x")
      ),
    )
    results.append(_bits(compiled(arr)))
  assert results[0] == results[1]


def test_argument_layout_is_part_of_the_executable_key():
  from jax.experimental.layout import Format  # pylint: disable=g-import-not-at-top
  from jax.experimental.layout import Layout  # pylint: disable=g-import-not-at-top

  def run(jit_):
    g = jit_(lambda a, b: a @ b)
    dev = jax.devices()[0]
    a = jax.device_put(jnp.arange(12.0).reshape(3, 4), dev)
    b = jax.device_put(jnp.ones((4, 2)), dev)
    col = jax.device_put(a, Format(Layout(major_to_minor=(1, 0)), a.sharding))
    return [_bits(g(a, b)), _bits(g(col, b)), _bits(g(a, b))]

  _both(run)


def test_jax_export_with_a_platform_name_of_its_own():
  # jax.export passes platform names through (an unknown one fails in its
  # own way, or lowers when every primitive has a generic rule): jaxworks'
  # check of lowering_platforms must not run for JAX's own callers.
  spec = jax.ShapeDtypeStruct((3,), jnp.float32)
  outcomes = []
  for jit_ in JITS.values():
    try:
      exp = jax.export.export(jit_(jnp.sin), platforms=("cpu", "other"))(spec)
      outcomes.append(("ok", exp.platforms, exp.mlir_module()))
    except Exception as e:  # pylint: disable=broad-except
      outcomes.append((type(e), str(e)))
  assert outcomes[0] == outcomes[1]


def test_compile_of_an_abstract_mesh_lowering_without_devices_raises_stocks():
  amesh = jax.sharding.AbstractMesh(
    (2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,)
  )
  spec = jax.ShapeDtypeStruct(
    (8, 2), jnp.float32, sharding=jax.NamedSharding(amesh, jax.P("x"))
  )
  errors = []
  for jit_ in JITS.values():
    lowered = (
      jit_(lambda v: v * 2).trace(spec).lower(lowering_platforms=("tpu",))
    )
    with pytest.raises(Exception) as e:
      lowered.compile()
    errors.append((type(e.value), str(e.value)))
  assert errors[0] == errors[1]
  assert "device_assignment" in errors[0][1]
