"""The one file reader every read path of a checkpoint uses.

Files are opened relative to a directory descriptor (regular files only,
since a FIFO's open does not block restore but its read would), so a
checkpoint replaced at its path meanwhile is read as it was opened; reads
are bounded. ``Files.read`` reads an array's bytes through the descriptor
its header came from, checked as they are read, straight into a new
aligned buffer of its own memory map, which on CPU the placed array can
take over.

A stored array is a ``Stored`` (what its header says and how its data is
checked); one in a local file is a ``StoredFile`` (its descriptor and
stamp), one in a bucket a ``restore_objects.StoredObject``. What reads
them is a ``Reader`` (buffers, checks, decompression): ``Files`` for local
files, ``restore_objects.ObjectFiles`` for objects; both read ranges with
``read_range`` and ``read_checked``.

>>> import os, tempfile, numpy as np
>>> d = tempfile.mkdtemp()
>>> np.save(os.path.join(d, "x.npy"), np.arange(3, dtype=np.int32))
>>> dir_fd = os.open(d, DIR_FLAGS)
>>> fd, st = open_file("x.npy", dir_fd)
>>> (shape, fortran, dtype, offset) = read_npy_header(fd)
>>> s = StoredFile(shape, dtype, fortran, "x", st.st_size - offset, "x",
...                offset, None, fd=fd, stamp=stamp(st))
>>> load("api", "<root>", "x", s, Files()).tolist()
[0, 1, 2]
>>> os.close(fd); os.close(dir_fd)
"""

from __future__ import annotations

import abc
import concurrent.futures
import dataclasses
import errno
import io
import math
import mmap
import os
import stat
import threading
import typing
from typing import Any
import zipfile
import zlib

import numpy as np

from ... import _checked_read
from . import checksum
from . import codec
from . import format


@dataclasses.dataclass
class Stored:
  """One array on disk: its header, where its data lies, and how to get it."""

  shape: tuple[int, ...]
  # As the .npy header says (may be raw void bytes, may be big-endian).
  dtype: np.dtype
  fortran: bool
  where: str  # "'<file>'" or "member '<name>' of '<file>'", for messages
  data_bytes: int  # the bytes of data present after the header
  file: str  # the path of the file holding the data, for messages
  offset: int  # where the data starts in the file
  member: str | None  # a compressed .npz member (read through zipfile), or None
  exact: np.dtype | None = None  # the dtype the record names (None: no record)
  # The file's name in the checkpoint (a shard file's: what ``read_tasks``'
  # handles are keyed by); a local file is opened again by it.
  name: str = ""
  # What the data is checked against when read: the record's CRC-32C of
  # each chunk of a file's data, or an .npz member's CRC-32 (zip's own) with
  # the CRC-32 of its .npy header, where the data continues it.
  sums: list[int] | None = None
  zip_crc: int | None = None
  header_crc: int = 0
  # The codec of a compressed file (see codec): its data is decompressed
  # whole from the file's start (``offset`` 0), or None for raw data.
  codec: str | None = None
  # Where the data is read into buffers of its own per device (``Pieces``):
  # the byte ranges of the data each device holds, in order; else None.
  pieces: list[tuple[int, int]] | None = None

  @property
  def nbytes(self) -> int:
    """The bytes of data the header describes (Python ints: a shape whose
    byte count overflows int64 is that many bytes, never a wrapped one)."""
    return math.prod(self.shape) * self.dtype.itemsize

  @property
  def value_dtype(self) -> np.dtype:
    """The dtype of the values: the recorded one, else the header's, in native order."""
    return self.dtype.newbyteorder("=") if self.exact is None else self.exact


@dataclasses.dataclass
class StoredFile(Stored):
  """An array in a local file, read through a descriptor (``Files``)."""

  # The descriptor the header was read from (-1: closed after validation, to
  # be opened again as ``name`` relative to ``dir_fd`` and checked to be the
  # same file), and (device, inode, size, mtime) of the file when validated.
  fd: int = -1
  dir_fd: int = -1
  stamp: tuple[int, ...] = ()


def read_header(f: Any) -> tuple[tuple[int, ...], bool, np.dtype]:
  """(shape, fortran, dtype) of the .npy header at ``f``'s position."""
  version = np.lib.format.read_magic(f)
  if version == (1, 0):
    return np.lib.format.read_array_header_1_0(f)
  return np.lib.format.read_array_header_2_0(f)


_MAX_HEADER = 12 + 10_000  # numpy reads headers of at most 10,000 bytes


OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)

# Descriptors a directory checkpoint keeps open from validation to reading;
# files past this many are opened again when read (a process may open only
# RLIMIT_NOFILE files, often 1024).
HELD_FILES = 256

DIR_FLAGS = (
  os.O_RDONLY
  | getattr(os, "O_DIRECTORY", 0)
  | getattr(os, "O_CLOEXEC", 0)
  | os.O_NONBLOCK
)


class CheckpointReplacedError(FileNotFoundError):
  """A file that the checkpoint's record names is gone: the checkpoint was
  replaced or deleted while it was read (its files go only after another
  save committed, or a delete). ``restore`` and ``metadata`` then read the
  path again, from its commit point; never a partial tree."""


def replaced(api: str, file: str) -> CheckpointReplacedError:
  """The error of a read that finds ``file`` (as errors name it) gone."""
  return CheckpointReplacedError(
    f"{api}: {file} is gone: the checkpoint was replaced or deleted while "
    "it was read, and nothing of it is returned"
  )


def moved(dir_fd: int, path: str) -> bool:
  """Whether the directory ``dir_fd``, opened at ``path``, is no longer
  there (deleted, or another one renamed over it)."""
  st = os.fstat(dir_fd)
  try:
    now = os.stat(path)
  except (FileNotFoundError, NotADirectoryError):
    return True
  return st.st_nlink == 0 or (st.st_dev, st.st_ino) != (now.st_dev, now.st_ino)


# What a file of the checkpoint is, not what the system did: a symlink loop,
# a socket, a directory where a file belongs.
_CONTENT_ERRNOS = frozenset({errno.ELOOP, errno.ENXIO, errno.EISDIR})


def unreadable(message: str, err: BaseException, fix: str) -> Exception:
  """The error of a file restore cannot open or read: ``message`` (naming
  the API and the file) and ``err``. An error of the system (EIO, EACCES,
  EMFILE, ...) stays an OSError of its errno (its class: PermissionError,
  say), which code retrying I/O errors catches; an unreadable file of the
  checkpoint is ValueError, with ``fix``."""
  if (
    isinstance(err, OSError)
    and err.errno is not None
    and err.errno not in _CONTENT_ERRNOS
  ):
    detail = err.strerror or str(err)
    if err.filename is not None and str(err.filename) not in message:
      detail += f": {err.filename!r}"
    return OSError(err.errno, f"{message}: {detail}")
  return ValueError(f"{message}: {err}; {fix}")


def gone(
  api: str, file: str, name: str, dir_fd: int, key: str | None = None
) -> FileNotFoundError:
  """The error for the file ``name`` of the checkpoint directory ``dir_fd``
  (``file``: its path) found missing: ``CheckpointReplacedError`` where the directory is no
  longer at its path (a save replaced it, or it was deleted: read it
  again); else the checkpoint is damaged (a file deleted from it, or a
  partial copy), an error naming the array ``key`` and the fix."""
  root = file[: -len(name)].rstrip(os.sep) if file.endswith(name) else file
  if dir_fd < 0 or moved(dir_fd, root or os.sep):
    return replaced(api, repr(file))
  what = f" of the array at {key!r}" if key is not None else ""
  return FileNotFoundError(
    errno.ENOENT,
    f"{api}: {file!r}{what} is missing from the checkpoint {root!r}, whose "
    "record names it (it was deleted from the checkpoint, or the checkpoint "
    "was copied in part); copy the whole checkpoint again, or restore "
    "another one",
    file,
  )


#: How many times restore and metadata read a path whose checkpoint is
#: replaced or deleted under them (``CheckpointReplacedError``) before they raise.
READ_TRIES = 4


def stamp(st: os.stat_result) -> tuple[int, ...]:
  """What identifies a file's contents: device, inode, size, modification time."""
  return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def open_file(
  name: str, dir_fd: int | None = None
) -> tuple[int, os.stat_result]:
  """(descriptor, fstat) of a regular file; a FIFO's open does not block."""
  fd = os.open(name, OPEN_FLAGS | os.O_NONBLOCK, dir_fd=dir_fd)
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      raise ValueError("it is not a regular file")
    return fd, st
  except BaseException:
    os.close(fd)
    raise


def open_named(
  api: str, file: str, dir_fd: int, name: str, key: str, what: str = ""
) -> tuple[int, os.stat_result]:
  """(descriptor, fstat) of the file ``name`` of the checkpoint directory
  ``dir_fd`` (``file``: its path), which holds the array at ``key``: a
  missing one raises ``gone``'s error, any other failure ``unreadable``'s,
  naming ``what`` the file is ("the shard file ... of ..."; default: the
  file)."""
  try:
    return open_file(name, dir_fd)
  except FileNotFoundError:
    raise gone(api, file, name, dir_fd, key) from None
  except (OSError, ValueError) as err:
    raise unreadable(
      f"{api}: {what or repr(file)} cannot be read",
      err,
      "restore reads regular files written by save",
    ) from None


def read_all(fd: int, size: int) -> bytes:
  """The first ``size`` bytes of a file (fewer if it is shorter)."""
  parts, done = [], 0
  while done < size:
    b = os.pread(fd, size - done, done)
    if not b:
      break
    parts.append(b)
    done += len(b)
  return b"".join(parts)


def read_small(
  api: str, path: str, dir_fd: int, name: str, what: str
) -> bytes | None:
  """The bytes of the regular file ``name`` of the checkpoint directory
  ``dir_fd`` (None if there is none), refusing one of more than
  ``format.MAX_MANIFEST_BYTES``."""
  file = os.path.join(path, name)
  try:
    fd, st = open_file(name, dir_fd)
  except FileNotFoundError:
    return None
  except (OSError, ValueError) as err:
    raise unreadable(
      f"{api}: {what} {file!r} cannot be read",
      err,
      "write the checkpoint again",
    ) from None
  try:
    data = read_all(fd, min(st.st_size, format.MAX_MANIFEST_BYTES) + 1)
  finally:
    os.close(fd)
  if len(data) > format.MAX_MANIFEST_BYTES:
    raise ValueError(
      f"{api}: {what} {file!r} holds more than {format.MAX_MANIFEST_BYTES} bytes "
      "(MAX_MANIFEST_BYTES), more than save writes; the checkpoint is "
      "damaged: write it again"
    )
  return data


def read_npy_header(
  fd: int, cache: dict[bytes, tuple[Any, bool, np.dtype, int]] | None = None
) -> tuple[Any, bool, np.dtype, int]:
  """(shape, fortran, dtype, data offset) of the .npy file ``fd``, read with
  ``pread`` (at most numpy's largest header); with ``cache``, parsed once
  per distinct header (the shards of an array share theirs)."""
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
  parsed = None if cache is None else cache.get(raw)
  if parsed is None:
    parsed = read_header(io.BytesIO(raw)) + (size,)
    if cache is not None and len(raw) == size:  # a whole header
      cache[raw] = parsed
  return parsed


#: What the CPU runtime needs to take a host buffer over without a copy.
ALIGN = 64

#: An array of at least this many bytes gets a memory map of its own; smaller
#: ones are carved out of shared maps of ``SLAB`` bytes.
OWN_MAP = 64 * 2**10

SLAB = 2**20

#: Maps of at least this many bytes ask for transparent huge pages: the
#: kernel zeroes and maps a restore's new memory 2 MiB at a time (with 4 KiB
#: pages, page faults take most of a large restore's time).
HUGE_PAGE = 2 * 2**20

_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def anonymous_map(nbytes: int, huge_pages: bool = True) -> mmap.mmap:
  """A new private anonymous map of ``nbytes`` (huge pages from
  ``HUGE_PAGE``, unless ``huge_pages`` is false)."""
  m = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE)
  if huge_pages and nbytes >= HUGE_PAGE and _MADV_HUGEPAGE is not None:
    try:
      m.madvise(_MADV_HUGEPAGE)
    except OSError:  # huge pages switched off: the map keeps 4 KiB pages
      pass
  return m


class HostMemory:
  """New host buffers for the arrays of one restore, in anonymous memory maps.

  Not from malloc: restore's buffers are allocated on its reader thread and
  freed wherever the placed arrays die, and glibc keeps such memory in the
  reader thread's arena (a new thread each restore, up to 8 arenas per core)
  for reuse there: the process grows with every dropped restore, and
  ``malloc_trim`` does not return it. A map goes back
  to the OS when the last array using it is collected. Maps are page-aligned;
  small arrays share one (``ALIGN``-aligned inside it) so that a 4-byte leaf
  does not take a page. Used by one thread at a time.

  ``huge_pages``: large maps ask for transparent huge pages (see
  ``HUGE_PAGE``): right where the data comes from the page cache, faster
  than memory can be faulted in 4 KiB at a time (a local restore of 1 GiB:
  ~600 ms -> ~160 ms). A bucket's data arrives at network speed, which hides
  4 KiB faults, while huge pages made its restores bimodal here (a restore of
  16 x 64 MiB from the local S3 server: 1.1 s or 1.8-2.1 s, the slow ones
  spending 1.4 s of system time zeroing huge pages against 0.5 s; with 4 KiB
  pages 1.17-1.27 s, 0.85 s of system time, every time): restores from
  buckets pass False.
  """

  def __init__(self, huge_pages: bool = True) -> None:
    self._huge_pages = huge_pages
    self._slab: mmap.mmap | None = None
    self._used = SLAB

  def empty(
    self, shape: tuple[int, ...], dtype: np.dtype, fortran: bool = False
  ) -> tuple[np.ndarray, np.ndarray]:
    """(array, its bytes): a new uninitialized array whose data starts on an
    ``ALIGN``-byte boundary, and a flat uint8 view of the same memory."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= OWN_MAP:
      buf, start = anonymous_map(nbytes, self._huge_pages), 0
    else:
      start = self._used + (-self._used % ALIGN)
      if self._slab is None or start + nbytes > SLAB:
        self._slab, start = anonymous_map(SLAB, self._huge_pages), 0
      buf = self._slab
      self._used = start + nbytes
    flat = np.ndarray((nbytes,), np.uint8, buffer=buf, offset=start)
    array = np.ndarray(
      shape, dtype, buffer=buf, offset=start, order="F" if fortran else "C"
    )
    return array, flat


class Pieces:
  """An array read as the parts its devices hold, each in a buffer of its
  own: ``bounds``, the byte ranges of its C-order data (in order, tiling
  it); ``buffers``, their bytes (``ALIGN``-aligned). Where an array is
  split in rows whose byte offsets are not multiples of ``ALIGN``, the CPU
  runtime copies each row block of one whole buffer into a new one (a
  second copy of the data, into memory it faults in anew); these place
  without a copy (``restore_files.place_pieces``)."""

  def __init__(
    self,
    shape: tuple[int, ...],
    dtype: np.dtype,
    bounds: list[tuple[int, int]],
    memory: HostMemory,
  ) -> None:
    self.shape, self.dtype, self.bounds = shape, dtype, bounds
    self.buffers = [
      memory.empty((hi - lo,), np.dtype(np.uint8))[1] for lo, hi in bounds
    ]

  @property
  def nbytes(self) -> int:
    return self.bounds[-1][1]

  def views(self, lo: int, hi: int) -> list[memoryview]:
    """Bytes ``lo`` to ``hi`` of the data, as views of the buffers."""
    out = []
    for (a, b), buf in zip(self.bounds, self.buffers):
      if a < hi and lo < b:
        out.append(buf.data[max(lo, a) - a : min(hi, b) - a])
    return out

  def part(self, start: int, shard_shape: tuple[int, ...]) -> np.ndarray:
    """The part whose data starts at byte ``start``, as an array."""
    for (a, _), buf in zip(self.bounds, self.buffers):
      if a == start:
        return buf.view(self.dtype).reshape(shard_shape)
    raise KeyError(start)


def device_pieces(
  shape: tuple[int, ...], dtype: np.dtype, sharding: Any
) -> list[tuple[int, int]] | None:
  """The byte ranges of an array's C-order data that the devices of
  ``sharding`` hold, in order, where each of two or more devices holds a
  block of whole rows (split along the first axis only) of its own, the
  blocks tile the data, and one of them starts off ``ALIGN``; else None."""
  if len(shape) < 1 or 0 in shape or not sharding.is_fully_addressable:
    return None
  index_map = sharding.addressable_devices_indices_map(shape)
  if len(index_map) < 2:
    return None
  row = math.prod(shape[1:]) * dtype.itemsize
  bounds = []
  for index in index_map.values():
    if len(index) != len(shape) or any(s != slice(None) for s in index[1:]):
      return None
    start, stop, step = index[0].indices(shape[0])
    if step != 1 or stop <= start:
      return None
    bounds.append((start * row, stop * row))
  bounds.sort()
  if (
    bounds[0][0] != 0
    or bounds[-1][1] != shape[0] * row
    or any(a[1] != b[0] for a, b in zip(bounds, bounds[1:]))
    or all(lo % ALIGN == 0 for lo, _ in bounds)
  ):
    return None
  return bounds


#: Bytes per read call when one array is read by several threads (a chunk
#: of the checksums: each thread checks what it read).
CHUNK = checksum.CHUNK


def default_read_threads() -> int:
  """Threads reading one checkpoint: the CPU count, at most 8."""
  return max(1, min(8, os.cpu_count() or 1))


class Reader(abc.ABC):
  """Reads stored arrays into new aligned buffers (``HostMemory``), checked
  against the record as they are read: what every kind of place shares
  (``Files`` reads local files, ``restore_objects.ObjectFiles`` objects in
  a bucket). ``read`` is called from one thread at a time; ``close()``
  stops the reader's threads (joins them)."""

  def __init__(self, verify: bool, memory: HostMemory) -> None:
    self._verify = verify
    self._memory = memory

  @abc.abstractmethod
  def read(self, s: Any) -> np.ndarray:
    """The bytes of ``s`` as an array of its header dtype, in a buffer of its
    own (``Pieces`` where ``s.pieces`` says)."""

  def close(self) -> None:
    pass

  def _decompress_from(
    self, raw: Any, s: Stored, memory: HostMemory
  ) -> np.ndarray:
    """A compressed file (see codec) read from ``raw`` (a binary file at its
    first byte), decompressed into a new buffer from ``memory``: exactly its
    header's bytes, then checked against the record's CRC-32C sums of the
    uncompressed data."""
    assert s.codec is not None
    f = codec.open_reader(s.codec, raw)
    array, flat = read_exactly(f, s, memory)
    if self._verify:
      checksum.check(s.sums, flat.data)
    return array


class Files(Reader):
  """Reads stored arrays (``StoredFile``) into new aligned buffers, through
  the descriptors their headers were read from.

  An array of more than one ``CHUNK`` is read by ``threads`` threads at once
  (the calling thread and a pool of ``threads - 1``), each reading chunks
  with ``os.preadv`` into its part of the buffer: copying from the page
  cache and faulting in the new buffer's pages are CPU work, which a single
  thread does at a fraction of what several cores do. ``read`` is called
  from one thread at a time; ``close()`` shuts the pool down (joins it).
  """

  def __init__(self, threads: int = 1, verify: bool = True) -> None:
    super().__init__(verify, HostMemory())
    self._threads = threads
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None

  def close(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=True)
      self._pool = None

  def read(self, s: StoredFile) -> np.ndarray:
    """The bytes of ``s`` as an array of its header dtype, in a buffer of its
    own (``Pieces`` where ``s.pieces`` says); raises ValueError if the file
    is not the one validated, or changed."""
    fd = s.fd
    if fd < 0:  # closed after validation: the same file must be there
      try:
        fd, st = open_file(s.name, s.dir_fd)
      except FileNotFoundError:
        raise gone("", s.file, s.name, s.dir_fd) from None
    try:
      if s.fd < 0 and stamp(st) != s.stamp:
        raise ValueError("it was replaced after restore validated it")
      try:
        if s.codec is not None:
          array = self._decompress(fd, s)
        elif s.member is None:
          array = self._read_stored(fd, s)
        else:
          array = self._inflate(fd, s)
      except codec_errors(s.codec, checksum.Mismatch):
        if stamp(os.fstat(fd)) != s.stamp:  # the likelier cause, named
          raise ValueError("it was modified while restore read it") from None
        raise
      if stamp(os.fstat(fd)) != s.stamp:
        raise ValueError("it was modified while restore read it")
    finally:
      if fd != s.fd:
        os.close(fd)
    return array

  def _read_stored(self, fd: Any, s: StoredFile) -> Any:
    """A raw array's data read into a new buffer (a buffer per device where
    ``s.pieces`` says: ``Pieces``)."""
    array: Any
    data: memoryview | Pieces
    if s.pieces is not None:
      array = data = Pieces(s.shape, s.dtype, s.pieces, self._memory)
    else:
      array, flat = self._memory.empty(s.shape, s.dtype, s.fortran)
      data = flat.data
    size = s.nbytes
    sums = s.sums if self._verify else None
    if size:
      chunks = [(lo, min(lo + CHUNK, size)) for lo in range(0, size, CHUNK)]
      workers = min(self._threads, len(chunks))
      if workers <= 1 and sums is not None and CHUNK == checksum.CHUNK:
        for lo, hi in chunks:
          read_checked(fd, data, s.offset, lo, hi, sums)
      elif workers <= 1:
        read_range(fd, data, s.offset, 0, size)
        checksum.check_views(sums, _views(data, 0, size))
      elif CHUNK == checksum.CHUNK:  # each thread checks the chunks it read
        self._read_chunks(fd, data, s.offset, chunks, workers, sums)
      else:
        self._read_chunks(fd, data, s.offset, chunks, workers, None)
        checksum.check_views(sums, _views(data, 0, size))
    elif sums:
      raise checksum.Mismatch("it holds no data, but the record has checksums")
    if self._verify and s.zip_crc is not None:
      got = s.header_crc
      for part in _views(data, 0, size):
        got = zlib.crc32(part, got)
      if got != s.zip_crc:
        raise checksum.Mismatch(
          f"its CRC-32 is {got:#010x}, the archive recorded {s.zip_crc:#010x}: "
          "the file is damaged"
        )
    return array

  def _inflate(self, fd: int, s: StoredFile) -> np.ndarray:
    """A compressed .npz member, inflated into a new buffer (exactly its
    header's bytes: more or fewer data, or a bad checksum, raise)."""
    assert s.member is not None
    with (
      open(fd, "rb", closefd=False) as raw,
      zipfile.ZipFile(raw) as zf,
      zf.open(s.member) as f,
    ):
      # Reading to the end also checks the member's CRC.
      array, _ = read_exactly(typing.cast(Any, f), s, self._memory)
    return array

  def _decompress(self, fd: int, s: StoredFile) -> np.ndarray:
    """A compressed file, read from its start (``_decompress_from``)."""
    with open(fd, "rb", closefd=False) as raw:
      raw.seek(0)
      return self._decompress_from(raw, s, self._memory)

  def _read_chunks(
    self,
    fd: Any,
    view: memoryview | Pieces,
    offset: int,
    chunks: list,
    workers: int,
    sums: list[int] | None,
  ) -> None:
    """Reads ``chunks`` on ``workers`` threads (this one included); raises the
    first error after every thread has stopped touching the buffer."""
    if self._pool is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(
        self._threads - 1, thread_name_prefix=READ_THREAD_PREFIX
      )
    todo = iter(chunks)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work() -> None:
      while True:
        with lock:
          if errors:
            return
          lo_hi = next(todo, None)
        if lo_hi is None:
          return
        try:
          lo, hi = lo_hi
          read_checked(fd, view, offset, lo, hi, sums)
        except BaseException as err:  # raised below, on the calling thread
          with lock:
            errors.append(err)
          return

    futures = [self._pool.submit(work) for _ in range(workers - 1)]
    work()
    concurrent.futures.wait(futures)
    if errors:
      raise errors[0]


def read_exactly(
  f: Any, s: Stored, memory: HostMemory
) -> tuple[np.ndarray, np.ndarray]:
  """(array, flat uint8 view) of the .npy stream ``f`` (a zip member or a
  decompressing reader), read into a new buffer from ``memory``: its header
  must still be ``s``'s, and its data exactly the header's bytes (fewer or
  more raise)."""
  shape, fortran, dtype = read_header(f)
  if (tuple(shape), dtype, fortran) != (s.shape, s.dtype, s.fortran):
    raise ValueError(
      f"it now holds {dtype.str}{list(shape)}, not {s.dtype.str}{list(s.shape)}"
    )
  array, flat = memory.empty(s.shape, s.dtype, s.fortran)
  view, done = flat.data, 0
  while done < flat.size:
    n = f.readinto(view[done:])
    if not n:
      raise EOFError(f"the data ends {flat.size - done} bytes early")
    done += n
  if f.read(1):
    raise ValueError("it holds more data than its header describes")
  return array, flat


def codec_errors(
  name: str | None, *base: type[BaseException]
) -> tuple[type[BaseException], ...]:
  """``base`` and what reading a damaged file of codec ``name`` raises
  besides (nothing more for raw data)."""
  return base if name is None else base + codec.errors()


#: Name prefix of the threads that read chunks of one array.
READ_THREAD_PREFIX = "jaxworks-restore-chunk"


def _views(view: memoryview | Pieces, lo: int, hi: int) -> list[memoryview]:
  """Bytes [lo, hi) of a buffer or of ``Pieces``, as views."""
  return view.views(lo, hi) if isinstance(view, Pieces) else [view[lo:hi]]


def read_range(
  fd: Any, view: memoryview | Pieces, offset: int, lo: int, hi: int
) -> None:
  """Bytes [lo, hi) of the data at ``offset`` into ``view[lo:hi]`` (or the
  buffers of ``Pieces`` that hold them).

  ``fd``: a file descriptor, read ``READ_STEP`` bytes a call, in C++ with
  the GIL released once (the rest, where the file ends early or a read
  fails, again in Python, which raises the error); or an object in a bucket
  (anything with ``read_into(views, position)``, see restore_objects), read
  in one request.
  """
  if not isinstance(fd, int):
    fd.read_into(_views(view, lo, hi), offset + lo)
    return
  done = lo + _checked_read.read_into(
    fd, _views(view, lo, hi), offset + lo, READ_STEP
  )
  while done < hi:
    end = min(done + READ_STEP, hi)
    n = os.preadv(fd, _views(view, done, end), offset + done)
    if n == 0:
      raise EOFError(
        f"the data ends {hi - done} bytes early (at byte {offset + done} of "
        "the file)"
      )
    done += n


#: Bytes one read call of a local file asks for. On a TPU VM's 9p file
#: system (gVisor) reads of 256 KiB on 8 threads move 2.2 GB/s where reads
#: of 8 MiB move 1.1 GB/s and numpy.load 1.1 GB/s (measured on a v5e host);
#: on ext4 the step size made no difference beyond noise (1 GiB unchecked,
#: best of 9: 119 ms in 8 MiB calls, 115 ms in 256 KiB ones) once the steps
#: of a range are read in C++ (``_checked_read.read_into``): from Python,
#: each step hands the GIL over twice, which the read threads and the thread
#: placing the arrays wait on (a restore of 16 x 32 MiB onto 8 CPU devices:
#: 15-25% slower in 256 KiB Python steps than in one call a range).
READ_STEP = 2**18

#: Bytes a checked read reads (in ``READ_STEP`` calls, in C++), then sums,
#: at a time, where the sums run in Python: the checksum runs over data the
#: CPU's cache still holds (summing a whole chunk after reading it would
#: read it from memory again), and each step hands the GIL over twice.
SUM_STEP = 2**20

#: SUM_STEP of the C++ loop (``_checked_read``, where the CPU has its vector
#: CRC-32C): with no GIL to hand over, steps that stay in the core's L2 cost
#: only their reads.
FAST_SUM_STEP = READ_STEP


def read_checked(
  fd: Any,
  view: memoryview | Pieces,
  offset: int,
  lo: int,
  hi: int,
  sums: list[int] | None,
  k: int | None = None,
) -> None:
  """``read_range`` of bytes [lo, hi): checksum chunk ``k`` (default: lo's,
  ``lo // checksum.CHUNK``) of the data, checked against ``sums`` (None:
  not checked)."""
  if sums is None:
    read_range(fd, view, offset, lo, hi)
    return
  value = 0
  crc = checksum.crc
  if not isinstance(fd, int):  # an object: one request, then the sums
    read_range(fd, view, offset, lo, hi)
    for part in _views(view, lo, hi):
      value = crc(part, value)
  elif _checked_read.FAST:  # read and summed in C++, without the GIL
    done, value = _checked_read.read_crc32c(
      fd, _views(view, lo, hi), offset + lo, FAST_SUM_STEP
    )
    if done < hi - lo:  # the file ended or a read failed: read_range says so
      read_range(fd, view, offset, lo + done, hi)
      for part in _views(view, lo + done, hi):
        value = crc(part, value)
  else:  # this loop runs per SUM_STEP on every read thread: kept lean
    for a in range(lo, hi, SUM_STEP):
      b = min(a + SUM_STEP, hi)
      parts = _views(view, a, b)
      n = _checked_read.read_into(fd, parts, offset + a, READ_STEP)
      if n < b - a:  # a short read: the rest (or the error) as read_range does
        read_range(fd, view, offset, a + n, b)
      for part in parts:
        value = crc(part, value)
  if k is None:
    k = lo // checksum.CHUNK
  if k >= len(sums) or value != sums[k]:
    raise checksum.mismatch(k, value, sums, hi - lo)


def load(
  api: str, where: str, key: str, s: Stored, files: Reader
) -> np.ndarray:
  """The data of one stored array, with its exact dtype in native byte order,
  in a new buffer that nothing else references."""
  try:
    a = files.read(s)
  except CheckpointReplacedError:
    raise replaced(api, s.where) from None
  except FileNotFoundError as err:  # deleted from the checkpoint
    raise FileNotFoundError(
      err.errno,
      f"{api}: the leaf at {where} (key {key!r}){err.strerror}",
      err.filename,
    ) from None
  except codec_errors(
    s.codec, OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error
  ) as err:
    raise unreadable(
      f"{api}: the leaf at {where} (key {key!r}): reading {s.where} failed",
      err,
      "the file changed or is damaged since restore validated it",
    ) from None
  if a.dtype.kind == "V" and s.exact is not None:
    return a.view(s.exact)
  if not a.dtype.isnative:  # in place: the buffer is ours
    return a.byteswap(inplace=True).view(a.dtype.newbyteorder("="))
  return a
