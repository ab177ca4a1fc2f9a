"""Checkpoints in object stores: the same files, committed by their record.

A checkpoint in a bucket is the objects a local save writes, under the
URL's prefix, with the same names and bytes (a directory copied with any
tool restores from the bucket, and back). Object stores have no rename and
no fsync, so the commit is the record, ``jaxworks_dtypes.json``, written
last with a conditional create: a prefix without its record is a save that
did not commit, and reads as absent; of two saves to one new path exactly
one creates the record, the other raises ``FileExistsError``.

``save`` writes the checkpoint to a local temporary directory with the
local writer (checksums and all), uploads every file in parallel (large
ones in parts), then creates the record. An overwrite first writes and
commits the new checkpoint under ``.<name>.jaxworks-new-<hex>`` beside the
path, then removes the old record, replaces the objects at the path and
creates the record again; a reader that finds no record at the path reads
the committed copy beside it, so at every moment one complete checkpoint
is readable. ``source`` finds the committed checkpoint at a URL (or the
copy an overwrite committed beside it), which restore and metadata read in
ranges straight from the objects (restore_objects).
"""

from __future__ import annotations

from collections.abc import Callable
import os
import secrets
import tempfile
import threading
from typing import Any

from . import format
from . import stores
from .progress import Progress
from .storage import LOG
from .storage import Storage

_NEW = ".jaxworks-new-"
#: Bytes of an ``.npy`` file that ``metadata`` reads (its header).
HEADER_BYTES = 64 * 1024


def _local_files(root: str) -> dict[str, str]:
  """``{key: local path}`` of every file under ``root``."""
  out = {}
  for dirpath, _, names in os.walk(root):
    for n in names:
      full = os.path.join(dirpath, n)
      out[os.path.relpath(full, root).replace(os.sep, "/")] = full
  return out


def _stagings(parent: Storage, name: str) -> dict[str, bool]:
  """``{prefix: committed}`` of the ``.<name>.jaxworks-new-*`` prefixes."""
  start = f".{name}{_NEW}"
  return {
    p: parent.child(p).exists(format.RECORD)
    for p in parent.children()
    if p.startswith(start)
  }


def _upload(
  st: Storage, files: dict[str, str], progress: bool | None = False
) -> None:
  """Uploads ``{key: local file}`` to ``st`` in parallel; ``progress`` as
  ``Progress``'s ``enabled`` (a bar of the bytes uploaded)."""
  from .storage import run_parallel

  items = sorted(files.items())
  bar = Progress(
    "upload",
    sum(os.path.getsize(f) for _, f in items) if progress is not False else 0,
    enabled=progress,
  )
  lock = threading.Lock()

  def one(kv: tuple[str, str]) -> None:
    st.upload(kv[0], kv[1])
    if bar.enabled:
      with lock:
        bar.update(os.path.getsize(kv[1]))

  try:
    run_parallel(one, items, st.concurrency)
  finally:
    bar.close()


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


class Upload:
  """A save to the object-store ``url``: checked in the call, the local
  writer writes ``local`` (a temporary directory's), ``finish()`` uploads
  and commits, ``abort()`` removes the local copy.

  Raises:
    FileExistsError: a checkpoint is committed at ``url`` and not
      ``overwrite`` (``finish``: another save committed there meanwhile).
  """

  def __init__(
    self,
    api: str,
    url: str,
    storage_options: dict[str, Any] | None,
    overwrite: bool,
    progress: bool | None = False,
  ) -> None:
    self.api, self.url, self.progress = api, url, progress
    self.st, self.parent, self.name = _destination(api, url, storage_options)
    self.npz = self.name.endswith(".npz")
    if self.npz:
      self.stagings: dict[str, bool] = {}
      self.committed = self.parent.exists(self.name)
    else:
      self.stagings = _stagings(self.parent, self.name)
      self.committed = self.st.exists(format.RECORD) or any(
        self.stagings.values()
      )
    if self.committed and not overwrite:
      raise _exists(api, url)
    self._tmp = tempfile.TemporaryDirectory(prefix="jaxworks-upload-")
    self.local = os.path.join(self._tmp.name, self.name)

  def abort(self) -> None:
    self._tmp.cleanup()

  def finish(self) -> None:
    try:
      self._finish()
    finally:
      self.abort()

  def _finish(self) -> None:
    st, parent, name = self.st, self.parent, self.name
    if self.npz:
      if self.committed:
        parent.upload(name, self.local)  # one object: replaced atomically
      else:
        with open(self.local, "rb") as f:
          try:
            parent.create(name, f.read())
          except FileExistsError:
            raise _exists(self.api, self.url) from None
      LOG.info("saved %s", self.url)
      return
    files = _local_files(self.local)
    with open(files.pop(format.RECORD), "rb") as f:
      record = f.read()
    if self.committed:
      # The new one committed beside the path first: always one readable.
      new = parent.child(f".{name}{_NEW}{secrets.token_hex(8)}")
      _upload(new, files, self.progress)
      new.create(format.RECORD, record)
      st.delete([format.RECORD])
    st.delete(sorted(set(st.list()) - set(files)))
    _upload(st, files, self.progress)
    try:
      st.create(format.RECORD, record)
    except FileExistsError:
      raise _exists(self.api, self.url) from None
    for prefix in self.stagings:  # of saves killed before they finished
      parent.child(prefix).delete_prefix()
    if self.committed:
      new.delete_prefix()
    LOG.info("saved %s (%d objects)", self.url, len(files) + 1)


class Collective:
  """The bucket side of a save that several processes make together
  (multiprocess drives it, every process holding one): each writes its
  files into ``local`` (a temporary directory's), uploads them where
  process 0 says (``begin``), process 0 commits (``commit``); an overwrite
  of a committed checkpoint commits beside the path first, then every
  process uploads its files again to the path (``move``) and process 0
  commits there (``finish``).

  Raises:
    FileExistsError: a checkpoint is committed at ``url`` and not
      ``overwrite`` (``commit``: another save committed there meanwhile).
  """

  def __init__(
    self,
    api: str,
    url: str,
    storage_options: dict[str, Any] | None,
    overwrite: bool,
    progress: bool | None = False,
  ) -> None:
    self.api, self.url, self.progress = api, url, progress
    self.st, self.parent, self.name = _destination(api, url, storage_options)
    self.stagings = _stagings(self.parent, self.name)
    self.committed = self.st.exists(format.RECORD) or any(
      self.stagings.values()
    )
    if self.committed and not overwrite:
      raise _exists(api, url)
    self._tmp = tempfile.TemporaryDirectory(prefix="jaxworks-upload-")
    self.local = os.path.join(self._tmp.name, self.name)
    os.mkdir(self.local)
    self.target = self.st  # where this process uploads (``begin``/``attach``)

  @property
  def beside(self) -> bool:
    """Whether the files go beside the path first (an overwrite)."""
    return self.target is not self.st

  def where(self) -> str:
    return self.target.url

  def begin(self) -> str:
    """Process 0, before any file is uploaded: where every process uploads,
    as the name to post ("" for the path itself, whose leftovers of saves
    that did not commit it removes first)."""
    if self.committed:
      name = f".{self.name}{_NEW}{secrets.token_hex(8)}"
      self.target = self.parent.child(name)
      return name
    if self.st.exists(format.RECORD):  # committed meanwhile
      raise _exists(self.api, self.url)
    self.st.delete(sorted(self.st.list()))
    return ""

  def attach(self, name: str) -> None:
    """The other processes: where process 0 said (``begin``)."""
    self.target = self.parent.child(name) if name else self.st

  def upload(self) -> None:
    """Uploads this process's files to the target, in parallel."""
    _upload(self.target, _local_files(self.local), self.progress)

  def commit(self, manifest: bytes, record: bytes) -> bool:
    """Process 0, every process's files uploaded: the manifest, then the
    record created at the target (the commit). True if the files must
    then move to the path (``move`` on every process, then ``finish``):
    the old checkpoint's record and objects are removed first, and the
    one committed beside it is what readers find meanwhile."""
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
    self.st.delete_prefix()
    return True

  def move(self) -> None:
    """Every process: its files uploaded again, to the path."""
    _upload(self.st, _local_files(self.local))

  def finish(self, manifest: bytes, record: bytes) -> None:
    """Process 0, every process's files at the path: the commit there."""
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
    """Process 0, the save failed before its commit: what it uploaded beside
    the path is removed (at the path, no record: absent, and the next save
    removes it)."""
    if self.beside:
      self.target.delete_prefix()

  def close(self) -> None:
    """Removes the local copy."""
    self._tmp.cleanup()


def save(
  api: str,
  url: str,
  storage_options: dict[str, Any] | None,
  overwrite: bool,
  save_local: Callable[[str], None],
) -> None:
  """Saves to the object-store ``url``; ``save_local(path)`` writes the files."""
  up = Upload(api, url, storage_options, overwrite)
  try:
    save_local(up.local)
    up.finish()
  finally:
    up.abort()


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
  raise FileNotFoundError(
    f"{api}: no checkpoint at {st.url!r}: no {format.RECORD} there (a "
    "prefix without it is a save that did not commit, and is absent)"
  )
