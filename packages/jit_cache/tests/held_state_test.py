"""What an executable holds on to: host callbacks' state, deleted constants.

A re-created closure may reuse an executable compiled for an earlier one only
when the executable would do exactly what compiling anew would. A host
callback is called back by the executable itself, so everything it carries
(a ``functools.partial``'s arguments and keywords, a bound method's
``__self__``, a callable object, closure cells) must be the very objects of
the closure being called, never objects of an earlier closure that merely
compare equal. A constant jax Array kept by identity may have been deleted
(donated) since: compiling anew raises, so reuse must too. Every case runs
with ``jax.jit`` and with ``jaxworks.jit_cache.jit`` and compares.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import functools

import jax
from jax.experimental import io_callback
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks import jit_cache
from jaxworks.jit_cache import jit as our_jit


def _scale(state, v):
  return (np.asarray(v) * np.float32(state[0])).astype(np.float32)


def _scale_kw(v, *, state):
  return _scale(state, v)


def _scale_dict(box, v):
  return _scale(box["s"], v)


def _scale_first(boxed, v):
  return _scale(boxed[0], v)


def _append(sink, v):
  sink.append(int(v))


class Holder:
  """Carries the state as an attribute; equal to every other Holder."""

  def __init__(self, state):
    self.state = state

  def scale(self, v):
    return _scale(self.state, v)

  def __call__(self, v):
    return _scale(self.state, v)

  def __eq__(self, other):
    return isinstance(other, Holder)

  def __hash__(self):
    return 0


#: Each way a callback can carry per-closure state (a one-element list or
#: numpy array whose content is equal across closures at compile time).
CARRIERS = {
  "partial-list": lambda s: functools.partial(_scale, s),
  "partial-keyword": lambda s: functools.partial(_scale_kw, state=s),
  "partial-dict": lambda s: functools.partial(_scale_dict, {"s": s}),
  "partial-tuple-of-list": lambda s: functools.partial(_scale_first, (s,)),
  "nested-partial": lambda s: functools.partial(functools.partial(_scale, s)),
  "bound-method": lambda s: Holder(s).scale,
  "callable-object": Holder,
  "closure-cell": lambda s: lambda v: _scale(s, v),
}
STATES = {"list": lambda: [2.0], "ndarray": lambda: np.array([2.0])}


def _pure_callback_outputs(jit, carrier, state_kind):
  """Two closures over equal state; the second's state changes after both
  compiled; each closure must see its own state."""
  fs, states = [], []
  x = jnp.ones((4,), jnp.float32)
  for _ in range(2):
    state = STATES[state_kind]()
    cb = CARRIERS[carrier](state)

    def f(v, cb=cb):
      return jax.pure_callback(cb, jax.ShapeDtypeStruct(v.shape, v.dtype), v)

    g = jit(f)
    np.testing.assert_array_equal(np.asarray(g(x)), np.full(4, 2.0))
    fs.append(g)
    states.append(state)
  states[1][0] = 14.0
  return [np.asarray(g(x)).tolist() for g in fs]


@pytest.mark.parametrize("state_kind", sorted(STATES))
@pytest.mark.parametrize("carrier", sorted(CARRIERS))
def test_pure_callback_sees_its_own_closures_state(carrier, state_kind):
  want = _pure_callback_outputs(jax.jit, carrier, state_kind)
  jit_cache.clear_caches()
  got = _pure_callback_outputs(our_jit, carrier, state_kind)
  assert want == [[2.0] * 4, [14.0] * 4]
  assert got == want


def _io_callback_logs(jit):
  logs = [[], []]
  fs = []
  for log in logs:
    record = functools.partial(_append, log)

    def f(v, record=record):
      io_callback(record, None, v, ordered=True)
      return v + 1

    fs.append(jit(f))
  fs[0](jnp.int32(1))
  jax.effects_barrier()  # the callback has run (an accelerator runs it later)
  logs[0].clear()  # equal to the second closure's log when that compiles
  fs[1](jnp.int32(2))
  fs[0](jnp.int32(1))
  jax.effects_barrier()
  return logs


def test_io_callback_logs_into_its_own_closures_list():
  want = _io_callback_logs(jax.jit)
  jit_cache.clear_caches()
  got = _io_callback_logs(our_jit)
  assert want == [[1], [2]]
  assert got == want


def test_executable_reuse_still_holds_for_immutable_partial_state():
  """A partial over immutable values (a tuple of floats, a string) carries
  nothing that could differ: the second closure reuses the executable."""
  jit_cache.clear_caches()
  fs = []
  for _ in range(2):
    cb = functools.partial(_scale, (3.0,))

    def f(v, cb=cb):
      return jax.pure_callback(cb, jax.ShapeDtypeStruct(v.shape, v.dtype), v)

    g = our_jit(f)
    np.testing.assert_array_equal(np.asarray(g(jnp.ones(2))), [3.0, 3.0])
    fs.append(g)
  assert fs[0].cache_info().compiles == 1
  assert fs[1].cache_info().compiles == 0
  assert fs[1].cache_info().executable_reuses == 1


def _outcome(fn):
  try:
    return ("ok", np.asarray(fn()).tolist()[:3])
  except Exception as e:  # pylint: disable=broad-except
    return ("raised", type(e))


def _donated_constant(jit, path):
  """A closure over a 128 KiB jax Array compiles; the array is donated; then
  ``path`` uses a new closure over it (or the old one)."""
  big = jnp.arange(1 << 15, dtype=jnp.float32)
  inner = jit(lambda x, c: x + c)

  def make():
    return jit(lambda x: x + big)

  first = make()
  assert _outcome(lambda: first(1.0)) == ("ok", [1.0, 2.0, 3.0])
  if path == "deleted":
    big.delete()
  else:
    jit(lambda a: a * 2, donate_argnums=0)(big)
  assert big.is_deleted()
  return {
    "new-closure": _outcome(lambda: make()(1.0)),
    "new-closure-under-jit": _outcome(lambda: jax.jit(make())(1.0)),
    "same-function": _outcome(lambda: first(1.0)),
    "inner-jit": _outcome(lambda: jit(lambda x: inner(x, big))(1.0)),
  }


@pytest.mark.parametrize("path", ["donated", "deleted"])
def test_deleted_or_donated_constant_raises_as_stock(path):
  want = _donated_constant(jax.jit, path)
  jit_cache.clear_caches()
  got = _donated_constant(our_jit, path)
  assert want["new-closure"] == ("raised", RuntimeError)
  assert got == want
