"""Every ``jit`` option in every form stock accepts, compared with ``jax.jit``.

``jax.jit`` normalizes its options loosely: argnums through
``operator.index`` or by iterating (numpy integers, ``True``, numpy arrays,
tuples of numpy integers, generators), argnames as a string or an iterable of
strings, flags by truthiness. Hypothesis draws each option in each of those
forms (and bad ones); both jits are built and called on fresh arguments, and
must agree on the result or on the exception class.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import warnings

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks import jit_cache
from jaxworks.jit_cache import jit as our_jit


def f(a, b, c):
  return a * 2 + c + (0 if isinstance(b, (int, float)) else b)


def _args():
  return (jnp.ones(2), 3.0, jnp.arange(2.0))


def _int_forms(i):
  """``i`` as each form ``jax.jit`` accepts for one position."""
  mask = np.zeros(3, bool)
  if i >= 0:
    mask[i] = True
  return st.sampled_from(
    [
      i,
      np.int64(i),
      np.int32(i),
      np.array(i),
      np.array([i]),
      (i,),
      [i],
      (np.int64(i),),
      range(i, i + 1),
    ]
    + ([tuple(np.nonzero(mask)[0])] if i >= 0 else [])
    + ([bool(i)] if i in (0, 1) else [])
    + ([(bool(i),)] if i in (0, 1) else [])
  )


#: Values that are neither positions nor iterables of positions.
BAD_NUMS = st.sampled_from(
  [1.0, np.float64(1.0), "1", (1.5,), [None], {"a": 1}, object(), 7, -4]
)
NUMS = st.one_of(st.integers(-3, 2).flatmap(_int_forms), BAD_NUMS)
NAMES = st.sampled_from(
  [
    "b",
    np.str_("b"),
    ["b"],
    ("b", "c"),
    ("c",),
    [],
    "zz",
    1,
    b"b",
    (np.str_("c"),),
  ]
)
FLAGS = st.sampled_from([True, False, np.bool_(True), np.bool_(False), 0, 1])


def _outcome(jit, options):
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      out = jit(f, **options)(*_args())
    return ("ok", np.asarray(out).tobytes(), str(out.dtype))
  except Exception as e:  # pylint: disable=broad-except
    return ("raised", type(e))


@settings(max_examples=120, deadline=None, derandomize=True)
@given(
  options=st.fixed_dictionaries(
    {},
    optional={
      "static_argnums": NUMS,
      "donate_argnums": NUMS,
      "static_argnames": NAMES,
      "donate_argnames": NAMES,
      "keep_unused": FLAGS,
      "inline": FLAGS,
    },
  )
)
def test_options_match_stock(options):
  want = _outcome(jax.jit, options)
  got = _outcome(our_jit, options)
  assert got == want, options


@pytest.mark.parametrize(
  "value",
  [
    np.int64(1),
    tuple(np.nonzero(np.array([False, True, False]))[0]),
    np.array([1]),
    True,
    (True,),
  ],
  ids=["np.int64", "nonzero", "np.array", "True", "(True,)"],
)
@pytest.mark.parametrize("option", ["static_argnums", "donate_argnums"])
def test_numpy_and_bool_argnums_work_as_in_stock(option, value):
  """The forms a user's mask or config gives (all refused before)."""
  want = _outcome(jax.jit, {option: value})
  got = _outcome(our_jit, {option: value})
  assert want[0] == "ok"
  assert got == want
  jitted = our_jit(f, **{option: value})
  jitted(*_args())
  assert jitted.cache_info().traces == 1
  assert jit_cache.check_argnums(value, option) == (1,)
