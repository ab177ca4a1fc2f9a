"""The host value save writes for a jax.Array: its distinct shards, in place.

A shard on a CPU device is host memory already, and ``np.asarray`` of it is
a view, not a copy. The view keeps the buffer alive after ``delete()``, and
JAX does not donate a buffer that a host view still references (the call
that asked for the donation copies instead), so a view is as safe to write
in the background as a private copy and costs nothing to take. On an
accelerator ``np.asarray`` is the device-to-host copy.

An array held by one device is written as its one view. A sharded array (of
at least 1 MiB: a smaller one is copied whole, which is cheaper) is
written shard by shard after the .npy header when its shards tile it by
leading rows (the bytes of each shard are then one contiguous run of the
file), and is assembled in the writing thread otherwise: never in the
caller's.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from . import checksum


class Shards:
  """The distinct shards of a fully addressable jax.Array, as host views."""

  def __init__(self, x: jax.Array) -> None:
    self.shape = tuple(x.shape)
    self.dtype = np.dtype(x.dtype)
    self.nbytes = int(x.nbytes)
    self.pieces: list[tuple[tuple[int, ...], np.ndarray]] = []
    for s in x.addressable_shards:
      if s.replica_id == 0:
        start = tuple(i.indices(n)[0] for i, n in zip(s.index, self.shape))
        self.pieces.append((start, np.asarray(s.data)))
    self.pieces.sort(key=lambda p: p[0])

  def by_rows(self) -> bool:
    """Whether the pieces, in order, are consecutive blocks of whole rows."""
    row = 0
    for start, a in self.pieces:
      zeros = (0,) * (len(self.shape) - 1)
      if (start[0], start[1:], a.shape[1:]) != (row, zeros, self.shape[1:]):
        return False
      row += a.shape[0]
    return row == self.shape[0]

  def assemble(self) -> np.ndarray:
    out = np.empty(self.shape, self.dtype)
    for start, a in self.pieces:
      out[tuple(slice(i, i + n) for i, n in zip(start, a.shape))] = a
    return out


def start_copy(x: Any) -> None:
  """Starts the device-to-host copy of a live jax.Array (no-op otherwise)."""
  if isinstance(x, jax.Array) and not x.is_deleted():
    x.copy_to_host_async()


#: A sharded array smaller than this is assembled by one ``np.asarray`` (a
#: copy of at most 1 MiB) instead of held shard by shard: the Python work per
#: shard costs more than copying it.
SHARDS_MIN_BYTES = 1 << 20


def of(x: jax.Array) -> np.ndarray | Shards:
  """The host value of ``x``: a view (or copy, off CPU) of its one buffer,
  or, for an array of at least ``SHARDS_MIN_BYTES`` that several devices
  hold parts of, its shards."""
  if (
    len(x.sharding.device_set) == 1
    or not x.is_fully_addressable
    or x.nbytes < SHARDS_MIN_BYTES
  ):
    return np.asarray(x)
  shards = Shards(x)
  if len(shards.pieces) == 1:
    return shards.pieces[0][1]
  return shards


def raw(a: np.ndarray) -> memoryview:
  """The C-order bytes of ``a``, without a copy when it is contiguous."""
  return np.ascontiguousarray(a).reshape(-1).view(np.uint8).data


def header_dtype(dtype: np.dtype) -> np.dtype:
  """``dtype``, or raw bytes of its size when an .npy header cannot name it
  (bfloat16, float8, int4, ...: the dtype record names them)."""
  try:
    descr = np.lib.format.dtype_to_descr(dtype)
    if np.lib.format.descr_to_dtype(descr) == dtype:
      return dtype
  except (TypeError, ValueError):
    pass
  return np.dtype(f"V{dtype.itemsize}")


def _header(f: Any, shape: tuple[int, ...], dtype: np.dtype, fortran: bool):
  header = {
    "descr": np.lib.format.dtype_to_descr(dtype),
    "fortran_order": fortran,
    "shape": shape,
  }
  try:
    np.lib.format.write_array_header_1_0(f, header)
  except ValueError:  # a header over 64 KiB
    np.lib.format.write_array_header_2_0(f, header)


def write_npy(
  f: Any, value: np.ndarray | Shards, step: int = checksum.CHUNK
) -> list[int]:
  """Writes ``value`` to the binary file object ``f`` as one .npy file,
  ``step`` bytes per write, each summed right after; returns the checksums
  of its data (checksum.Sums).

  The data goes through ``f.write`` (numpy's ``tofile`` would lose the
  errno of a failed write: ENOSPC, EFBIG)."""
  if isinstance(value, Shards) and not value.by_rows():
    value = value.assemble()
  stored = header_dtype(value.dtype)
  sums = checksum.Sums()
  if isinstance(value, np.ndarray):
    a = value.view(stored)
    fortran = a.flags.f_contiguous and not a.flags.c_contiguous
    _header(f, a.shape, stored, bool(fortran))
    pieces = [a.T if fortran else a]
  else:
    _header(f, value.shape, stored, False)
    pieces = [a.view(stored) for _, a in value.pieces]
  for a in pieces:
    data = raw(a)
    for lo in range(0, len(data), step):
      part = data[lo : lo + step]
      f.write(part)
      sums.update(part)
  return sums.done()
