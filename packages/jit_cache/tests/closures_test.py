"""explain_miss for re-created functions (the sweep): what differs from the
nearest earlier function of the same code, in the user's terms."""

import collections

import jax.numpy as jnp
import numpy as np

from jaxworks import jit_cache


def make_step(lr, momentum=0.9):
  def step(w, g):
    return w - lr * g * momentum

  return jit_cache.jit(step)


def test_sweep_names_the_closed_over_constant():
  w = jnp.ones(3)
  make_step(0.1)(w, w)  # compiled; the function dies right away
  text = make_step(0.01).explain_miss(w, w)
  assert text.startswith("step: miss: nothing is cached for this step yet")
  assert (
    "closed-over constant `lr` (cell 0): 0.1 -> 0.01; pass it as an "
    "argument to reuse the compiled step"
  ) in text.splitlines()[1]
  assert len(text.splitlines()) == 2  # only what differs


def test_equal_closure_predicts_nothing_and_reuses():
  w = jnp.arange(3.0)
  make_step(0.25)(w, w)
  again = make_step(0.25)
  text = again.explain_miss(w, w)
  assert "closed over equal values as far as explain_miss can see" in text
  assert "decided after tracing" in text
  assert "is reused if" not in text  # never a prediction it has not checked
  again(w, w)
  assert again.cache_info().executable_reuses == 1
  assert again.cache_info().compiles == 0


def adam(lr):
  """An optimizer as optax builds one: its rate in a closure of a function
  held by a named tuple."""

  def init(p):
    return jnp.zeros_like(p)

  def update(g, state):
    return -lr * g, state

  return collections.namedtuple("GradientTransformation", "init update")(
    init, update
  )


def make_optimizer_step(opt):
  def step(w, g):
    u, _ = opt.update(g, None)
    return w + u

  return jit_cache.jit(step)


def test_a_value_nested_in_closures_is_named_at_its_path():
  w = jnp.ones(3)
  first = make_optimizer_step(adam(1e-3))
  first(w, w)
  second = make_optimizer_step(adam(0.5))
  text = second.explain_miss(w, w)
  assert (
    "closed-over constant `opt` (cell 0).update -> closure `lr`: 0.001 -> 0.5"
  ) in text
  assert "equal values" not in text
  second(w, w)
  assert second.cache_info().compiles == 1  # as the explanation said


def test_new_function_with_differently_typed_arguments_names_them():
  w = jnp.ones(3)
  first = make_optimizer_step(adam(1e-3))
  first(w, w)
  again = make_optimizer_step(adam(1e-3))
  wi = jnp.ones(3, jnp.int32)
  text = again.explain_miss(wi, w)
  assert "its arguments differ: w: dtype float32 -> int32" in text
  assert "decided after tracing" in text


class Slotted:
  """No __dict__: explain_miss cannot look inside."""

  __slots__ = ("scale",)

  def __init__(self, scale):
    self.scale = scale


def test_what_it_cannot_see_into_is_said_plainly():
  def make(obj):
    return jit_cache.jit(lambda x: x * obj.scale)

  x = jnp.ones(2)
  kept = make(Slotted(1.0))
  kept(x)
  other = make(Slotted(2.0))
  text = other.explain_miss(x)
  assert "explain_miss cannot see into: closed-over constant `obj`" in text
  other(x)
  assert other.cache_info().compiles == 1


def test_defaults_and_arrays():
  w = jnp.ones(2)

  def make(scale, table):
    def f(x, k=2):
      return x * scale + table[:2] * k

    return jit_cache.jit(f)

  small = np.arange(4.0, dtype=np.float32)
  make(1.5, small)(w)
  text = make(1.5, small + 1).explain_miss(w)
  assert (
    "closed-over constant `table` (cell 1): float32[4] [0.0, 1.0, 2.0, " in text
  )
  assert "-> float32[4] [1.0, 2.0, 3.0, 4.0]" in text

  def make_k(k):
    def g(x, n=k):
      return x * n

    return jit_cache.jit(g)

  make_k(3)(w)
  assert "default of `n`: 3 -> 4" in make_k(4).explain_miss(w)


def test_first_function_of_its_code():
  def fresh(v):
    return v - 1

  f = jit_cache.jit(fresh)
  assert f.explain_miss(jnp.ones(2)) == (
    "fresh: miss: nothing is cached for fresh yet"
  )


def test_logs_each_miss_once_and_only_when_jax_explains(caplog, capsys):
  import jax  # pylint: disable=g-import-not-at-top

  w = jnp.ones(5)
  caplog.set_level("DEBUG")
  make_step(0.5)(w, w)
  make_step(0.5)(w, w)
  assert not [r for r in caplog.records if "TRACING CACHE" in r.getMessage()]
  assert "CACHE" not in capsys.readouterr().out
  jax.config.update("jax_explain_cache_misses", True)
  try:
    make_step(0.75)(w, w)
    make_step(0.75)(w, w)
  finally:
    jax.config.update("jax_explain_cache_misses", False)
  misses = [r for r in caplog.records if "TRACING CACHE MISS" in r.getMessage()]
  # One record per miss: JAX's own WARNING (code counting JAX's records sees
  # as many as under jax.jit), carrying jit_cache's explanation.
  assert [r.levelname for r in misses] == ["WARNING"] * 2, [
    (r.name, r.getMessage()[:60]) for r in misses
  ]
  first, second = (r.getMessage() for r in misses)
  assert "JIT_CACHE TRACING CACHE MISS for step defined at " in first
  assert "closed-over constant `lr` (cell 0): 0.5 -> 0.75" in first
  assert "closed over equal values" in second
  ours = [r for r in caplog.records if r.name == "jaxworks.jit_cache"]
  assert [r.levelname for r in ours] == ["INFO"]
  assert (
    ours[0]
    .getMessage()
    .startswith("JIT_CACHE EXECUTABLE REUSE for step defined at ")
  )
