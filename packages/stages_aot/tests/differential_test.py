"""Differential test: random small programs through every stage, against stock JAX.

Each generated program (elementwise ops, reductions, captured constants, dtypes
incl. bfloat16, shapes incl. 0-d and empty) goes trace -> lower -> export ->
serialize -> deserialize -> call (and jax.grad through the serialized VJP), and
is compared, bit for bit, with stock ``jax.jit`` and with stock ``jax.export``'s
own round trip. The same blob with one byte flipped (four times) must then be
refused by ``deserialize`` or still run (and, if it is still the same program,
give the same bits).
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np

from jaxworks import stages_aot as sa

DTYPES = ["float32", "bfloat16", "float16", "int32", "uint8"]
SHAPES = [(), (0,), (3,), (2, 3), (2, 0), (1, 4, 2)]

FLOAT_UNARY = {
  "sin": jnp.sin,
  "exp": lambda x: jnp.exp(x / 4),
  "tanh": jnp.tanh,
  "sqrt_abs": lambda x: jnp.sqrt(jnp.abs(x)),
}
ANY_UNARY = {
  "neg": jnp.negative,
  "abs": jnp.abs,
  "square": jnp.square,
  "sign": jnp.sign,
}
BINARY = {
  "add": jnp.add,
  "mul": jnp.multiply,
  "sub": jnp.subtract,
  "max": jnp.maximum,
  "min": jnp.minimum,
}
REDUCTIONS = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}


def is_float(dtype):
  return jnp.issubdtype(jnp.dtype(dtype), jnp.floating)


@st.composite
def programs(draw):
  dtype = draw(st.sampled_from(DTYPES))
  shape = draw(st.sampled_from(SHAPES))
  n_inputs = draw(st.integers(1, 2))
  unary = dict(ANY_UNARY, **(FLOAT_UNARY if is_float(dtype) else {}))
  steps = []
  n_values = n_inputs
  for _ in range(draw(st.integers(1, 5))):
    kind = draw(st.sampled_from(["unary", "binary", "constant"]))
    if kind == "unary":
      steps.append(
        (
          "unary",
          draw(st.sampled_from(sorted(unary))),
          draw(st.integers(0, n_values - 1)),
        )
      )
    elif kind == "binary":
      a, b = (
        draw(st.integers(0, n_values - 1)),
        draw(st.integers(0, n_values - 1)),
      )
      steps.append(("binary", draw(st.sampled_from(sorted(BINARY))), a, b))
    else:
      steps.append(
        (
          "constant",
          draw(st.integers(0, 2**31 - 1)),
          draw(st.integers(0, n_values - 1)),
        )
      )
    n_values += 1
  # Reductions over an axis (or all), then the outputs: the last value and the reduction.
  empty = 0 in shape
  red = draw(st.sampled_from(["sum"] if empty else sorted(REDUCTIONS)))
  axis = draw(st.sampled_from([None] + list(range(len(shape)))))
  platforms = draw(st.sampled_from([None, ("cpu", "tpu")]))
  seed = draw(st.integers(0, 2**31 - 1))
  flips = draw(
    st.lists(
      st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)),
      min_size=4,
      max_size=4,
    )
  )
  vjp_order = (
    draw(st.sampled_from([0, 1])) if dtype in ("float32", "bfloat16") else 0
  )
  return dict(
    dtype=dtype,
    shape=shape,
    n_inputs=n_inputs,
    steps=steps,
    reduction=(red, axis),
    platforms=platforms,
    seed=seed,
    flips=flips,
    vjp_order=vjp_order,
  )


def random_array(rng, shape, dtype):
  if is_float(dtype):
    return np.asarray(rng.standard_normal(shape) * 2, dtype=jnp.dtype(dtype))
  if jnp.dtype(dtype) == np.uint8:
    return rng.integers(0, 8, size=shape).astype(np.uint8)
  return rng.integers(-5, 6, size=shape).astype(jnp.dtype(dtype))


def build(spec):
  rng = np.random.default_rng(spec["seed"])
  dtype, shape = jnp.dtype(spec["dtype"]), spec["shape"]
  unary = dict(ANY_UNARY, **FLOAT_UNARY)
  constants = {}
  for i, step in enumerate(spec["steps"]):
    if step[0] == "constant":
      constants[i] = random_array(np.random.default_rng(step[1]), shape, dtype)

  def fun(*xs):
    values = list(xs)
    for i, step in enumerate(spec["steps"]):
      if step[0] == "unary":
        values.append(unary[step[1]](values[step[2]]))
      elif step[0] == "binary":
        values.append(BINARY[step[1]](values[step[2]], values[step[3]]))
      else:
        values.append(values[step[2]] + constants[i])
    red, axis = spec["reduction"]
    return values[-1], REDUCTIONS[red](values[-1], axis=axis)

  fun.__name__ = "generated"
  args = [random_array(rng, shape, dtype) for _ in range(spec["n_inputs"])]
  return fun, args


def same_bits(got, want):
  got, want = np.asarray(got), np.asarray(want)
  assert got.dtype == want.dtype and got.shape == want.shape, (
    got.dtype,
    got.shape,
    want.dtype,
    want.shape,
  )
  assert got.tobytes() == want.tobytes(), (got, want)


@settings(
  max_examples=25,
  deadline=None,
  derandomize=True,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(programs())
def test_random_programs_round_trip_like_stock(spec):
  fun, args = build(spec)
  platforms = spec["platforms"]
  stock_out = jax.jit(fun)(*args)
  stock_exp = jax.export.export(jax.jit(fun), platforms=platforms or ("cpu",))(
    *args
  )
  vjp_order = spec["vjp_order"]
  stock_loaded = jax.export.deserialize(
    stock_exp.serialize(vjp_order=vjp_order)
  )
  stock_round_trip = stock_loaded.call(*args)

  traced = sa.trace(fun, *args)
  lowered = traced.lower(lowering_platforms=platforms)
  exported = lowered.export(vjp_order=vjp_order)
  blob = exported.serialize()
  loaded = sa.deserialize(blob)
  ours = loaded(*args)
  assert (
    loaded.platforms == tuple(platforms or ("cpu",))
    and loaded.vjp_order == vjp_order
  )
  assert [sa.format_aval(a) for a in loaded.out_avals] == [
    sa.format_aval(a) for a in stock_exp.out_avals
  ]
  for got, want, also in zip(ours, stock_out, stock_round_trip):
    same_bits(got, want)
    same_bits(got, also)
  # Under jit too (the exported program inlined into another one).
  for got, want in zip(jax.jit(loaded)(*args), stock_out):
    same_bits(got, want)
  # The compiled stage of the same lowering.
  if platforms is None:
    for got, want in zip(lowered.compile()(*args), stock_out):
      same_bits(got, want)

  if (
    vjp_order
  ):  # reverse mode through the serialized VJP, as stock's round trip

    def loss(call):
      return lambda x: sum(
        jnp.sum(o.astype(jnp.float32)) for o in call(x, *args[1:])
      )

    same_bits(
      jax.grad(loss(loaded))(args[0]),
      jax.grad(loss(stock_loaded.call))(args[0]),
    )

  # Flipped bytes: refused, or a program that runs (the same bits when it
  # is still the same program).
  for where, xor in spec["flips"]:
    check_flipped(blob, int(where * len(blob)), xor, loaded, args, stock_out)


def check_flipped(blob, position, xor, loaded, args, stock_out):
  damaged = bytearray(blob)
  damaged[position] ^= xor
  try:
    again = sa.deserialize(bytes(damaged))
  except ValueError as e:
    assert "not a valid serialized exported program" in str(e)
    return
  same_interface = (
    str(again.in_tree),
    [sa.format_aval(a) for a in again.in_avals],
  ) == (str(loaded.in_tree), [sa.format_aval(a) for a in loaded.in_avals])
  if same_interface:
    outs = again(*args)
    if again.mlir_text() == loaded.mlir_text() and str(again.out_tree) == str(
      loaded.out_tree
    ):
      for got, want in zip(outs, stock_out):
        same_bits(got, want)
  else:
    zeros = [np.zeros(a.shape, a.dtype) for a in again.in_avals]
    a, k = again.in_tree.unflatten(zeros)
    again(*a, **k)
