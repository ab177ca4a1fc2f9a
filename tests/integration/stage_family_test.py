"""One stage family, a superset of jax.stages, from every entry point.

The public names of stock ``jax.stages.Traced``, ``Lowered`` and ``Compiled``
are read by introspection at test time. For every entry point
(``jit_cache.jit(f).trace/lower``, ``stages_aot.trace``,
``pmap_chunked.pmap(f).trace/lower``) each name must exist on jaxworks'
object with the stock signature (stock's public parameters, in order, kind
and default; jaxworks may add keyword-only ones) and give stock's result on
the same function and arguments where the two are comparable. A stock name
this test does not know fails it, so a new JAX attribute gets a comparison
before it is claimed.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks import jit_cache
from jaxworks import pmap_chunked
from jaxworks import stages_aot

N = 8


def _f(x, y):
  return jnp.sin(x) @ y + 1.0


def _g(x):
  return x * 2.0 - jax.lax.pmean(x, "i")


def _h(x):
  return x * 2.0


X = np.arange(12, dtype=np.float32).reshape(3, 4)
Y = np.ones((4, 2), np.float32)
XS = np.arange(N * 3, dtype=np.float32).reshape(N, 3)


def _public(cls) -> list[str]:
  return sorted(n for n in dir(cls) if not n.startswith("_"))


def _str(v):
  return str(v)


def _lojax(v):
  return (str(v.jaxpr), v.fun_name, v.args_info, v.out_tree)


def _type(v):
  return type(v)


def _hlo(text):
  """Optimized HLO without source locations (the call sites differ)."""
  text = re.sub(r",? metadata=\{[^}]*\}", "", text)
  return [line for line in text.splitlines() if "file_name_id=" not in line]


#: How each stock name's result is compared: a normalizing function applied
#: to both results (``None``: compare as they are), or "method" entries below.
_PROPERTIES = {
  "Traced": {
    "args_info": None,
    "donate_argnums": None,
    "fun_name": None,
    "in_avals": None,
    "in_tree": None,
    "jaxpr": _str,
    "lojax": _lojax,
    "out_avals": None,
    "out_info": None,
    "out_tree": None,
  },
  "Lowered": {
    "args_info": None,
    "donate_argnums": None,
    "in_avals": None,
    "in_tree": None,
    "out_info": None,
    "out_tree": None,
  },
  "Compiled": {
    "args_info": None,
    "donate_argnums": None,
    "in_avals": None,
    "in_tree": None,
    "input_formats": None,
    "input_shardings": None,
    "out_info": None,
    "out_tree": None,
    "output_formats": None,
    "output_shardings": None,
  },
}

#: Methods called with no arguments (normalized results compared); "lower"
#: and "compile" are compared through the stage they return, "call" through
#: calling the compiled program.
_METHODS = {
  "Traced": {"lower": "stage"},
  "Lowered": {
    "as_text": None,
    "compile": "stage",
    "compiler_ir": _str,
    "cost_analysis": None,
  },
  "Compiled": {
    "as_text": _hlo,
    "call": "call",
    "cost_analysis": None,
    "memory_analysis": _str,
    "runtime_executable": _type,
  },
}

_STOCK = {
  "Traced": jax.stages.Traced,
  "Lowered": jax.stages.Lowered,
  "Compiled": jax.stages.Compiled,
}
_OURS = {
  "Traced": jit_cache.Traced,
  "Lowered": jit_cache.Lowered,
  "Compiled": jit_cache.Compiled,
}


@pytest.mark.parametrize("stage", sorted(_STOCK))
def test_the_test_knows_every_stock_public_name(stage):
  known = set(_PROPERTIES[stage]) | set(_METHODS[stage])
  new = sorted(set(_public(_STOCK[stage])) - known)
  assert not new, (
    f"jax.stages.{stage} has public names this test does not compare: "
    f"{new}; add a comparison (and make jaxworks' {stage} give stock's "
    "result)"
  )
  gone = sorted(known - set(_public(_STOCK[stage])))
  assert not gone, f"jax.stages.{stage} no longer has {gone}: drop them here"


def _check_signature(stage: str, name: str, ours, stock) -> None:
  """Stock's parameters, in order, kind and default, JAX's private ones
  included (JAX's own modules pass them); additions are keyword-only with
  defaults and public."""
  sig_stock = inspect.signature(getattr(type(stock), name))
  sig_ours = inspect.signature(getattr(type(ours), name))
  theirs = list(sig_stock.parameters.values())
  mine = list(sig_ours.parameters.values())
  key = lambda p: (p.name, p.kind, p.default)  # noqa: E731
  stock_keys = [key(p) for p in theirs]
  assert [key(p) for p in mine if key(p) in stock_keys] == stock_keys, (
    f"{stage}.{name}: {sig_ours} lacks or reorders stock's {sig_stock}"
  )
  for extra in (p for p in mine if key(p) not in stock_keys):
    assert extra.kind is inspect.Parameter.KEYWORD_ONLY and (
      extra.default is not inspect.Parameter.empty
    ), f"{stage}.{name}: added parameter {extra} must be keyword-only"
    assert not extra.name.startswith("_"), (
      f"{stage}.{name}: added private parameter {extra}"
    )


def _compare(stage: str, ours, stock, args, skip=None) -> None:
  """Compares every stock public name; ``skip`` maps a stage to the names
  whose results are not comparable there (they are still checked to exist,
  with the stock signature)."""
  skip = skip or {}
  assert isinstance(ours, _OURS[stage]) and isinstance(ours, _STOCK[stage])
  not_compared = skip.get(stage, frozenset())
  for name in _public(_STOCK[stage]):
    assert hasattr(ours, name), f"jaxworks {stage} lacks {name}"
    if name in _PROPERTIES[stage]:
      if name in not_compared:
        getattr(ours, name)  # it works
        continue
      norm = _PROPERTIES[stage][name] or (lambda v: v)
      assert norm(getattr(ours, name)) == norm(getattr(stock, name)), (
        f"{stage}.{name} differs from stock"
      )
      continue
    _check_signature(stage, name, ours, stock)
    how = _METHODS[stage][name]
    if name in not_compared:
      continue
    if how == "stage":
      next_stage = {"lower": "Lowered", "compile": "Compiled"}[name]
      _compare(
        next_stage, getattr(ours, name)(), getattr(stock, name)(), args, skip
      )
    elif how == "call":
      assert type(ours).call is jax.stages.Compiled.call
      np.testing.assert_array_equal(ours(*args), stock(*args))
    else:
      norm = how or (lambda v: v)
      assert norm(getattr(ours, name)()) == norm(getattr(stock, name)()), (
        f"{stage}.{name}() differs from stock"
      )


def test_jit_cache_trace():
  ours = jit_cache.jit(_f).trace(X, Y)
  _compare("Traced", ours, jax.jit(_f).trace(X, Y), (X, Y))


def test_jit_cache_lower():
  ours = jit_cache.jit(_f).lower(X, Y)
  _compare("Lowered", ours, jax.jit(_f).lower(X, Y), (X, Y))


def test_jit_cache_donation_and_keyword_arguments():
  def h(a, b, *, c):
    return a + b * c

  kw = {"c": np.float32(3)}
  ours = jit_cache.jit(h, donate_argnums=0).trace(X, X, **kw)
  stock = jax.jit(h, donate_argnums=0).trace(X, X, **kw)
  assert ours.donate_argnums == stock.donate_argnums == (0,)
  _compare("Traced", ours, stock, (X, X), skip={"Traced": {"lower"}})
  lowered = ours.lower()
  _compare("Lowered", lowered, stock.lower(), (), {"Lowered": {"compile"}})
  compiled, stock_compiled = lowered.compile(), stock.lower().compile()
  np.testing.assert_array_equal(
    compiled(jnp.array(X), X, **kw), stock_compiled(jnp.array(X), X, **kw)
  )


def test_stages_aot_trace():
  ours = stages_aot.trace(_f, X, Y)
  assert type(ours) is jit_cache.Traced
  _compare("Traced", ours, jax.jit(_f).trace(X, Y), (X, Y))


def test_cross_platform_lowering_is_stocks_module():
  platforms = ("cpu", "tpu")
  for traced in (jit_cache.jit(_f).trace(X, Y), stages_aot.trace(_f, X, Y)):
    ours = traced.lower(lowering_platforms=platforms)
    stock = jax.jit(_f).trace(X, Y).lower(lowering_platforms=platforms)
    assert ours.platforms == platforms and ours.fun_name == "_f"
    assert str(ours.jaxpr) == str(traced.jaxpr)
    _compare("Lowered", ours, stock, (X, Y), {"Lowered": {"compile"}})
    compiled = ours.compile(platform="cpu")  # an addition: stock cannot
    assert compiled.platform == "cpu" and compiled.lowered_for == platforms
    np.testing.assert_allclose(compiled(X, Y), _f(X, Y), rtol=1e-6)


#: The program pmap_chunked traces takes the flat argument leaves, placed on
#: its mesh; stock jax.pmap has no trace stage, so the traced program is
#: compared with jax.jit's trace of the same function where that is
#: meaningful (names, trees, output info) and checked to work otherwise.
_PMAP_TRACED_SKIP = {
  "Traced": {"jaxpr", "lojax", "in_avals", "args_info", "out_avals"}
  | {"out_info", "lower"}
}
#: pmap_chunked's module is its own jit(shard_map) (its text differs from
#: jax.pmap's); its out_info carries no sharding (jax.pmap's names the mesh).
_PMAP_LOWERED_SKIP = {
  "Lowered": {"as_text", "compiler_ir", "cost_analysis", "out_info"},
  "Compiled": {"as_text"},
}


def test_pmap_chunked_trace():
  ours = pmap_chunked.pmap(_h, "i").trace(XS)
  stock = jax.jit(_h).trace(XS)  # jax.pmap has no trace()
  # A Traced of the family (a subclass whose lower() refuses JAX's own
  # exporters, as they refuse jax.pmap; lowering is the family's).
  assert isinstance(ours, jit_cache.Traced)
  assert type(ours).lower is not jit_cache.Traced.lower
  assert type(ours.lower()) is jit_cache.Lowered
  _compare("Traced", ours, stock, (XS,), skip=_PMAP_TRACED_SKIP)
  assert ours.out_info.shape == stock.out_info.shape
  assert ours.out_info.dtype == stock.out_info.dtype
  lowered = ours.lower()
  assert type(lowered) is jit_cache.Lowered and lowered.platforms == ("cpu",)


def test_pmap_chunked_lower():
  ours = pmap_chunked.pmap(_g, "i").lower(XS)
  stock = jax.pmap(_g, "i").lower(XS)
  assert type(ours) is jit_cache.Lowered and ours.fun_name == "_g"
  _compare("Lowered", ours, stock, (XS,), skip=_PMAP_LOWERED_SKIP)
  assert jax.tree.map(lambda s: (s.shape, s.dtype), ours.out_info) == (
    jax.tree.map(lambda s: (s.shape, s.dtype), stock.out_info)
  )
