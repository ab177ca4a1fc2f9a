"""Checksums of checkpoint data: CRC-32C of every ``CHUNK`` bytes of a file's
data (what follows its .npy header).

A list per file, not one value: restore reads an array's chunks on several
threads at once, and each thread checks the chunks it read. ``fastcrc``
releases the GIL and sums with carry-less multiplies (AVX-512 VPCLMULQDQ
where the CPU has it): about 100 GB/s a core on data in cache, against 28
GB/s for the CPU's CRC32 instruction alone (the ``crc32c`` package), so the
checks of a restore cost a few percent of its CPU time.
The writer computes them as it writes, in its writer thread. Where fastcrc
is missing (an install with ``pip --no-deps``), the crc32c package computes
the same values; with neither, only checksumming raises, with the fix.

>>> sums = Sums()
>>> sums.update(b"abc"); sums.update(b"def")
>>> sums.done() == of(memoryview(b"abcdef"))
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _implementation() -> Callable[[Any, int], int] | None:
  """fastcrc's CRC-32C, else crc32c's (the same values), else None."""
  try:
    from fastcrc.crc32 import iscsi

    return iscsi
  except ImportError:
    pass
  try:
    from crc32c import crc32c

    return crc32c
  except ImportError:
    return None


_crc32c = _implementation()

#: The package computing the checksums: "fastcrc", "crc32c" or None.
IMPLEMENTATION = None if _crc32c is None else _crc32c.__module__.split(".")[0]

#: Bytes per checksum (and per read call of one array's file).
CHUNK = 8 * 2**20


def _missing(data: Any, value: int = 0) -> int:
  raise ImportError(
    "jaxworks.batched_transfer checkpoints need a CRC-32C implementation: "
    "neither fastcrc (a requirement of jaxworks-batched-transfer) nor crc32c "
    "is installed. Fix: pip install 'fastcrc>=0.5'."
  )


_sum: Callable[[Any, int], int] = _crc32c if _crc32c is not None else _missing


def crc(data: Any, value: int = 0) -> int:
  """CRC-32C of ``data`` (a bytes-like object), continuing from ``value``."""
  return _sum(data, value)


def of(view: memoryview) -> list[int]:
  """The checksums of ``view``'s bytes, one per ``CHUNK``."""
  view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
  return [crc(view[lo : lo + CHUNK]) for lo in range(0, len(view), CHUNK)]


class Sums:
  """Checksums of a stream of bytes, one per ``CHUNK``, as it is written."""

  def __init__(self) -> None:
    self._sums: list[int] = []
    self._value = 0
    self._filled = 0

  def update(self, data: Any) -> None:
    view = memoryview(data).cast("B")
    while len(view):
      n = min(len(view), CHUNK - self._filled)
      self._value = crc(view[:n], self._value)
      self._filled += n
      view = view[n:]
      if self._filled == CHUNK:
        self._sums.append(self._value)
        self._value, self._filled = 0, 0

  def done(self) -> list[int]:
    """The checksums of everything written."""
    if self._filled:
      self._sums.append(self._value)
      self._value, self._filled = 0, 0
    return list(self._sums)


class Mismatch(ValueError):
  """Data that fails its checksum."""


def mismatch(k: int, got: int, expected: list[int], n: int) -> Mismatch:
  """The error for chunk ``k`` (``n`` bytes) whose CRC-32C is ``got``."""
  want = f"{expected[k]:#010x}" if k < len(expected) else "none"
  return Mismatch(
    f"its data fails the checksum check (CRC-32C of bytes "
    f"{k * CHUNK}-{k * CHUNK + n} of its data is {got:#010x}, the "
    f"checkpoint recorded {want}): the file is damaged"
  )


def check_views(
  expected: list[int] | None, views: list[memoryview], first: int = 0
) -> None:
  """``check`` of the bytes of ``views`` one after another (the parts of one
  range of an array held in buffers of their own, ``reader.Pieces``)."""
  if expected is None or len(views) == 1:
    check(expected, views[0], first)
    return
  sums = Sums()
  for view in views:
    sums.update(view)
  total = sum(len(memoryview(v).cast("B")) for v in views)
  for k, got in enumerate(sums.done(), first):
    if k >= len(expected) or got != expected[k]:
      raise mismatch(k, got, expected, min(CHUNK, total - (k - first) * CHUNK))


def check(expected: list[int] | None, view: memoryview, first: int = 0) -> None:
  """Raises Mismatch unless the chunks ``first, first + 1, ...`` whose bytes
  ``view`` holds (whole chunks, the last one maybe short) match ``expected``."""
  if expected is None:
    return
  view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
  for k, lo in enumerate(range(0, len(view), CHUNK), first):
    part = view[lo : lo + CHUNK]
    got = crc(part)
    if k >= len(expected) or got != expected[k]:
      raise mismatch(k, got, expected, len(part))
