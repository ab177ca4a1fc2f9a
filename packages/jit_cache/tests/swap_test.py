"""The drop-in swap: ``jax.jit = jit_cache.jit``, and the adoption API.

jit_cache binds the stock JAX callables it builds on at import, so replacing
``jax.jit`` with it (by plain assignment, or with ``install()``) cannot make
it call itself. The core cases run under the swap in this process and in a
fresh one, each compared with stock ``jax.jit``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import ast
import pathlib
import textwrap
import types

import child
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks import jit_cache
from jaxworks.jit_cache import jit

STOCK_JIT = jax.jit


def _same(a, b):
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  assert ta == tb, (ta, tb)
  for x, y in zip(la, lb):
    x, y = jnp.asarray(x), jnp.asarray(y)
    assert x.shape == y.shape and x.dtype == y.dtype, (x, y)
    assert x.weak_type == y.weak_type, (x, y)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def check_core_cases(stock):
  """Runs jit_cache's core cases through ``jax.jit`` as it is now, comparing
  each with ``stock`` (the original ``jax.jit``). Returns the case count."""
  jj = jax.jit  # looked up now: jit_cache's under the swap
  assert jj is jit_cache.jit, jj
  cases = 0

  # 1. call, kwargs, pytrees, cached second call
  def f(x, y, *, scale):
    return {"s": jnp.sin(x) * scale + y["b"], "n": x.sum()}

  x, y = jnp.arange(6.0).reshape(2, 3), {"b": jnp.ones(3)}
  wrapped = jj(f)
  assert isinstance(wrapped, jit_cache.JitFunction)
  for _ in range(2):
    _same(wrapped(x, y, scale=2.0), stock(f)(x, y, scale=2.0))
  assert wrapped.cache_info().traces == 1
  cases += 1

  # 2. inner jits (through jax.jit looked up inside the traced function)
  def inner(v):
    return jnp.cos(v) + 1

  def outer(v):
    for _ in range(3):
      v = jax.jit(inner)(v)
    return jax.jit(lambda w: w * 2)(v)

  _same(jj(outer)(x), stock(outer)(x))
  jaxpr = jax.make_jaxpr(jj(outer))(x)
  assert [e.primitive.name for e in jaxpr.eqns] == ["jit"]
  cases += 1

  # 3. grad, vmap, jvp, both orders
  def loss(w, v):
    return jnp.sum(jnp.tanh(v @ w) ** 2)

  w, v = jnp.ones((3, 2)), jnp.arange(6.0).reshape(2, 3) / 6
  _same(jax.grad(jj(loss))(w, v), jax.grad(stock(loss))(w, v))
  _same(jj(jax.grad(loss))(w, v), stock(jax.grad(loss))(w, v))
  _same(
    jax.vmap(jj(loss), in_axes=(None, 0))(w, v[:, None, :]),
    jax.vmap(stock(loss), in_axes=(None, 0))(w, v[:, None, :]),
  )
  _same(jax.jvp(jj(jnp.sin), (x,), (x,)), jax.jvp(stock(jnp.sin), (x,), (x,)))
  cases += 1

  # 4. trace / lower / compile
  traced = jj(loss).trace(w, v)
  assert traced.fun_name == "loss"
  lowered = jj(loss).lower(w, v)
  s_lowered = stock(loss).lower(w, v)
  assert isinstance(lowered, jax.stages.Lowered)
  assert lowered.in_avals == s_lowered.in_avals
  compiled = traced.lower().compile()
  _same(compiled(w, v), s_lowered.compile()(w, v))
  cases += 1

  # 5. eval_shape (stock's and ours, of a jitted and a plain function)
  assert jax.eval_shape(jj(loss), w, v) == jax.eval_shape(stock(loss), w, v)
  assert jj(loss).eval_shape(w, v) == stock(loss).eval_shape(w, v)
  assert jit_cache.eval_shape(loss, w, v) == jax.eval_shape(loss, w, v)
  assert str(jit_cache.make_jaxpr(loss)(w, v)) == str(
    jax.make_jaxpr(loss)(w, v)
  )
  cases += 1

  # 6. static arguments by number and by name
  def power(v, n, *, mode):
    return v**n if mode == "pow" else v * n

  for n, mode in ((2, "pow"), (3, "pow"), (3, "mul")):
    _same(
      jj(power, static_argnums=1, static_argnames="mode")(x, n, mode=mode),
      stock(power, static_argnums=1, static_argnames="mode")(x, n, mode=mode),
    )
  cases += 1

  # 7. donation
  a = jnp.arange(4.0)
  out = jj(lambda p, q: p + q, donate_argnums=0)(a, jnp.ones(4))
  assert a.is_deleted()
  _same(out, jnp.arange(4.0) + 1)
  cases += 1

  # 8. control flow and jax.numpy under the swap
  def body(c, t):
    return c + jnp.sum(t), c

  xs = jnp.arange(12.0).reshape(4, 3)
  _same(
    jj(lambda c: jax.lax.scan(body, c, xs))(0.0),
    stock(lambda c: jax.lax.scan(body, c, xs))(0.0),
  )
  _same(
    jj(lambda p: jax.lax.cond(p > 0, jnp.sin, jnp.cos, p))(0.5),
    stock(lambda p: jax.lax.cond(p > 0, jnp.sin, jnp.cos, p))(0.5),
  )
  _same(jj(jnp.linalg.norm)(x), stock(jnp.linalg.norm)(x))
  cases += 1

  # 9. decorator forms and methods
  @jax.jit
  def g(v):
    return v + 1

  class M:
    def __init__(self, k):
      self.k = k

    @jax.jit
    def scaled(self, v):
      return v * self.k

  assert isinstance(g, jit_cache.JitFunction)
  _same(g(x), x + 1)
  _same(jj(static_argnames="k")(lambda v, k: v * k)(x, k=3), x * 3)
  # A jitted method gets ``self`` as a dynamic argument: not a JAX type,
  # so both raise TypeError.
  m = M(2.0)
  with pytest.raises(TypeError):
    m.scaled(x)
  with pytest.raises(TypeError):
    stock(M.scaled.__wrapped__)(m, x)
  cases += 1
  return cases


# ------------------------------------------------------------- the swap


def test_plain_assignment_in_process():
  before = jax.jit
  jax.jit = jit_cache.jit
  try:
    assert check_core_cases(STOCK_JIT) == 9
  finally:
    jax.jit = before
  assert jax.jit is STOCK_JIT


_SUBPROCESS = textwrap.dedent("""
    import sys
    import jax
    from jaxworks import jit_cache
    stock = jax.jit
    jax.jit = jit_cache.jit          # the plain swap, before anything runs
    sys.path.insert(0, {tests!r})
    import swap_test
    print("cases", swap_test.check_core_cases(stock))
    assert jax.jit is jit_cache.jit
""")


def test_plain_assignment_in_a_fresh_process():
  tests = str(pathlib.Path(__file__).resolve().parent)
  proc = child.run("-c", _SUBPROCESS.format(tests=tests), timeout=600)
  assert "cases 9" in proc.stdout
  assert "RecursionError" not in proc.stderr


def test_jit_cache_never_looks_up_jax_jit(monkeypatch):
  calls = []
  real = jit_cache.jit

  def counting(*args, **kwargs):
    calls.append(None)
    return real(*args, **kwargs)

  monkeypatch.setattr(jax, "jit", counting)
  f = jit(lambda v: v * 3)
  np.testing.assert_array_equal(f(jnp.ones(2)), [3.0, 3.0])
  np.testing.assert_array_equal(
    f.lower(jnp.ones(2)).compile()(jnp.ones(2)), [3.0, 3.0]
  )
  assert f.eval_shape(jnp.ones(2)).shape == (2,)
  jaxpr = jit_cache.make_jaxpr(lambda v: v + 1)(1.0)
  assert jaxpr.eqns[0].primitive.name == "add"
  assert jit_cache.eval_shape(jnp.sin, 1.0).shape == ()
  assert not calls  # jit_cache never looked jax.jit up


# --------------------------------------------------------- adoption API


def test_install_uninstall_are_reversible_and_idempotent():
  assert not jit_cache.is_installed()
  try:
    jit_cache.install()
    jit_cache.install()
    assert jax.jit is jit_cache.jit and jit_cache.is_installed()
    assert isinstance(jax.jit(lambda v: v), jit_cache.JitFunction)
  finally:
    jit_cache.uninstall()
  assert jax.jit is STOCK_JIT
  jit_cache.uninstall()  # nothing installed: nothing changes
  assert jax.jit is STOCK_JIT


def test_uninstall_refuses_to_overwrite_a_later_assignment():
  other = lambda *a, **k: None  # noqa: E731
  jit_cache.install()
  try:
    jax.jit = other
    with pytest.raises(RuntimeError, match="reassigned after install"):
      jit_cache.uninstall()
    assert jax.jit is other
    jax.jit = jit_cache.jit
    jit_cache.uninstall()
  finally:
    jax.jit = STOCK_JIT
  assert not jit_cache.is_installed()


def test_installed_context_manager():
  with jit_cache.installed():
    assert jax.jit is jit_cache.jit
    _same(jax.jit(jnp.cos)(0.0), STOCK_JIT(jnp.cos)(0.0))
  assert jax.jit is STOCK_JIT
  with pytest.raises(ZeroDivisionError):
    with jit_cache.installed():
      raise ZeroDivisionError
  assert jax.jit is STOCK_JIT
  # Nested, and inside install(): each exit restores what its entry saw.
  jit_cache.install()
  try:
    with jit_cache.installed():
      with jit_cache.installed():
        assert jax.jit is jit_cache.jit
      assert jax.jit is jit_cache.jit
    assert jax.jit is jit_cache.jit
  finally:
    jit_cache.uninstall()
  assert jax.jit is STOCK_JIT


def test_install_docstring_names_what_it_replaces():
  for fn in (jit_cache.install, jit_cache.installed):
    assert "``jax.jit``" in fn.__doc__ or "jax.jit" in fn.__doc__
  assert "exactly one name" in jit_cache.install.__doc__


# ----------------------------------------------- no call-time lookups


_SRC = pathlib.Path(jit_cache.__file__).resolve().parent / "_src"
#: adopt.py reads and writes jax.jit on purpose (never calls it).
_ALLOWED = {"adopt.py"}


def _call_time_jax_callables(path):
  """``jax.<name>`` loads inside function bodies where ``jax.<name>`` is a
  function (a module, class or config object is not an entry point anyone
  swaps)."""
  tree = ast.parse(path.read_text())
  found = []

  class Visitor(ast.NodeVisitor):
    depth = 0

    def visit_FunctionDef(self, node):  # pylint: disable=invalid-name
      for d in node.decorator_list:
        self.visit(d)
      self.depth += 1
      for stmt in node.body:  # annotations and defaults are not call time
        self.visit(stmt)
      self.depth -= 1

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node):  # pylint: disable=invalid-name
      self.depth += 1
      self.visit(node.body)
      self.depth -= 1

    def visit_Attribute(self, node):  # pylint: disable=invalid-name
      if (
        self.depth
        and isinstance(node.value, ast.Name)
        and node.value.id == "jax"
      ):
        target = getattr(jax, node.attr, None)
        if isinstance(
          target, (types.FunctionType, types.BuiltinFunctionType)
        ) or (
          callable(target) and not isinstance(target, (type, types.ModuleType))
        ):
          found.append(f"{path.name}:{node.lineno}: jax.{node.attr}")
      self.generic_visit(node)

  Visitor().visit(tree)
  return found


def test_no_stock_callable_is_looked_up_at_call_time():
  files = sorted(p for p in _SRC.glob("*.py") if p.name not in _ALLOWED)
  assert len(files) >= 6
  found = [hit for p in files for hit in _call_time_jax_callables(p)]
  assert found == []


def test_the_scan_finds_a_call_time_lookup(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("import jax\n\ndef f(g):\n  return jax.jit(g)\nh = jax.jit\n")
  assert _call_time_jax_callables(bad) == ["bad.py:4: jax.jit"]
