"""Where checkpoints live: local paths and object-store URLs, one interface.

``parse`` reads a path or URL (``s3://bucket/prefix``, ``gs://...``,
``az://container/prefix``, a plain path; other URLs, ``file://`` too, are
refused as ``destination.open`` refuses them) into a
``Location``; ``stores.open_storage`` returns the ``Storage`` for it: a
``LocalStorage`` (here: regular files read through the descriptor that was
checked, bounded by the size seen; writes fsynced; ``create`` without
replacing, by ``link``) or an object store (``stores``, whose client
libraries are imported only for a URL).

Keys are ``/``-separated names relative to the storage's root. ``create``
and ``replace`` are the commit primitives: ``create`` writes a whole object
only if no object of that key exists (a conditional put on object stores),
``replace`` only if the object is still the version ``read_tagged`` read
(its ETag on S3 and Azure, its generation on GCS), so of two writers
exactly one succeeds and the other gets ``FileExistsError``
(``ChangedError`` for a ``replace``).

>>> import os, tempfile
>>> root = tempfile.mkdtemp()
>>> s = LocalStorage("example", parse("example", root))
>>> s.write("a/b.bin", b"0123456789")
>>> s.list()
{'a/b.bin': 10}
>>> bytes(s.read("a/b.bin", 2, 5))
b'234'
>>> s.create("marker", b"done")
>>> s.create("marker", b"again")
Traceback (most recent call last):
FileExistsError: example: '...marker' exists already; ...
>>> parse("example", "s3://bucket/run/1")
Location(scheme='s3', bucket='bucket', prefix='run/1')
>>> import shutil; shutil.rmtree(root)
"""

from __future__ import annotations

import abc
import builtins
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Iterator
from collections.abc import Sequence
import concurrent.futures
import contextlib
import dataclasses
import functools
import io
import logging
import os
import queue
import secrets
import stat
import threading
from typing import Any
from typing import TypeVar

import numpy as np

LOG = logging.getLogger("jaxworks.batched_transfer")

#: The object-store URL schemes and the service each names.
SCHEMES = {"s3": "S3", "gs": "GCS", "az": "Azure Blob Storage"}
#: Parts of a large object read or written at once, and their size.
CHUNK = 8 * 2**20
DEFAULT_CONCURRENCY = 8
#: Objects up to this size are read in one request.
WHOLE = 32 * 2**20

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Location:
  """A parsed path or URL.

  Attributes:
    scheme: ``"file"`` or one of ``SCHEMES``.
    bucket: the bucket or container (``""`` for a local path).
    prefix: the key prefix inside the bucket without leading or trailing
      ``/`` (for ``"file"``: the absolute local path).
  """

  scheme: str
  bucket: str
  prefix: str

  @property
  def url(self) -> str:
    """The path as a URL (a plain path for local files)."""
    if self.scheme == "file":
      return self.prefix
    tail = f"/{self.prefix}" if self.prefix else ""
    return f"{self.scheme}://{self.bucket}{tail}"

  @property
  def remote(self) -> bool:
    """True for an object store."""
    return self.scheme != "file"

  def child(self, name: str) -> Location:
    """The location of ``name`` (a ``/``-separated key) under this one."""
    if self.scheme == "file":
      return Location("file", "", os.path.join(self.prefix, *name.split("/")))
    prefix = f"{self.prefix}/{name}" if self.prefix else name
    return Location(self.scheme, self.bucket, prefix.strip("/"))

  @property
  def parent(self) -> Location:
    """The location one level up (the bucket's root stays itself)."""
    if self.scheme == "file":
      return Location("file", "", os.path.dirname(self.prefix))
    return Location(self.scheme, self.bucket, self.prefix.rpartition("/")[0])

  @property
  def name(self) -> str:
    """The last component of the path."""
    if self.scheme == "file":
      return os.path.basename(self.prefix)
    return self.prefix.rpartition("/")[2]


def path_text(api: str, path: Any) -> str:
  """``path`` (a str or os.PathLike) as text; TypeError naming ``api``
  for anything else."""
  try:
    return os.fsdecode(os.fspath(path))
  except TypeError:
    raise TypeError(
      f"{api}: the path must be a str or os.PathLike (a local path or an "
      f"s3://, gs:// or az:// URL), got {type(path).__name__}"
    ) from None


def parse(api: str, path: Any) -> Location:
  """``path`` (str, bytes or os.PathLike) as a ``Location``.

  Raises:
    TypeError: ``path`` is not a path.
    ValueError: a URL of another scheme (``file://`` too: the message
      names the local path to use), a URL without a bucket, an empty path,
      or a ``.``/``..`` component in a URL's key.
  """
  text = path_text(api, path)
  if not text:
    raise ValueError(f"{api}: the path is empty")
  scheme, sep, rest = text.partition("://")
  if not sep:
    return Location("file", "", os.path.abspath(text))
  if scheme.lower() not in SCHEMES:
    raise ValueError(unknown_url(api, text, scheme))
  scheme = scheme.lower()
  bucket, _, prefix = rest.partition("/")
  if not bucket:
    raise ValueError(
      f"{api}: {text!r} names no bucket; write {scheme}://BUCKET/PREFIX"
    )
  parts = [p for p in prefix.split("/") if p]
  if any(p in (".", "..") for p in parts):
    raise ValueError(
      f"{api}: {text!r} has a '.' or '..' component; object keys are not "
      "resolved as paths: write the key as it is stored"
    )
  return Location(scheme, bucket, "/".join(parts))


def unknown_url(api: str, text: str, scheme: str) -> str:
  """The message refusing ``text``, a URL of ``scheme`` that is none of
  ``SCHEMES`` (a ``file://`` URL: naming the local path to use)."""
  fix = ""
  if scheme.lower() == "file":
    local = text[len(scheme) + 3 :]
    local = "/" + local.partition("/")[2] if local else local
    fix = f" (for this one, the local path {local!r})"
  return (
    f"{api}: {text!r} is a URL of a kind it does not take: use an s3://, "
    f"gs:// or az:// URL or a local path{fix}, or mount the bucket (e.g. "
    "gcsfuse) and use the mounted path"
  )


def is_key(key: str) -> bool:
  """True if ``key`` is a relative ``/``-separated key: no empty, ``.`` or
  ``..`` segment (what a listing yields for a folder marker ``a/`` or a
  stray ``a//b`` is none)."""
  return bool(key) and all(p not in ("", ".", "..") for p in key.split("/"))


def check_key(api: str, key: str) -> str:
  """``key`` if it is a relative ``/``-separated key without ``.``/``..``."""
  if not is_key(key):
    raise ValueError(f"{api}: bad key {key!r} (a relative a/b/c name)")
  return key


def names_below(root: str, prefixes: Iterable[str]) -> builtins.list[str]:
  """The one-segment names of a delimited listing's common ``prefixes``
  under ``root`` (``root/NAME/``), sorted; what is not one is left out
  (``root//``: a stray ``root//key``)."""
  start = len(root) + 1 if root else 0
  return sorted(
    n
    for p in prefixes
    if "/" not in (n := p[start:].removesuffix("/")) and is_key(n)
  )


def request_error(
  st: Storage,
  kind: str,
  err: Exception,
  key: str,
  doing: str,
  endpoint: str | None,
  fix: str,
  retried: str,
) -> OSError:
  """The error of an object store's failed request, by ``kind`` (what the
  store made of ``err``): ``exists`` (a conditional create lost),
  ``bucket`` (no such bucket), ``missing`` (no such object), ``refused``
  (credentials; ``fix`` says what to set), ``stray`` (a key the client
  cannot represent), ``rejected`` (the client refused the request itself)
  or ``failed`` (after the retries, which ``retried`` describes). Names the
  API, the object's URL and the endpoint."""
  where = st.where(key)
  first = str(err).strip().splitlines()[0] if str(err).strip() else ""
  via = f" (endpoint {endpoint})" if endpoint else ""
  if kind == "exists":
    return FileExistsError(
      f"{st.api}: {where!r} exists already; delete it, or pass "
      "overwrite=True where the API takes it"
    )
  if kind == "changed":
    return ChangedError(
      f"{st.api}: {where!r} changed since it was read (another writer "
      "replaced or deleted it); read it again"
    )
  if kind == "bucket":
    return FileNotFoundError(
      f"{st.api}: {doing} {where!r}: the bucket {st.location.bucket!r} does "
      f"not exist{via}; create it, or check the URL and the endpoint"
    )
  if kind == "missing":
    return FileNotFoundError(f"{st.api}: {where!r} does not exist{via}")
  if kind == "refused":
    return PermissionError(
      f"{st.api}: {doing} {where!r} was refused{via}: {first}; {fix}"
    )
  if kind == "stray":
    return StrayKeyError(
      f"{st.api}: {doing} {where!r}: the client library cannot represent "
      f"an object's key there ({first}); the bucket holds an object whose "
      "key has an empty, '.' or '..' segment or a control character, "
      "which no save writes: rename or delete it (not retried: this is no "
      "network fault)"
    )
  if kind == "rejected":
    return OSError(
      f"{st.api}: {doing} {where!r}: the client library refused the "
      f"request ({type(err).__name__}: {first}); not retried: check "
      "storage_options and the URL"
    )
  return OSError(
    f"{st.api}: {doing} {where!r} failed{via} after {retried}: {first}; "
    "check that the endpoint is reachable and the service healthy, then "
    "try again (storage_options max_retries / retry_timeout_s set the "
    "retries)"
  )


class ChangedError(FileExistsError):
  """A conditional ``Storage.replace`` found the object changed (or gone)
  since ``read_tagged`` read it: another writer came first."""


class StrayKeyError(OSError):
  """A listing met an object whose key the client library cannot represent
  (an empty, ``.`` or ``..`` segment, a control character: legal in the
  bucket, never written by a save). Not a network fault: never retried.
  Callers that can do without the whole listing (a restore reads the
  objects its record names) catch it; others let its message say what to
  remove."""


def run_parallel(
  fn: Callable[[T], Any], items: Iterable[T], threads: int
) -> list[Any]:
  """``[fn(x) for x in items]`` on ``threads`` threads; the first error."""
  items = list(items)
  if threads <= 1 or len(items) <= 1:
    return [fn(x) for x in items]
  with concurrent.futures.ThreadPoolExecutor(
    min(threads, len(items)), thread_name_prefix="jaxworks-storage"
  ) as pool:
    futures = [pool.submit(fn, x) for x in items]
    try:
      return [f.result() for f in futures]
    except BaseException:
      for f in futures:
        f.cancel()
      raise


def in_writer_threads(
  count: int,
  take: Callable[[int], Any],
  work: Callable[[int, Any], None],
  done: Callable[[int], None],
  threads: int,
  name: str,
) -> None:
  """``work(i, take(i))`` for each ``i < count``: ``take`` runs on this
  thread, in order, ``work`` on one of ``threads`` threads named ``name``;
  ``done(i)`` after each (done or failed). After the first error nothing
  more is taken or worked on; it is raised here once the threads ended
  (``in_threads``).
  """

  def items() -> Iterator[tuple[Callable[[], None], Callable[[], None]]]:
    for i in range(count):
      value = take(i)
      yield functools.partial(work, i, value), functools.partial(done, i)
      del value

  in_threads(items(), threads, name, count)


def in_threads(
  items: Iterator[tuple[Callable[[], None], Callable[[], None]]],
  threads: int,
  name: str,
  count: int | None = None,
  what: str = "jaxworks.batched_transfer",
) -> None:
  """Runs ``job()`` then ``release()`` for each ``(job, release)`` of
  ``items`` on one of ``threads`` threads named ``name``; ``items`` is
  advanced on this thread, at most ``threads`` ahead of the workers.
  ``release()`` runs for every item taken, worked on or not (after an
  error no more jobs run or are taken); the first error is raised here
  once the threads ended. ``count``: how many items there are, where
  fewer than ``threads`` need fewer threads.

  A thread that cannot start (``RuntimeError: can't start new thread``)
  raises ``ThreadStartError`` (``what`` names the API and the checkpoint
  in it) once the threads already started ended: none is left waiting.
  The threads are daemons besides, so none can keep the process alive.

  Plain threads, not concurrent.futures: a non-blocking save may still be
  writing while the interpreter exits, when executors refuse new work.
  """
  todo: queue.Queue = queue.Queue(maxsize=threads)
  errors: list[BaseException] = []

  def loop() -> None:
    while True:
      item = todo.get()
      if item is None:
        return
      job, release = item
      try:
        if not errors:
          job()
      except BaseException as err:  # raised below, on the calling thread
        errors.append(err)
      finally:
        del job, item
        try:
          release()
        except BaseException as err:  # raised below, on the calling thread
          errors.append(err)

  n = threads if count is None else min(threads, max(1, count))
  workers: builtins.list[threading.Thread] = []
  try:
    for k in range(n):
      w = threading.Thread(target=loop, name=f"{name}-{k}", daemon=True)
      try:
        w.start()
      except RuntimeError as err:
        raise ThreadStartError(
          f"{what}: could not start thread {k + 1} of {n} ({name}-{k}): "
          f"{err}; nothing was committed: the checkpoint that was at the "
          "path (if any) is still there. Lower the thread count (e.g. "
          "write_threads=) or raise the process's thread limit (ulimit -u), "
          "then try again"
        ) from err
      workers.append(w)
    it = iter(items)
    while not errors:
      item = next(it, None)
      if item is None:
        break
      todo.put(item)
      del item
  finally:
    for _ in workers:
      todo.put(None)
    for w in workers:
      w.join()
    # An unfinished generator's cleanup runs now, not whenever it is
    # collected (a traceback holding this frame would keep it).
    getattr(items, "close", lambda: None)()
  if errors:
    raise errors[0]


class ThreadStartError(RuntimeError):
  """A thread of ``in_threads`` (or a background save's) could not start;
  what was started ended, nothing was committed."""


def copy_into(out: memoryview, at: int, data: Any) -> int:
  """Copies the bytes-like ``data`` into ``out`` from ``at`` (as many as
  fit), with the GIL released (a memoryview's copy holds it, and the
  request threads of a restore copy at once); how many were copied."""
  src = np.frombuffer(data, np.uint8)
  n = min(src.size, len(out) - at)
  np.frombuffer(out, np.uint8)[at : at + n] = src[:n]
  return n


def chunks(size: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
  """``(start, end)`` pairs that cut ``size`` bytes into ``chunk`` parts."""
  return [(s, min(s + chunk, size)) for s in range(0, size, chunk)]


class Storage(abc.ABC):
  """The objects (or files) under one root: a directory or a URL prefix.

  Every method takes keys relative to the root. Errors are ``OSError``
  subclasses whose message names the API, the URL, the key and the fix:
  ``FileNotFoundError`` (no such object, bucket or container),
  ``FileExistsError`` (``create`` of an existing key), ``PermissionError``
  (credentials refused), ``OSError`` (anything else, after the retries).
  """

  def __init__(self, api: str, location: Location) -> None:
    self.api = api
    self.location = location

  @property
  def url(self) -> str:
    """The root as the user wrote it (normalized)."""
    return self.location.url

  def where(self, key: str = "") -> str:
    """The URL (or path) of ``key`` for messages."""
    return self.location.child(key).url if key else self.url

  def child(self, name: str) -> Storage:
    """The storage of the prefix ``name`` under this root."""
    return self._at(self.location.child(check_key(self.api, name)))

  def parent(self) -> Storage:
    """The storage one level up (a bucket's root stays itself)."""
    return self._at(self.location.parent)

  @abc.abstractmethod
  def _at(self, location: Location) -> Storage:
    """A storage of the same kind and configuration at ``location``."""

  @abc.abstractmethod
  def list(self, prefix: str = "") -> dict[str, int]:
    """Every key under ``prefix`` (recursively) and its size, sorted.

    Objects whose key is not one (``is_key``: a folder marker, an empty,
    ``.`` or ``..`` segment) are left out: no save writes them.

    Raises:
      StrayKeyError: the client library refused a key it listed.
    """

  @abc.abstractmethod
  def children(self) -> builtins.list[str]:
    """The names of the prefixes (directories) right under the root (each
    one segment, ``is_key``).

    Raises:
      StrayKeyError: the client library refused a key it listed.
    """

  @abc.abstractmethod
  def size(self, key: str) -> int:
    """The size of ``key``; FileNotFoundError if there is none."""

  @abc.abstractmethod
  def mtime_ns(self, key: str) -> int:
    """When ``key`` was last written (ns since the epoch)."""

  def exists(self, key: str) -> bool:
    """True if ``key`` exists."""
    try:
      self.size(key)
    except FileNotFoundError:
      return False
    return True

  @abc.abstractmethod
  def read(self, key: str, start: int = 0, end: int | None = None) -> Any:
    """Bytes ``[start, end)`` of ``key`` (a buffer); at most what exists.

    With ``end`` None, one version of the key to its end, read in one
    request: never a new version cut to an old length (a lease record is
    rewritten while others read it)."""

  def read_ranges(
    self, key: str, ranges: Sequence[tuple[int, int]]
  ) -> builtins.list[Any]:
    """Several ranges of ``key`` at once (buffers, in order)."""
    return run_parallel(
      lambda r: self.read(key, r[0], r[1]), ranges, self.concurrency
    )

  def read_into(self, key: str, offset: int, out: memoryview) -> None:
    """Fills ``out`` with ``key``'s bytes from ``offset``, in parallel parts.

    Raises:
      OSError: the object ends before ``out`` is full (a truncated object).
    """
    out = out.cast("B")

    def part(r: tuple[int, int]) -> None:
      data = memoryview(self.read(key, offset + r[0], offset + r[1]))
      if len(data) != r[1] - r[0]:
        raise OSError(
          f"{self.api}: {self.where(key)!r} ends at byte "
          f"{offset + r[0] + len(data)}, before the {offset + r[1]} bytes "
          "the checkpoint's record says it holds; the object was truncated "
          "after the checkpoint was written: save it again"
        )
      out[r[0] : r[1]] = data

    run_parallel(part, chunks(len(out)), self.concurrency)

  def stream_into(self, key: str, start: int, *outs: memoryview) -> None:
    """Fills the buffers ``outs``, one after another, with ``key``'s bytes
    from ``start`` in one request, streamed into them as they arrive (no
    copy of the whole range in memory; object stores override this, here:
    ``read``).

    Raises:
      OSError: the object ends before the buffers are full (a truncated
        object).
    """
    into = Into(outs)
    data = memoryview(self.read(key, start, start + into.size)).cast("B")
    into.write(data)
    if into.pos != into.size:
      raise self.short(key, start + into.pos, start + into.size)

  def open_stream(self, key: str) -> ByteStream | None:
    """All of ``key`` in one request (no range), its bytes read in order as
    they are taken (``ByteStream``), or None where this storage reads in
    ranges only (here)."""
    return None

  def short(self, key: str, got: int, want: int) -> OSError:
    """The error of ``key`` ending at byte ``got``, before ``want``."""
    return OSError(
      f"{self.api}: {self.where(key)!r} ends at byte {got}, before the "
      f"{want} bytes the checkpoint's record says it holds; the object was "
      "truncated after the checkpoint was written: save it again"
    )

  @abc.abstractmethod
  def write(self, key: str, data: Any) -> None:
    """Writes ``data`` (a bytes-like object) as ``key``, replacing it."""

  @abc.abstractmethod
  def upload(self, key: str, filename: str) -> None:
    """Writes the local file ``filename`` as ``key`` in bounded memory."""

  def download(self, key: str, filename: str, size: int | None = None) -> int:
    """Copies ``key`` to the new local file ``filename``; its size.

    Parts are read in parallel and written in place (``pwrite``), so at most
    ``concurrency`` parts are in memory. ``size``: the object's, if listed
    (else asked for).
    """
    size = self.size(key) if size is None else size
    fd = os.open(filename, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
      os.ftruncate(fd, size)

      def part(r: tuple[int, int]) -> None:
        data = memoryview(self.read(key, r[0], r[1]))
        if len(data) != r[1] - r[0]:
          raise OSError(
            f"{self.api}: {self.where(key)!r} changed while it was read "
            f"({size} bytes when listed, {r[0] + len(data)} now); read it "
            "again once nothing writes it"
          )
        os.pwrite(fd, data, r[0])

      # An object of up to WHOLE bytes in one request (fewer round trips);
      # larger ones in CHUNK parts.
      parts = [(0, size)] if size <= WHOLE else chunks(size)
      run_parallel(part, parts, self.concurrency)
    finally:
      os.close(fd)
    LOG.debug("downloaded %s (%d bytes)", self.where(key), size)
    return size

  def open_write(self, key: str, size: int = 0) -> ObjectWriter:
    """A writable file whose bytes become ``key`` at ``close()`` (nothing
    is visible before; ``abort()`` drops them). ``size``: the bytes
    expected, if known (a large object is streamed in parts at once)."""
    return ObjectWriter(self, key, size)

  def _stream(self, key: str) -> Any:
    """A file (``write``, ``close``) streaming ``key`` in parts of bounded
    memory; here: the bytes gathered, written at ``close``."""
    return _Gathered(self, key)

  def copy(self, src: str, dst: str) -> None:
    """Copies ``src`` to ``dst`` (replacing it) on the server if it can;
    here: read, then written."""
    self.write(dst, self.read(src))

  @abc.abstractmethod
  def create(self, key: str, data: bytes) -> None:
    """Writes ``key`` only if it does not exist (FileExistsError if it does).

    Of two writers that create the same key, one succeeds: this is the
    commit of a checkpoint.
    """

  @abc.abstractmethod
  def tag_of(self, key: str) -> str | None:
    """The tag of ``key``'s current version (``replace``), None if there
    is no such object; nothing of it is read."""

  @abc.abstractmethod
  def read_tagged(self, key: str) -> tuple[bytes, str] | None:
    """All of ``key`` in one request and the tag of that version of it
    (what ``replace`` compares: an ETag, a generation); None if there is
    no such object."""

  @abc.abstractmethod
  def replace(self, key: str, data: bytes, tag: str) -> None:
    """Writes ``key`` only if it is still the version ``tag`` names
    (``read_tagged``): a conditional put (S3 and Azure ``If-Match``, GCS
    ``ifGenerationMatch``).

    Raises:
      ChangedError: the object is another version now, or gone.
    """

  @abc.abstractmethod
  def delete(self, keys: Iterable[str]) -> None:
    """Deletes ``keys``; a missing key is no error."""

  def delete_prefix(self, prefix: str = "") -> int:
    """Deletes every key under ``prefix``; how many there were."""
    keys = list(self.list(prefix))
    self.delete(keys)
    return len(keys)

  concurrency: int = DEFAULT_CONCURRENCY


class _Gathered:
  """``Storage._stream``'s default: the bytes held, written at ``close``."""

  def __init__(self, st: Storage, key: str) -> None:
    self.st, self.key, self.buf = st, key, bytearray()

  def write(self, b: Any) -> int:
    self.buf += b
    return len(b)

  def close(self) -> None:
    self.st.write(self.key, self.buf)


class ObjectWriter:
  """A binary file writing one object (``Storage.open_write``): up to
  ``WHOLE`` bytes are held and written in one request at ``close()``; a
  larger object is streamed in parts (``Storage._stream``: a multipart or
  resumable upload of at most ``concurrency`` parts in flight)."""

  def __init__(self, st: Storage, key: str, size: int = 0) -> None:
    self.st, self.key = st, key
    self._buf = bytearray()
    self._out = st._stream(key) if size > WHOLE else None
    self.written = 0

  def write(self, b: Any) -> int:
    view = memoryview(b).cast("B")
    n = len(view)
    self.written += n
    if self._out is None:
      if len(self._buf) + n <= WHOLE:
        self._buf += view
        return n
      self._out = self.st._stream(self.key)
      self._out.write(self._buf)
      self._buf = bytearray()
    self._out.write(view)
    return n

  def flush(self) -> None:
    pass

  def close(self) -> None:
    """Writes the object: visible once this returns."""
    if self._out is None:
      self.st.write(self.key, self._buf)
      self._buf = bytearray()
    else:
      self._out.close()
    LOG.debug("wrote %s (%d bytes)", self.st.where(self.key), self.written)

  def abort(self) -> None:
    """Drops what was written (an unfinished multipart upload is never an
    object)."""
    self._buf = bytearray()
    self._out = None


class Into(io.RawIOBase):
  """A writable file over buffers, filled one after another (a download
  streamed into them; a retried download seeks back to its beginning).
  ``pos``: the bytes written; what does not fit is dropped."""

  def __init__(self, outs: Sequence[memoryview]) -> None:
    self.outs = [memoryview(o).cast("B") for o in outs]
    self.size = sum(len(o) for o in self.outs)
    self.pos = 0

  def writable(self) -> bool:
    return True

  def seek(self, pos: int, whence: int = 0) -> int:
    self.pos = pos if whence == 0 else self.pos + pos
    return self.pos

  def tell(self) -> int:
    return self.pos

  def write(self, b: Any) -> int:
    data = memoryview(b).cast("B")
    done, base = 0, 0
    for out in self.outs:
      if done == len(data):
        break
      at = self.pos - base
      if 0 <= at < len(out):
        k = copy_into(out, at, data[done:])
        done += k
        self.pos += k
      base += len(out)
    return len(data)


class ByteStream:
  """One request's bytes of an object, taken in order (``Storage.open_stream``):
  what has arrived and is not yet taken is at most one chunk of the stream."""

  def __init__(self, st: Storage, key: str, chunks: Iterator[Any]) -> None:
    self.st, self.key = st, key
    self._chunks: Iterator[Any] | None = chunks
    self._left = memoryview(b"")
    #: The object's bytes taken so far.
    self.pos = 0

  def readinto(self, out: memoryview) -> int:
    """Fills ``out`` with the next bytes; how many (fewer only where the
    object ends).

    Raises:
      OSError: the request failed (``Storage``'s errors).
    """
    out = out.cast("B")
    n = 0
    while n < len(out):
      if not self._left:
        chunk = None if self._chunks is None else next(self._chunks, None)
        if chunk is None:
          break
        self._left = memoryview(chunk).cast("B")
      k = copy_into(out, n, self._left)
      self._left = self._left[k:]
      n += k
    self.pos += n
    return n

  def close(self) -> None:
    """Drops the request (the rest of its bytes are not read)."""
    chunks, self._chunks, self._left = self._chunks, None, memoryview(b"")
    close = getattr(chunks, "close", None)
    if close is not None:
      close()


class LocalStorage(Storage):
  """Files under a local directory, with the guarantees of a local save.

  Reads open the file without following a final symlink, refuse anything
  that is not a regular file, and read at most the size ``fstat`` gave;
  writes are fsynced before they return, with their directory.
  """

  def __init__(self, api: str, location: Location) -> None:
    super().__init__(api, location)
    self.root = location.prefix

  def _at(self, location: Location) -> LocalStorage:
    return LocalStorage(self.api, location)

  def _path(self, key: str) -> str:
    return os.path.join(self.root, *check_key(self.api, key).split("/"))

  def _open(self, key: str) -> tuple[int, int]:
    path = self._path(key)
    try:
      fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
      raise FileNotFoundError(f"{self.api}: {path!r} does not exist") from None
    except OSError as e:
      raise type(e)(
        e.errno, f"{self.api}: cannot open {path!r}: {e.strerror}"
      ) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      os.close(fd)
      raise OSError(f"{self.api}: {path!r} is not a regular file")
    return fd, st.st_size

  def list(self, prefix: str = "") -> dict[str, int]:
    top = self._path(prefix) if prefix else self.root
    out = {}
    for dirpath, dirnames, filenames in os.walk(top):
      dirnames.sort()
      for f in filenames:
        full = os.path.join(dirpath, f)
        try:
          st = os.lstat(full)
        except FileNotFoundError:  # renamed or removed since it was listed
          continue  # (another writer's temporary): not a key now
        if stat.S_ISREG(st.st_mode):
          rel = os.path.relpath(full, self.root).replace(os.sep, "/")
          out[rel] = st.st_size
    return dict(sorted(out.items()))

  def children(self) -> builtins.list[str]:
    try:
      with os.scandir(self.root) as it:
        return sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
      return []

  def size(self, key: str) -> int:
    fd, size = self._open(key)
    os.close(fd)
    return size

  def mtime_ns(self, key: str) -> int:
    fd, _ = self._open(key)
    try:
      return os.fstat(fd).st_mtime_ns
    finally:
      os.close(fd)

  def read(self, key: str, start: int = 0, end: int | None = None) -> bytes:
    fd, size = self._open(key)
    try:
      end = size if end is None else min(end, size)
      parts, pos = [], start
      while pos < end:
        b = os.pread(fd, end - pos, pos)
        if not b:
          break
        parts.append(b)
        pos += len(b)
      return b"".join(parts)
    finally:
      os.close(fd)

  def _fsync_dir(self, path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
      os.fsync(fd)
    finally:
      os.close(fd)

  def _write_new(self, path: str, fill: Callable[[int], None]) -> str:
    """Writes and fsyncs a temporary beside ``path``; its name."""
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.jaxworks-new-{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
      fill(fd)
      os.fsync(fd)
    except BaseException:
      os.close(fd)
      os.unlink(tmp)
      raise
    os.close(fd)
    return tmp

  def _write_all(self, fd: int, data: Any) -> None:
    view = memoryview(data).cast("B")
    while view:
      view = view[os.write(fd, view) :]

  def write(self, key: str, data: Any) -> None:
    path = self._path(key)
    tmp = self._write_new(path, lambda fd: self._write_all(fd, data))
    os.replace(tmp, path)
    self._fsync_dir(os.path.dirname(path))

  def upload(self, key: str, filename: str) -> None:
    def fill(fd: int) -> None:
      with open(filename, "rb") as f:
        while b := f.read(CHUNK):
          self._write_all(fd, b)

    path = self._path(key)
    os.replace(self._write_new(path, fill), path)
    self._fsync_dir(os.path.dirname(path))

  def create(self, key: str, data: bytes) -> None:
    path = self._path(key)
    tmp = self._write_new(path, lambda fd: self._write_all(fd, data))
    try:
      os.link(tmp, path)  # fails, EEXIST, where ``path`` exists: no replace
    except FileExistsError:
      raise FileExistsError(
        f"{self.api}: {path!r} exists already; delete it, or pass "
        "overwrite=True where the API takes it"
      ) from None
    finally:
      os.unlink(tmp)
    self._fsync_dir(os.path.dirname(path))

  def _tag(self, fd: int) -> str:
    st = os.fstat(fd)
    return f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"

  def tag_of(self, key: str) -> str | None:
    try:
      fd, _ = self._open(key)
    except FileNotFoundError:
      return None
    try:
      return self._tag(fd)
    finally:
      os.close(fd)

  def read_tagged(self, key: str) -> tuple[bytes, str] | None:
    try:
      fd, size = self._open(key)
    except FileNotFoundError:
      return None
    try:
      return os.pread(fd, size, 0), self._tag(fd)
    finally:
      os.close(fd)

  def replace(self, key: str, data: bytes, tag: str) -> None:
    # No compare-and-swap on a file: the tag (inode, mtime, size) checked,
    # then the new file renamed over it. Heads live in buckets; this is
    # for the interface's tests.
    path = self._path(key)
    tmp = self._write_new(path, lambda fd: self._write_all(fd, data))
    try:
      now = self.read_tagged(key)
      if now is None or now[1] != tag:
        raise ChangedError(
          f"{self.api}: {path!r} changed since it was read (another writer "
          "replaced or deleted it); read it again"
        )
      os.replace(tmp, path)
    except BaseException:
      with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
      raise
    self._fsync_dir(os.path.dirname(path))

  def delete(self, keys: Iterable[str]) -> None:
    for key in keys:
      try:
        os.unlink(self._path(key))
      except FileNotFoundError:
        pass
