"""Swapping module attributes for replacements and back: one mechanism for
every jaxworks package's ``install()``, ``uninstall()`` and ``installed()``.

Every package that adopts a JAX entry point carries this file as
``jaxworks.<pkg>._src.swap`` (in the repository a link to
``tools/py/swap.py``, in each wheel a copy), like ``dep_check.py``: the
packages are versioned separately and share no code at run time. What a
package swaps is declared in its own ``_src/adopt.py``, which makes its
public ``is_installed``/``install``/``uninstall``/``installed`` with
:func:`adoption`.

A :class:`Swap` is a set of ``(module, attribute, replacement)`` entries that
change together. ``install()`` remembers what each attribute was and assigns
the replacements (a second call changes nothing); ``uninstall()`` puts back
what the latest ``install()`` found, and refuses, changing nothing, when other
code reassigned one of the attributes since; ``installed()`` does both around
a block. Each Swap has its own lock, so threads that install and uninstall
concurrently always leave a whole state behind, never half of one.

>>> import types
>>> mod = types.ModuleType("mod")
>>> mod.f = len
>>> s = Swap("jaxworks.demo", [(mod, "f", abs)])
>>> s.install()
>>> mod.f is abs, s.is_installed()
(True, True)
>>> s.uninstall()
>>> mod.f is len
True
>>> with s.installed():
...   mod.f(-2)
2
>>> mod.f is len
True
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
import contextlib
import threading
from types import ModuleType
from typing import Any
from typing import NamedTuple


class _Missing:
  """Stands for an attribute the module did not have (restoring it deletes
  the attribute again)."""

  def __repr__(self) -> str:
    return "<no such attribute>"


_MISSING: Any = _Missing()


def _set(module: ModuleType, attr: str, value: Any) -> None:
  if value is not _MISSING:
    setattr(module, attr, value)
  elif hasattr(module, attr):
    delattr(module, attr)


class Swap:
  """Module attributes swapped for replacements together.

  Args:
    api: the adopting package (``"jaxworks.jit_cache"``), named in errors as
      ``<api>.install`` / ``<api>.uninstall``.
    entries: ``(module, attribute name, replacement)`` triples, one per name
      to replace; at least one, each name once.
  """

  def __init__(
    self, api: str, entries: Sequence[tuple[ModuleType, str, Any]]
  ) -> None:
    self._api = api
    self._entries = tuple(entries)
    self._names = tuple(f"{m.__name__}.{a}" for m, a, _ in self._entries)
    if not self._entries:
      raise ValueError(f"Swap({api!r}): no entries; name at least one")
    if len(set(self._names)) != len(self._names):
      raise ValueError(
        f"Swap({api!r}): each attribute once, got {list(self._names)}"
      )
    self._replacements = tuple(r for _, _, r in self._entries)
    self._lock = threading.Lock()
    # What the attributes were before each install() that replaced them.
    self._saved: list[tuple[Any, ...]] = []

  def _current(self) -> tuple[Any, ...]:
    return tuple(getattr(m, a, _MISSING) for m, a, _ in self._entries)

  def _ours(self, current: tuple[Any, ...]) -> list[bool]:
    return [c is r for c, r in zip(current, self._replacements)]

  def _assign(self, values: tuple[Any, ...], undo: tuple[Any, ...]) -> None:
    """Sets every attribute to ``values``; when one assignment fails, sets
    those already done back to ``undo`` and re-raises (no half-done swap)."""
    done = 0
    try:
      for (module, attr, _), value in zip(self._entries, values):
        _set(module, attr, value)
        done += 1
    except BaseException:
      for (module, attr, _), value in zip(self._entries[:done], undo):
        _set(module, attr, value)
      raise

  def is_installed(self) -> bool:
    """True while every attribute is its replacement."""
    return all(self._ours(self._current()))

  def install(self) -> None:
    """Assigns every replacement, remembering what was there.

    Idempotent. Raises RuntimeError, changing nothing, when only some of the
    attributes are the replacements (other code reassigned the rest).
    """
    with self._lock:
      current = self._current()
      ours = self._ours(current)
      if all(ours):
        return
      if any(ours):
        others = "; ".join(
          f"{n} is {c!r:.80}"
          for n, c, o in zip(self._names, current, ours)
          if not o
        )
        raise RuntimeError(
          f"{self._api}.install: only part of it is installed ({others}, "
          f"not {self._api}'s); not completing it. Assign those back to "
          f"{self._api}'s and call uninstall(), or set them yourself"
        )
      self._assign(self._replacements, current)
      self._saved.append(current)

  def uninstall(self) -> None:
    """Puts back what the latest :meth:`install` replaced.

    Idempotent: without an earlier ``install()`` it changes nothing. Raises
    RuntimeError, changing nothing, when other code reassigned any of the
    attributes after ``install()``.
    """
    with self._lock:
      if not self._saved:
        return
      current = self._current()
      moved = [
        (n, c)
        for n, c, o in zip(self._names, current, self._ours(current))
        if not o
      ]
      if moved:
        now = "; ".join(
          f"{n} was reassigned after install() (it is now {c!r:.80})"
          for n, c in moved
        )
        raise RuntimeError(
          f"{self._api}.uninstall: {now}; not overwriting it. Restore that "
          f"assignment first, or set {', '.join(n for n, _ in moved)} yourself"
        )
      self._assign(self._saved[-1], current)
      self._saved.pop()

  @contextlib.contextmanager
  def installed(self) -> Iterator[None]:
    """The replacements inside the block; on exit every attribute is what it
    was on entry, also when the block raises."""
    with self._lock:
      before = self._current()
      self._assign(self._replacements, before)
    try:
      yield
    finally:
      with self._lock:
        self._assign(before, self._current())


class Adoption(NamedTuple):
  """A package's adoption API, as :func:`adoption` makes it."""

  is_installed: Callable[[], bool]
  install: Callable[[], None]
  uninstall: Callable[[], None]
  installed: Callable[[], contextlib.AbstractContextManager[None]]


def adoption(
  api: str,
  module: ModuleType,
  attr: str,
  replacement: Any,
  *,
  defined_in: str,
  keeps: str,
  note: str = "",
) -> Adoption:
  """The four public functions with which a package adopts one entry point.

  They swap ``module.attr`` for ``replacement`` (one :class:`Swap` of one
  entry) and carry the documentation of the package's own functions:
  ``replacement`` is called ``<api>.<attr>`` in it and the package
  ``<api>``'s last component (``jit_cache``).

  Args:
    api: the package (``"jaxworks.jit_cache"``).
    module: the module whose attribute is replaced (``jax``).
    attr: the attribute (``"jit"``); also the package's name for
      ``replacement``.
    replacement: what ``install()`` assigns.
    defined_in: the ``__name__`` of the module that binds the functions (they
      report it as their ``__module__``).
    keeps: the names that keep what they were bound to before ``install()``,
      as a phrase of ``install()``'s docstring.
    note: a sentence ``install()``'s docstring adds after the name it
      replaces (what it leaves alone, or why).
  """
  swap = Swap(api, [(module, attr, replacement)])
  pkg = api.rsplit(".", 1)[-1]
  target = f"{module.__name__}.{attr}"
  imports = f">>> import {module.__name__}\n  >>> from jaxworks import {pkg}"
  check = f"{target} is {pkg}.{attr}"

  def is_installed() -> bool:
    return swap.is_installed()

  def install() -> None:
    swap.install()

  def uninstall() -> None:
    swap.uninstall()

  def installed() -> contextlib.AbstractContextManager[None]:
    return swap.installed()

  is_installed.__doc__ = f"True while ``{target}`` is :func:`{api}.{attr}`."
  install.__doc__ = f"""Makes ``{target}`` be :func:`{api}.{attr}` for the process.

  Replaces exactly one name: the attribute ``{attr}`` of the
  ``{module.__name__}`` module.{note and " " + note} Code that looks
  ``{target}`` up when it runs then gets {pkg}'s. Names bound earlier keep what they were bound
  to: {keeps}. Idempotent: a second call changes nothing. Undo with
  :func:`uninstall`.

  {imports}
  >>> {pkg}.install()
  >>> {check}
  True
  >>> {pkg}.uninstall()
  >>> {check}
  False
  """
  uninstall.__doc__ = f"""Puts back the ``{target}`` that :func:`install` replaced.

  Idempotent: without an earlier ``install()`` (or after ``uninstall()``) it
  changes nothing. When ``install()`` found ``{target}`` already replaced by
  something else, that object is what comes back.

  Raises:
    RuntimeError: ``{target}`` was reassigned by other code after
      ``install()``; it is left as it is (restore that assignment first, or
      assign ``{target}`` yourself).
  """
  installed.__doc__ = f"""Context manager: ``{target}`` is {pkg}'s inside the block.

  On exit ``{target}`` is what it was on entry (still {pkg}'s when it was
  installed before the block), also when the block raises. Replaces the same
  single name as :func:`install`.

  {imports}
  >>> with {pkg}.installed():
  ...   {check}
  True
  >>> {check}
  False
  """
  functions = Adoption(is_installed, install, uninstall, installed)
  for f in functions:
    f.__module__ = defined_in
    f.__qualname__ = f.__name__
  return functions
