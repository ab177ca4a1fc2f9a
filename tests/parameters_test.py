"""No function of the five packages takes more than 8 parameters.

Read from the packages' source (``packages/<pkg>/jaxworks/``, ast): every
function and method, nested ones included, counting every parameter but
``self`` and ``cls``. Where more are needed, an options object carries them
(``pmap_chunked``'s ``PmapOptions``, the options dict ``jit_cache``'s core
takes).

Exempt, each with its reason:

- ``MIRRORS``: public entry points whose signature is a stock JAX API's (the
  drop-in contract, DESIGN.md: same names, positions and defaults), plus the
  few parameters listed with them. The test checks the mirror against
  ``inspect.signature`` of the stock function, so the exemption lapses when
  the signatures part.
- ``ALLOWED``: functions left as they are for a stated reason; an entry that
  no longer breaks the rule (or no longer exists) fails the test, so the list
  only shrinks.
"""

import ast
import inspect
import pathlib

import jax
import pytest


def _root():
  here = pathlib.Path(__file__).resolve().parent
  for base in (pathlib.Path.cwd(), here.parent):
    if (base / "packages.bzl").is_file():
      return base
  raise AssertionError("no packages.bzl: run from the repository root")


ROOT = _root()
PACKAGES = (
  "axis_names",
  "batched_transfer",
  "jit_cache",
  "pmap_chunked",
  "stages_aot",
)
MAX_PARAMETERS = 8

#: Public entry point -> (the stock JAX function it mirrors, the parameters
#: it adds after stock's).
MIRRORS = {
  "jit_cache/_src/api.py::jit": (jax.jit, ("maxsize",)),
  "pmap_chunked/_src/api.py::pmap": (jax.pmap, ("chunked", "maxsize")),
}

# (Named without its issue number: tests/repo_test.py refuses those.)
_REWRITE = (
  "a public entry point whose options are keyword-only, one per setting, as "
  "orbax's and jax.device_put's are (CheckpointManagerOptions groups the "
  "manager's); the functions behind it take the options as one object"
)
#: Function -> why it may take more than 8 parameters for now.
ALLOWED = {
  "batched_transfer/_src/checkpoint/api.py::save": _REWRITE,
  "batched_transfer/_src/checkpoint/api.py::restore": _REWRITE,
  "batched_transfer/_src/checkpoint/manager.py::CheckpointManager.__init__": (
    _REWRITE
  ),
}


def functions(tree):
  """(qualified name, node) of every function, methods as Class.name."""
  out = []

  def visit(node, prefix):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
        out.append((prefix + child.name, child))
        visit(child, prefix + child.name + ".")
      elif isinstance(child, ast.ClassDef):
        visit(child, prefix + child.name + ".")

  visit(tree, "")
  return out


def parameters(fn):
  """The parameter names of a function node, without self and cls."""
  a = fn.args
  names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
  names += [p.arg for p in (a.vararg, a.kwarg) if p is not None]
  return [n for n in names if n not in ("self", "cls")]


def over_the_limit(root=ROOT):
  """{name: [signature node's parameters, ...]} of every function over the
  limit (overloads of one name listed together)."""
  out = {}
  for package in PACKAGES:
    base = root / "packages" / package / "jaxworks"
    modules = sorted(base.rglob("*.py"))
    assert modules, f"no sources under {base}"
    for path in modules:
      rel = path.relative_to(base).as_posix()
      for name, fn in functions(ast.parse(path.read_text(), str(path))):
        names = parameters(fn)
        if len(names) > MAX_PARAMETERS:
          out.setdefault(f"{rel}::{name}", []).append(names)
  return out


@pytest.fixture(scope="module")
def found():
  return over_the_limit()


def test_no_function_takes_more_than_8_parameters(found):
  over = {
    name: max(len(p) for p in params)
    for name, params in found.items()
    if name not in MIRRORS and name not in ALLOWED
  }
  assert not over, (
    f"more than {MAX_PARAMETERS} parameters: {over}; pass an options object "
    "(e.g. a frozen dataclass) instead"
  )


def test_every_exemption_is_still_needed(found):
  stale = sorted(n for n in (*MIRRORS, *ALLOWED) if n not in found)
  assert not stale, (
    f"{stale} take at most {MAX_PARAMETERS} parameters now (or are gone): "
    "remove them from MIRRORS / ALLOWED in tests/parameters_test.py"
  )


@pytest.mark.parametrize("name", sorted(MIRRORS))
def test_mirrors_take_stocks_parameters(found, name):
  stock, extra = MIRRORS[name]
  want = list(inspect.signature(stock).parameters) + list(extra)
  for params in found[name]:  # the implementation and its overloads
    # An overload without the function (the decorator form) omits it.
    assert params in (want, want[1:]), (
      f"{name} takes {params}, not {stock.__module__}.{stock.__name__}'s "
      f"parameters plus {extra}: it is no mirror, so the 8-parameter rule "
      "applies"
    )


def test_the_rule_sees_what_it_looks_for(tmp_path):
  src = tmp_path / "packages" / "axis_names" / "jaxworks" / "axis_names"
  src.mkdir(parents=True)
  for package in PACKAGES[1:]:
    other = tmp_path / "packages" / package / "jaxworks"
    other.mkdir(parents=True)
    (other / "ok.py").write_text("def f(a, b, c, d, e, f, g, h): pass\n")
  (src / "m.py").write_text(
    "class C:\n"
    "  def m(self, a, b, c, d, e, f, g, h): pass\n"
    "  def n(self, a, b, c, d, e, f, g, h, *, i): pass\n"
    "def outer():\n"
    "  def inner(a, b, c, d, e, f, g, *h, **i): pass\n"
  )
  assert sorted(over_the_limit(tmp_path)) == [
    "axis_names/m.py::C.n",
    "axis_names/m.py::outer.inner",
  ]
