"""Filtered tracebacks of user errors: as short under jit_cache.jit as under
jax.jit, with the user's frame last."""

import os
import traceback

import jax
import jax.numpy as jnp
import pytest

from jaxworks import jit_cache


@pytest.fixture(autouse=True)
def remove_frames():
  before = jax.config.jax_traceback_filtering
  jax.config.update("jax_traceback_filtering", "remove_frames")
  yield
  jax.config.update("jax_traceback_filtering", before)


def _frames(jit, inner):
  def user_step(x):
    return x * 2 + missing_name  # noqa: F821  # pylint: disable=undefined-variable

  def user_outer(x):
    return jit(user_step)(x) + 1

  def call():
    x = jnp.ones(3)
    return jit(user_outer)(x) if inner else jit(user_step)(x)

  with pytest.raises(NameError) as info:
    call()
  return traceback.extract_tb(info.value.__traceback__)


@pytest.mark.parametrize("inner", [False, True])
def test_filtered_traceback_no_longer_than_stock(inner):
  stock = _frames(jax.jit, inner)
  ours = _frames(jit_cache.jit, inner)
  assert ours[-1].name == "user_step"
  assert ours[-1].line == stock[-1].line
  package = os.path.join("jaxworks", "jit_cache", "")
  assert not any(package in f.filename for f in ours), [
    (f.filename, f.name) for f in ours
  ]
  assert len(ours) <= len(stock), (
    [f.name for f in ours],
    [f.name for f in stock],
  )
