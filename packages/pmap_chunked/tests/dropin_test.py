"""Drop-in contract: stock signature and exception classes, install(), and
the plain swap of jax.pmap / jax.jit / jax.device_put in a fresh process."""

import contextlib
import inspect
import os
import subprocess
import sys
import textwrap

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks import pmap_chunked
from jaxworks.pmap_chunked import pmap

N = 8
pytestmark = pytest.mark.skipif(
  jax.device_count() < N, reason="needs 8 devices (XLA_FLAGS)"
)
STOCK_PMAP = jax.pmap
# Parameters pmap_chunked adds after stock's (keyword-only, with defaults).
EXTRA = ("chunked", "maxsize")


def test_signature_is_stocks_plus_keyword_only_extras():
  stock = list(inspect.signature(STOCK_PMAP).parameters.values())
  ours = list(inspect.signature(pmap).parameters.values())
  assert len(ours) == len(stock) + len(EXTRA)
  for mine, theirs in zip(ours, stock):
    assert (mine.name, mine.kind, mine.default) == (
      theirs.name,
      theirs.kind,
      theirs.default,
    ), (mine, theirs)
  for mine, name in zip(ours[len(stock) :], EXTRA):
    assert mine.name == name
    assert mine.kind is inspect.Parameter.KEYWORD_ONLY
    assert mine.default is not inspect.Parameter.empty


x8 = jnp.ones((N, 2))


def _gen(v):
  yield v


# name -> (call, class to expect when stock's is a private subclass of it)
CASES = {
  "not callable": (lambda p: p(3), None),
  "generator function": (lambda p: p(_gen), None),
  "staticmethod object": (lambda p: p(staticmethod(lambda v: v)), None),
  "in_axes leaf not an int": (lambda p: p(lambda v: v, in_axes=0.5), None),
  "in_axes string leaf": (lambda p: p(lambda v: v, in_axes=("a",)), None),
  "out_axes leaf not an int": (lambda p: p(lambda v: v, out_axes="a"), None),
  "in_axes too short": (
    lambda p: p(lambda a, b: a, in_axes=(0,))(x8, x8),
    None,
  ),
  "in_axes prefix mismatch": (
    lambda p: p(lambda a: a, in_axes=({"a": 0},))(x8),
    None,
  ),
  "in_axes nested length": (
    lambda p: p(lambda a: a, in_axes=((0, 0, 0),))((x8, x8)),
    None,
  ),
  "in_axes dict for tuple": (
    lambda p: p(lambda a: a, in_axes={"a": 0})(x8),
    None,
  ),
  "out_axes prefix mismatch": (
    lambda p: p(lambda a: (a, a), out_axes=(0, 0, 0))(x8),
    None,
  ),
  "out_axes out of range": (lambda p: p(lambda a: a, out_axes=3)(x8), None),
  "static out of range": (
    lambda p: p(lambda a, k: a, static_broadcasted_argnums=1)(x8),
    None,
  ),
  "static passed by keyword": (
    lambda p: p(lambda a, k: a, static_broadcasted_argnums=1)(x8, k=1),
    None,
  ),
  "static not an int": (
    lambda p: p(lambda a, k: a, static_broadcasted_argnums="1"),
    None,
  ),
  "static unhashable list": (
    lambda p: p(lambda a, k: a, static_broadcasted_argnums=1)(x8, [1]),
    None,
  ),
  "static unhashable array": (
    lambda p: p(lambda a, k: a, static_broadcasted_argnums=1)(x8, np.ones(2)),
    None,
  ),
  "static and donated": (
    lambda p: p(lambda a, k: a, static_broadcasted_argnums=1, donate_argnums=1)(
      x8, 1
    ),
    None,
  ),
  "mismatched axis sizes": (
    lambda p: p(lambda a, b: a + b)(x8, jnp.ones((4, 2))),
    ValueError,
  ),
  "more than the devices": (
    lambda p: p(lambda a: a)(jnp.ones(N + 1)),
    ValueError,
  ),
  "axis_size disagrees": (lambda p: p(lambda a: a, axis_size=4)(x8), None),
  "nothing mapped": (lambda p: p(lambda a: a, in_axes=None)(x8), None),
  "mapped Python scalar": (lambda p: p(lambda a: a)(1.0), None),
  "mapped 0-d array next to a mapped one": (
    lambda p: p(lambda a, b: a)(x8, jnp.ones(())),
    None,
  ),
  "string argument next to a mapped one": (
    lambda p: p(lambda a, b: a)(x8, "abc"),
    None,
  ),
  "object argument next to a mapped one": (
    lambda p: p(lambda a, b: a)(x8, object()),
    None,
  ),
  "in_axes beyond the rank": (
    lambda p: p(lambda a: a, in_axes=1)(jnp.ones(N)),
    None,
  ),
  "0-d keyword argument": (lambda p: p(lambda a: a)(a=jnp.ones(())), None),
  "empty devices": (lambda p: p(lambda a: a, devices=[]), None),
  "unhashable axis_name": (lambda p: p(lambda a: a, axis_name=["i"])(x8), None),
  "unbound axis name": (
    lambda p: p(lambda a: jax.lax.psum(a, "j"), axis_name="i")(x8),
    None,
  ),
  "unknown backend": (lambda p: p(lambda a: a, backend="no_such")(x8), None),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_exception_class_as_stock(name):
  call, public = CASES[name]
  with pytest.raises(Exception) as stock_err:
    call(STOCK_PMAP)
  expected = type(stock_err.value)
  if public is not None:
    # Stock raises a private subclass (IndivisibleError) of `public`.
    assert issubclass(expected, public) and expected is not public
    expected = public
  with pytest.raises(expected) as ours:
    call(pmap)
  assert str(ours.value).startswith("jaxworks.pmap_chunked"), ours.value


@contextlib.contextmanager
def _restoring_jax_pmap():
  before = jax.pmap
  try:
    yield
  finally:
    jax.pmap = before


def test_install_uninstall_and_context_manager():
  with _restoring_jax_pmap():
    assert jax.pmap is STOCK_PMAP and not pmap_chunked.is_installed()
    pmap_chunked.install()
    assert jax.pmap is pmap and pmap_chunked.is_installed()
    pmap_chunked.install()  # idempotent
    np.testing.assert_array_equal(jax.pmap(lambda v: v * 2)(x8), 2 * x8)
    assert isinstance(jax.pmap(lambda v: v), pmap_chunked.Pmapped)
    pmap_chunked.uninstall()
    assert jax.pmap is STOCK_PMAP
    pmap_chunked.uninstall()  # idempotent
    assert jax.pmap is STOCK_PMAP
    # Only jax.pmap changes: the helpers JAX 0.10 removed stay removed.
    with pmap_chunked.installed():
      assert jax.pmap is pmap
      with pytest.raises(AttributeError):
        jax.device_put_replicated  # noqa: B018
      with pytest.raises(AttributeError):
        jax.device_put_sharded  # noqa: B018
    assert jax.pmap is STOCK_PMAP
    with pytest.raises(RuntimeError, match="boom"):
      with pmap_chunked.installed():
        raise RuntimeError("boom")
    assert jax.pmap is STOCK_PMAP


def test_uninstall_does_not_clobber_a_later_assignment():
  with _restoring_jax_pmap():
    pmap_chunked.install()
    mine = lambda *a, **k: None  # noqa: E731
    jax.pmap = mine
    with pytest.raises(RuntimeError, match="reassigned after install"):
      pmap_chunked.uninstall()
    assert jax.pmap is mine
    jax.pmap = pmap
    pmap_chunked.uninstall()
    assert jax.pmap is STOCK_PMAP


def test_stock_callables_are_bound_at_import(monkeypatch):
  """Reassigning the jax.* names pmap_chunked builds on changes nothing."""

  def trap(name):
    def called(*args, **kwargs):
      raise AssertionError(f"pmap_chunked looked up jax.{name} at call time")

    return called

  for name in (
    "pmap",
    "shard_map",
    "typeof",
    "devices",
    "make_array_from_single_device_arrays",
    "make_array_from_process_local_data",
  ):
    monkeypatch.setattr(jax, name, trap(name))
  monkeypatch.setattr(
    jax.sharding, "get_abstract_mesh", trap("sharding.get_abstract_mesh")
  )
  f = pmap(
    lambda v, k: v * k + jax.lax.psum(v, "i"), "i", static_broadcasted_argnums=1
  )
  x = np.arange(N, dtype=np.float32)
  np.testing.assert_allclose(f(x, 2), x * 2 + x.sum())
  assert f.lower(x, 2).out_info.shape == (N,)
  inner = pmap(lambda v: jax.lax.psum(v, "j"), "j")
  np.testing.assert_allclose(pmap(inner, "i")(np.ones((2, 4))), 4.0)
  devices = STOCK_DEVICES[:4]
  rep = pmap_chunked.device_put_replicated(np.ones(3), devices)
  assert rep.shape == (4, 3)
  sharded = pmap_chunked.device_put_sharded(
    [np.full(2, k) for k in range(4)], devices
  )
  np.testing.assert_array_equal(sharded[:, 0], np.arange(4))


STOCK_DEVICES = jax.devices()

SWAPPED = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jaxworks import batched_transfer, jit_cache, pmap_chunked
    stock_pmap = jax.pmap
    # The plain swap a user adopting jaxworks would write: all three at once.
    jax.jit = jit_cache.jit
    jax.device_put = batched_transfer.device_put
    jax.pmap = pmap_chunked.pmap

    n = jax.device_count()
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    f = jax.pmap(lambda v: v / jax.lax.psum(v, "i"), axis_name="i")
    out = f(x)
    np.testing.assert_allclose(out, x / x.sum(0), rtol=1e-6)
    assert out.addressable_shards[0].data.shape == (1, 3)
    # Outputs feed jax.jit (now jit_cache) and jax.device_put (now
    # batched_transfer) and come back into jax.pmap.
    doubled = jax.jit(lambda a: a * 2)(out)
    again = f(jax.device_put(doubled, out.sharding))
    np.testing.assert_allclose(again, out, rtol=1e-6)
    # in_axes/out_axes, pytrees, statics, weak types, donation.
    g = jax.pmap(lambda d, k: {"y": d["a"] * k + d["b"], "n": d["b"].sum()},
                 "i", in_axes=({"a": 1, "b": None}, None),
                 out_axes={"y": 1, "n": None}, static_broadcasted_argnums=1,
                 donate_argnums=0)
    a = jnp.ones((3, n), jnp.bfloat16)
    r = g({"a": a, "b": jnp.ones(3, jnp.bfloat16)}, 2.0)
    assert r["y"].shape == (3, n) and r["y"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(r["y"], np.float32), 3.0)
    assert float(r["n"]) == 3.0
    assert g.lower({"a": a, "b": jnp.ones(3, jnp.bfloat16)},
                   2.0).out_info["y"].dtype == jnp.bfloat16
    # Nested pmaps, and jax.jit around jax.pmap.
    inner = jax.pmap(lambda v: jax.lax.psum(v, "j"), "j")
    np.testing.assert_allclose(jax.pmap(inner, "i")(np.ones((2, n // 2))),
                               n // 2)
    h = jax.jit(lambda v: jax.pmap(lambda w: w + 1)(v) * 2)
    np.testing.assert_allclose(h(x), (x + 1) * 2)
    # Same values as stock pmap (bound before the swap).
    np.testing.assert_allclose(
        jax.pmap(lambda v: jnp.sin(v))(x), stock_pmap(lambda v: jnp.sin(v))(x))
    rep = pmap_chunked.device_put_replicated(np.ones(2), jax.devices()[:4])
    assert rep.shape == (4, 2)
    print("SWAPPED OK")
""")


def test_plain_swap_of_jit_device_put_and_pmap_in_a_fresh_process(tmp_path):
  script = tmp_path / "swapped.py"
  script.write_text(SWAPPED)
  env = dict(
    os.environ,
    XLA_FLAGS="--xla_force_host_platform_device_count=8",
    JAX_PLATFORMS="cpu",
    PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
  )
  done = subprocess.run(
    [sys.executable, str(script)],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert done.returncode == 0 and "SWAPPED OK" in done.stdout, (
    done.stdout[-3000:] + done.stderr[-6000:]
  )


# Errors whose stock message a user's code may match: jaxworks keeps stock's
# sentence whole and adds the function, the value and the fix after it.
STOCK_SENTENCE_CASES = {
  "empty devices": lambda p: p(lambda a: a, devices=[]),
  "no argument leaves": lambda p: p(lambda a: a)({}),
  "every in_axes None": lambda p: p(lambda a: a, in_axes=None)(x8),
  "static argument by keyword": lambda p: p(
    lambda a, b: a + b, static_broadcasted_argnums=(1,)
  )(jnp.ones((1, 1)), b=1),
}


@pytest.mark.parametrize("name", sorted(STOCK_SENTENCE_CASES))
def test_stock_message_is_kept_whole(name):
  call = STOCK_SENTENCE_CASES[name]
  with pytest.raises(ValueError) as stock_err:
    call(STOCK_PMAP)
  with pytest.raises(ValueError) as ours:
    call(pmap)
  message = str(ours.value)
  assert message.startswith("jaxworks.pmap_chunked.pmap: "), message
  assert str(stock_err.value) in message
  assert len(message) > len("jaxworks.pmap_chunked.pmap: ") + len(
    str(stock_err.value)
  )  # and says more: the function, the value or the fix
