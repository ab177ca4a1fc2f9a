"""Swapping module attributes for replacements and back: one mechanism for
every jaxworks package's ``install()``, ``uninstall()`` and ``installed()``.

Every package that adopts a JAX entry point carries this file as
``jaxworks.<pkg>._src.swap`` (in the repository a link to
``tools/py/swap.py``, in each wheel a copy), like ``dep_check.py``: the
packages are versioned separately and share no code at run time. What a
package swaps is declared in its own ``_src/adopt.py``.

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

from collections.abc import Iterator
from collections.abc import Sequence
import contextlib
import threading
from types import ModuleType
from typing import Any


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
