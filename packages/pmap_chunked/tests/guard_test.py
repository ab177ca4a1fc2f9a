"""Ambient state (transfer guards, debug_nans, default device, meshes, x64,
axis environment): pmap reads it as jax.pmap does.

Differential against stock ``jax.pmap``: every guard level, set through each
of JAX's guard entry points (thread-local context managers and the global
option), times every kind of input a call may have to move. Raise/no-raise,
the exception class and, for the logging levels, which transfers are logged
(C++ warnings on file descriptor 2, captured with ``capfd``) must be stock's.
"""

import contextlib
import math
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import jaxworks_testing as jwt
import numpy as np
import pytest

# Private imports below: pmap makes its transfers through this binding; counting
# them means patching it.
from jaxworks.pmap_chunked import pmap
import jaxworks.pmap_chunked._src.deps as deps

# Every device present: 8 host devices on the CPU target, one TPU chip.
N = jax.device_count()


def sharded():
  return NamedSharding(Mesh(np.array(jax.devices()), ("i",)), P("i"))


LEVELS = ["allow", "log", "disallow", "log_explicit", "disallow_explicit"]


@contextlib.contextmanager
def _global_guard(level):
  old = jax.config.jax_transfer_guard
  jax.config.update("jax_transfer_guard", level)
  try:
    yield
  finally:
    jax.config.update("jax_transfer_guard", old)
    for name in ("host_to_device", "device_to_device", "device_to_host"):
      jax.config.update(f"jax_transfer_guard_{name}", old)


SETTERS = {
  "transfer_guard": jax.transfer_guard,
  "host_to_device": jax.transfer_guard_host_to_device,
  "device_to_device": jax.transfer_guard_device_to_device,
  "global": _global_guard,
}


def _placed():
  return jax.device_put(np.arange(N, dtype=np.float32), sharded())


# name -> (function, in_axes, arguments). Each moves one kind of input.
KINDS = {
  "numpy": (lambda x: x * 2, 0, lambda: (np.arange(N, dtype=np.float32),)),
  "python_scalar": (
    lambda x, s: x * s,
    (0, None),
    lambda: (_placed(), 3.0),
  ),
  "numpy_int64": (lambda x: x + 1, 0, lambda: (np.arange(N),)),
  "numpy_broadcast": (
    lambda x, w: x * w,
    (0, None),
    lambda: (_placed(), np.arange(3, dtype=np.float32)[:, None]),
  ),
  "pytree_mixed": (
    lambda t: t["a"] + t["b"],
    0,
    lambda: ({"a": _placed(), "b": np.ones(N, np.float32)},),
  ),
  "prng_keys": (
    lambda k: jax.random.uniform(k),
    0,
    lambda: (jax.random.split(jax.random.key(0), N),),
  ),
  "on_right_devices": (lambda x: x * 2, 0, lambda: (_placed(),)),
  "uncommitted_on_device_0": (
    lambda x: x * 2,
    0,
    lambda: (jnp.arange(N, dtype=jnp.float32),),
  ),
}

_STOCK = {k: jax.pmap(f, in_axes=ax) for k, (f, ax, _) in KINDS.items()}
_OURS = {k: pmap(f, in_axes=ax) for k, (f, ax, _) in KINDS.items()}


def _outcome(p, args, setter, level, capfd):
  capfd.readouterr()
  try:
    with SETTERS[setter](level):
      out = p(*args)
    out.block_until_ready()
    result = ("ok", np.asarray(out).tolist())
  except Exception as e:  # compared with stock's below
    result = (type(e), None)
  err = capfd.readouterr().err
  logged = {
    kind
    for kind in ("host-to-device", "device-to-device")
    if f"{kind} transfer" in err
  }
  return result, logged


@pytest.mark.parametrize("setter", list(SETTERS))
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind", list(KINDS))
def test_guard_as_stock(kind, level, setter, capfd):
  make = KINDS[kind][2]
  stock = _outcome(_STOCK[kind], make(), setter, level, capfd)
  ours = _outcome(_OURS[kind], make(), setter, level, capfd)
  assert ours == stock, (kind, level, setter)


def test_guard_cases_reach_every_outcome(capfd):
  """The differential above is not vacuous: stock raises, logs and allows."""
  raised = _outcome(
    _STOCK["numpy"], KINDS["numpy"][2](), "transfer_guard", "disallow", capfd
  )
  assert raised[0][0] is jax.errors.JaxRuntimeError
  jwt.require_devices(2)  # from device 0 to the others
  logged = _outcome(
    _STOCK["uncommitted_on_device_0"],
    KINDS["uncommitted_on_device_0"][2](),
    "device_to_device",
    "log",
    capfd,
  )
  assert logged == (("ok", [2.0 * i for i in range(N)]), {"device-to-device"})


def test_disallow_stops_the_implicit_transfer_with_stocks_message():
  f = pmap(lambda x: x * 2)
  with jax.transfer_guard("disallow"):
    with pytest.raises(
      jax.errors.JaxRuntimeError, match="Disallowed host-to-device transfer"
    ):
      f(np.ones(N, np.float32))
    # An explicit device_put is allowed by "disallow", as in stock JAX.
    out = f(jax.device_put(np.ones(N, np.float32), sharded()))
  # (Read back outside the guard: on an accelerator that is a transfer too.)
  np.testing.assert_array_equal(out, np.full(N, 2.0))


def test_guard_read_per_call_not_cached():
  f = pmap(lambda x: x + 1)
  outcomes = []
  for level in ["allow", "disallow", "allow", "disallow"]:
    try:
      with jax.transfer_guard(level):
        f(np.ones(N, np.float32))
      outcomes.append("ok")
    except jax.errors.JaxRuntimeError:
      outcomes.append("raised")
  assert outcomes == ["ok", "raised", "ok", "raised"]


def test_committed_array_elsewhere_moves_as_an_implicit_transfer(capfd):
  """Stock raises ValueError for a committed array on other devices; pmap
  moves it (a documented difference), and a guard treats that move as the
  implicit device-to-device transfer it is."""
  jwt.require_devices(2)  # an array on one device of several
  x = jax.device_put(np.arange(N, dtype=np.float32), jwt.device(3))
  with pytest.raises(ValueError):
    jax.pmap(lambda v: v * 2)(x)
  f = pmap(lambda v: v * 2)
  with jax.transfer_guard("disallow"):
    with pytest.raises(
      jax.errors.JaxRuntimeError, match="Disallowed device-to-device"
    ):
      f(x)
  with jax.transfer_guard_host_to_device("disallow"):
    np.testing.assert_array_equal(f(x), 2 * np.arange(N))
  capfd.readouterr()
  with jax.transfer_guard("log"):
    np.testing.assert_array_equal(f(x), 2 * np.arange(N))
  assert "device-to-device transfer" in capfd.readouterr().err
  assert not x.is_deleted()
  # A donated one: the moved copy is donated, the caller's array stays.
  g = pmap(lambda v: v + 1, donate_argnums=0)
  with jax.transfer_guard("log"):
    np.testing.assert_array_equal(g(x), 1 + np.arange(N))
  assert not x.is_deleted()


def test_without_guard_inputs_still_move_in_one_batched_transfer(monkeypatch):
  moved = []
  real = deps.device_put

  def counting(tree, target):
    moved.append(len(jax.tree.leaves(tree)))
    return real(tree, target)

  monkeypatch.setattr(deps, "device_put", counting)
  f = pmap(lambda a, b: a + b)
  f(np.ones(N, np.float32), np.ones(N, np.float32))
  assert moved == [2]
  with jax.transfer_guard("log_explicit"):
    f(np.ones(N, np.float32), np.ones(N, np.float32))
  assert moved == [2]  # under a guard jit moves them, as for jax.pmap


def test_nested_pmap_under_guard():
  jwt.require_devices(8)  # a 2 x 4 mesh
  inner = pmap(lambda v: jax.lax.psum(v, "j"), "j")
  outer = pmap(inner, "i")
  with jax.transfer_guard("log"):
    np.testing.assert_array_equal(
      outer(np.ones((2, 4), np.float32)), np.full((2, 4), 4.0)
    )
  with jax.transfer_guard("disallow"):
    with pytest.raises(jax.errors.JaxRuntimeError, match="Disallowed"):
      outer(np.ones((2, 4), np.float32))


def _placed_arg():
  return jax.device_put(
    np.ones(N, np.float32),
    NamedSharding(Mesh(np.array(jax.devices()), ("p",)), P("p")),
  )


@pytest.mark.parametrize("pm", [jax.pmap, pmap], ids=["stock", "jaxworks"])
def test_no_donation_while_debug_nans(pm):
  """jax.pmap reads debug_nans per call and donates nothing while it is on;
  a program built for an earlier call with donation is not reused."""
  f = pm(lambda v: v + 1, "p", donate_argnums=0)
  deleted = []
  for on in [False, True, False, True]:
    x = _placed_arg()
    with jax.debug_nans(on):
      np.testing.assert_array_equal(f(x), np.full(N, 2.0))
    deleted.append(x.is_deleted())
  assert deleted == [True, False, True, False]


def _describe(out):
  if isinstance(out, Exception):
    return type(out)
  return [
    (
      np.asarray(o).tobytes(),
      str(o.dtype),
      o.weak_type,
      o.shape,
      sorted(d.id for d in o.sharding.device_set),
      o.committed,
    )
    for o in jax.tree.leaves(out)
  ]


_SHAPE_2D = jwt.fit((2, 4))  # (1, 1) on one chip


def _mesh_2d():
  devices = jax.devices()[::-1][: math.prod(_SHAPE_2D)]
  return Mesh(
    np.array(devices).reshape(_SHAPE_2D),
    ("a", "b"),
    axis_types=(jax.sharding.AxisType.Explicit,) * 2,
  )


def _mesh_auto():
  devices = np.array(jax.devices()[N // 2 :])
  return Mesh(devices, ("a",), axis_types=(jax.sharding.AxisType.Auto,))


CONTEXTS = {
  "none": contextlib.nullcontext,
  "default_device": lambda: jax.default_device(jwt.device(3)),
  "set_mesh": lambda: jax.set_mesh(_mesh_2d()),
  "with_mesh": _mesh_auto,
  "x64": lambda: jax.enable_x64(True),
  "debug_infs": lambda: jax.debug_infs(True),
}
PROGRAMS = {
  "scale": (
    lambda x, s: x * s,
    dict(in_axes=(0, None)),
    (np.arange(float(N)), 2),
  ),
  "psum": (
    lambda x: jax.lax.psum(x, "i"),
    dict(axis_name="i"),
    (np.arange(N, dtype=np.float32),),
  ),
  "reciprocal": (lambda x: 1 / x, {}, (np.arange(N, dtype=np.float32),)),
  "int": (lambda x: x + 1, {}, (np.arange(N),)),
  "unmapped_out": (
    lambda x: (x * 3, 1.5),
    dict(out_axes=(0, None)),
    (np.arange(N, dtype=np.float32),),
  ),
}


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_ambient_state_in_both_orders_as_stock(program):
  """One function per implementation, called under each context and again
  in reverse order: every call gives stock's values, dtypes, weak types,
  devices and committedness, or stock's exception class."""
  fun, options, args = PROGRAMS[program]
  stock, ours = jax.pmap(fun, **options), pmap(fun, **options)
  order = list(CONTEXTS) + list(CONTEXTS)[::-1]
  for name in order:
    if name == "x64" and not jwt.has_x64():
      continue  # a TPU has no float64
    results = []
    for p in (stock, ours):
      try:
        with CONTEXTS[name]():
          results.append(_describe(p(*args)))
      except Exception as e:  # compared below
        results.append(_describe(e))
    assert results[1] == results[0], (program, name)


def test_axis_probe_under_vmap_as_stock():
  def probe(x):
    try:
      return x * jax.lax.axis_size("j")
    except NameError:
      return x * 0

  for p in (jax.pmap(probe), pmap(probe)):
    np.testing.assert_array_equal(p(jnp.ones(N)), np.zeros(N))
    np.testing.assert_array_equal(
      jax.vmap(p, axis_name="j")(jnp.ones((3, N))), np.full((3, N), 3.0)
    )
    np.testing.assert_array_equal(p(jnp.ones(N)), np.zeros(N))


def test_debug_infs_switched_on_later_raises_floating_point_error():
  for p in (jax.pmap(lambda x: 1 / x), pmap(lambda x: 1 / x)):
    p(np.arange(N, dtype=np.float32))
    with jax.debug_infs(True):
      with pytest.raises(Exception) as info:
        p(np.arange(N, dtype=np.float32))
    assert isinstance(info.value, FloatingPointError), type(info.value)
