"""Drop-in adoption: the same signature as jax.device_put, and the package keeps working when
jax.device_put and jax.jit are swapped for other callables (a plain assignment, or install())."""

import inspect

import jax
from jax.experimental.layout import Format
from jax.experimental.layout import Layout
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.sharding import SingleDeviceSharding
import jaxworks_testing as jwt
import numpy as np
import pytest

from jaxworks import batched_transfer as bt

# Stock JAX's functions, bound at import: before any test swaps the attributes.
STOCK_PUT = jax.device_put
STOCK_JIT = jax.jit


def _params(f):
  return [
    (p.name, p.kind, p.default)
    for p in inspect.signature(f).parameters.values()
  ]


def test_signature_is_stocks():
  # Names, positions, kinds and defaults (annotations are JAX's private type names).
  assert _params(bt.device_put) == _params(STOCK_PUT)
  assert _params(bt.device_put) == [
    ("x", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
    ("device", inspect.Parameter.POSITIONAL_OR_KEYWORD, None),
    ("src", inspect.Parameter.KEYWORD_ONLY, None),
    ("donate", inspect.Parameter.KEYWORD_ONLY, False),
    ("may_alias", inspect.Parameter.KEYWORD_ONLY, None),
  ]
  x = np.arange(3.0)
  assert bt.device_put(x=x, device=jwt.device(1)).devices() == {jwt.device(1)}
  with pytest.raises(TypeError):
    bt.device_put(
      x, target=jwt.device(1)
    )  # the pre-0.1.1 keyword is gone, as in stock
  with pytest.raises(TypeError):
    STOCK_PUT(x, target=jwt.device(1))


@pytest.fixture
def swapped(monkeypatch):
  """jax.device_put is batched_transfer's and jax.jit a wrapper that records its calls."""
  jit_calls = []
  real_jit = jax.jit

  def recording_jit(*args, **kwargs):
    jit_calls.append(args)
    return real_jit(*args, **kwargs)

  monkeypatch.setattr(jax, "device_put", bt.device_put)
  monkeypatch.setattr(jax, "jit", recording_jit)
  yield jit_calls


def assert_same(out, ref):
  assert jax.tree.structure(out) == jax.tree.structure(ref)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    assert jax.typeof(a) == jax.typeof(b) and a.sharding == b.sharding
    assert a.committed == b.committed and a.format == b.format
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def corpus():
  return {
    "f32": np.arange(8, dtype=np.float32),
    "i64": np.arange(4),
    "s": [1, 2.5, True],
    "dev": jax.device_put(np.ones(8, np.float32), jwt.device(3)),
    "u": jnp.arange(8.0),
    "bf16": np.ones(8, jnp.bfloat16),
  }


def targets():
  mesh = jwt.mesh_fit((4, 2), ("a", "b"))
  return [
    None,
    jwt.device(1),
    SingleDeviceSharding(jwt.device(2)),
    NamedSharding(mesh, P()),
    {
      "f32": NamedSharding(mesh, P("a")),
      "i64": jwt.device(0),
      "s": None,
      "dev": jwt.device(3),
      "u": None,
      "bf16": NamedSharding(mesh, P(None)),
    },
  ]


def test_core_cases_under_the_plain_swap(swapped, tmp_path):
  for target in targets():
    assert_same(jax.device_put(corpus(), target), STOCK_PUT(corpus(), target))
  # A Format target relayouts with a jit: stock jit bound at import, never jax.jit.
  fmt = Format(Layout((0, 1)), SingleDeviceSharding(jwt.device(1)))
  x = np.arange(12, dtype=np.float32).reshape(3, 4)
  assert_same(jax.device_put(x, fmt), STOCK_PUT(x, fmt))
  # PartitionSpec targets and calls under a trace go to stock device_put, not jax.device_put.
  mesh = jwt.mesh_fit((2, 4), ("a", "b"))
  with jax.set_mesh(mesh):
    assert_same(jax.device_put(x[:2], P("a")), STOCK_PUT(x[:2], P("a")))
  f = STOCK_JIT(lambda a: jax.device_put(a, jwt.device(0)) * 2)
  np.testing.assert_array_equal(f(x), 2 * x)
  # save / restore / plan / place_for.
  bt.save(tmp_path / "c.npz", corpus())
  like = jax.eval_shape(corpus)
  assert_same(
    bt.restore(tmp_path / "c.npz", like, placement=jwt.device(1)),
    STOCK_PUT(corpus(), jwt.device(1)),
  )
  assert bt.plan(corpus(), jwt.device(1)).num_leaves == 8
  compiled = STOCK_JIT(lambda a: a + 1).lower(x).compile()
  assert (
    bt.place_for(compiled, x, argnum=0).format == compiled.input_formats[0][0]
  )
  assert swapped == []  # jax.jit was never looked up by the package


def test_a_swap_to_something_that_raises_is_never_called(monkeypatch):
  def trap(*args, **kwargs):
    raise AssertionError("jaxworks looked up a swapped jax name at call time")

  mesh = jwt.mesh_fit((8,), ("x",))
  tree, ref = corpus(), STOCK_PUT(corpus(), NamedSharding(mesh, P()))
  monkeypatch.setattr(jax, "device_put", trap)
  monkeypatch.setattr(jax, "jit", trap)
  assert_same(bt.device_put(tree, NamedSharding(mesh, P())), ref)
  fmt = Format(Layout((0,)), SingleDeviceSharding(jwt.device(2)))
  assert bt.device_put(np.ones(4), fmt).format.layout.major_to_minor == (0,)
  with jax.set_mesh(mesh):
    assert bt.device_put(np.ones(8), P("x")).sharding.spec == P("x")


def test_install_uninstall_and_installed():
  original = jax.device_put
  assert not bt.is_installed()
  bt.uninstall()  # nothing installed: a no-op
  assert jax.device_put is original
  bt.install()
  try:
    bt.install()  # idempotent
    assert jax.device_put is bt.device_put and bt.is_installed()
    assert_same(
      jax.device_put(corpus(), jwt.device(1)),
      STOCK_PUT(corpus(), jwt.device(1)),
    )
  finally:
    bt.uninstall()
  assert jax.device_put is original and not bt.is_installed()
  bt.uninstall()
  assert jax.device_put is original

  with pytest.raises(KeyError):
    with bt.installed():
      assert jax.device_put is bt.device_put
      raise KeyError("inside")
  assert jax.device_put is original


def test_uninstall_refuses_to_overwrite_a_later_assignment(monkeypatch):
  original = jax.device_put
  bt.install()
  other = lambda *a, **k: None  # noqa: E731
  jax.device_put = other
  try:
    with pytest.raises(
      RuntimeError, match="jax.device_put was reassigned after install"
    ):
      bt.uninstall()
    assert jax.device_put is other
  finally:
    jax.device_put = bt.device_put
    bt.uninstall()
  assert jax.device_put is original
