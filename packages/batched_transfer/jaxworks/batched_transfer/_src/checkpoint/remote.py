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
``job.SaveJob``, or every process's, driven by multiprocess): the writer
threads stream each file straight into its object (``Storage.open_write``:
small ones in one request, large ones as parallel multipart uploads, their
CRC-32C computed as the bytes go out), no local copy; then the record is
created. A save to a path without a committed checkpoint writes at the
path, after removing what saves that did not commit left there. An
overwrite writes and commits the new checkpoint under
``.<name>.jaxworks-new-<hex>`` beside the path, then removes the old record
and objects, copies the new objects to the path on the server (no second
upload) and creates the record there; a reader that finds no record at the
path reads the committed copy beside it, so at every moment one complete
checkpoint is readable. An ``.npz`` is one object, written locally, then
uploaded (``NpzUpload``). ``source`` finds the committed checkpoint at a
URL (or the copy an overwrite committed beside it), which restore and
metadata read in ranges straight from the objects (restore_objects).
"""

from __future__ import annotations

from collections.abc import Callable
import os
import secrets
import tempfile
from typing import Any

from . import format
from . import lease as lease_lib
from . import stores
from .storage import LOG
from .storage import Storage
from .storage import in_writer_threads

_NEW = ".jaxworks-new-"
#: Bytes of an ``.npy`` file that ``metadata`` reads (its header).
HEADER_BYTES = 64 * 1024


def _stagings(parent: Storage, name: str) -> dict[str, bool]:
  """``{prefix: committed}`` of the ``.<name>.jaxworks-new-*`` prefixes."""
  start = f".{name}{_NEW}"
  return {
    p: parent.child(p).exists(format.RECORD)
    for p in parent.children()
    if p.startswith(start)
  }


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


def _destination(
  api: str, url: str, storage_options: dict[str, Any] | None
) -> tuple[Storage, Storage, str]:
  """(the prefix's storage, its parent's, its name) of a save to ``url``;
  ValueError for a bucket's root."""
  st = stores.open_storage(api, url, storage_options)
  loc = st.location
  if not loc.prefix:
    raise ValueError(
      f"{api}: {url!r} is a bucket's root; save to a prefix in it "
      f"({loc.scheme}://{loc.bucket}/NAME)"
    )
  return st, st._at(loc.parent), loc.name


def _exists(api: str, url: str) -> FileExistsError:
  return FileExistsError(
    f"{api}: a checkpoint exists at {url!r}; pass overwrite=True to "
    "replace it, or save to another path"
  )


class NpzUpload:
  """A save of an ``.npz`` (one object) to ``url``: checked in the call,
  the local writer writes ``local`` (a temporary file's path),
  ``finish()`` uploads it (created only if absent, unless it replaces a
  committed one), ``abort()`` removes the local copy.

  Raises:
    FileExistsError: an object is at ``url`` and not ``overwrite``
      (``finish``: another save created it meanwhile).
  """

  def __init__(
    self,
    api: str,
    url: str,
    storage_options: dict[str, Any] | None,
    overwrite: bool,
  ) -> None:
    self.api, self.url = api, url
    self.st, self.parent, self.name = _destination(api, url, storage_options)
    self.committed = self.parent.exists(self.name)
    if self.committed and not overwrite:
      raise _exists(api, url)
    self._tmp = tempfile.TemporaryDirectory(prefix="jaxworks-upload-")
    self.local = os.path.join(self._tmp.name, self.name)

  def abort(self) -> None:
    self._tmp.cleanup()

  def finish(self) -> None:
    try:
      if self.committed:  # one object: replaced atomically
        self.parent.upload(self.name, self.local)
      else:
        with open(self.local, "rb") as f:
          try:
            self.parent.create(self.name, f.read())
          except FileExistsError:
            raise _exists(self.api, self.url) from None
      LOG.info("saved %s", self.url)
    finally:
      self.abort()


def _leased(keys: Any) -> list[str]:
  """``keys`` less the writer lease's objects (``.jaxworks-writer/*``)."""
  return [k for k in keys if not k.startswith(lease_lib.PREFIX + "/")]


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
    storage_options: dict[str, Any] | None,
    overwrite: bool,
    progress: bool | None = False,
    lease: bool = True,
  ) -> None:
    del progress  # the writes are the upload: the save's bar draws them
    self.api, self.url, self.overwrite = api, url, overwrite
    self.lease = lease
    self._held: lease_lib.Lease | None = None
    self.st, self.parent, self.name = _destination(api, url, storage_options)
    self.stagings = _stagings(self.parent, self.name)
    self.committed = self.st.exists(format.RECORD) or any(
      self.stagings.values()
    )
    if self.committed and not overwrite:
      raise _exists(api, url)
    self.target = self.st  # where this process writes (``begin``/``attach``)
    self.written: list[str] = []

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
    self.stagings = _stagings(self.parent, self.name)
    self.committed = self.st.exists(format.RECORD) or any(
      self.stagings.values()
    )
    if self.committed:
      if not self.overwrite:
        raise _exists(self.api, self.url)
      name = f".{self.name}{_NEW}{secrets.token_hex(8)}"
      self.target = self.parent.child(name)
      return name
    self.st.delete(sorted(_leased(self.st.list())))
    return ""

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
      raise _exists(self.api, self.url) from None
    if not self.beside:
      self._clean()
      LOG.info("saved %s", self.url)
      return False
    self.st.delete([format.RECORD])
    self.st.delete(_leased(self.st.list()))  # not the lease
    return True

  def move(self) -> None:
    """Every process: its objects copied to the path on the server."""
    self._still()
    here = self.target.location.name
    self._copy([(f"{here}/{n}", f"{self.name}/{n}") for n in self.written])

  def _copy(self, pairs: list[tuple[str, str]]) -> None:
    from .storage import run_parallel

    run_parallel(
      lambda p: self.parent.copy(*p), pairs, 2 * self.parent.concurrency
    )

  def finish(self, record: bytes, manifest: bytes | None = None) -> None:
    """Process 0, every process's objects at the path: the commit there."""
    self._still()
    if manifest is not None:
      self.st.write(format.MANIFEST, manifest)
    try:
      self.st.create(format.RECORD, record)
    except FileExistsError:
      raise _exists(self.api, self.url) from None
    self.target.delete_prefix()
    self._clean()
    LOG.info("saved %s", self.url)

  def _clean(self) -> None:
    for prefix in self.stagings:  # of saves killed before they finished
      self.parent.child(prefix).delete_prefix()

  def abort(self) -> None:
    """Process 0, the save failed before its commit: what it wrote beside
    the path is removed (at the path, no record: absent, and the next save
    removes it)."""
    if self.beside:
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


#: The bucket side of a collective save (multiprocess) is ``Bucket``.
Collective = Bucket


def source(api: str, st: Storage) -> Storage:
  """The committed checkpoint at ``st``, or the one an overwrite left beside.

  Raises:
    FileNotFoundError: no record at the URL nor beside it.
  """
  if st.exists(format.RECORD):
    return st
  loc = st.location
  if loc.prefix:
    parent = st._at(loc.parent)
    done = [p for p, ok in _stagings(parent, loc.name).items() if ok]
    if done:
      return parent.child(sorted(done)[-1])
    # An overwrite removes its copy beside the path only once the path is
    # committed: that may have happened since the record was looked for.
    if st.exists(format.RECORD):
      return st
  raise FileNotFoundError(
    f"{api}: no checkpoint at {st.url!r}: no {format.RECORD} there (a "
    "prefix without it is a save that did not commit, and is absent)"
  )
