"""Typed stub of the C++ extension jaxworks.batched_transfer._checked_read (cc/_checked_read_module.cc)."""

from collections.abc import Sequence
from typing import Any

# Buffers: any object with the buffer protocol (collections.abc.Buffer from Python 3.12).

#: Whether the CRC-32C runs its vector path (x86-64 with AVX-512 and VPCLMULQDQ) on this CPU.
FAST: bool

def crc32c(data: Any, value: int = 0) -> int:
  """CRC-32C of a contiguous buffer, continuing ``value`` (0 to start)."""

def read_crc32c(
  fd: int, parts: Sequence[Any], offset: int, step: int, value: int = 0
) -> tuple[int, int]:
  """Reads file ``fd`` from ``offset`` into the writable buffers ``parts``, ``step`` bytes a read, each summed right
  after it is read; (bytes read, their CRC-32C continuing ``value``), fewer where the file ends or a read fails."""

def read_into(fd: int, parts: Sequence[Any], offset: int, step: int) -> int:
  """Reads file ``fd`` from ``offset`` into the writable buffers ``parts``, ``step`` bytes a read, with the GIL released
  once; the bytes read, fewer where the file ends or a read fails."""
