"""The host value save writes for a jax.Array: its distinct shards, in place.

A shard on a CPU device is host memory already, and ``np.asarray`` of it is
a view, not a copy. The view keeps the buffer alive after ``delete()``, and
JAX does not donate a buffer that a host view still references: the call
that asked for the donation copies instead. A blocking save writes the
views (nothing runs beside it). A non-blocking one copies them (``owned``,
in the save call: a training step donating its parameters would otherwise
copy every one of them at every step until the save is written: with a
256 MiB parameter, 3 steps of 110 ms took 240 ms each, and take 133 ms with
the copy, which costs 57 ms in the call). On an accelerator ``np.asarray``
is the device-to-host copy.

Off CPU, a non-blocking save's call copies its large leaves on their
devices where they have the memory (``copy_on_devices``: a byte copy, no
computation) and the writing thread takes the device-to-host copies
(``np.asarray`` waits without the GIL: the caller's thread ran with gaps
under 0.4 ms while a 64 MiB copy took 91 ms on a TPU v5e). There the call
of a 64 MiB leaf took 4.5 ms instead of 80 ms. CPU devices report no memory
and get no such copy: it would be a memcpy that the next donating step
waits for (the training loop with a 256 MiB array lost 864 ms per interval
that way, 529 ms with the copy in the call).

An array held by one device is written as its one view. A sharded array (of
at least 1 MiB: a smaller one is copied whole, which is cheaper) is
written shard by shard after the .npy header when its shards tile it by
leading rows (the bytes of each shard are then one contiguous run of the
file), and is assembled in the writing thread otherwise: never in the
caller's.

Every host copy save takes of a device array goes through ``host_copy``,
and every byte it writes of one through ``c_parts``: a host copy can come
back in any memory order (a TPU hands back column-major copies for some
shapes, and copies of a 3-D array strided neither C nor Fortran), and a
numpy leaf can have any strides (negative, zero, gaps). The files are
always in C order, as their headers say: ``c_parts`` gives the C-order
bytes of an array of any strides a block of rows at a time (one copy of at
most ``step`` bytes each, never of the whole array), and as views where the
array is C-contiguous already.
"""

from __future__ import annotations

from collections.abc import Iterator
import functools
import io
import threading
from typing import Any

import jax
import numpy as np

from .. import jax_internals
from . import checksum


class Shards:
  """The distinct shards of an array, as host arrays: ``pieces``, (start
  index, host array) in order of start."""

  def __init__(
    self,
    shape: tuple[int, ...],
    dtype: Any,
    pieces: list[tuple[tuple[int, ...], np.ndarray]],
  ) -> None:
    self.shape = tuple(shape)
    self.dtype = np.dtype(dtype)
    self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
    self.pieces = sorted(pieces, key=lambda p: p[0])

  def by_rows(self) -> bool:
    """Whether the pieces, in order, are consecutive blocks of whole rows."""
    row = 0
    for start, a in self.pieces:
      zeros = (0,) * (len(self.shape) - 1)
      if (start[0], start[1:], a.shape[1:]) != (row, zeros, self.shape[1:]):
        return False
      row += a.shape[0]
    return row == self.shape[0]

  def row_blocks(self) -> list[np.ndarray]:
    """The pieces in order (of ``by_rows`` shards: the array's rows)."""
    return [a for _, a in self.pieces]

  def assemble(self) -> np.ndarray:
    out = np.empty(self.shape, self.dtype)
    for start, a in self.pieces:
      out[tuple(slice(i, i + n) for i, n in zip(start, a.shape))] = a
    return out


def distinct_shards(x: jax.Array) -> list[tuple[tuple[int, ...], jax.Array]]:
  """(start index, single-device array) of each distinct shard of the fully
  addressable ``x`` (replica 0 of each), in order of start."""
  if len(x.sharding.device_set) == 1:
    return [((0,) * x.ndim, x)]
  shape, out = tuple(x.shape), []
  for s in x.addressable_shards:
    if s.replica_id == 0:
      out.append(
        (tuple(i.indices(n)[0] for i, n in zip(s.index, shape)), s.data)
      )
  return sorted(out, key=lambda p: p[0])


def host_copy(x: jax.Array) -> np.ndarray:
  """The host copy of a device array: a view of its buffer on CPU, the
  device-to-host copy elsewhere, in whatever memory order it comes back
  (the one place save takes one: ``of``, ``Shards`` and the collective
  save's checks of the leaves process 0 writes)."""
  return np.asarray(x)


def on_cpu(x: jax.Array) -> bool:
  """Whether ``x`` lies on CPU devices (its host copies are views)."""
  return all(
    getattr(d, "platform", None) == "cpu" for d in x.sharding.device_set
  )


def owned(value: Any, empty: Any) -> Any:
  """``value`` (an array, or ``of``'s ``Shards``) copied into new buffers
  ``empty(shape, dtype, fortran)`` gives (the copy keeps the memory order of
  a C- or Fortran-contiguous array, C order otherwise): a host value that
  holds no device buffer nor the caller's memory."""

  def copy(a: np.ndarray) -> np.ndarray:
    fortran = a.flags.f_contiguous and not a.flags.c_contiguous
    out, _ = empty(a.shape, a.dtype, fortran)
    np.copyto(out, a, casting="no")
    return out

  if isinstance(value, Shards):
    value.pieces = [(start, copy(a)) for start, a in value.pieces]
    return value
  return copy(np.asarray(value))


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
    return host_copy(x)
  pieces = [(start, host_copy(a)) for start, a in distinct_shards(x)]
  if len(pieces) == 1:
    return pieces[0][1]
  return Shards(x.shape, x.dtype, pieces)


#: A non-blocking save's call copies each leaf of at least this many bytes
#: on its devices where they have the memory (``copy_on_devices``), and the
#: writing thread takes its device-to-host copy: the call then does not wait
#: for it. A smaller leaf's device-to-host copy is waited for in the call.
DEVICE_COPY_MIN_BYTES = 1 << 20


def free_bytes(device: Any) -> int:
  """The bytes of ``device`` a save's device copies may take: its limit
  less its peak use so far (a training step's temporaries included); 0
  where it does not say (CPU devices)."""
  stats = device.memory_stats() or {}
  limit, peak = stats.get("bytes_limit"), stats.get("peak_bytes_in_use")
  if not isinstance(limit, int) or not isinstance(peak, int):
    return 0
  return max(0, limit - peak)


#: Bytes of each device held by ``OnDevice`` copies not yet let go (a
#: device's peak use may not show them yet: saves called one after another).
_held: dict[Any, int] = {}
_held_lock = threading.Lock()


class OnDevice:
  """A leaf's distinct shards copied on their devices (in the save call,
  the device-to-host copies started): the leaf's owner may donate or
  delete it at once. ``host()`` (in the writing thread) is its host value,
  as ``of`` gives it, and lets the device copies go (as does dropping it:
  a save that failed first)."""

  def __init__(
    self, x: jax.Array, pieces: list[tuple[tuple[int, ...], jax.Array]]
  ) -> None:
    self.shape, self.dtype = tuple(x.shape), np.dtype(x.dtype)
    self.pieces = pieces
    self.held = _device_bytes(pieces)
    with _held_lock:
      for d, n in self.held.items():
        _held[d] = _held.get(d, 0) + n

  def _let_go(self) -> None:
    held, self.held = self.held, {}
    with _held_lock:
      for d, n in held.items():
        _held[d] -= n

  def host(self) -> np.ndarray | Shards:
    pieces, self.pieces = self.pieces, []
    try:
      if len(pieces) == 1:  # the whole array (one device, or replicated)
        return host_copy(pieces[0][1])
      return Shards(
        self.shape, self.dtype, [(at, host_copy(a)) for at, a in pieces]
      )
    finally:
      del pieces
      self._let_go()

  def __del__(self) -> None:
    self._let_go()


def _device_bytes(pieces: list[tuple[tuple[int, ...], jax.Array]]) -> dict:
  """{device: bytes} of single-device ``pieces``."""
  out: dict[Any, int] = {}
  for _, a in pieces:
    d = next(iter(a.sharding.device_set))
    out[d] = out.get(d, 0) + a.nbytes
  return out


def copy_on_devices(leaves: list[Any]) -> dict[int, OnDevice]:
  """``{i: OnDevice}`` for the leaves a non-blocking save's call copies on
  their devices: the fully addressable jax.Arrays in device memory of at
  least ``DEVICE_COPY_MIN_BYTES``, largest first, while the shards fit each
  device's ``free_bytes`` less what earlier saves' copies still hold (none
  on CPU, where a host copy is a memcpy anyway). One batched copy
  (``jax.device_put(..., may_alias=False)``: the bytes as they are, no
  computation); their device-to-host copies start."""
  free: dict[Any, int] = {}
  chosen: list[tuple[int, list[tuple[tuple[int, ...], jax.Array]]]] = []
  big = [
    i
    for i, x in enumerate(leaves)
    if isinstance(x, jax.Array)
    and x.nbytes >= DEVICE_COPY_MIN_BYTES
    and x.is_fully_addressable
    and x.sharding.memory_kind in (None, "device")  # not host memory
    and not x.is_deleted()
  ]
  for i in sorted(big, key=lambda i: -leaves[i].nbytes):
    devices = leaves[i].sharding.device_set
    for d in devices:
      if d not in free:
        with _held_lock:
          held = _held.get(d, 0)
        free[d] = free_bytes(d) - held
    if all(free[d] <= 0 for d in devices):
      continue  # e.g. CPU devices: not even their shards looked at
    pieces = distinct_shards(leaves[i])
    need = _device_bytes(pieces)
    if all(free[d] >= n for d, n in need.items()):
      for d, n in need.items():
        free[d] -= n
      chosen.append((i, pieces))
  if not chosen:
    return {}
  flat = [a for _, pieces in chosen for _, a in pieces]
  copies = iter(
    jax_internals.stock_device_put(
      flat, [a.sharding for a in flat], may_alias=False
    )
  )
  out = {}
  for i, pieces in chosen:
    out[i] = OnDevice(leaves[i], [(at, next(copies)) for at, _ in pieces])
  for value in out.values():
    for _, a in value.pieces:
      a.copy_to_host_async()
  return out


def _flat_bytes(a: np.ndarray) -> np.ndarray:
  """The bytes of the C-contiguous array ``a``, as a flat uint8 view."""
  return a.reshape(-1).view(np.uint8)


def c_blocks(a: np.ndarray, step: int) -> Iterator[np.ndarray]:
  """The C-order bytes of ``a`` (any strides: C, Fortran, neither, negative
  or zero), as flat uint8 arrays one after another: views of ``step`` bytes
  where ``a`` is C-contiguous, else copies of blocks of rows of at most
  ``step`` bytes (or of one element), so that no copy of the whole array is
  made."""
  if a.flags.c_contiguous:
    flat = _flat_bytes(a)
    for lo in range(0, flat.size, step):
      yield flat[lo : lo + step]
    return
  if not a.size:
    return
  # Dimensions k.. fit in one block whole; dimension k - 1 is cut into runs
  # of ``rows`` of them, for every index of the dimensions before it.
  k, inner = a.ndim, a.itemsize
  while k and inner * a.shape[k - 1] <= step:
    k -= 1
    inner *= a.shape[k]
  if not k:
    yield _flat_bytes(np.ascontiguousarray(a))
    return
  rows, n = max(1, step // inner), a.shape[k - 1]
  for index in np.ndindex(*a.shape[: k - 1]):
    sub = a[index]
    for lo in range(0, n, rows):
      yield _flat_bytes(np.ascontiguousarray(sub[lo : lo + rows]))


def c_parts(value: np.ndarray | Shards, step: int) -> Iterator[memoryview]:
  """The C-order bytes of ``value`` (an array, or the shards of one that tile
  it by rows), in parts of at most ``step`` bytes (``c_blocks``)."""
  arrays = [value] if isinstance(value, np.ndarray) else value.row_blocks()
  for a in arrays:
    for block in c_blocks(a, step):
      yield block.data


def c_views(value: np.ndarray | Shards) -> list[np.ndarray] | None:
  """The C-order bytes of ``value`` as flat uint8 views, one after another,
  where it has them without a copy (a C-contiguous array, or shards that
  tile it by rows, each C-contiguous); else None (``c_parts`` copies)."""
  if isinstance(value, np.ndarray):
    arrays = [value]
  elif value.by_rows():
    arrays = value.row_blocks()
  else:
    return None
  if not all(a.flags.c_contiguous for a in arrays):
    return None
  return [_flat_bytes(a) for a in arrays]


def digest(value: np.ndarray | Shards) -> list[int]:
  """The checksums (checksum.Sums) of the data save writes of ``value``."""
  if isinstance(value, Shards) and not value.by_rows():
    value = value.assemble()
  sums = checksum.Sums()
  for part in c_parts(value, checksum.CHUNK):
    sums.update(part)
  return sums.done()


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


def write_header(f: Any, shape: tuple[int, ...], dtype: np.dtype) -> None:
  """Writes the .npy header of a C-order array of ``shape`` and ``dtype``
  (raw bytes of its size where a header cannot name it: header_dtype)."""
  f.write(_header(tuple(shape), np.dtype(dtype)))


@functools.lru_cache(maxsize=4096)
def _header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
  """write_header's bytes (numpy formats them in Python: kept for the
  shapes saved again at every interval, off the GIL of a training loop)."""
  header = {
    "descr": np.lib.format.dtype_to_descr(header_dtype(dtype)),
    "fortran_order": False,  # c_parts writes C order, whatever the strides
    "shape": shape,
  }
  out = io.BytesIO()
  try:
    np.lib.format.write_array_header_1_0(out, header)
  except ValueError:  # a header over 64 KiB
    np.lib.format.write_array_header_2_0(out, header)
  return out.getvalue()


#: Bytes of one write call of a raw file (each then summed while the core's
#: cache holds it). Saving 1 GiB from a TPU v5e on its VM's 9p file system:
#: 1 MiB writes 0.72 GB/s, 8 MiB 0.69, 64 MiB 0.58; no difference on ext4.
WRITE_STEP = 1 << 20


def write_npy(
  f: Any, value: np.ndarray | Shards, step: int = WRITE_STEP
) -> list[int]:
  """Writes ``value`` to the binary file object ``f`` as one .npy file in C
  order, whatever its strides (``c_parts``), ``step`` bytes per write, each
  summed right after; returns the checksums of its data (checksum.Sums).

  The data goes through ``f.write`` (numpy's ``tofile`` would lose the
  errno of a failed write: ENOSPC, EFBIG)."""
  if isinstance(value, Shards) and not value.by_rows():
    value = value.assemble()
  write_header(f, tuple(value.shape), value.dtype)
  sums = checksum.Sums()
  for part in c_parts(value, step):
    f.write(part)
    sums.update(part)
  return sums.done()
