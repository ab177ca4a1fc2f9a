"""Checkpoints in object stores: the same files, committed by their record.

A checkpoint in a bucket is the objects a local save writes, under the
URL's prefix, with the same names and bytes (a directory copied with any
tool restores from the bucket, and back). Object stores have no rename and
no fsync, so the commit is the record, ``jaxworks_dtypes.json``, written
last with a conditional create: a prefix without its record is a save that
did not commit, and reads as absent; of two saves to one new path exactly
one creates the record, the other raises ``FileExistsError``.

One saver per path: before any object is written, the save takes the
path's writer lease (lease: ``<url>/.jaxworks-writer/<generation>``,
created with the conditional create, a heartbeat, a dead saver's lease
taken over with a warning) and gives it back once committed (and an
overwrite's copy done). A second process saving the path meanwhile stops
before writing anything (``FileExistsError``, or with ``overwrite``
``WriterConflictError``), so it never writes over the objects of the
checkpoint the first commits, as the no-replace rename of a local save
guarantees. Readers ignore the lease's objects; the cleanup of leftovers
keeps them. A CheckpointManager's saves take none: it holds its
directory's.

``Bucket`` is the bucket side of a directory save (one process's, driven by
``job.SaveJob``, or every process's, driven by multiprocess), through
``destination.BucketPrefix``: the writer
threads stream each file straight into its object (``Storage.open_write``:
small ones in one request, large ones as parallel multipart uploads, their
CRC-32C computed as the bytes go out), no local copy; then the record is
created. A save to a path without a committed checkpoint writes at the
path, after removing what saves that did not commit left there. An
overwrite writes and commits the new checkpoint under
``.<name>.jaxworks-next-<hex>`` beside the path, names that copy in the
path's object ``.jaxworks-moved``, removes the old record (the commit of
the overwrite: from then on the path reads as the copy it names) and
objects, copies the new objects to the path on the server (no second
upload), creates the record there and removes the name and the copy. A
reader takes the path's record if there is one, else the copy that
``.jaxworks-moved`` names (one object, so failed copy rounds in a row leave
one answer: the last save that committed); at every moment one complete
checkpoint is readable, the last one committed. Copies beside the path
that no name points to are leftovers, which the next save removes. (0.6.0
named its copies ``.<name>.jaxworks-new-<hex>`` and wrote no name: a path
with neither record nor name reads the newest committed one of those.) An
``.npz`` is one object, written locally, then uploaded
(``destination.BucketNpz``). ``source`` finds the committed checkpoint at a
URL (or the copy an overwrite committed beside it), which restore and
metadata read in ranges straight from the objects (restore_objects).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Iterator
import contextlib
import secrets
from typing import Any

from . import codec
from . import format
from . import lease as lease_lib
from . import storage
from .storage import LOG
from .storage import Storage
from .storage import in_writer_threads

#: The copies beside a path: an overwrite's (``_NEXT``), and 0.6.0's.
_NEXT = ".jaxworks-next-"
_NEW = ".jaxworks-new-"
#: The object at a path naming the copy beside it that an overwrite
#: committed, while the path itself holds no record.
MOVED = ".jaxworks-moved"
_HEX = frozenset("0123456789abcdef")
#: Bytes of an ``.npy`` file that ``metadata`` reads (its header).
HEADER_BYTES = 64 * 1024


def _is_copy(name: str, copy: str, marker: str = _NEXT) -> bool:
  """Whether ``copy`` is a ``.<name><marker><16 hex>`` copy's name."""
  start = f".{name}{marker}"
  tail = copy[len(start) :]
  return copy.startswith(start) and len(tail) == 16 and set(tail) <= _HEX


def _copies(parent: Storage, name: str) -> list[str] | None:
  """The copies beside ``name`` in ``parent`` (both kinds); None where the
  parent cannot be listed (a stray key there: the copies are left, and the
  next listing that can removes them)."""
  try:
    children = parent.children()
  except storage.StrayKeyError as err:
    LOG.warning("%s; the copies beside %r are left", err, name)
    return None
  return [c for c in children if _is_copy(name, c) or _is_copy(name, c, _NEW)]


def _moved(api: str, st: Storage, name: str) -> str | None:
  """The copy that the path's ``MOVED`` object names, if there is one.

  Raises:
    ValueError: the object holds no copy's name (it was edited).
  """
  try:
    data = bytes(st.read(MOVED, 0, 256))
  except FileNotFoundError:
    return None
  copy = data.decode("utf-8", "replace")
  if not _is_copy(name, copy):
    raise ValueError(
      f"{api}: {st.where(MOVED)!r} names no copy beside {st.url!r} "
      f"({data[:80]!r}); the checkpoint is damaged: save it again with "
      "overwrite=True"
    )
  return copy


def committed_at(
  api: str,
  st: Storage,
  copies: list[str] | None = None,
  has_record: bool | None = None,
) -> Storage | None:
  """Where the checkpoint committed at ``st`` is: ``st`` if it has a
  record; else the copy beside it that its ``MOVED`` object names (if that
  has its record); else (0.6.0's overwrites left no name) the newest
  committed ``.jaxworks-new-`` copy beside it; else None.

  Args:
    copies: the copies beside ``st`` (``_copies``) where the caller listed
      them: no name is looked for without a copy to name (an overwrite
      removes its name before its copy).
    has_record: whether ``st`` has a record, where the caller looked.
  """
  if st.exists(format.RECORD) if has_record is None else has_record:
    return st
  loc = st.location
  if not loc.prefix:
    return None
  parent = st.parent()
  if copies is None or any(_is_copy(loc.name, c) for c in copies):
    copy = _moved(api, st, loc.name)
    if copy is not None:
      at = parent.child(copy)
      return at if at.exists(format.RECORD) else None
  if copies is None:
    copies = _copies(parent, loc.name) or []
  old = [parent.child(c) for c in copies if _is_copy(loc.name, c, _NEW)]
  done = [
    (c.mtime_ns(format.RECORD), c.url, c)
    for c in old
    if c.exists(format.RECORD)
  ]
  return max(done, key=lambda t: t[:2])[2] if done else None


#: Name prefix of the threads that write objects.
WRITE_THREAD_PREFIX = "jaxworks-save-object"
#: Bytes an .npy header takes at most, beyond the data (a size hint).
_HEADER = 4096


def _upload(
  st: Storage,
  names: list[str],
  take: Callable[[int], Any],
  fill: Callable[[int, Any, Any], Any],
  done: Callable[[int], None],
  threads: int,
) -> list[Any]:
  """Writes object ``names[i]`` of ``st`` as ``fill(i, value, file)``
  writes it, ``value = take(i)`` taken in order on this thread, on
  ``threads`` threads; ``done(i)`` once it is written (or failed); what
  each ``fill`` returned. Nothing of a failed object is visible.
  """
  out: list[Any] = [None] * len(names)

  def work(i: int, a: Any) -> None:
    f = st.open_write(names[i], int(getattr(a, "nbytes", 0)) + _HEADER)
    try:
      out[i] = fill(i, a, f)
      f.close()
    except BaseException:
      f.abort()
      raise

  in_writer_threads(len(names), take, work, done, threads, WRITE_THREAD_PREFIX)
  return out


def split(api: str, url: str, st: Storage) -> tuple[Storage, str]:
  """(the parent's storage, the name) of a save to ``url`` (``st``);
  ValueError for a bucket's root."""
  loc = st.location
  if not loc.prefix:
    raise ValueError(
      f"{api}: {url!r} is a bucket's root; save to a prefix in it "
      f"({loc.scheme}://{loc.bucket}/NAME)"
    )
  return st.parent(), loc.name


def exists_error(api: str, url: str) -> FileExistsError:
  """The error of a save without overwrite to ``url``, where a checkpoint
  is committed."""
  return FileExistsError(
    f"{api}: a checkpoint exists at {url!r}; pass overwrite=True to "
    "replace it, or save to another path"
  )


def _named(api: str, at: Storage) -> list[str]:
  """The objects of the checkpoint at ``at`` that its record and manifest
  name, and the control objects (for where a listing is refused)."""
  names = [format.RECORD, format.MANIFEST, MOVED]
  try:
    where = at.where(format.RECORD)
    record = format.decode_record(api, where, bytes(at.read(format.RECORD)))
    names += [
      codec.file_name(e[0], record.codecs.get(e[0]))
      for e in record.tree or ()
      if len(e) == 2
    ]
    data = bytes(at.read(format.MANIFEST, 0, format.MAX_MANIFEST_BYTES))
    arrays = format.parse_manifest(data)
  except (FileNotFoundError, *format.DAMAGED):
    return names
  return names + sorted({s.file for a in arrays.values() for s in a.shards})


def _written(key: str) -> bool:
  """Whether a save writes objects named ``key`` (then it removes them)."""
  return (
    key in (format.RECORD, format.MANIFEST, MOVED)
    or codec.split_name(key) is not None
  ) and not key.startswith(lease_lib.PREFIX + "/")


class Bucket:
  """The bucket side of a directory save to ``url`` (see the module
  docstring): checked in the call; ``begin`` (process 0, in the save's
  turn) takes the path's writer lease and says where the objects go, the
  path or a prefix beside it (the other processes of a collective save
  ``attach`` there); every process ``write``s its objects; process 0
  ``commit``s; an overwrite then ``move``s every process's objects to the
  path (server-side copies) and process 0 ``finish``es with the commit
  there; ``end`` (process 0, once done or failed) gives the lease back.

  Args:
    lease: take the path's writer lease in ``begin`` (False: the caller
      holds one on a directory above, a CheckpointManager's).

  Raises:
    FileExistsError: a checkpoint is committed at ``url``, or another live
      process is saving there, and not ``overwrite`` (``begin``;
      ``commit``: another save committed there meanwhile).
    WriterConflictError: with ``overwrite``, another live process is
      saving to ``url`` (``begin``).
  """

  def __init__(
    self,
    api: str,
    url: str,
    st: Storage,
    overwrite: bool,
    lease: bool = True,
  ) -> None:
    self.api, self.url, self.overwrite = api, url, overwrite
    self.lease = lease
    self._held: lease_lib.Lease | None = None
    self.st = st
    self.parent, self.name = split(api, url, st)
    self._look()
    if self.current is not None and not overwrite:
      raise exists_error(api, url)
    self.target = self.st  # where this process writes (``begin``/``attach``)
    self.written: list[str] = []
    self._switched = False  # the path reads as the target (``commit``)

  @property
  def beside(self) -> bool:
    """Whether the objects go beside the path first (an overwrite)."""
    return self.target is not self.st

  def where(self) -> str:
    return self.target.url

  def begin(self) -> str:
    """Process 0, in the save's turn, before any object is written: the
    path's writer lease taken (``end`` gives it back), then where every
    process writes, as the name to post ("" for the path itself, whose
    leftovers of saves that did not commit it removes first)."""
    if self.lease and self._held is None:
      self._held = lease_lib.acquire(
        self.api, self.st, self.url, self._conflict
      )
    try:
      return self._begin()
    except BaseException:
      self.end()
      raise

  def _conflict(self, api: str, url: str, record: dict[str, Any]) -> Exception:
    """The error of a save that meets another live saver's lease."""
    who = lease_lib.describe(record)
    gone = (
      f"If that process is gone, its lease expires {lease_lib.EXPIRY_S:g} s "
      f"after its last heartbeat (or delete {url}/{lease_lib.PREFIX})"
    )
    if not self.overwrite:
      return FileExistsError(
        f"{api}: a checkpoint is being saved at {url!r} by {who}; save to "
        "another path, or wait for that save and pass overwrite=True to "
        f"replace its checkpoint. {gone}"
      )
    return lease_lib.WriterConflictError(
      f"{api}: {url!r} is being saved by {who}; two saves of one path at "
      "once would write over each other's objects, so this one stops "
      "before writing any. Let one process save each path (in a job of "
      "several processes, every process calls save and process 0 commits), "
      f"or save to another path. {gone}"
    )

  def _still(self) -> None:
    """Raises WriterConflictError if another process took this save's
    lease over (this one's heartbeat had stopped): before each step that
    writes at the path."""
    lost = None if self._held is None else self._held.lost
    if lost is not None:
      raise lease_lib.WriterConflictError(
        f"{self.api}: {self.url!r} is now saved by "
        f"{lease_lib.describe(lost)}, which took over this save's writer "
        f"lease (its heartbeat had stopped for {lease_lib.EXPIRY_S:g} s: "
        "was this process suspended?); this save stops before writing "
        "there again: save again once that one is done, or to another path"
      )

  def _begin(self) -> str:
    # Again: the saves called before this one may have committed since.
    self._look()
    if self.current is not None:
      if not self.overwrite:
        raise exists_error(self.api, self.url)
      name = f".{self.name}{_NEXT}{secrets.token_hex(8)}"
      self.target = self.parent.child(name)
      return name
    self.st.delete(self._leftovers())
    return ""

  def _leftovers(self) -> list[str]:
    """The objects at the path that a save writes (array files, record,
    manifest, name of a copy): of the checkpoint being replaced, or of
    saves that did not commit; others are not the checkpoint's, and stay.
    Where the path cannot be listed (a stray key), the control objects and
    those that the record of the checkpoint read there names."""
    try:
      return [k for k in self.st.list() if _written(k)]
    except storage.StrayKeyError as err:
      LOG.warning("%s; removing only the objects jaxworks wrote there", err)
    return _named(self.api, self.current or self.st)

  def _look(self) -> None:
    """What is at the path: its record first (the first request of a
    save names the path in any error), then the copies beside it."""
    has = self.st.exists(format.RECORD)
    self.copies = _copies(self.parent, self.name)
    self.current = committed_at(self.api, self.st, self.copies, has)

  def attach(self, name: str) -> None:
    """The other processes: where process 0 said (``begin``)."""
    self.target = self.parent.child(name) if name else self.st

  def write(
    self,
    names: list[str],
    take: Callable[[int], Any],
    fill: Callable[[int, Any, Any], Any],
    done: Callable[[int], None],
    threads: int,
  ) -> list[Any]:
    """Writes this process's objects ``names`` to the target (``_upload``);
    what each ``fill`` returned (the checksums)."""
    out = _upload(self.target, names, take, fill, done, threads)
    self.written += names
    return out

  def commit(self, record: bytes, manifest: bytes | None = None) -> bool:
    """Process 0, every process's objects written: the manifest, then the
    record created at the target (the commit). True if the objects must
    then move to the path (``move`` on every process, then ``finish``):
    the old checkpoint's record and objects are removed first, and the
    one committed beside it is what readers find meanwhile."""
    self._still()
    if manifest is not None:
      self.target.write(format.MANIFEST, manifest)
    try:
      self.target.create(format.RECORD, record)
    except FileExistsError:
      raise exists_error(self.api, self.url) from None
    if not self.beside:
      self._tidy([], self.copies or [])
      return False
    old = self._leftovers()  # before the record that names them goes
    # The commit of this overwrite: the path reads as the target once it
    # names it and has no record of its own (deleted next, if it had one).
    self.st.write(MOVED, self.target.location.name.encode())
    self._switched = self.current is not self.st
    with self._noted():
      self.st.delete([format.RECORD])
      self._switched = True
      self.st.delete([k for k in old if k != MOVED])
      self._clean(self.copies or [])
    return True

  @contextlib.contextmanager
  def _noted(self) -> Iterator[None]:
    """An error of the copy round says that the overwrite committed."""
    try:
      yield
    except BaseException as err:
      if self._switched:
        err.add_note(
          f"{self.api}: the new checkpoint was committed at "
          f"{self.target.url!r}: {self.url!r} reads as it until a save to "
          f"{self.url!r} completes (it removes the copy)"
        )
      raise

  def move(self) -> None:
    """Every process: its objects copied to the path on the server."""
    self._still()
    here = self.target.location.name
    with self._noted():
      self._copy([(f"{here}/{n}", f"{self.name}/{n}") for n in self.written])

  def _copy(self, pairs: list[tuple[str, str]]) -> None:
    from .storage import run_parallel

    run_parallel(
      lambda p: self.parent.copy(*p), pairs, 2 * self.parent.concurrency
    )

  def finish(self, record: bytes, manifest: bytes | None = None) -> None:
    """Process 0, every process's objects at the path: the commit there."""
    with self._noted():
      self._still()
      if manifest is not None:
        self.st.write(format.MANIFEST, manifest)
      try:
        self.st.create(format.RECORD, record)
      except FileExistsError:
        raise exists_error(self.api, self.url) from None
    self._tidy([MOVED], [*(self.copies or []), self.target.location.name])

  def _tidy(self, keys: list[str], copies: list[str]) -> None:
    """Once the path holds its committed checkpoint: ``keys`` and the
    copies beside removed; a failure only logged (the save is done, the
    next one removes them)."""
    try:
      if keys:
        self.st.delete(keys)
      self._clean(copies)
    except OSError as err:
      LOG.warning(
        "%s; %s is saved, the next save removes the rest", err, self.url
      )

  def _clean(self, copies: list[str]) -> None:
    """Removes ``copies`` beside the path: of saves killed or failed before
    they finished, the one replaced, this one's once copied."""
    for copy in copies:
      self.parent.child(copy).delete_prefix()

  def abort(self) -> None:
    """Process 0, the save failed before its commit: what it wrote beside
    the path is removed (at the path, no record: absent, and the next save
    removes it). Once the path reads as that copy (``commit`` named it),
    it stays, and the next save removes it."""
    if self.beside and not self._switched:
      self.target.delete_prefix()

  def end(self) -> None:
    """Process 0, the save done or failed: the writer lease given back
    (again: nothing)."""
    held, self._held = self._held, None
    if held is not None:
      lease_lib.release(held)

  def close(self) -> None:
    """Nothing is held locally; the lease, if still held, given back."""
    self.end()


def source(api: str, st: Storage) -> Storage:
  """The committed checkpoint at ``st``, or the copy beside it that an
  overwrite committed and named (``_current``).

  Raises:
    FileNotFoundError: no record at the URL nor a committed copy beside.
  """
  # An overwrite that finishes meanwhile creates the path's record, then
  # removes the name and the copy: what was looked for may be gone since.
  for _ in range(3):
    found = committed_at(api, st)
    if found is not None:
      return found
  raise FileNotFoundError(
    f"{api}: no checkpoint at {st.url!r}: no {format.RECORD} there (a "
    "prefix without it is a save that did not commit, and is absent)"
  )


def delete(api: str, st: Storage) -> bool:
  """Deletes the checkpoint committed at ``st`` (a manager's step) and the
  copies beside it, first what commits it (its record, the name of its
  copy): it is never half read. False if there was none."""
  at = committed_at(api, st)
  if at is None:
    return False
  try:
    keys = list(st.list())
  except storage.StrayKeyError as err:
    LOG.warning("%s; deleting only the objects jaxworks wrote there", err)
    keys = _named(api, st) if at is st else [format.RECORD, MOVED]
  st.delete([format.RECORD, MOVED])
  st.delete(keys)
  loc = st.location
  parent = st.parent()
  for copy in _copies(parent, loc.name) or []:
    parent.child(copy).delete_prefix()
  return True
