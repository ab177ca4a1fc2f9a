"""Restore of a checkpoint in a bucket: its objects read in parallel ranges
straight into the buffers restore places, no local copy.

``open_at`` finds the committed checkpoint at a URL (``remote.source``:
the version its head names, read once; a prefix without a head nor a
record of an earlier version is absent), lists that version once and reads
its record, checked against the head. An array stored raw whose shape the
record says (``shapes``, which save writes) is not read when opened: its
header's length follows from the object's size, and its header comes
with its data in one request, checked against the record when it arrives
(``Object.read_checked``); ``metadata`` reads none of them. The other objects (a record of an earlier version, a
compressed or Fortran-order array) have their first bytes read in parallel
when opened (``PROBE``: the ``.npy`` header, all of a small object).
Restoring the whole checkpoint from a store that streams whole objects
(``Storage.open_stream``: S3, Azure), each of those takes one request: a
small one read whole when opened (``SMALL``), any other of at most ``PART``
bytes requested whole, its header read from the first bytes and the request
held (``HELD`` of them at most) until the array's turn comes, its body then
streamed into the array's buffer; elsewhere, and for ``metadata``, a partial
restore and arrays larger than ``PART``, the header is a ranged request of
its own and the data another. What it returns is a ``restore_files.Opened``
(``ObjectOpened``) or a ``restore_shards.Manifest`` (``ObjectManifest``),
siblings of the ``LocalOpened`` and ``LocalManifest`` restore opens on
disk: they share those bases' validation and planning, so the checkpoint
is validated the same way before anything is placed (headers read when
opened; the others against the record, their own header checked as it
arrives, and nothing stays placed if one disagrees), and only their reads
go to the bucket:

- the arrays are read ahead of placement in the order restore places
  them, ``concurrency`` requests at once, within half of
  ``max_inflight_bytes`` (``ObjectFiles``): each array in one ranged
  request (parts of ``PART`` bytes for a larger one), its body streamed
  into the array's own buffer (``Storage.stream_into``), then checked
  against the record's CRC-32C of each 8 MiB;
- a checkpoint several processes wrote: each process reads only the byte
  ranges of the shard files that its devices' regions need
  (``restore_shards.read_tasks``), and the header of those files only.

Memory: the arrays of the batches in flight (``max_inflight_bytes``),
``PROBE`` bytes per object, the small objects read whole when opened
(``SMALL``; at most ``max_inflight_bytes`` of them, each freed once its
batch has it), and for each of the ``HELD`` requests held open one chunk
of the stream plus what the kernel queues on its socket until it is read
(about 1.1 MiB per request on Linux: 64 held requests of 16 MiB objects
queued 64 x 1.1 MiB, and 8 MiB more of the process's own memory). An ``.npz`` object is one file: it is read from
an unlinked temporary file.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
import concurrent.futures
import contextlib
import dataclasses
import io
import math
import os
import tempfile
import threading
from typing import Any

import numpy as np

from . import checksum
from . import codec
from . import format
from . import hostvalue
from . import reader
from . import remote
from . import restore_files
from . import restore_shards
from . import storage
from .format import Entry
from .format import Shard
from .storage import LOG
from .storage import Storage
from .storage import StrayKeyError
from .storage import run_parallel

#: The first bytes of each object read when it is opened: the ``.npy``
#: header (numpy writes at most about 10 KB of it), and all of an object this
#: small, which is then not read again.
PROBE = remote.HEADER_BYTES
#: Objects of at most this many bytes are read whole when restore opens
#: them (header and data in one request), as long as all read so stay within
#: restore's ``max_inflight_bytes``: a tree of many small arrays takes one
#: request per array, not two.
SMALL = 4 * 2**20
#: The most bytes of one array read in one request (streamed into its
#: buffer): larger arrays in parts of this size, several at once. A
#: multiple of the checksum chunk; each part is checked as a whole.
PART = 64 * 2**20
#: The first bytes of a shard file read when it is opened (its header).
SHARD_PROBE = 16 * 2**10
#: The most objects whose whole-object request restore holds open after
#: their header, for their data (``Object.stream``); the others' data is
#: requested again, by range.
HELD = 64


class Object:
  """One object, read in ranges: what ``reader.read_range`` reads instead
  of a file descriptor. ``head``: its first bytes, read when opened;
  ``stream``: the request that read them, held for the bytes after them
  (or None); ``check``: for an object whose header was not read when
  opened (its shape from the record), what checks the header when it
  arrives with the data (``read_checked``)."""

  def __init__(
    self,
    st: Storage,
    key: str,
    size: int,
    head: Any,
    stream: storage.ByteStream | None = None,
    check: Callable[[bytes], None] | None = None,
  ) -> None:
    self.st, self.key, self.size, self.head = st, key, size, head
    self.stream, self.check = stream, check

  @property
  def url(self) -> str:
    return self.st.where(self.key)

  def read_into(self, views: list[memoryview], pos: int) -> None:
    """Fills ``views``, one after another, with the object's bytes from
    ``pos``: from the held request where it is there, else one ranged
    request, streamed into them (none where the bytes were read when it was
    opened).

    Raises:
      OSError: the object ends before ``views`` are full.
    """
    if len(views) > 1 and self.stream is None and pos >= len(self.head):
      self.st.stream_into(self.key, pos, *views)
      return
    for view in views:
      self._read_one(view, pos)
      pos += len(view)

  def _read_one(self, view: memoryview, pos: int) -> None:
    n = len(view)
    if pos + n <= len(self.head):
      view[:] = self.head[pos : pos + n]
      return
    stream, self.stream = self.stream, None
    if stream is not None:
      at = stream.pos
      if pos == at or pos < at <= len(self.head):
        self._from_stream(stream, view, pos)
        return
      stream.close()
    self.st.stream_into(self.key, pos, view)

  def read_checked(self, views: list[memoryview], offset: int) -> None:
    """The header (the object's first ``offset`` bytes) and ``views`` after
    it, in one request; the header then checked by ``check``.

    Raises:
      ValueError: the header is not the one the record says.
      OSError: the object ends before ``views`` are full.
    """
    assert self.check is not None
    head = bytearray(offset)
    self.st.stream_into(self.key, 0, memoryview(head), *views)
    self.check(bytes(head))

  def _from_stream(
    self, stream: storage.ByteStream, view: memoryview, pos: int
  ) -> None:
    """``view`` from ``pos``: the held request's bytes, those before it from
    ``head``; a request that fails midway is taken up by a ranged one."""
    done = stream.pos - pos
    if done:
      view[:done] = self.head[pos : stream.pos]
    try:
      got = stream.readinto(view[done:])
    except OSError as err:  # dropped, timed out: the rest by range
      LOG.debug("%s: held request failed (%s), reading by range", self.url, err)
      stream.close()
      self.st.stream_into(self.key, pos + done, view[done:])
      return
    if done + got < len(view):
      stream.close()
      raise self.st.short(self.key, stream.pos, pos + len(view))
    if stream.pos < self.size:
      self.stream = stream  # more to read, in order
    else:
      stream.close()

  def close(self) -> None:
    """Drops the held request, if any."""
    stream, self.stream = self.stream, None
    if stream is not None:
      stream.close()


class _RangeFile(io.RawIOBase):
  """An object as a seekable binary file (for a compressed file's reader)."""

  def __init__(self, obj: Object) -> None:
    self._obj, self._pos = obj, 0

  def readable(self) -> bool:
    return True

  def seekable(self) -> bool:
    return True

  def tell(self) -> int:
    return self._pos

  def seek(self, pos: int, whence: int = 0) -> int:
    base = {0: 0, 1: self._pos, 2: self._obj.size}[whence]
    self._pos = max(0, base + pos)
    return self._pos

  def readinto(self, b: Any) -> int:
    view = memoryview(b).cast("B")
    n = max(0, min(len(view), self._obj.size - self._pos))
    if n:
      self._obj.read_into([view[:n]], self._pos)
      self._pos += n
    return n


@dataclasses.dataclass
class StoredObject(reader.Stored):
  """An array in an object (``obj``), not a file (``reader.StoredFile``)."""

  obj: Any = None


class _Job:
  """One array being read: its buffer, the parts still in flight, the first
  error."""

  def __init__(self, array: Any, parts: int) -> None:
    self.array = array
    self.parts = parts
    self.error: BaseException | None = None
    self.done = threading.Event()
    if not parts:
      self.done.set()


class ObjectFiles(reader.Reader):
  """The ``reader.Reader`` of objects (``reader.Files`` reads local files):
  a scheduler thread walks the arrays in
  the order restore reads them (``order``) and reads ahead, each array in
  one request streamed into its own buffer (parts of ``PART`` bytes for a
  larger one; every part checked in the thread that read it),
  ``concurrency`` requests at once, as long as the arrays read and not yet
  taken by ``read`` hold at most ``budget`` bytes (one array at least). ``read`` waits for its array;
  a compressed one is read there, as it is decompressed."""

  def __init__(
    self, verify: bool, concurrency: int, order: list[Any], budget: int
  ) -> None:
    # 4 KiB pages: data at network speed (see reader.HostMemory).
    super().__init__(verify, reader.HostMemory(huge_pages=False))
    self._budget = budget
    self._jobs: dict[int, _Job] = {}
    self._held = 0  # bytes read ahead and not yet taken
    self._cond = threading.Condition()
    self._stop = False
    self._failed: BaseException | None = None
    self._requests = concurrent.futures.ThreadPoolExecutor(
      concurrency, thread_name_prefix=reader.READ_THREAD_PREFIX
    )
    self._lazy_memory = reader.HostMemory(huge_pages=False)  # read's thread
    self._thread = threading.Thread(
      target=self._schedule,
      args=(order,),
      name="jaxworks-restore-objects",
      daemon=True,
    )
    self._thread.start()

  def _schedule(self, order: list[Any]) -> None:
    try:
      self._walk(order)
    except BaseException as err:  # raised by the ``read`` waiting for it
      with self._cond:
        self._failed = err
        self._cond.notify_all()

  def _walk(self, order: list[Any]) -> None:
    for s in order:
      with self._cond:
        if s.codec is None:
          while self._held and self._held + s.nbytes > self._budget:
            if self._stop:
              return
            self._cond.wait()
        if self._stop:
          return
        if s.codec is not None:  # read by ``read``
          self._jobs[id(s)] = _Job(None, 0)
          self._cond.notify_all()
          continue
        self._held += s.nbytes
      if s.pieces is not None:  # a buffer per device (see reader.Pieces)
        array: Any = reader.Pieces(s.shape, s.dtype, s.pieces, self._memory)
        views = array.views
      else:
        array, flat = self._memory.empty(s.shape, s.dtype, s.fortran)
        views = lambda lo, hi, flat=flat: [flat.data[lo:hi]]  # noqa: E731
      parts = storage.chunks(s.nbytes, PART)
      job = _Job(array, len(parts))
      if self._verify and not parts and s.sums:
        job.error = checksum.Mismatch(
          "it holds no data, but the record has checksums"
        )
      with self._cond:
        self._jobs[id(s)] = job
        self._cond.notify_all()
      for lo, hi in parts:
        try:
          self._requests.submit(self._part, s, job, views(lo, hi), lo)
        except RuntimeError:  # shut down: restore ended
          return

  def _part(self, s: Any, job: _Job, views: list[memoryview], lo: int) -> None:
    try:
      if job.error is None:
        if lo == 0 and s.obj.check is not None:
          s.obj.read_checked(views, s.offset)  # the header with the data
        else:
          s.obj.read_into(views, s.offset + lo)
        if self._verify:
          checksum.check_views(s.sums, views, lo // checksum.CHUNK)
    except BaseException as err:  # raised by ``read``: never an unfilled array
      job.error = job.error or err
    finally:
      with self._cond:
        job.parts -= 1
        if not job.parts:
          s.obj.head = s.obj.head[: s.offset]  # read: its memory goes back
          job.done.set()

  def read(self, s: Any) -> np.ndarray:
    with self._cond:
      while id(s) not in self._jobs:
        if self._failed is not None:
          raise self._failed
        self._cond.wait()
      job = self._jobs.pop(id(s))
    job.done.wait()
    if s.codec is not None:
      return self._decompress_object(s.obj, s)
    with self._cond:
      self._held -= s.nbytes
      self._cond.notify_all()
    if job.error is not None:
      raise job.error
    return job.array

  def close(self) -> None:
    with self._cond:
      self._stop = True
      self._cond.notify_all()
    self._thread.join()
    self._requests.shutdown(wait=True, cancel_futures=True)
    super().close()

  def _decompress_object(self, obj: Object, s: StoredObject) -> np.ndarray:
    """A compressed object (see codec), read in ``storage.CHUNK`` ranges as
    it is decompressed into a new buffer, checked as on disk."""
    raw = io.BufferedReader(_RangeFile(obj), storage.CHUNK)
    return self._decompress_from(raw, s, self._lazy_memory)


class ObjectOpened(restore_files.Opened):
  """A checkpoint one process wrote, in a bucket (``restore_files``; its
  sibling ``restore_files.LocalOpened`` holds local files): arrays in
  objects (``StoredObject``), read by ``ObjectFiles``."""

  def __init__(self, api: str, url: str, st: Storage) -> None:
    super().__init__(api, url)
    self.st = st

  def files(
    self, threads: int, verify: bool, order: list[Any], budget: int
  ) -> reader.Reader:
    return ObjectFiles(verify, self.st.concurrency, order, budget)

  def close(self) -> None:
    super().close()
    for s in self.stored.values():
      obj = getattr(s, "obj", None)
      if obj is not None:
        obj.close()


class ObjectManifest(restore_shards.Manifest):
  """A checkpoint several processes wrote, in a bucket (``restore_shards``;
  its sibling ``restore_shards.LocalManifest`` reads a local directory):
  the shard files' headers are read when a region needs them, in parallel,
  and their byte ranges by ranged requests (``Object``)."""

  def __init__(
    self,
    api: str,
    url: str,
    st: Storage,
    arrays: dict[str, Entry],
    sizes: dict[str, int],
    record: bytes | None,
  ) -> None:
    super().__init__(api, url, arrays)
    self.st, self._sizes, self._record = st, sizes, record

  def record_data(self) -> bytes | None:
    return self._record

  def read_threads(self, threads: int) -> int:
    return max(threads, self.st.concurrency)

  def open_shards(self, needed: list[tuple[str, Entry, Shard]]) -> None:
    todo = [n for n in needed if n[2].file not in self.stored]
    heads = run_parallel(
      lambda n: _probe(self.api, self.st, n[2].file, self._sizes, SHARD_PROBE),
      todo,
      self.st.concurrency,
    )
    for (key, entry, shard), obj in zip(todo, heads):
      file = obj.url
      try:
        shape, fortran, dtype, offset = _header(obj)
      except (OSError, ValueError, EOFError) as err:
        raise ValueError(
          f"{self.api}: the shard file {file!r} of {key!r} is not a readable "
          f".npy file: {err}"
        ) from None
      s = _stored(shape, dtype, fortran, obj, offset)
      s.name = shard.file  # what read_tasks' handles are keyed by
      s.sums = None if shard.crc32c is None else list(shard.crc32c)
      restore_shards.check_shard(self.api, file, key, entry, shard, s)
      self.stored[shard.file] = s

  def open_shard(self, key: str, entry: Entry, shard: Shard) -> reader.Stored:
    self.open_shards([(key, entry, shard)])
    return self.stored[shard.file]

  def handles(self, used: dict[str, reader.Stored]) -> dict[str, Any]:
    return {name: getattr(s, "obj") for name, s in used.items()}

  def unchanged(self, fds: dict[str, Any], used: dict[str, Any]) -> None:
    pass  # an object changed since listed fails its size or its checksums

  def release(self, fds: dict[str, Any], used: dict[str, Any]) -> None:
    pass

  def close(self) -> None:
    self.stored = {}


def _missing(api: str, url: str, key: str) -> FileNotFoundError:
  return FileNotFoundError(
    f"{api}: {url!r} lists no object {key!r}, which the checkpoint needs: "
    "it was deleted after the checkpoint was committed; save the checkpoint "
    "again"
  )


def _packed(
  api: str, src: Storage, sizes: dict[str, int], keys: list[str]
) -> dict[str, StoredObject]:
  """The arrays packed in the archive ``format.PACKED`` of ``src`` (the
  ``keys`` its record packed), read whole in one request: each member's
  data is then read from those bytes."""
  name = format.PACKED
  if name not in sizes:
    raise _missing(api, src.url, name)
  data = bytes(src.read(name, 0, sizes[name]))
  url = src.where(name)
  _, members = restore_files.npz_members(api, url, io.BytesIO(data), len(data))
  if sorted(m.key for m in members) != sorted(keys) or any(
    m.member is not None for m in members
  ):
    raise ValueError(
      f"{api}: {url!r} does not hold exactly the uncompressed members its "
      "record packed; the checkpoint is damaged: save it again"
    )
  out = {}
  for m in members:
    # Each member's bytes, without a copy (its own view: a read drops it).
    head = memoryview(data)[: m.offset + m.data_bytes]
    out[m.key] = StoredObject(
      m.shape, m.dtype, m.fortran, m.where, m.data_bytes, url, m.offset,
      None, obj=Object(src, name, len(head), head),
    )  # fmt: skip
  return out


def _probe(
  api: str,
  st: Storage,
  key: str,
  sizes: dict[str, int],
  n: int,
  hold: bool = False,
) -> Object:
  """The object ``key`` with its first ``n`` bytes read; ``hold``: by a
  request of the whole object (where the storage streams one), held for
  the rest unless it has ended."""
  size = sizes.get(key)
  if size is None:
    raise _missing(api, st.url, key)
  stream = st.open_stream(key) if hold and size else None
  if stream is None:
    head = bytes(st.read(key, 0, min(size, n))) if size else b""
    return Object(st, key, size, head)
  first = bytearray(min(size, n))
  try:
    got = stream.readinto(memoryview(first))
  except BaseException:
    stream.close()
    raise
  del first[got:]
  if got < n or got >= size:  # all of it read (or all there is)
    stream.close()
    stream = None
  return Object(st, key, size, first, stream)


def _header(obj: Object) -> tuple[tuple[int, ...], bool, np.dtype, int]:
  """(shape, fortran, dtype, data offset) from an object's first bytes."""
  f = io.BytesIO(obj.head)
  shape, fortran, dtype = reader.read_header(f)
  return tuple(shape), fortran, dtype, f.tell()


def _stored(
  shape: tuple[int, ...],
  dtype: np.dtype,
  fortran: bool,
  obj: Object,
  offset: int,
  use: str | None = None,
) -> StoredObject:
  # A compressed object's data is as long as its header says, or reading it
  # raises (the frame is decompressed whole, and its end checked).
  if use is None:
    present = obj.size - offset
  else:
    present = math.prod(shape) * dtype.itemsize
  return StoredObject(
    shape, dtype, fortran, repr(obj.url), present, obj.url, offset, None,
    codec=use, obj=obj,
  )  # fmt: skip


def _read_small(api: str, st: Storage, key: str, what: str) -> bytes:
  data = bytes(st.read(key, 0, format.MAX_MANIFEST_BYTES + 1))
  if len(data) > format.MAX_MANIFEST_BYTES:
    raise ValueError(
      f"{api}: {what} {st.where(key)!r} holds more than "
      f"{format.MAX_MANIFEST_BYTES} bytes (MAX_MANIFEST_BYTES), more than "
      "save writes; the checkpoint is damaged: write it again"
    )
  return data


def _manifest(api: str, src: Storage) -> dict[str, Entry]:
  data = _read_small(api, src, format.MANIFEST, "the manifest")
  try:
    return format.parse_manifest(data)
  except format.DAMAGED as err:
    raise ValueError(
      f"{api}: the manifest {src.where(format.MANIFEST)!r} is damaged "
      f"({type(err).__name__}: {err}); write the checkpoint again"
    ) from None


def _named(
  api: str, src: Storage, record: bytes, err: StrayKeyError
) -> dict[str, int]:
  """``{name: size}`` of the objects a checkpoint's record (and manifest)
  name, each asked for on its own: where a listing of ``src`` fails on a
  key of another object (``StrayKeyError``), which restore ignores. A
  record written before it listed the tree names no files: the error
  stands then."""
  saved = format.decode_record(api, f"the record of {src.url!r}", record)
  if saved.tree is None:
    raise err
  names = [format.MANIFEST, *(saved.files() or ())]

  def size(name: str) -> int | None:
    try:
      return src.size(name)
    except FileNotFoundError:
      return None

  got = run_parallel(size, names, src.concurrency)
  sizes = {n: z for n, z in zip(names, got) if z is not None}
  if format.MANIFEST in sizes:
    files = sorted(
      {s.file for a in _manifest(api, src).values() for s in a.shards}
    )
    got = run_parallel(size, files, src.concurrency)
    sizes.update((n, z) for n, z in zip(files, got) if z is not None)
  return dict(sorted(sizes.items()))


def open_at(
  api: str, st: Storage, budget: int = 0, pinned: remote.Pinned | None = None
) -> restore_files.Opened | restore_shards.Manifest:
  """The committed checkpoint at ``st`` (an object store's prefix), opened:
  listed, its record (and manifest) and the headers of its arrays read.

  Args:
    budget: bytes of small objects (``SMALL``) read whole now, whose data
      is then not requested again (0: headers only, for ``metadata``).
    pinned: the checkpoint's version, where the caller pinned it (else
      the head is read here: ``remote.source``).

  Raises:
    FileNotFoundError: no committed checkpoint at ``st``.
    ValueError: an object that is not what save wrote.
  """
  loc = st.location
  if format.is_npz(loc.name) and loc.prefix:
    parent = st.parent()
    if parent.exists(loc.name):
      return _open_npz(api, parent, loc.name)
  if pinned is None:
    pinned = remote.source(api, st)
  src = pinned.st  # the version the head names (0.6.x: where it is)
  record = pinned.check_record(
    api, _read_small(api, src, format.RECORD, "the record")
  )
  try:
    sizes = src.list()
  except StrayKeyError as err:
    LOG.debug("%s; reading the objects the record names", err)
    sizes = _named(api, src, record, err)
  if format.MANIFEST in sizes:
    arrays = _manifest(api, src)
    LOG.debug("opened %s (%d objects)", src.url, len(sizes))
    return ObjectManifest(api, src.url, src, arrays, sizes, record)
  opened = ObjectOpened(api, src.url, src)
  opened.record = record
  names = {}
  for name in sizes:
    split = codec.split_name(name)
    if split is None:
      continue
    key, use = split
    if key in names:
      raise ValueError(
        f"{api}: {src.url!r} holds two objects for the array at {key!r} "
        f"({codec.file_name(key, None)!r} and a compressed one); the "
        "checkpoint is damaged: remove the one save did not write"
      )
    names[key] = (name, use)
  # Arrays whose record gives their header: none read now; each one's
  # header comes with its data, in one request, and is checked then.
  where = f"the record {format.RECORD!r} of {src.url!r}"
  saved = format.decode_record(api, where, record)
  if saved.packed:
    opened.stored.update(_packed(api, src, sizes, saved.packed))
  for key, (name, use) in list(names.items()):
    s = _expected(api, where, src, key, name, use, sizes[name], saved)
    if s is not None:
      opened.stored[key] = s
      del names[key]
  wanted, hold, held = {}, set(), 0
  whole = budget > 0  # a restore, which reads every array's data
  for key, (name, use) in sorted(names.items()):
    size = sizes[name]
    wanted[name] = PROBE
    if PROBE < size <= SMALL and size <= budget:
      wanted[name], budget = size, budget - size
    # A raw array read in one part (its data at most PART bytes after a
    # header of less than PROBE), not whole now: one request, held for its
    # data (one read whole now takes one ranged request: a streamed one
    # costs more per request for a small object).
    one_part = size <= PART + PROBE
    if (
      whole and use is None and wanted[name] < size and one_part and held < HELD
    ):
      hold.add(name)
      held += 1
  heads = run_parallel(
    lambda item: _probe(
      api, src, item[1][0], sizes, wanted[item[1][0]], item[1][0] in hold
    ),
    sorted(names.items()),
    src.concurrency,
  )
  for (key, (name, use)), obj in zip(sorted(names.items()), heads):
    try:
      if use is None:
        shape, fortran, dtype, offset = _header(obj)
      else:
        f = codec.open_reader(use, io.BufferedReader(_RangeFile(obj)))
        shape, fortran, dtype = reader.read_header(f)
        shape, offset = tuple(shape), 0
    except reader.codec_errors(use, OSError, ValueError, EOFError) as err:
      raise ValueError(
        f"{api}: {obj.url!r} is not a readable .npy file: {err}"
      ) from None
    if dtype.hasobject:
      raise ValueError(
        f"{api}: {obj.url!r} holds Python objects, which restore does not load"
      )
    opened.stored[key] = _stored(shape, dtype, fortran, obj, offset, use)
  LOG.debug("opened %s (%d objects)", src.url, len(sizes))
  return opened


def _expected(
  api: str,
  where: str,
  st: Storage,
  key: str,
  name: str,
  use: str | None,
  size: int,
  record: format.Record,
) -> StoredObject | None:
  """The array at ``key`` as its record says save wrote it (raw, in C order,
  of its shape and dtype), its header checked when it arrives with the data
  (``Object.read_checked``); None where the record does not say (a record
  without ``c_order`` may have Fortran-order files), or the object's size
  leaves no room for such a header (then read when opened)."""
  dims, name_of_dtype = record.shapes.get(key), record.dtypes.get(key)
  if (
    dims is None
    or name_of_dtype is None
    or use is not None
    or not record.c_order
  ):
    return None
  shape = tuple(dims)
  dtype = hostvalue.header_dtype(
    format.exact_dtype(api, where, key, name_of_dtype)
  )
  nbytes = math.prod(shape) * dtype.itemsize
  offset = size - nbytes
  if not nbytes or not 0 < offset <= PROBE:
    return None
  check = _header_check(st.where(name), shape, dtype)
  obj = Object(st, name, size, b"", check=check)
  return _stored(shape, dtype, False, obj, offset)


def _header_check(
  url: str, shape: tuple[int, ...], dtype: np.dtype
) -> Callable[[bytes], None]:
  """What checks an object's header (all of its bytes before the data)
  against the shape and dtype the record says."""

  def check(head: bytes) -> None:
    f = io.BytesIO(head)
    try:
      got_shape, fortran, got = reader.read_header(f)
    except (OSError, ValueError, EOFError) as err:
      raise ValueError(f"{url!r} is not a readable .npy file: {err}") from None
    differs = format.header_differences(
      tuple(got_shape), got, fortran, shape, dtype, True
    )
    if not differs and f.tell() != len(head):
      differs = (
        f"{f.tell()} bytes where the record's shape and dtype, with the "
        f"object's size, make it {len(head)}"
      )
    if differs:
      raise ValueError(
        f"{url!r} has a header of {differs} (its header says shape "
        f"{tuple(got_shape)}, dtype {got.str}, "
        f"{'Fortran' if fortran else 'C'} order; the checkpoint's record "
        f"says shape {shape}, dtype {dtype.str}, C order): the object was "
        "replaced after the checkpoint was committed; save the checkpoint "
        "again"
      )

  return check


def _open_npz(api: str, parent: Storage, name: str) -> restore_files.Opened:
  """An ``.npz`` object (one file: a zip archive), read from a temporary
  file that is unlinked at once (restore holds its descriptor)."""
  fd, tmp = tempfile.mkstemp(prefix="jaxworks-npz-", suffix=".npz")
  os.close(fd)
  os.unlink(tmp)
  try:
    parent.download(name, tmp)
    opened = restore_files.open_checkpoint(api, tmp)
  finally:
    try:
      os.unlink(tmp)
    except FileNotFoundError:
      pass
  opened.path = parent.where(name)
  for s in opened.stored.values():
    s.where = s.where.replace(repr(tmp), repr(opened.path))
  return opened


@contextlib.contextmanager
def noting(path: str) -> Iterator[None]:
  """Adds to an error raised inside it a note naming the objects of the
  checkpoint at the URL ``path`` (destination.BucketPrefix.noting)."""
  try:
    yield
  except Exception as err:
    err.add_note(
      f"(the checkpoint is the objects under {path}: each file named "
      f"above is the object {path}/<its name>)"
    )
    raise
