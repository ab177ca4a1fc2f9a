"""The files of a checkpoint several processes wrote: manifest and shard files.

``open_manifest`` opens the checkpoint directory once and reads
``jaxworks_manifest.json`` relative to that descriptor (a regular file of at
most ``MAX_MANIFEST_BYTES``), then checks its schema: every shard file name
relative and inside the directory, every shard inside its array, the shards'
volumes adding up to the array's. ``Manifest.open_shard`` opens a shard file
relative to the same directory descriptor (regular files only: a FIFO's open
does not block) and checks its .npy header against the manifest, before
anything is placed. ``Manifest.read_tasks`` reads a region of an array with
``preadv`` through the descriptors validated, so a checkpoint replaced at its
path while restore runs is read whole as it was validated, or refused.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from collections.abc import Iterator
import dataclasses
import io
import itertools
import json
import math
import os
from typing import Any

import numpy as np

from . import checksum
from . import files
from . import record as record_lib
from .sharded import MANIFEST
from .sharded import MANIFEST_FORMAT

#: The largest manifest restore reads (a damaged or hostile one may be huge).
MAX_MANIFEST_BYTES = 256 * 2**20
#: Runs of fewer bytes are read as one block of whole rows and copied.
SMALL_RUN = 256 * 2**10
_MAX_HEADER = 12 + 10_000  # numpy reads headers of at most 10,000 bytes
DIR_FLAGS = (
  os.O_RDONLY
  | getattr(os, "O_DIRECTORY", 0)
  | getattr(os, "O_CLOEXEC", 0)
  | os.O_NONBLOCK
)

Bounds = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Shard:
  file: str  # relative to the checkpoint directory
  start: tuple[int, ...]
  shape: tuple[int, ...]
  crc32c: tuple[int, ...] | None = None  # checksums of its data (checksum)


@dataclasses.dataclass
class Entry:
  shape: tuple[int, ...]
  dtype: np.dtype
  shards: list[Shard]
  # The grid: the shards' distinct starts along each dimension, sorted, and
  # the shard at each combination of starts.
  starts: list[list[int]] = dataclasses.field(default_factory=list)
  at: dict[tuple[int, ...], Shard] = dataclasses.field(default_factory=dict)

  def overlapping(self, want: Bounds) -> Iterator[Shard]:
    """The shards that overlap the region ``want`` (none if it is empty)."""
    ranges = [
      range(bisect.bisect_right(st, w0) - 1, bisect.bisect_left(st, w1))
      for st, (w0, w1) in zip(self.starts, want)
    ]
    for idx in itertools.product(*ranges):
      yield self.at[tuple(st[i] for st, i in zip(self.starts, idx))]


def _ints(v: Any, n: int | None, what: str) -> tuple[int, ...]:
  if not isinstance(v, list) or (n is not None and len(v) != n):
    raise ValueError(f"{what} is {v!r:.80}, not a list of {n or ''} ints")
  if not all(type(d) is int and d >= 0 for d in v):
    raise ValueError(f"{what} is {v!r:.80}, not non-negative ints")
  return tuple(v)


def _file_name(v: Any) -> str:
  if (
    not isinstance(v, str)
    or not v.endswith(".npy")
    or "\0" in v
    or os.path.isabs(v)
    or os.path.normpath(v) != v
    or ".." in v.split("/")
  ):
    raise ValueError(f"the shard file name {v!r:.80} is not a relative path")
  return v


def parse(data: bytes) -> dict[str, Entry]:
  """The arrays a manifest describes; ValueError/KeyError/TypeError if damaged."""
  m = json.loads(data.decode())
  if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
    raise ValueError(
      f"unknown format {m.get('format') if isinstance(m, dict) else m!r:.40}"
    )
  arrays = m["arrays"]
  if not isinstance(arrays, dict):
    raise TypeError("'arrays' is not an object")
  out: dict[str, Entry] = {}
  for key, a in arrays.items():
    shape = _ints(a["shape"], None, f"the shape of {key!r}")
    if not isinstance(a["dtype"], str):
      raise TypeError(f"the dtype of {key!r} is not a name")
    dtype = np.dtype(a["dtype"])
    if dtype.hasobject or dtype.fields is not None:
      raise ValueError(f"the dtype of {key!r} is {dtype}")
    shards = []
    for s in a["shards"]:
      file = _file_name(s["file"])
      start = _ints(s["start"], len(shape), f"the start of {file!r}")
      sshape = _ints(s["shape"], len(shape), f"the shape of {file!r}")
      if any(b + n > d for b, n, d in zip(start, sshape, shape)):
        raise ValueError(
          f"the shard {file!r} lies outside {key!r} {list(shape)}"
        )
      sums = s.get("crc32c")
      if sums is not None:
        sums = _ints(sums, None, f"the checksums of {file!r}")
      shards.append(Shard(file, start, sshape, sums))
    _check_grid(key, shape, shards)
    starts = [sorted({x.start[d] for x in shards}) for d in range(len(shape))]
    out[key] = Entry(shape, dtype, shards, starts, {x.start: x for x in shards})
  return out


def _check_grid(key: str, shape: tuple[int, ...], shards: list[Shard]) -> None:
  """The shards tile the array as a grid (as a sharding's shards do): along
  each dimension their extents partition it, and each cell is one shard."""
  cells = 1
  for d, n in enumerate(shape):
    end = 0
    extents = sorted({(s.start[d], s.start[d] + s.shape[d]) for s in shards})
    for a, b in extents:
      if a != end or (a == b and n):
        break
      end = b
    if end != n or (extents and extents[-1][1] != n):
      raise ValueError(f"the shards of {key!r} do not tile dimension {d}")
    cells *= len(extents)
  if len({(s.start, s.shape) for s in shards}) != len(shards) or (
    len(shards) != cells
  ):
    raise ValueError(f"the shards of {key!r} do not tile the array")


def read_small(
  api: str, path: str, dir_fd: int, name: str, what: str
) -> bytes | None:
  """The bytes of the regular file ``name`` of the checkpoint directory
  ``dir_fd`` (None if there is none), refusing one of more than
  ``MAX_MANIFEST_BYTES``."""
  file = os.path.join(path, name)
  try:
    fd, st = files._open_file(name, dir_fd)
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as err:
    raise ValueError(
      f"{api}: {what} {file!r} cannot be read: {err}; write the checkpoint "
      "again"
    ) from None
  try:
    data = files._read_all(fd, min(st.st_size, MAX_MANIFEST_BYTES) + 1)
  finally:
    os.close(fd)
  if len(data) > MAX_MANIFEST_BYTES:
    raise ValueError(
      f"{api}: {what} {file!r} holds more than {MAX_MANIFEST_BYTES} bytes "
      "(MAX_MANIFEST_BYTES), more than save writes; the checkpoint is "
      "damaged: write it again"
    )
  return data


def open_manifest(api: str, path: str) -> Manifest | None:
  """The opened manifest checkpoint at ``path``; None if ``path`` is not a
  directory or holds no manifest (a checkpoint one process wrote)."""
  try:
    dir_fd = os.open(path, DIR_FLAGS)
  except OSError:
    return None  # not a directory (or nothing): restore's other path says why
  try:
    data = read_small(api, path, dir_fd, MANIFEST, "the manifest")
    if data is None:
      os.close(dir_fd)
      return None
    file = os.path.join(path, MANIFEST)
    try:
      arrays = parse(data)
    except record_lib.DAMAGED as err:
      raise ValueError(
        f"{api}: the manifest {file!r} is damaged ({type(err).__name__}: "
        f"{err}); write the checkpoint again"
      ) from None
  except BaseException:
    os.close(dir_fd)
    raise
  return Manifest(api, path, dir_fd, arrays)


class Manifest:
  """An opened manifest checkpoint: the directory descriptor, the arrays, and
  the shard files opened and validated so far; ``close()`` closes them."""

  def __init__(
    self, api: str, path: str, dir_fd: int, arrays: dict[str, Entry]
  ) -> None:
    self.api, self.path, self.dir_fd, self.arrays = api, path, dir_fd, arrays
    self.stored: dict[str, files.Stored] = {}
    self._held = 0
    self._headers: dict[bytes, tuple[Any, bool, np.dtype, int]] = {}

  def close(self) -> None:
    for s in self.stored.values():
      if s.fd >= 0:
        os.close(s.fd)
        s.fd = -1
    if self.dir_fd >= 0:
      os.close(self.dir_fd)
      self.dir_fd = -1

  def __enter__(self) -> Manifest:
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def read_record(self) -> record_lib.Record:
    """The checkpoint's record (read relative to the directory), checked
    against the manifest's dtypes; an empty one where there is none."""
    data = read_small(
      self.api, self.path, self.dir_fd, record_lib.NAME, "the record"
    )
    if data is None:
      return record_lib.Record()
    where = f"the record {record_lib.NAME!r} of {self.path!r}"
    record = record_lib.decode(self.api, where, data)
    for key, name in record.dtypes.items():
      entry = self.arrays.get(key)
      if (
        entry is not None
        and files.exact_dtype(self.api, where, key, name) != entry.dtype
      ):
        raise ValueError(
          f"{self.api}: {where} says {name} for {key!r} but the manifest "
          f"says {entry.dtype.name}; the checkpoint is damaged"
        )
    return record

  def open_shard(self, key: str, entry: Entry, shard: Shard) -> files.Stored:
    """The validated shard file (opened relative to the directory)."""
    s = self.stored.get(shard.file)
    if s is not None:
      return s
    api, file = self.api, os.path.join(self.path, shard.file)
    try:
      fd, st = files._open_file(shard.file, self.dir_fd)
    except (OSError, ValueError) as err:
      raise ValueError(
        f"{api}: the shard file {file!r} of {key!r} cannot be read: {err}; "
        "restore reads regular files written by save"
      ) from None
    try:
      try:
        shape, fortran, dtype, offset = self._header(fd)
      except (OSError, ValueError, EOFError) as err:
        raise ValueError(
          f"{api}: the shard file {file!r} of {key!r} is not a readable .npy "
          f"file: {err}"
        ) from None
      s = files.Stored(
        tuple(shape), dtype, fortran, repr(file), st.st_size - offset, file,
        offset, None, fd=fd, dir_fd=self.dir_fd, name=shard.file,
        stamp=files.stamp(st),
        sums=None if shard.crc32c is None else list(shard.crc32c),
      )  # fmt: skip
      header = dtype.newbyteorder("=")
      bad = ""
      if s.shape != shard.shape:
        bad = f"holds {list(s.shape)}, the manifest says {list(shard.shape)}"
      elif dtype.itemsize != entry.dtype.itemsize or not (
        (dtype.kind == "V" and dtype.fields is None)
        or (dtype.isnative and header == entry.dtype)
      ):
        bad = f"holds {dtype.str}, the manifest says {entry.dtype.name}"
      elif s.data_bytes != math.prod(s.shape) * dtype.itemsize:
        bad = (
          f"holds {s.data_bytes} bytes of data but its header needs "
          f"{s.nbytes}; it is truncated or damaged"
        )
      if bad:
        raise ValueError(
          f"{api}: the shard file {file!r} of {key!r} {bad}. Nothing was placed"
        )
    except BaseException:
      os.close(fd)
      raise
    if self._held < files.HELD_FILES:
      self._held += 1
    else:  # opened again, relative to the directory, when read
      os.close(fd)
      s.fd = -1
    self.stored[shard.file] = s
    return s

  def _header(self, fd: int) -> tuple[Any, bool, np.dtype, int]:
    """(shape, fortran, dtype, data offset) of the .npy file ``fd``: parsed
    once per distinct header (the shards of an array share theirs)."""
    head = os.pread(fd, 12, 0)
    if len(head) < 10 or head[:6] != b"\x93NUMPY":
      raise ValueError("it has no .npy magic string")
    if head[6] == 1:
      size = 10 + int.from_bytes(head[8:10], "little")
    elif len(head) == 12:
      size = 12 + int.from_bytes(head[8:12], "little")
    else:
      raise EOFError("the header is cut short")
    if size > _MAX_HEADER:
      raise ValueError(f"its header is {size} bytes, more than numpy writes")
    raw = os.pread(fd, size, 0)
    parsed = self._headers.get(raw)
    if parsed is None:
      parsed = files._read_header(io.BytesIO(raw)) + (size,)
      if len(raw) == size:  # a whole header (else the line above raised)
        self._headers[raw] = parsed
    return parsed

  def pieces(
    self, key: str, entry: Entry, want: Bounds
  ) -> list[tuple[files.Stored, Shard]]:
    """The validated shard files overlapping the region ``want`` of ``key``
    (ValueError if they do not cover it)."""
    out, covered = [], 0
    for shard in entry.overlapping(want):
      inter = _intersect(shard, want)
      if inter is None:
        continue
      out.append((self.open_shard(key, entry, shard), shard))
      covered += math.prod(b - a for a, b in inter)
    if covered != math.prod(hi - lo for lo, hi in want):
      raise ValueError(
        f"{self.api}: the shards of {key!r} in the manifest of {self.path!r} "
        f"do not tile the array (region {list(want)}); the checkpoint is damaged"
      )
    return out


def _intersect(shard: Shard, want: Bounds) -> Bounds | None:
  inter = tuple(
    (max(s, w0), min(s + n, w1))
    for s, n, (w0, w1) in zip(shard.start, shard.shape, want)
  )
  return None if any(a >= b for a, b in inter) else inter


def read_tasks(
  pieces: list[tuple[files.Stored, Shard]],
  want: Bounds,
  out: np.ndarray,
  fds: dict[str, int],
  chunk: int,
  verified: set[tuple[str, int]] | None = None,
) -> list[Callable[[], None]]:
  """Calls that together read the region ``want`` into ``out`` (C order, of
  the region's shape) from the shard files, through ``fds`` (by file name).

  With ``verified`` (a set), a call that reads one whole checksum chunk of
  a file checks it, and ``(file name, chunk)`` is added to the set."""
  itemsize = out.dtype.itemsize
  dst = out.reshape(-1).view(np.uint8) if out.size else None
  tasks: list[Callable[[], None]] = []
  if dst is None:
    return tasks
  dshape = tuple(hi - lo for lo, hi in want) + (itemsize,)
  for s, shard in pieces:
    inter = _intersect(shard, want)
    if inter is None:
      continue
    sshape = shard.shape + (itemsize,)
    lo = tuple(a - st for (a, _), st in zip(inter, shard.start)) + (0,)
    ext = tuple(b - a for a, b in inter) + (itemsize,)
    dlo = tuple(a - w0 for (a, _), (w0, _) in zip(inter, want)) + (0,)
    name = s.name
    if s.fortran or (
      len(ext) > 1 and _tail_bytes(ext, sshape, dshape) < SMALL_RUN
    ):
      tasks.append(_block_task(s, fds, name, sshape, lo, ext, dshape, dlo, dst))
      continue
    k = _tail_dim(ext, sshape, dshape)
    run = math.prod(ext[k:])
    sstr, dstr = _strides(sshape), _strides(dshape)
    for lead in np.ndindex(*ext[:k]):
      src_off = sum((lo[i] + t) * sstr[i] for i, t in enumerate(lead))
      dst_off = sum((dlo[i] + t) * dstr[i] for i, t in enumerate(lead))
      src_off += lo[k] * sstr[k]
      dst_off += dlo[k] * dstr[k]
      for a in range(0, run, chunk):
        n = min(chunk, run - a)
        at = src_off + a  # in the file's data
        whole = (
          verified is not None
          and s.sums is not None
          and at % checksum.CHUNK == 0
          and n == min(checksum.CHUNK, s.nbytes - at)
        )
        if whole and verified is not None:
          verified.add((name, at // checksum.CHUNK))
        tasks.append(
          _run_task(
            fds,
            s,
            s.offset + at,
            dst[dst_off + a : dst_off + a + n],
            at // checksum.CHUNK if whole else None,
          )
        )
  return tasks


def _strides(shape: tuple[int, ...]) -> list[int]:
  return [math.prod(shape[i + 1 :]) for i in range(len(shape))]


def _tail_dim(ext: tuple, sshape: tuple, dshape: tuple) -> int:
  """The first dimension from which one copy is contiguous in both arrays."""
  k = len(ext) - 1
  while k > 0 and ext[k] == sshape[k] == dshape[k]:
    k -= 1
  return k


def _tail_bytes(ext: tuple, sshape: tuple, dshape: tuple) -> int:
  return math.prod(ext[_tail_dim(ext, sshape, dshape) :])


def _run_task(
  fds: dict[str, int],
  s: files.Stored,
  offset: int,
  view: np.ndarray,
  chunk: int | None = None,
) -> Callable[[], None]:
  """Reads ``view.size`` bytes at ``offset``; checks them as checksum chunk
  ``chunk`` of the file (None: no check)."""

  def task() -> None:
    try:
      sums = None if chunk is None else s.sums
      files.read_checked(
        fds[s.name], view.data, offset, 0, view.size, sums, chunk
      )
    except (OSError, EOFError, ValueError) as err:
      raise ValueError(f"{s.where} failed: {err}") from None

  return task


def verify_tasks(
  used: dict[str, files.Stored],
  fds: dict[str, int],
  verified: set[tuple[str, int]],
) -> list[Callable[[], None]]:
  """Calls that check the checksum chunks of the files in ``used`` that no
  read call checked (regions that cut through a chunk): each reads its
  chunk into a scratch buffer."""
  tasks: list[Callable[[], None]] = []
  for name, s in used.items():
    if s.sums is None:
      continue
    for k, at in enumerate(range(0, s.nbytes, checksum.CHUNK)):
      if (name, k) not in verified:
        n = min(checksum.CHUNK, s.nbytes - at)
        tasks.append(_run_task(fds, s, s.offset + at, np.empty(n, np.uint8), k))
  return tasks


def _block_task(s, fds, name, sshape, lo, ext, dshape, dlo, dst):
  """Reads whole rows of the shard (all of a Fortran-ordered one) and copies
  the region's part: for regions whose contiguous runs are small."""

  def task() -> None:
    if s.fortran:
      rows, first = sshape[0], 0
    else:
      rows, first = ext[0], lo[0]
    block = np.empty(math.prod(sshape[1:]) * rows, np.uint8)
    start = first * math.prod(sshape[1:])
    try:
      files._read_range(fds[name], block.data, s.offset + start, 0, block.size)
    except (OSError, EOFError) as err:
      raise ValueError(f"{s.where} failed: {err}") from None
    if s.fortran:  # the bytes of each element stay together
      n = len(sshape) - 1
      src = block.reshape(sshape[:-1][::-1] + sshape[-1:]).transpose(
        list(range(n - 1, -1, -1)) + [n]
      )
      src = src[tuple(slice(a, a + n) for a, n in zip(lo, ext))]
    else:
      src = block.reshape((rows,) + sshape[1:])
      src = src[
        (slice(None),) + tuple(slice(a, a + n) for a, n in zip(lo[1:], ext[1:]))
      ]
    region = dst.reshape(dshape)
    region[tuple(slice(a, a + n) for a, n in zip(dlo, ext))] = src

  return task
