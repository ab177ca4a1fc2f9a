"""A bounded mapping that evicts its least recently used entries: the one LRU
of every jaxworks package.

Every package that bounds a cache carries this file as
``jaxworks.<pkg>._src.lru`` (in the repository a link to ``tools/py/lru.py``,
in each wheel a copy), like ``swap.py``. It holds no lock: each cache keeps
the lock it already has around its lookups and insertions.

>>> c = LRU(2)
>>> c.put("a", 1), c.put("b", 2)
([], [])
>>> c.get("a")
1
>>> c.put("c", 3)
[('b', 2)]
>>> list(c)
['a', 'c']
>>> c.resize(1)
[('a', 1)]
>>> c.refresh("c"); c.peek("c"), c.peek("zz")
(3, None)
>>> c.popitem()
('c', 3)
>>> LRU(0).put("x", 1)
[('x', 1)]
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Iterator
from typing import Generic
from typing import TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_MISSING = object()


class LRU(Generic[K, V]):
  """Entries in use order, oldest first, at most ``maxsize`` of them.

  Args:
    maxsize: the bound; ``None`` for none (entries are then only ordered).

  :meth:`get`, :meth:`put` and ``refresh`` make an entry the newest;
  ``peek``, iteration and ``in`` do not. A key keeps the object it was
  first stored under while it stays (a weak reference with a callback stays
  that reference when an equal one refreshes it). Whatever an insertion or
  :meth:`resize` evicts is returned, oldest first, so that the caller can
  release it outside its lock.

  ``peek(key, default=None)`` (the value without changing the order) and
  ``refresh(key)`` (makes ``key`` the newest; KeyError if absent) are the
  underlying ordered dict's own ``get`` and ``move_to_end``, bound at
  construction: a lookup's hot path pays no Python call for them, and under
  the GIL each is one step that needs no lock against the other operations.
  """

  __slots__ = ("_maxsize", "_data", "peek", "refresh")

  peek: Callable[..., V | None]
  refresh: Callable[[K], None]

  def __init__(self, maxsize: int | None = None):
    self._maxsize = _checked(maxsize)
    # Never replaced: ``peek`` and ``refresh`` are bound to it.
    self._data: collections.OrderedDict[K, V] = collections.OrderedDict()
    self.peek = self._data.get
    self.refresh = self._data.move_to_end

  @property
  def maxsize(self) -> int | None:
    return self._maxsize

  def get(self, key: K, default: V | None = None) -> V | None:
    """The value of ``key``, made the newest entry; ``default`` if absent."""
    value = self._data.get(key, _MISSING)
    if value is _MISSING:
      return default
    self._data.move_to_end(key)
    return value  # type: ignore[return-value]

  def put(self, key: K, value: V) -> list[tuple[K, V]]:
    """Sets ``key`` as the newest entry; returns the entries evicted."""
    self._data[key] = value
    self._data.move_to_end(key)
    return self._evict()

  def pop(self, key: K, default: V | None = None) -> V | None:
    """Removes ``key``; its value, or ``default`` if absent."""
    return self._data.pop(key, default)

  def popitem(self) -> tuple[K, V]:
    """Removes and returns the oldest entry (KeyError if there is none)."""
    return self._data.popitem(last=False)

  def resize(self, maxsize: int | None) -> list[tuple[K, V]]:
    """Sets the bound; returns the entries that no longer fit."""
    self._maxsize = _checked(maxsize)
    return self._evict()

  def clear(self) -> list[tuple[K, V]]:
    """Removes every entry; returns them, oldest first."""
    gone = list(self._data.items())
    self._data.clear()
    return gone

  def items(self) -> list[tuple[K, V]]:
    """The entries, oldest first (a copy)."""
    return list(self._data.items())

  def values(self) -> list[V]:
    """The values, oldest first (a copy)."""
    return list(self._data.values())

  def __contains__(self, key: object) -> bool:
    return key in self._data

  def __iter__(self) -> Iterator[K]:
    return iter(list(self._data))

  def __len__(self) -> int:
    return len(self._data)

  def __repr__(self) -> str:
    return f"LRU(maxsize={self._maxsize}, entries={len(self._data)})"

  def _evict(self) -> list[tuple[K, V]]:
    if self._maxsize is None:
      return []
    evicted = []
    while len(self._data) > self._maxsize:
      evicted.append(self._data.popitem(last=False))
    return evicted


def _checked(maxsize: int | None) -> int | None:
  if maxsize is not None and (
    isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 0
  ):
    raise ValueError(
      f"LRU: maxsize must be a non-negative int or None, got {maxsize!r}"
    )
  return maxsize
