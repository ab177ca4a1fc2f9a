"""The checkpoint files: .npy headers in a directory or an .npz, the dtype record.

Opening a checkpoint reads only headers: each array becomes a ``Stored`` with
its shape, header dtype, order, and where its data lies. ``Files.read`` then
reads an array's bytes straight into a new 64-byte-aligned host buffer (one
``preadv`` loop, no memory map and no second copy), so that on CPU the placed
array can take that buffer over instead of copying it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import struct
import threading
from typing import Any
import zipfile
import zlib

import numpy as np

_ZIP_LOCAL_HEADER = struct.Struct(
  "<4s5H3L2H"
)  # 30 bytes; last two: name and extra lengths
# The exact dtype name of every leaf, next to the arrays (a member of the .npz, a file in
# the directory): .npy headers cannot name bfloat16, float8_*, int4, ... types.
DTYPE_RECORD = "jaxworks_dtypes.json"
RECORD_FORMAT = 1


@dataclasses.dataclass
class Stored:
  """One array on disk: its header, where its data lies, and how to get it."""

  shape: tuple[int, ...]
  dtype: (
    np.dtype
  )  # as the .npy header says (may be raw void bytes, may be big-endian)
  fortran: bool
  where: str  # "'<file>'" or "member '<name>' of '<file>'", for messages
  data_bytes: int  # the bytes of data present after the header
  file: str  # the file holding the data
  offset: int  # where the data starts in ``file``
  member: str | None  # a compressed .npz member (read through zipfile), or None
  exact: np.dtype | None = None  # the dtype the record names (None: no record)

  @property
  def nbytes(self) -> int:
    """The bytes of data the header describes."""
    return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

  @property
  def value_dtype(self) -> np.dtype:
    """The dtype of the values: the recorded one, else the header's, in native order."""
    if self.exact is not None:
      return self.exact
    return self.dtype.newbyteorder("=")


def _read_header(f: Any) -> tuple[tuple[int, ...], bool, np.dtype]:
  version = np.lib.format.read_magic(f)
  if version == (1, 0):
    return np.lib.format.read_array_header_1_0(f)
  return np.lib.format.read_array_header_2_0(f)


def open_directory(
  api: str, path: str
) -> tuple[dict[str, Stored], bytes | None]:
  out: dict[str, Stored] = {}
  record = None
  for root, dirs, files in os.walk(path):
    dirs.sort()
    for name in sorted(files):
      file = os.path.join(root, name)
      if root == path and name == DTYPE_RECORD:
        with open(file, "rb") as f:
          record = f.read()
        continue
      if not name.endswith(".npy"):
        continue
      key = os.path.relpath(file, path)[:-4].replace(os.sep, "/")
      try:
        with open(file, "rb") as f:
          shape, fortran, dtype = _read_header(f)
          offset = f.tell()
          size = os.fstat(f.fileno()).st_size
      except (OSError, ValueError, EOFError) as err:
        raise ValueError(
          f"{api}: {file!r} is not a readable .npy file: {err}"
        ) from None
      if dtype.hasobject:
        raise ValueError(
          f"{api}: {file!r} holds Python objects, which restore does not load"
        )
      out[key] = Stored(
        tuple(shape),
        dtype,
        fortran,
        repr(file),
        size - offset,
        file,
        offset,
        None,
      )
  return out, record


def open_npz(api: str, path: str) -> tuple[dict[str, Stored], bytes | None]:
  out: dict[str, Stored] = {}
  record = None
  try:
    zf = zipfile.ZipFile(path)
  except (OSError, zipfile.BadZipFile) as err:
    raise ValueError(
      f"{api}: {path!r} is not a readable .npz file: {err}"
    ) from None
  with zf, open(path, "rb") as raw:
    file_size = os.fstat(raw.fileno()).st_size
    for info in zf.infolist():
      where = f"member {info.filename!r} of {path!r}"
      try:
        if info.filename == DTYPE_RECORD:
          record = zf.read(info)
          continue
        if not info.filename.endswith(".npy"):
          continue
        key = info.filename[:-4]
        if (
          info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1
        ):
          raw.seek(info.header_offset)
          fields = _ZIP_LOCAL_HEADER.unpack(raw.read(_ZIP_LOCAL_HEADER.size))
          start = (
            info.header_offset
            + _ZIP_LOCAL_HEADER.size
            + fields[-2]
            + fields[-1]
          )
          raw.seek(start)
          shape, fortran, dtype = _read_header(raw)
          offset = raw.tell()
          # The member's data ends where the archive says it does, and never past the file.
          end = min(
            start + info.file_size, start + info.compress_size, file_size
          )
          data_bytes = end - offset
          member = None
        else:  # compressed members are inflated when their batch comes
          with zf.open(info) as f:
            shape, fortran, dtype = _read_header(f)
            data_bytes = info.file_size - f.tell()
          offset, member = 0, info.filename
      except (
        OSError,
        ValueError,
        EOFError,
        struct.error,
        zipfile.BadZipFile,
        zlib.error,
      ) as err:
        raise ValueError(
          f"{api}: {where} is not a readable .npy: {err}"
        ) from None
      if dtype.hasobject:
        raise ValueError(f"{api}: {where} holds Python objects")
      out[key] = Stored(
        tuple(shape), dtype, fortran, where, data_bytes, path, offset, member
      )
  return out, record


def apply_record(
  api: str, path: str, stored: dict[str, Stored], record: bytes | None
) -> None:
  """Sets each stored array's exact dtype from the dtype record written by save."""
  if record is None:
    return
  where = f"the dtype record {DTYPE_RECORD!r} of {path!r}"
  try:
    data = json.loads(record.decode())
    names = data["dtypes"]
    if data.get("format") != RECORD_FORMAT or not isinstance(names, dict):
      raise ValueError(f"unknown format {data.get('format')!r}")
  except (
    UnicodeDecodeError,
    ValueError,
    KeyError,
    TypeError,
    AttributeError,
  ) as err:
    raise ValueError(
      f"{api}: {where} is damaged ({err}); it was written by "
      "jaxworks.batched_transfer.save: write the checkpoint again"
    ) from None
  for key, s in stored.items():
    name = names.get(key)
    if name is None:
      continue
    try:
      exact = np.dtype(name) if isinstance(name, str) else None
    except TypeError:
      exact = None
    if (
      exact is None
      or exact.name != name
      or exact.hasobject
      or exact.fields is not None
    ):
      raise ValueError(
        f"{api}: {where} names the dtype {name!r} for key {key!r}, which is not "
        "a dtype numpy or ml_dtypes knows; is a newer ml_dtypes needed?"
      )
    header = s.dtype.newbyteorder("=")
    if exact.itemsize != s.dtype.itemsize or (
      header.kind != "V" and header != exact
    ):
      raise ValueError(
        f"{api}: {s.where} has a header of dtype {s.dtype.str} but {where} "
        f"says {name}; the checkpoint is damaged"
      )
    s.exact = exact


ALIGN = (
  64  # what the CPU runtime needs to take a host buffer over without a copy
)


def aligned_empty(
  shape: tuple[int, ...], dtype: np.dtype, fortran: bool = False
) -> tuple[np.ndarray, np.ndarray]:
  """(array, its bytes): a new uninitialized array whose data starts on an
  ``ALIGN``-byte boundary, and a flat uint8 view of the same memory."""
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(nbytes + ALIGN, np.uint8)
  start = -raw.ctypes.data % ALIGN
  flat = raw[start : start + nbytes]
  array = np.ndarray(
    shape, dtype, buffer=flat.data, order="F" if fortran else "C"
  )
  return array, flat


#: Bytes per read call when one array is read by several threads.
CHUNK = 8 * 2**20


def default_read_threads() -> int:
  """Threads reading one checkpoint: the CPU count, at most 8."""
  return max(1, min(8, os.cpu_count() or 1))


class Files:
  """Reads stored arrays into new aligned buffers; keeps the last file open
  (an .npz is one file for all its members).

  An array of more than one ``CHUNK`` is read by ``threads`` threads at once
  (the calling thread and a pool of ``threads - 1``), each reading chunks
  with ``os.preadv`` into its part of the buffer: copying from the page
  cache and faulting in the new buffer's pages are CPU work, which a single
  thread does at a fraction of what several cores do. ``read`` is called
  from one thread at a time; ``close()`` shuts the pool down (joins it).
  """

  def __init__(self, threads: int = 1) -> None:
    self._path: str | None = None
    self._fd = -1
    self._threads = threads
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None

  def close(self) -> None:
    if self._fd >= 0:
      os.close(self._fd)
    self._path, self._fd = None, -1
    if self._pool is not None:
      self._pool.shutdown(wait=True)
      self._pool = None

  def _open(self, path: str) -> int:
    if path != self._path:
      if self._fd >= 0:
        os.close(self._fd)
        self._fd = -1
      self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
      self._path = path
    return self._fd

  def read(self, s: Stored) -> np.ndarray:
    """The bytes of ``s`` as an array of its header dtype, in a buffer of its own."""
    if s.member is not None:
      with zipfile.ZipFile(s.file) as zf, zf.open(s.member) as f:
        a = np.lib.format.read_array(f, allow_pickle=False)
      if a.shape != s.shape or a.dtype != s.dtype:
        raise ValueError(
          f"it now holds {a.dtype.str}{list(a.shape)}, not "
          f"{s.dtype.str}{list(s.shape)}"
        )
      return a
    array, flat = aligned_empty(s.shape, s.dtype, s.fortran)
    if flat.size:
      fd = self._open(s.file)
      chunks = [
        (lo, min(lo + CHUNK, flat.size)) for lo in range(0, flat.size, CHUNK)
      ]
      workers = min(self._threads, len(chunks))
      if workers <= 1:
        _read_range(fd, flat.data, s.offset, 0, flat.size)
      else:
        self._read_chunks(fd, flat.data, s.offset, chunks, workers)
    return array

  def _read_chunks(
    self, fd: int, view: memoryview, offset: int, chunks: list, workers: int
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
          _read_range(fd, view, offset, *lo_hi)
        except BaseException as err:  # raised below, on the calling thread
          with lock:
            errors.append(err)
          return

    futures = [self._pool.submit(work) for _ in range(workers - 1)]
    work()
    concurrent.futures.wait(futures)
    if errors:
      raise errors[0]


#: Name prefix of the threads that read chunks of one array.
READ_THREAD_PREFIX = "jaxworks-restore-chunk"


def _read_range(
  fd: int, view: memoryview, offset: int, lo: int, hi: int
) -> None:
  """Bytes [lo, hi) of the data at ``offset`` into ``view[lo:hi]``."""
  done = lo
  while done < hi:  # read() returns at most about 2 GiB at a time
    n = os.preadv(fd, [view[done:hi]], offset + done)
    if n == 0:
      raise EOFError(
        f"the data ends {hi - done} bytes early (at byte {offset + done} of "
        "the file)"
      )
    done += n


def load(api: str, where: str, key: str, s: Stored, files: Files) -> np.ndarray:
  """The data of one stored array, with its exact dtype in native byte order,
  in a new buffer that nothing else references."""
  try:
    a = files.read(s)
  except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as err:
    raise ValueError(
      f"{api}: the leaf at {where} (key {key!r}): reading {s.where} failed: "
      f"{err}; the file changed or is damaged since restore validated it"
    ) from None
  if a.dtype.kind == "V" and s.exact is not None:
    return a.view(s.exact)
  if not a.dtype.isnative:  # in place: the buffer is ours
    return a.byteswap(inplace=True).view(a.dtype.newbyteorder("="))
  return a
