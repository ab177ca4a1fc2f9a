"""pmap's options in every form jax.pmap reads, deleted and donated inputs,
output shardings and unbound axis names: each against stock jax.pmap.

Options are given as numpy scalars, numpy arrays, bools, tuples of numpy
ints, lists, sets and generators; each call's outcome (result bits, dtype,
sharding, or exception class) is compared with stock's on a fresh function.
The hypothesis test (bounded, derandomized) draws several options at once.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import jaxworks_testing as jwt
import numpy as np
import pytest

from jaxworks.pmap_chunked import pmap

SETTINGS = settings(
  max_examples=jwt.examples(60),
  deadline=None,
  derandomize=True,
  database=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Every device present: 8 host devices on the CPU target, one TPU chip. Each
# case compares with stock jax.pmap there (an error of stock's class where
# stock raises, e.g. for 2 x 4 devices on one chip).
N = jax.device_count()
X = np.arange(2.0 * N, dtype=np.float32).reshape(N, 2)


def _outcome(f):
  try:
    return f(), None
  except Exception as err:  # compared by class by the callers
    return None, err


def _state(y):
  return (
    y.shape,
    y.dtype,
    y.weak_type,
    y.sharding,
    np.asarray(y).tobytes(),
  )


def _assert_same(mine, theirs, what):
  (out, err), (ref, ref_err) = mine, theirs
  if ref_err is not None:
    assert err is not None, f"{what}: stock raised {ref_err!r}, got {out}"
    assert isinstance(err, type(ref_err)), (what, err, ref_err)
    return
  assert err is None, f"{what}: raised {err!r} where stock returned"
  assert jax.tree.structure(out) == jax.tree.structure(ref), what
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    assert _state(a) == _state(b), what


def _both(call, what):
  """``call(p)`` with p = stock jax.pmap and this package's pmap."""
  theirs = _outcome(lambda: call(jax.pmap))
  mine = _outcome(lambda: call(pmap))
  _assert_same(mine, theirs, what)
  return mine


def _double(v):
  return v * 2


def _mul(a, b):
  return a * b


def _devs():
  return jax.devices()


# name -> call(p); each makes a fresh function (stock caches by function).
CASES = {
  "axis_size np.int64": lambda p: p(_double, axis_size=np.int64(N))(X),
  "axis_size np.int32": lambda p: p(_double, axis_size=np.int32(N))(X),
  "axis_size np.uint8": lambda p: p(_double, axis_size=np.uint8(N))(X),
  "axis_size True (size 1)": lambda p: p(_double, axis_size=True)(X[:1]),
  "axis_size True (size 8)": lambda p: p(_double, axis_size=True)(X),
  "axis_size np.bool_": lambda p: p(_double, axis_size=np.bool_(True))(X),
  "axis_size 0": lambda p: p(_double, axis_size=0)(X),
  "axis_size -1": lambda p: p(_double, axis_size=-1)(X),
  "axis_size 4": lambda p: p(_double, axis_size=4)(X),
  "axis_size '8'": lambda p: p(_double, axis_size="8")(X),
  "axis_size 8.5": lambda p: p(_double, axis_size=8.5)(X),
  "axis_size np.array(8)": lambda p: p(_double, axis_size=np.array(N))(X),
  "axis_size np.array([8])": lambda p: p(_double, axis_size=np.array([N]))(X),
  "devices generator": lambda p: p(_double, devices=(d for d in _devs()))(X),
  "devices iterator": lambda p: p(_double, devices=iter(_devs()))(X),
  "devices map": lambda p: p(_double, devices=map(lambda d: d, _devs()))(X),
  "devices list": lambda p: p(_double, devices=list(_devs()))(X),
  "devices tuple": lambda p: p(_double, devices=tuple(_devs()))(X),
  "devices reversed": lambda p: p(_double, devices=_devs()[::-1])(X),
  "devices dict": lambda p: p(_double, devices=dict.fromkeys(_devs()))(X),
  "devices np.array": lambda p: p(_double, devices=np.array(_devs()))(X),
  "devices np.array 2-D": lambda p: p(
    _double, devices=np.array(_devs()).reshape(2, 4)
  )(X),
  "devices np.array of one": lambda p: p(
    _double, devices=np.array(_devs()[:1])
  )(X[:1]),
  "devices []": lambda p: p(_double, devices=[])(X),
  "devices empty generator": lambda p: p(_double, devices=iter([]))(X),
  "devices a Device": lambda p: p(_double, devices=_devs()[0])(X[:1]),
  "devices ints": lambda p: p(_double, devices=list(range(N)))(X),
  "devices str": lambda p: p(_double, devices="cpu")(X),
  "devices repeated": lambda p: p(_double, devices=[_devs()[0]] * N)(X),
  "backend np.str_": lambda p: p(_double, backend=np.str_("cpu"))(X),
  "backend unknown": lambda p: p(_double, backend="no_such")(X),
  "backend int": lambda p: p(_double, backend=3)(X),
  "axis_name np.str_": lambda p: p(
    lambda v: jax.lax.psum(v, "i"), axis_name=np.str_("i")
  )(X),
  "axis_name list": lambda p: p(_double, axis_name=["i"])(X),
}
for _name, _form in {
  "np.int64": lambda: np.int64(1),
  "np.int8": lambda: np.int8(1),
  "np.array(1)": lambda: np.array(1),
  "np.array([1])": lambda: np.array([1]),
  "True": lambda: True,
  "(True,)": lambda: (True,),
  "(np.int64,)": lambda: (np.int64(1),),
  "nonzero": lambda: tuple(np.nonzero(np.array([False, True]))[0]),
  "[1]": lambda: [1],
  "{1}": lambda: {1},
  "generator": lambda: (i for i in [1]),
  "jnp int": lambda: jnp.int32(1),
  "1.0": lambda: 1.0,
  "'1'": lambda: "1",
  "None": lambda: None,
  "np.array([1.0])": lambda: np.array([1.0]),
  "5": lambda: 5,
  "-1": lambda: -1,
}.items():
  CASES[f"static {_name}"] = lambda p, f=_form: p(
    _mul, static_broadcasted_argnums=f()
  )(X, 3.0)
  CASES[f"donate {_name}"] = lambda p, f=_form: p(_mul, donate_argnums=f())(
    X, X
  )
  CASES[f"donate {_name} after a static"] = lambda p, f=_form: p(
    lambda s, a, b: a * b + s,
    static_broadcasted_argnums=np.int64(0),
    donate_argnums=f(),
  )(1.0, X, X)

# Deliberate differences (the README lists them), not compared here:
# "static -1" maps the scalar 3.0 (both raise ValueError classes, stock a
# sharding error from jit, this package AxisOutOfRangeError).


@pytest.mark.parametrize("name", sorted(CASES))
def test_option_forms_match_stock(name):
  # Against stock in a fresh process: stock's device cache compares
  # axis_size by ==, so an earlier case's axis_size=True would let
  # np.bool_(True) run (see the test below).
  jax.clear_caches()
  _both(CASES[name], name)


def test_axis_size_np_bool_is_a_type_error_as_stock_in_a_fresh_process():
  # A mapped size of 1, on any device count. numpy's bool has no __index__:
  # stock slices its device list with it (TypeError), until a call with
  # axis_size=True (or 1) leaves an entry in its device cache that
  # np.bool_(True) equals; this package raises TypeError on every call (the
  # README lists the difference).
  call = lambda p: p(_double, axis_size=np.bool_(True))(X[:1])
  jax.clear_caches()
  (_, err) = _both(call, "axis_size np.bool_, size 1")
  assert type(err) is TypeError
  assert "must be an integer" in str(err)
  out, err = _outcome(lambda: jax.pmap(_double, axis_size=True)(X[:1]))
  assert err is None and np.array_equal(out, X[:1] * 2)
  out, err = _outcome(lambda: call(jax.pmap))
  assert err is None and np.array_equal(out, X[:1] * 2)  # stock's cache
  with pytest.raises(TypeError, match="must be an integer"):
    call(pmap)
  jax.clear_caches()


def test_repro_axis_size_numpy_int_and_devices_generator_run():
  out, err = _both(lambda p: p(_double, axis_size=np.int64(N))(X), "axis_size")
  assert err is None and np.array_equal(out, X * 2)
  out, err = _both(
    lambda p: p(_double, devices=(d for d in _devs()))(X), "devices"
  )
  assert err is None and np.array_equal(out, X * 2)
  if N > 1:  # an array of one device is accepted (by stock too)
    with pytest.raises(ValueError):
      pmap(_double, devices=np.array(_devs()))(X)


def test_axis_size_equal_but_not_an_integer_is_a_type_error():
  # Stock slices its device list with it (TypeError) on a fresh cache; a
  # later call can hit an entry made for the int 8 and run.
  with pytest.raises(TypeError, match=f"axis_size={float(N)} must be an int"):
    pmap(_double, axis_size=float(N))(X)


@pytest.mark.parametrize(
  "call",
  [
    lambda p: p(_double, in_axes=None, axis_size=N)(X),
    lambda p: p(lambda: jnp.ones(3), axis_size=N)(),
    lambda p: p(lambda: jnp.ones(3), axis_size=N, in_axes=())(),
    lambda p: p(_double, static_broadcasted_argnums=0, axis_size=N)(3.0),
    lambda p: p(_double, in_axes=({"a": None},), axis_size=N)({"a": X}),
  ],
)
def test_axis_size_with_nothing_mapped_raises_value_error(call):
  (_, err) = _both(call, "nothing mapped")
  assert isinstance(err, ValueError)
  assert "at least one argument with a mapped axis" in str(err)


@pytest.mark.parametrize("axis_name", [None, "i"])
@pytest.mark.parametrize("out_axes", [0, 1, None])
def test_output_sharding_equals_stock(axis_name, out_axes):
  def f(v):
    if out_axes is None:
      return jnp.float32(1.0) + 0 * v.sum()
    return v * 2

  ref = jax.pmap(f, axis_name, out_axes=out_axes)(X)
  out = pmap(f, axis_name, out_axes=out_axes)(X)
  assert out.sharding == ref.sharding
  assert _state(out) == _state(ref)
  # Mixed in one jit, and each fed to the other pmap.
  both = jax.jit(lambda a, b: a + b)(out, ref)
  assert both.sharding == ref.sharding
  if out_axes == 0:
    again = pmap(f, axis_name)(ref)
    assert again.sharding == jax.pmap(f, axis_name)(out).sharding


def test_unbound_axis_name_runs_the_function_once_as_stock():
  calls = []

  def uses_j(v):
    calls.append(1)
    return jax.lax.psum(v, "j")

  for p in (jax.pmap, pmap):
    calls.clear()
    with pytest.raises(NameError):
      p(uses_j, "i")(X)
    assert len(calls) == 1, p
  calls.clear()
  with pytest.raises(NameError) as info:
    pmap(uses_j, "i")(X)
  err = info.value
  assert (err.primitive, err.axis_name, err.bound) == ("psum", "j", ("i",))
  line = uses_j.__code__.co_firstlineno + 2
  assert f"options_test.py:{line}" in str(err) and len(calls) == 1


def _input(kind):
  """A pmap input already on the pmap's devices: live, deleted, or donated
  (to jax.jit, to a pmap)."""
  y = jax.pmap(_double, "i")(X)
  if kind == "deleted":
    y.delete()
  elif kind == "donated_jit":
    jax.jit(lambda v: v + 1, donate_argnums=0)(y)
  elif kind == "donated_pmap":
    pmap(lambda v: v + 1, "i", donate_argnums=0)(y)
  return y


CALLS = {
  "positional": lambda p, y: p(_double, "i")(y),
  "keyword": lambda p, y: p(lambda v: v * 2, "i")(v=y),
  "in a tuple": lambda p, y: p(lambda t: t[0] * t[1], "i")((y, X)),
  "donated again": lambda p, y: p(_double, "i", donate_argnums=0)(y),
  "beside a static": lambda p, y: p(
    lambda a, s: a * s, "i", static_broadcasted_argnums=1
  )(y, 2.0),
}


@pytest.mark.parametrize("kind", ["deleted", "donated_jit", "donated_pmap"])
@pytest.mark.parametrize("how", sorted(CALLS))
def test_deleted_and_donated_inputs_raise_as_stock(kind, how):
  call = CALLS[how]
  # Stock's cached programs crash the process on a donated input (jaxlib
  # 0.10.2): stock gets a deleted one, which it rejects every time.
  theirs = _outcome(lambda: call(jax.pmap, _input("deleted")))
  assert isinstance(theirs[1], RuntimeError)
  f_calls = [call(pmap, _input("live")) for _ in range(2)]  # cached program
  assert all(not y.is_deleted() for y in f_calls)
  mine = _outcome(lambda: call(pmap, _input(kind)))
  _assert_same(mine, theirs, (kind, how))
  assert "deleted" in str(mine[1])


def test_donated_input_to_a_cached_program_raises_not_crashes():
  f = pmap(_double, "i")
  y = f(X)
  f(y)
  f(y)  # program cached
  pmap(lambda v: v + 1, "i", donate_argnums=0)(y)
  assert y.is_deleted()
  with pytest.raises(RuntimeError, match=r"argument args\[0\] .* deleted"):
    f(y)
  lowered = f.lower(y)  # only its shape is needed, as for jax.pmap
  assert lowered.out_info.shape == X.shape


# ---------------------------------------------------------------------------
# Differential: several options at once, each in a random form.


def _int_forms(k):
  """``k`` (an int) in the forms jax.pmap reads with operator.index."""
  return st.sampled_from(
    [k, np.int64(k), np.int32(k), np.array(k), jnp.int32(k)]
    + ([True] if k == 1 else [])
  )


@st.composite
def argnums(draw, allowed):
  """An argnums option naming some of ``allowed`` positions, in a random
  form: an int, a tuple or list of int forms, a numpy array, a generator."""
  chosen = draw(st.lists(st.sampled_from(allowed), unique=True, max_size=2))
  form = draw(
    st.sampled_from(["one", "tuple", "list", "array", "generator", "set"])
  )
  if form == "one" and len(chosen) == 1:
    v = draw(_int_forms(chosen[0]))
    return lambda: v
  forms = [draw(_int_forms(k)) for k in chosen]
  if form == "array":
    arr = np.array(chosen, dtype=np.int64)
    return lambda: arr
  if form == "generator":
    return lambda: (k for k in forms)
  if form == "list":
    return lambda: list(forms)
  if form == "set":
    return lambda: set(chosen)
  return lambda: tuple(forms)


@st.composite
def device_options(draw):
  n = draw(st.sampled_from([1, 2, 4, 8]))
  devices = draw(st.permutations(jax.devices()))[:n]
  form = draw(
    st.sampled_from(["none", "list", "tuple", "generator", "array", "dict"])
  )
  if form == "none":
    n = draw(st.sampled_from([1, 2, 4, 8]))
    return n, lambda: None
  if form == "array":
    arr = np.array(devices)
    return n, lambda: arr
  if form == "generator":
    return n, lambda: (d for d in devices)
  if form == "dict":
    return n, lambda: dict.fromkeys(devices)
  if form == "tuple":
    return n, lambda: tuple(devices)
  return n, lambda: list(devices)


@settings(SETTINGS)
@given(
  data=st.data(),
  device_option=device_options(),
  kinds=st.lists(
    st.sampled_from(["numpy", "live", "deleted", "donated"]),
    min_size=3,
    max_size=3,
  ),
)
def test_option_forms_and_inputs_match_stock(data, device_option, kinds):
  n, devices = device_option
  statics = data.draw(argnums([0, 1, 2, 3]))
  donate = data.draw(argnums([0, 1, 2, 3]))
  size_form = data.draw(st.sampled_from(["none", "int", "mismatch"]))
  axis_size = {
    "none": None,
    "int": data.draw(_int_forms(n)),
    "mismatch": data.draw(_int_forms(n + 1)),
  }[size_form]

  def fun(a, b, c, d):
    return a * 2 + b, c - d

  def make(kind, k, reference):
    x = np.arange(n * 2.0, dtype=np.float32).reshape(n, 2) + k
    if kind == "numpy":
      return x
    y = jax.device_put(x)
    if kind == "deleted" or (kind == "donated" and reference):
      y.delete()
    elif kind == "donated":
      jax.jit(lambda v: v + 1, donate_argnums=0)(y)
    return y

  def call(p, reference):
    args = [make(k, i, reference) for i, k in enumerate(kinds)]
    args.append(np.float32(0.5))  # argument 3: static or broadcast
    f = p(
      lambda *a: fun(*a),
      "i",
      in_axes=(0, 0, 0, None),
      static_broadcasted_argnums=statics(),
      donate_argnums=donate(),
      devices=devices(),
      axis_size=axis_size,
    )
    return f(*args)

  theirs = _outcome(lambda: call(jax.pmap, True))
  mine = _outcome(lambda: call(pmap, False))
  _assert_same(mine, theirs, (kinds, size_form))
