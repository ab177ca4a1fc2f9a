"""jit as a drop-in for jax.jit: signature, exception classes, behaviours.

Everything here is compared with stock ``jax.jit`` on the same inputs.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import gc
import inspect
import re
import warnings
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks import jit_cache
from jaxworks.jit_cache import jit

STOCK_JIT = jax.jit


# ------------------------------------------------------------- signature


def test_signature_matches_stock():
  stock = inspect.signature(STOCK_JIT).parameters
  ours = inspect.signature(jit).parameters
  # Stock's parameters first, in stock's order; then only ``maxsize``.
  assert list(ours)[: len(stock)] == list(stock)
  assert list(ours)[len(stock) :] == ["maxsize"]
  for name, p in stock.items():
    q = ours[name]
    assert q.kind == p.kind, name
    assert q.default is p.default or (
      type(q.default) is type(p.default) and q.default == p.default
    ), name
  assert stock["fun"].kind is inspect.Parameter.POSITIONAL_ONLY
  assert ours["maxsize"].kind is inspect.Parameter.KEYWORD_ONLY


def test_fun_is_positional_only_like_stock():
  for j in (STOCK_JIT, jit):
    with pytest.raises(TypeError):
      j(fun=lambda x: x)
    with pytest.raises(TypeError):  # options are keyword-only
      j(lambda x: x, None)


def test_decorator_factory_forms():
  @jit(static_argnames=["flag"])
  def f(x, flag):
    return x if flag else -x

  assert f(1, True) == 1 and f(1, False) == -1
  assert isinstance(f, jit_cache.JitFunction)
  g = jit()(lambda x: x + 1)
  assert g(1) == 2


# ------------------------------------------------------ exception classes


def _gen(x):
  yield x


def _ident(x):
  return x


def _two(x, y):
  return x + y


class _Slots:
  __slots__ = ()

  def __call__(self, x):
    return x + 1


ERROR_CASES = {
  "not_callable": lambda j: j(3),
  "none": lambda j: j(None),
  "generator_function": lambda j: j(_gen),
  "staticmethod_object": lambda j: j(staticmethod(_ident)),
  "classmethod_object": lambda j: j(classmethod(_ident)),
  "not_weakrefable_call": lambda j: j(_Slots())(1.0),
  "not_weakrefable_trace": lambda j: j(_Slots()).trace(1.0),
  "not_weakrefable_lower": lambda j: j(_Slots()).lower(1.0),
  "unhashable_static_argnum": lambda j: j(_two, static_argnums=1)(1.0, [1]),
  "unhashable_static_argname": lambda j: j(_two, static_argnames="y")(
    1.0, y={"a": 1}
  ),
  "static_argnums_out_of_range": lambda j: j(_two, static_argnums=2),
  "static_argnums_negative_out_of_range": lambda j: j(_two, static_argnums=-3),
  "donate_argnums_out_of_range": lambda j: j(_two, donate_argnums=5),
  "static_argnames_unknown": lambda j: j(_two, static_argnames="z"),
  "donate_argnames_unknown": lambda j: j(_two, donate_argnames="z"),
  "static_argnums_not_int": lambda j: j(_two, static_argnums="a"),
  "static_and_donated_name": lambda j: j(
    _two, static_argnames="x", donate_argnames="x"
  ),
  "device_and_backend": lambda j: j(
    _ident, device=jax.devices()[0], backend="cpu"
  ),
  "str_argument": lambda j: j(_ident)("abc"),
  "object_argument": lambda j: j(_ident)(object()),
  "dtype_argument": lambda j: j(_ident)(jnp.int32),
  "str_in_pytree_argument": lambda j: j(_ident)({"a": [1.0, "b"]}),
  "masked_array_argument": lambda j: j(_ident)(
    np.ma.array([1, 2], mask=[True, False])
  ),
  "missing_argument": lambda j: j(_two)(1.0),
  "unknown_keyword": lambda j: j(_two)(1.0, 2.0, z=3.0),
  "incompatible_shapes": lambda j: j(_two)(jnp.ones(2), jnp.ones(3)),
  "concretization": lambda j: j(lambda x: int(x))(1.0),
  "tracer_bool": lambda j: j(lambda x: 1.0 if x > 0 else 2.0)(1.0),
  "inner_error_under_grad": lambda j: jax.grad(j(lambda x: jnp.ones(2)[x]))(
    1.0
  ),
}


def _raised(case):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    try:
      case()
    except Exception as e:  # pylint: disable=broad-except
      return e
  return None


@pytest.mark.parametrize("name", sorted(ERROR_CASES))
def test_same_exception_class_as_stock(name):
  case = ERROR_CASES[name]
  stock = _raised(lambda: case(STOCK_JIT))
  ours = _raised(lambda: case(jit))
  assert stock is not None, f"{name}: stock jax.jit does not raise"
  assert ours is not None, f"{name}: jit_cache.jit does not raise"
  assert isinstance(ours, type(stock)), (name, ours, stock)


@pytest.mark.parametrize(
  "name,api,value",
  [
    ("not_callable", "jit", "int 3"),
    ("generator_function", "jit", "_gen"),
    ("staticmethod_object", "jit", "staticmethod"),
    ("classmethod_object", "jit", "classmethod"),
    ("not_weakrefable_call", "jit", "_Slots"),
    ("unhashable_static_argnum", "jit", "list [1]"),
    ("static_argnums_out_of_range", "jit", "static_argnums 2"),
    ("str_argument", "jit", "type <class 'str'>"),
  ],
)
def test_messages_name_api_value_and_fix(name, api, value):
  err = _raised(lambda: ERROR_CASES[name](jit))
  text = str(err)
  assert text.startswith(f"jaxworks.jit_cache.{api}: "), text
  assert value in text, text
  assert ";" in text  # the fix follows the diagnosis


@pytest.mark.parametrize(
  "name",
  [
    "str_argument",
    "object_argument",
    "dtype_argument",
    "str_in_pytree_argument",
  ],
)
def test_bad_argument_message_keeps_stocks_sentence(name):
  # Code written against stock may match its wording; jit_cache keeps stock's
  # first sentence (naming the function by name, not by its repr) and adds the
  # fix after it.
  stock = str(_raised(lambda: ERROR_CASES[name](STOCK_JIT)))
  ours = str(_raised(lambda: ERROR_CASES[name](jit)))
  first = stock.splitlines()[0].replace(repr(_ident), _ident.__name__)
  assert ours.startswith("jaxworks.jit_cache.jit: " + first + " "), (
    ours,
    first,
  )
  assert "mark the argument static" in ours


# ------------------------------------------------------------- donation


def _donation_warnings(fn, *args):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fn(*args)
  return [w for w in caught if "donated buffers" in str(w.message)]


def _unusable_donation(j, **kw):
  # No output has x's or y's shape/dtype: the donations cannot be used.
  return j(lambda x, y: x.sum() + jnp.float32(y.sum()), **kw)


@pytest.mark.parametrize(
  "kw", [dict(donate_argnums=(0, 1)), dict(donate_argnames=("x", "y"))]
)
def test_unusable_donation_warns_like_stock(kw):
  def args():
    return jnp.array([1.0, 2.0], jnp.float32), jnp.array([1, 2], jnp.int32)

  stock = _donation_warnings(_unusable_donation(STOCK_JIT, **kw), *args())
  ours = _donation_warnings(_unusable_donation(jit, **kw), *args())
  assert len(stock) == 1 and len(ours) == 1
  assert ours[0].category is stock[0].category
  assert str(ours[0].message) == str(stock[0].message)


def test_unusable_donation_warns_when_the_executable_is_reused():
  # A re-created identical function reuses the compiled executable (no
  # lowering); jax.jit lowers it anew and warns again: so must we.
  x, y = jnp.ones(3), jnp.ones(3, jnp.int32)
  first = _unusable_donation(jit, donate_argnums=(0, 1))
  assert len(_donation_warnings(first, x, y)) == 1
  second = _unusable_donation(jit, donate_argnums=(0, 1))
  x, y = jnp.ones(3), jnp.ones(3, jnp.int32)
  assert len(_donation_warnings(second, x, y)) == 1
  assert second.cache_info().executable_reuses == 1
  assert second.cache_info().compiles == 0


def test_usable_donation_does_not_warn():
  f = jit(lambda x: x * 2, donate_argnums=0)
  assert _donation_warnings(f, jnp.ones(4)) == []


# ---------------------------------------------------------------- tokens


def test_token_arguments_like_stock():
  def noop(arr, token):
    return arr, token

  for j in (STOCK_JIT, jit):
    f = j(noop)
    token = jax.lax.create_token()
    for _ in range(2):  # first call and the cached path
      arr, out = f(jnp.ones(4), token)
      assert isinstance(out, type(token))
      assert out is not token
      np.testing.assert_array_equal(arr, np.ones(4))


def test_token_threaded_through_inner_jit():
  inner = jit(lambda t, x: (t, x + 1))

  def outer(t, x):
    t, x = inner(t, x)
    return inner(t, x)

  ours = jit(outer)(jax.lax.create_token(), jnp.ones(2))
  stock = STOCK_JIT(outer)(jax.lax.create_token(), jnp.ones(2))
  assert isinstance(ours[0], type(stock[0]))
  np.testing.assert_array_equal(ours[1], stock[1])


# -------------------------------------------------- compile prunes args


def _entry_parameters(compiled):
  """Parameters of the compiled program's entry computation."""
  text = compiled.as_text()
  entry = text[text.index("ENTRY") :]
  entry = entry[: entry.index("\n}")]
  return len(re.findall(r"= \S+ parameter\(", entry))


@pytest.mark.parametrize("keep_unused", [False, True])
def test_lower_compile_prunes_unused_arguments_like_stock(keep_unused):
  def f(x, y, z):
    del z
    return x * 2 + y.sum()

  args = (jnp.ones(3), jnp.ones(4), 1.0)
  stock = STOCK_JIT(f, keep_unused=keep_unused).lower(*args).compile()
  ours = jit(f, keep_unused=keep_unused).lower(*args).compile()
  assert ours.in_avals == stock.in_avals
  assert _entry_parameters(ours) == _entry_parameters(stock)
  assert _entry_parameters(ours) == (3 if keep_unused else 2)
  np.testing.assert_array_equal(ours(*args), stock(*args))


def test_call_prunes_unused_arguments_like_stock():
  def f(x, unused):
    del unused
    return x + 1

  for keep_unused in (False, True):
    for j in (STOCK_JIT, jit):
      g = j(f, keep_unused=keep_unused)
      np.testing.assert_array_equal(g(jnp.ones(2), jnp.ones(5)), 2.0)


# -------------------------------------------------- _cache_size and repr


def test_cache_size_like_stock():
  def run(j):
    f = j(lambda x: (x**2).sum())
    sizes = [f._cache_size()]  # pylint: disable=protected-access
    for x in (
      jnp.arange(5.0),
      jnp.arange(5.0),
      jnp.arange(6.0),
      jnp.arange(5, dtype=jnp.int32),
    ):
      f(x)
      sizes.append(f._cache_size())  # pylint: disable=protected-access
    f._clear_cache()  # pylint: disable=protected-access
    sizes.append(f._cache_size())  # pylint: disable=protected-access
    return sizes

  assert run(jit) == run(STOCK_JIT) == [0, 1, 1, 2, 3, 0]


def test_repr_says_what_it_wraps():
  def my_function():
    return None

  assert repr(jit(my_function)) == f"<JitFunction of {my_function!r}>"
  assert repr(STOCK_JIT(my_function)) == f"<PjitFunction of {my_function!r}>"

  class BadRepr:
    def __call__(self):
      return None

    def __repr__(self):
      raise ValueError("no repr")

  assert repr(jit(BadRepr())) == "<JitFunction>"


# ------------------------------------------- re-wrapped functions (inline)


def test_rewrapping_the_same_function_traces_once():
  calls = []

  def f(x, y):
    calls.append(None)
    return jnp.sin(x) * y

  x = jnp.arange(4.0)
  outs = [jit(f)(x, 2.0) for _ in range(5)]
  assert len(calls) == 1
  for out in outs:
    np.testing.assert_array_equal(out, STOCK_JIT(f)(x, 2.0))
  assert jit(f).cache_info().traces == 1


def test_rewrapping_shares_only_with_identical_options():
  calls = []

  def f(x, n):
    calls.append(n)
    return x * n

  x = jnp.ones(2)
  jit(f)(x, 3)
  jit(f)(x, 3)
  assert len(calls) == 1
  np.testing.assert_array_equal(jit(f, static_argnums=1)(x, 3), x * 3)
  np.testing.assert_array_equal(jit(f, static_argnums=1)(x, 4), x * 4)
  assert len(calls) == 3  # static n: one trace per value, separate cache
  jit(f, keep_unused=True)(x, 3)
  jit(f, compiler_options={"xla_cpu_enable_fast_math": False})(x, 3)
  jit(f, compiler_options={"xla_cpu_enable_fast_math": False})(x, 3)
  jit(f, maxsize=7)(x, 3)
  assert len(calls) == 6


def test_rewrapping_sees_changed_defaults_and_code():
  def f(x, k=2.0):
    return x * k

  x = jnp.ones(2)
  np.testing.assert_array_equal(jit(f)(x), x * 2.0)
  f.__defaults__ = (5.0,)
  np.testing.assert_array_equal(jit(f)(x), x * 5.0)
  f.__code__ = (lambda x, k=2.0: x + k).__code__
  np.testing.assert_array_equal(jit(f)(x), x + 5.0)


def test_equal_but_distinct_callables_do_not_share():
  class Scale:
    def __init__(self, k):
      self.k = k

    def __eq__(self, other):
      return isinstance(other, Scale)  # all equal: identity must decide

    def __hash__(self):
      return 0

    def __call__(self, x):
      return x * self.k

  x = jnp.ones(3)
  np.testing.assert_array_equal(jit(Scale(2.0))(x), x * 2.0)
  np.testing.assert_array_equal(jit(Scale(3.0))(x), x * 3.0)


def test_wrapping_does_not_keep_the_function_alive():
  def make():
    y = jnp.arange(3.0)
    return lambda x: x + y

  f = make()
  ref = weakref.ref(f)
  g = jit(f)
  np.testing.assert_array_equal(g(1.0), jnp.arange(3.0) + 1)
  np.testing.assert_array_equal(jit(f)(1.0), jnp.arange(3.0) + 1)
  del f
  gc.collect()
  assert ref() is not None  # the wrapper holds it, as jax.jit's does
  np.testing.assert_array_equal(g(2.0), jnp.arange(3.0) + 2)
  del g
  gc.collect()
  assert ref() is None


def test_non_weakrefable_function_builds_and_fails_on_use():
  f = jit(_Slots())  # building works, as with jax.jit
  with pytest.raises(TypeError, match="cannot create weak reference"):
    f(1.0)
  # jax.eval_shape refuses such a callable too, jax.make_jaxpr takes it.
  for eval_shape in (jax.eval_shape, jit_cache.eval_shape):
    with pytest.raises(TypeError, match="cannot create weak reference"):
      eval_shape(_Slots(), 1.0)
  assert str(jit_cache.make_jaxpr(_Slots())(1.0)) == str(
    jax.make_jaxpr(_Slots())(1.0)
  )


# ------------------------------------------- pickling, clearing, freeing


def _module_level(x, n):
  return x * n


def test_pickles_as_function_and_options():
  # Stock's wrapper does not pickle (a local cache_miss); ours pickles as the
  # function and its options, and the copy shares the function's cache.
  import functools  # pylint: disable=g-import-not-at-top
  import pickle  # pylint: disable=g-import-not-at-top

  f = jit(_module_level, static_argnums=1)
  np.testing.assert_array_equal(f(jnp.ones(2), 3), [3.0, 3.0])
  g = pickle.loads(pickle.dumps(f))
  assert isinstance(g, jit_cache.JitFunction) and g is not f
  np.testing.assert_array_equal(g(jnp.ones(2), 4), [4.0, 4.0])
  np.testing.assert_array_equal(g(jnp.ones(2), 3), [3.0, 3.0])
  assert g.cache_info().traces == 2  # 3 traced by f, 4 by g
  named = functools.partial(_module_level)
  named.__name__ = "named"
  for fun in (
    _module_level,
    functools.partial(_module_level),
    functools.partial(functools.partial(_module_level)),
    named,
    lambda x: x,
  ):
    assert (
      jit(fun).__getstate__()["function_name"]
      == STOCK_JIT(fun).__getstate__()["function_name"]
    )


def test_jax_clear_caches_clears_jit_cache():
  calls = []

  def f(x):
    calls.append(None)
    return x + 1

  g = jit(f)
  g(jnp.ones(2))
  g(jnp.ones(2))
  assert len(calls) == 1 and g.cache_info().entries == 1
  jax.clear_caches()
  assert g.cache_info().entries == 0 and g._cache_size() == 0  # pylint: disable=protected-access
  g(jnp.ones(2))
  assert len(calls) == 2


def test_clear_cache_frees_the_executables():
  client = jax.devices()[0].client

  def live():
    gc.collect()
    return len(client.live_executables())

  @jit
  def f(x, y):
    return x * 3 + y * 7 - 11  # a program no other test compiles

  before = live()
  f(1, 2).block_until_ready()
  assert live() == before + 1
  f.clear_cache()
  assert live() <= before


def test_escaped_tracer_raises_like_stock():
  leaked = []

  def body(c, _):
    leaked.append(jnp.add(c, 1))
    return c, None

  jax.lax.scan(body, 1.0, None, length=2)  # leaks a tracer
  errors = []
  for j in (STOCK_JIT, jit):
    f = j(jnp.add)
    f(jnp.ones(()), 1.0)  # a cached entry for the same avals
    with pytest.raises(
      jax.errors.UnexpectedTracerError, match="was created on line"
    ) as e:
      f(jnp.ones(()), leaked[0])
    errors.append(e.value)
  assert type(errors[0]) is type(errors[1])
