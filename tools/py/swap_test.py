"""tools/py/swap.py, the install/uninstall mechanism every adopting jaxworks
package carries as ``_src/swap.py``, on stand-in modules (the packages'
adoption tests check it on ``jax`` itself)."""

import doctest
import sys
import threading
import types

import pytest
import swap


def _module(**attrs):
  module = types.ModuleType("fakejax")
  for name, value in attrs.items():
    setattr(module, name, value)
  return module


def stock_jit(f):
  return f


def stock_pmap(f):
  return f


def our_jit(f):
  return f


def our_pmap(f):
  return f


@pytest.fixture
def mod():
  return _module(jit=stock_jit, pmap=stock_pmap)


@pytest.fixture
def s(mod):
  return swap.Swap(
    "jaxworks.demo", [(mod, "jit", our_jit), (mod, "pmap", our_pmap)]
  )


def _state(mod):
  return mod.jit, mod.pmap


def _refusal(call):
  """The message of the RuntimeError ``call()`` raises."""
  with pytest.raises(RuntimeError) as e:
    call()
  return str(e.value)


def test_install_uninstall_reversible_and_idempotent(mod, s):
  assert not s.is_installed()
  s.install()
  s.install()
  assert _state(mod) == (our_jit, our_pmap) and s.is_installed()
  s.uninstall()
  assert _state(mod) == (stock_jit, stock_pmap) and not s.is_installed()
  s.uninstall()  # nothing installed: nothing changes
  assert _state(mod) == (stock_jit, stock_pmap)


def test_uninstall_without_install_leaves_an_outside_assignment(mod, s):
  mod.jit, mod.pmap = our_jit, our_pmap  # someone else assigned them
  assert s.is_installed()
  s.uninstall()
  assert _state(mod) == (our_jit, our_pmap)


def test_install_over_a_later_assignment_stacks(mod, s):
  s.install()
  mod.jit, mod.pmap = len, abs
  s.install()
  assert _state(mod) == (our_jit, our_pmap)
  s.uninstall()
  assert _state(mod) == (len, abs)  # what the second install() found
  with pytest.raises(RuntimeError, match="reassigned after install"):
    s.uninstall()


def test_uninstall_refuses_a_reassignment_and_changes_nothing(mod, s):
  s.install()
  other = lambda f: f  # noqa: E731
  mod.pmap = other
  message = _refusal(s.uninstall)
  assert message.startswith("jaxworks.demo.uninstall: fakejax.pmap was ")
  assert "reassigned after install() (it is now <function" in message
  assert "fakejax.jit" not in message
  assert message.endswith("or set fakejax.pmap yourself")
  assert _state(mod) == (our_jit, other)  # the installed one stays too
  mod.pmap = our_pmap
  s.uninstall()
  assert _state(mod) == (stock_jit, stock_pmap)


def test_uninstall_names_every_reassigned_attribute(mod, s):
  s.install()
  mod.jit, mod.pmap = len, abs
  message = _refusal(s.uninstall)
  assert "fakejax.jit was reassigned" in message
  assert "fakejax.pmap was reassigned" in message
  assert "set fakejax.jit, fakejax.pmap yourself" in message


def test_install_refuses_a_half_installed_state(mod, s):
  mod.jit = our_jit  # one of two: not ours to complete or undo
  message = _refusal(s.install)
  assert message.startswith("jaxworks.demo.install: only part of it")
  assert "fakejax.pmap is <function stock_pmap" in message
  assert "fakejax.jit is" not in message
  assert _state(mod) == (our_jit, stock_pmap)
  assert not s.is_installed()
  s.uninstall()  # never installed by s: nothing to undo
  assert _state(mod) == (our_jit, stock_pmap)


def test_installed_restores_what_it_found(mod, s):
  with s.installed():
    assert _state(mod) == (our_jit, our_pmap) and s.is_installed()
  assert _state(mod) == (stock_jit, stock_pmap)
  with pytest.raises(ZeroDivisionError):
    with s.installed():
      raise ZeroDivisionError
  assert _state(mod) == (stock_jit, stock_pmap)
  s.install()
  with s.installed():
    with s.installed():
      assert s.is_installed()
    assert s.is_installed()
  assert s.is_installed()
  s.uninstall()
  assert _state(mod) == (stock_jit, stock_pmap)


def test_an_absent_attribute_is_deleted_again(mod):
  s = swap.Swap("jaxworks.demo", [(mod, "vmap", our_jit)])
  s.install()
  assert mod.vmap is our_jit
  s.uninstall()
  assert not hasattr(mod, "vmap")
  with s.installed():
    assert mod.vmap is our_jit
  assert not hasattr(mod, "vmap")


class _Guarded(types.ModuleType):
  """A module whose attribute ``pmap`` cannot be assigned."""

  def __setattr__(self, name, value):
    if name == "pmap" and "pmap" in self.__dict__:
      raise AttributeError("fakejax.pmap is read-only")
    super().__setattr__(name, value)


def test_a_failed_assignment_leaves_no_half_done_swap():
  mod = _Guarded("fakejax")
  mod.jit, mod.pmap = stock_jit, stock_pmap
  s = swap.Swap(
    "jaxworks.demo", [(mod, "jit", our_jit), (mod, "pmap", our_pmap)]
  )
  with pytest.raises(AttributeError, match="read-only"):
    s.install()
  assert _state(mod) == (stock_jit, stock_pmap)
  assert not s.is_installed()
  s.uninstall()  # the failed install() saved nothing
  assert _state(mod) == (stock_jit, stock_pmap)
  with pytest.raises(AttributeError, match="read-only"):
    with s.installed():
      raise AssertionError("the block must not run")
  assert _state(mod) == (stock_jit, stock_pmap)


def test_threads_never_leave_half_a_swap(mod, s):
  errors = []
  start = threading.Barrier(8)

  def work():
    try:
      start.wait()
      for _ in range(300):
        # Unlocked, one thread's install() would see another's half-done
        # swap and raise "only part of it is installed".
        s.install()
        s.uninstall()
    except Exception as e:  # noqa: BLE001 - collected and asserted below
      errors.append(e)

  threads = [threading.Thread(target=work) for _ in range(8)]
  interval = sys.getswitchinterval()
  sys.setswitchinterval(1e-6)  # switch often, so that a race shows
  try:
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  finally:
    sys.setswitchinterval(interval)
  assert not errors, errors
  assert _state(mod) == (stock_jit, stock_pmap)


def test_entries_are_checked(mod):
  with pytest.raises(ValueError, match="no entries"):
    swap.Swap("jaxworks.demo", [])
  with pytest.raises(ValueError, match=r"each attribute once.*fakejax.jit"):
    swap.Swap("jaxworks.demo", [(mod, "jit", len), (mod, "jit", abs)])


def test_adoption_functions_swap_one_name_and_are_documented(mod, monkeypatch):
  demo = types.ModuleType("jaxworks.demo")
  demo.jit = our_jit
  demo.is_installed, demo.install, demo.uninstall, demo.installed = (
    swap.adoption(
      "jaxworks.demo",
      mod,
      "jit",
      our_jit,
      defined_in="jaxworks.demo._src.adopt",
      keeps="``from fakejax import jit`` executed before",
      note="Not ``fakejax.pmap``.",
    )
  )
  assert not demo.is_installed()
  demo.install()
  assert _state(mod) == (our_jit, stock_pmap) and demo.is_installed()
  demo.uninstall()
  assert _state(mod) == (stock_jit, stock_pmap)
  with demo.installed():
    assert mod.jit is our_jit
  assert mod.jit is stock_jit
  demo.install()
  mod.jit = len
  with pytest.raises(RuntimeError, match=r"^jaxworks.demo.uninstall: fakejax"):
    demo.uninstall()
  mod.jit = our_jit
  demo.uninstall()

  for name in ("is_installed", "install", "uninstall", "installed"):
    f = getattr(demo, name)
    assert (f.__name__, f.__qualname__) == (name, name)
    assert f.__module__ == "jaxworks.demo._src.adopt"
    assert "``fakejax.jit``" in f.__doc__
  assert ":func:`jaxworks.demo.jit`" in demo.install.__doc__
  assert "Not ``fakejax.pmap``. Code that" in demo.install.__doc__
  assert "keep what they were bound\n  to: ``from fakejax import jit``" in (
    demo.install.__doc__
  )
  # The examples of the docstrings run, against the package they name.
  namespace = types.ModuleType("jaxworks")
  namespace.demo = demo
  monkeypatch.setitem(sys.modules, "fakejax", mod)
  monkeypatch.setitem(sys.modules, "jaxworks", namespace)
  monkeypatch.setitem(sys.modules, "jaxworks.demo", demo)
  finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner()
  for f in (demo.install, demo.installed):
    for test in finder.find(f, f.__name__, globs={}):
      runner.run(test)
  assert runner.summarize(verbose=False) == (0, 10)
  assert mod.jit is stock_jit
