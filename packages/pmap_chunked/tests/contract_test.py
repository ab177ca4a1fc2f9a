"""What JAX-facing code sees of a pmap, against stock ``jax.pmap``.

argnums options in every form stock accepts (negative positions, bools,
numpy and JAX integers, lists, sets, ranges), the function's signature as
``inspect`` reports it (``chex.fake_pmap`` reads it), and
``jax.export.export`` of a pmap.
"""

import functools
import inspect
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from jaxworks.pmap_chunked import pmap

N = 8
pytestmark = pytest.mark.skipif(
  jax.device_count() < N, reason="needs 8 devices (XLA_FLAGS)"
)

ARGNUMS = [
  -1,
  -2,
  -3,
  0,
  1,
  2,
  3,
  True,
  False,
  (0, -1),
  [0, 1],
  (True,),
  np.int32(1),
  np.int64(-1),
  (),
  [],
  (0, 0),
  {0},
  frozenset({1}),
  range(2),
  {1: "a"},
  jnp.int32(1),
  np.array(1),
  np.array([0, 1]),
  1.0,
  "0",
  None,
  (1.0,),
  ("a",),
  object(),
]


def _three(a, b, c=1):
  return a


def _creation(make, **options):
  try:
    make(_three, **options)
    return None
  except Exception as e:  # compared with stock's below
    return type(e)


@pytest.mark.parametrize(
  "what", ["static_broadcasted_argnums", "donate_argnums"]
)
@pytest.mark.parametrize("value", ARGNUMS, ids=repr)
def test_argnums_accepted_or_refused_as_stock(what, value):
  stock = _creation(jax.pmap, **{what: value})
  assert _creation(pmap, **{what: value}) == stock
  if isinstance(value, (int, np.integer)) and value < 0:
    assert stock is None  # the repro: stock accepts -1 and True
  if value is True:
    assert stock is None


@pytest.mark.parametrize(
  "static, donate",
  [(0, 0), (-3, 0), (0, -3), (True, 1), (1, True), (-1, -1), (-1, 2), (2, 1)],
)
def test_static_and_donate_together_as_stock(static, donate):
  options = dict(static_broadcasted_argnums=static, donate_argnums=donate)
  assert _creation(pmap, **options) == _creation(jax.pmap, **options)


def _sharded():
  mesh = Mesh(np.array(jax.devices()[:N]), ("_internal_pmap_axis_name",))
  return jax.device_put(
    np.ones(N, np.float32), NamedSharding(mesh, P(mesh.axis_names[0]))
  )


def _call(make, static, donate):
  """Which arguments a call saw as Python values and which it donated."""
  seen = []

  def f(a, b):
    seen.append(type(b).__name__ == "int")
    return a * b

  x, y = _sharded(), _sharded()
  b = 3 if static in (1, True) else y
  in_axes = (0, None) if static in (1, True) else 0
  make(
    f, in_axes=in_axes, static_broadcasted_argnums=static, donate_argnums=donate
  )(x, b)
  return seen, x.is_deleted(), y.is_deleted()


@pytest.mark.parametrize(
  "static, donate",
  [
    (-1, ()),
    (-2, ()),
    (1, ()),
    (True, ()),
    ((), -1),
    ((), 0),
    ((), True),
    ((), (0, 1)),
    (True, 0),
    (1, -1),
    ((), np.int64(1)),
  ],
)
def test_argnums_mean_what_they_mean_for_stock(static, donate):
  """A negative position names no argument (jax.pmap counts none from the
  end); True is 1."""
  assert _call(pmap, static, donate) == _call(jax.pmap, static, donate)


def test_negative_static_position_does_not_shift_donation():
  """Stock shifts donate_argnums past a negative static position and donates
  argument 0 for donate_argnums=1 (a documented difference): pmap donates
  the argument named."""
  assert _call(jax.pmap, -1, 1)[1:] == (True, False)
  assert _call(pmap, -1, 1)[1:] == (False, True)


def test_bad_argnums_message_names_option_value_and_fix():
  with pytest.raises(
    TypeError,
    match=r"donate_argnums must be an int or a collection of ints, got 1\.5 "
    r".*donate_argnums=\(1,\)",
  ):
    pmap(_three, donate_argnums=1.5)


# --------------------------------------------------------------- signature


def _positional(x, y):
  return x


def _keyword_only(x, *, scale=2.0):
  return x


def _varargs(x, *rest, **options):
  return x


def _annotated(x: jax.Array, /, y: "float" = 1.0) -> jax.Array:
  return x


class _Callable:
  def __call__(self, x, y=1):
    return x


class _Model:
  def __init__(self, pm):
    self.step = pm(self._step)

  def _step(self, x, k=1):
    return x


FUNCTIONS = [
  lambda x: x,
  _positional,
  _keyword_only,
  _varargs,
  _annotated,
  functools.partial(_positional, 1),
  _Callable(),
]


def _signatures(p):
  return (
    inspect.signature(p, follow_wrapped=False),
    inspect.signature(p),
    p.__name__,
  )


@pytest.mark.parametrize("fun", FUNCTIONS, ids=lambda f: repr(f)[:30])
def test_signature_as_stock(fun):
  ours = _signatures(pmap(fun))
  assert ours == _signatures(jax.pmap(fun))
  assert str(ours[0]).startswith("(*args, **kwargs)")


def test_signature_of_methods_as_stock():
  def make(pm):
    class C:
      @pm
      def method(self, x, y=2):
        return x

    return C

  ours, stock = make(pmap), make(jax.pmap)
  for follow in (False, True):
    assert inspect.signature(ours.method, follow_wrapped=follow) == (
      inspect.signature(stock.method, follow_wrapped=follow)
    )
    assert inspect.signature(ours().method, follow_wrapped=follow) == (
      inspect.signature(stock().method, follow_wrapped=follow)
    )
  assert _signatures(_Model(pmap).step) == _signatures(_Model(jax.pmap).step)


def test_signature_does_not_change_what_a_call_does():
  p = pmap(_keyword_only)
  assert not inspect.isgeneratorfunction(p)
  assert not inspect.iscoroutinefunction(p)
  np.testing.assert_array_equal(p(jnp.ones(N)), np.ones(N))


# ------------------------------------------------------------------ export


@pytest.mark.parametrize("pm", [jax.pmap, pmap], ids=["stock", "jaxworks"])
def test_jax_export_of_a_pmap_raises_value_error_as_stock(pm):
  spec = jax.ShapeDtypeStruct((N, 3), jnp.float32)
  with pytest.raises(ValueError, match="must be the result of `jit`"):
    jax.export.export(pm(lambda x: x * 2))(spec)


def test_trace_still_lowers_for_users():
  spec = jax.ShapeDtypeStruct((N, 3), jnp.float32)
  traced = pmap(lambda x: x * 2).trace(spec)
  lowered = traced.lower()
  assert "stablehlo" in lowered.as_text()
  assert traced.lower(lowering_platforms=("cpu",)).platforms == ("cpu",)
