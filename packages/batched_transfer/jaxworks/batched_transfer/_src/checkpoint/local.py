"""Checkpoints on a local (or shared) file system: a directory of ``.npy``
files and its record, or one ``.npz`` (place tells the steps).

A save writes under a temporary name beside the path, holding the parent
directory's save lock, and its commit renames that into place in one step
(``commit.publish``: an exchange with the old copy, which the reaper then
removes). A committed directory is never changed: a read opens the
directory once, reads its record through that descriptor, then only the
files the record names (``_Local.open_checkpoint``); one that loses a race
with a save or a delete reads again (``_Local.reading``).
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from collections.abc import Iterator
import contextlib
import errno
import os
import re
from typing import Any
import zipfile

import jax

from . import codec
from . import commit
from . import format
from . import hostvalue
from . import lease as lease_lib
from . import reader
from . import restore_files
from . import restore_shards
from . import storage
from . import writer
from .place import Destination
from .place import Done
from .place import Opened
from .place import Save
from .place import T
from .place import Take
from .storage import LOG


class _Local(Destination):
  """A path on a (shared) file system, written under a temporary name
  beside it and renamed into place (``_LocalSave``)."""

  def __init__(self, api: str, path: str, overwrite: bool) -> None:
    super().__init__(api, path, overwrite)
    self.key = os.path.normpath(path)

  def child(self, name: str) -> Destination:
    path = os.path.abspath(os.path.join(self.path, name))
    kind = LocalNpz if format.is_npz(path) else LocalDirectory
    return kind(self.api, path, self.overwrite)

  def children(self) -> list[str]:
    try:
      return os.listdir(self.path)
    except FileNotFoundError:
      return []

  def commit_ns(self) -> int | None:
    try:
      return os.stat(self.path).st_mtime_ns
    except FileNotFoundError:
      return None

  def delete(self) -> bool:
    with commit.locked(self.path):
      if not self.committed():
        return False
      commit.delete(self.path)
    return True

  def storage(self) -> storage.Storage:
    where = storage.Location("file", "", os.path.abspath(self.path))
    return storage.LocalStorage(self.api, where)

  def make_directory(self, create: bool) -> None:
    if os.path.lexists(self.path) and not os.path.isdir(self.path):
      raise FileExistsError(
        f"{self.api}: {self.path!r} exists and is not a directory"
      )
    if create:
      commit.make_parents(self.path)

  def remove_leftovers(self, pattern: re.Pattern[str]) -> None:
    with commit.lock_directory(self.path):
      for _, p in commit.scan(self.path, pattern):
        LOG.debug("%s: removing %r, left by a killed save", self.api, p)
        commit.remove(p)

  def settle(self) -> None:
    commit.REAPER.wait()

  def open_checkpoint(self, budget: int = 0) -> Opened:
    if not os.path.lexists(self.path):
      commit.recover(self.path)  # the old copy of a save killed between
    if self.npz:
      return restore_files.open_checkpoint(self.api, self.path)
    # The commit point is the directory at the path: opened once, its
    # record read through that descriptor, then only what it names.
    try:
      fd = os.open(self.path, reader.DIR_FLAGS)
    except FileNotFoundError:
      raise FileNotFoundError(
        errno.ENOENT,
        f"{self.api}: no checkpoint at {self.path!r} (nothing is there)",
        self.path,
      ) from None
    except NotADirectoryError:  # a file: restore_files says what it is
      return restore_files.open_checkpoint(self.api, self.path)
    try:
      record = reader.read_small(
        self.api, self.path, fd, format.RECORD, "the record"
      )
      if record is None:
        if reader.moved(fd, self.path):  # a save or delete won the race
          raise reader.replaced(self.api, repr(self.path))
        raise restore_files.not_a_checkpoint(self.api, self.path)
      manifest = reader.read_small(
        self.api, self.path, fd, format.MANIFEST, "the manifest"
      )
    except BaseException:
      os.close(fd)
      raise
    if manifest is not None:
      return restore_shards.open_manifest(
        self.api, self.path, fd, manifest, record
      )
    return restore_files.open_directory(self.api, self.path, fd, record)

  def reading(
    self, budget: int, read: Callable[[Opened], T], board: Any = None
  ) -> T:
    """``read(opened)`` of the save committed at the path; again where the
    read found it replaced or deleted under it (``CheckpointReplacedError``:
    nothing of that read is returned), up to ``reader.READ_TRIES`` times.
    With a collective restore's ``board``, the processes agree that they
    opened the same save (its record's ``save_id``) and read it whole, or
    every one of them reads again (``_Agreement``)."""
    for attempt in range(1, reader.READ_TRIES + 1):
      agreed = _Agreement(self.api, board, attempt)
      try:
        with (
          self.noting(),
          contextlib.closing(self.open_checkpoint(budget)) as opened,
        ):
          if board is not None:
            agreed.on("open", _save_id(self.api, self.path, opened))
          out = read(opened)
        try:
          agreed.on("read", "ok")
        except BaseException:
          delete_arrays(out)  # another process read another save
          raise
        return out
      except reader.CheckpointReplacedError as err:
        agreed.replaced()
        if attempt == reader.READ_TRIES:
          err.add_note(
            f"{self.api}: {self.path!r} was replaced or deleted under each "
            f"of {attempt} reads in a row; read it once its saves are done"
          )
          raise
        LOG.info("%s: %s; reading %s again", self.api, err, self.path)
    raise AssertionError("unreachable")

  def read_record(self) -> bytes | None:
    try:
      fd = os.open(self.path, reader.DIR_FLAGS)
    except FileNotFoundError:
      raise FileNotFoundError(
        errno.ENOENT, f"{self.api}: no checkpoint at {self.path!r}", self.path
      ) from None
    try:
      data = reader.read_small(
        self.api, self.path, fd, format.RECORD, "the record"
      )
    finally:
      os.close(fd)
    if data is None:
      raise restore_files.not_a_checkpoint(self.api, self.path)
    return data

  def check(self) -> None:
    check_target(self.api, self.path, self.overwrite)

  def _locked_temp(self, suffix: str) -> tuple[contextlib.ExitStack, str]:
    """The save lock of the parent taken, the leftovers of earlier saves to
    the path removed: (the lock, the save's temporary name)."""
    locked = contextlib.ExitStack()
    locked.enter_context(commit.locked(self.path))
    try:
      commit.clean(self.path)
      return locked, commit.temp_name(self.path, commit.NEW, suffix)
    except BaseException:
      locked.close()
      raise


class _LocalSave(Save):
  """A save to a local path: its files under the temporary name ``tmp``
  beside the path, published by a rename (the parent's save lock held, by
  the process that commits, until ``end``)."""

  def __init__(
    self, dest: _Local, tmp: str, locked: contextlib.ExitStack | None
  ) -> None:
    self.api, self.path, self.overwrite = dest.api, dest.path, dest.overwrite
    self.tmp: str | None = tmp
    self.name = os.path.basename(tmp)
    self._locked = locked if locked is not None else contextlib.ExitStack()

  def where(self) -> str:
    return self.path

  def _publish(self) -> None:
    assert self.tmp is not None
    commit.publish(self.api, self.tmp, self.path, self.overwrite)
    self.tmp = None

  def abort(self) -> None:
    tmp, self.tmp = self.tmp, None
    if tmp is not None:
      commit.remove(tmp)

  def end(self) -> None:
    self._locked.close()


class LocalDirectory(_Local):
  """A directory of ``.npy`` files (``<key>.shards/<n>.npy`` and a manifest
  for a checkpoint several processes wrote) and the record."""

  def committed(self) -> bool:
    """A directory with its record (a directory without one is a save
    that did not commit, or not a checkpoint)."""
    return os.path.isdir(self.path) and os.path.isfile(
      os.path.join(self.path, format.RECORD)
    )

  def begin(self) -> DirectorySave:
    locked, tmp = self._locked_temp("")
    try:
      os.mkdir(tmp)
    except OSError as err:
      locked.close()
      raise writer.write_error(self.api, self.path, tmp, err) from err
    return DirectorySave(self, tmp, locked)

  def attach(self, name: str) -> DirectorySave:
    return DirectorySave(
      self, os.path.join(os.path.dirname(self.path), name), None
    )


class DirectorySave(_LocalSave):
  """A save of a directory checkpoint: the files written into the
  temporary directory and fsynced, then the record (and manifest), then
  the rename."""

  def write(
    self,
    stems: list[str],
    take: Take,
    done: Done,
    threads: int,
    codecs: dict[str, str],
  ) -> dict[str, list[int]]:
    assert self.tmp is not None
    _, sums = writer.write_directory(
      self.api, self.path, self.tmp, stems, take, done, threads, codecs
    )
    commit.fsync_dirs(self.tmp, self.api, self.path)
    return sums

  def put(self, name: str, data: bytes) -> None:
    assert self.tmp is not None
    writer.write_file(
      self.api, self.path, os.path.join(self.tmp, name),
      lambda f: f.write(data),
    )  # fmt: skip

  def commit(self, record: bytes, manifest: bytes | None = None) -> None:
    tmp = self.tmp
    assert tmp is not None
    files = [(format.RECORD, record)]
    if manifest is not None:
      files.insert(0, (format.MANIFEST, manifest))
    for name, data in files:
      writer.write_file(
        self.api, self.path, os.path.join(tmp, name), lambda f: f.write(data)
      )
    commit.fsync_path(tmp, self.api, self.path)
    self._publish()


class LocalNpz(_Local):
  """One uncompressed ``.npz`` archive: the arrays' members written in
  order on the calling thread, the record last, then renamed into place."""

  npz = True

  def committed(self) -> bool:
    return os.path.isfile(self.path)

  def read_record(self) -> bytes | None:
    return None  # in the archive: open_checkpoint reads it

  def begin(self) -> NpzSave:
    locked, tmp = self._locked_temp(".npz")
    try:
      file = builtins.open(tmp, "xb")  # noqa: SIM115
    except OSError as err:
      locked.close()
      raise writer.write_error(self.api, self.path, tmp, err) from err
    return NpzSave(self, tmp, locked, file)


class NpzSave(_LocalSave):
  """A save of an ``.npz``: its members written into the temporary file,
  the record last, fsynced, then the rename."""

  def __init__(
    self, dest: _Local, tmp: str, locked: contextlib.ExitStack, file: Any
  ) -> None:
    super().__init__(dest, tmp, locked)
    self._file: Any = file
    self._zip: zipfile.ZipFile | None = zipfile.ZipFile(
      file, "w", compression=zipfile.ZIP_STORED, allowZip64=True
    )

  def write(
    self,
    stems: list[str],
    take: Take,
    done: Done,
    threads: int,
    codecs: dict[str, str],
  ) -> dict[str, list[int]]:
    zf = self._zip
    assert zf is not None
    with self._writing():
      for i, stem in enumerate(stems):
        a = take(i)
        with zf.open(stem + ".npy", "w", force_zip64=True) as member:
          hostvalue.write_npy(member, a)  # the archive's CRC-32 guards it
        del a
        done(i)
    return {}

  def commit(self, record: bytes, manifest: bytes | None = None) -> None:
    zf, f = self._zip, self._file
    assert zf is not None and f is not None
    with self._writing():
      zf.writestr(format.RECORD, record)
      zf.close()
      f.flush()
      os.fsync(f.fileno())
      f.close()
    self._zip = self._file = None
    self._publish()

  @contextlib.contextmanager
  def _writing(self) -> Iterator[None]:
    """A failed write raises ``writer.write_error``'s OSError."""
    try:
      yield
    except OSError as err:
      if err.errno is None:
        raise
      raise writer.write_error(self.api, self.path, str(self.tmp), err) from err

  def abort(self) -> None:
    zf, f = self._zip, self._file
    self._zip = self._file = None
    for part in (zf, f):
      if part is not None:
        with contextlib.suppress(Exception):  # the failed write raises
          part.close()
    super().abort()


class _Agreement:
  """Where every process of a collective read (``board``, a
  ``multiprocess`` board; None: this process reads alone) agrees, at each
  step of one attempt, on what it read: the same save (``open``: its
  record's id), whole (``read``). A disagreement, or a process that found
  the checkpoint replaced, makes every process read again."""

  def __init__(self, api: str, board: Any, attempt: int) -> None:
    self.api, self.board, self.attempt = api, board, attempt
    self.posted: set[str] = set()

  def on(self, step: str, value: str) -> None:
    """Raises CheckpointReplacedError unless every process posted
    ``value`` (never "replaced") at ``step`` of this attempt."""
    if self.board is None:
      return
    self.posted.add(step)
    values = self.board.agree(f"{self.attempt}/{step}", value or "-")
    if value == _REPLACED or len(set(values)) > 1:
      raise reader.CheckpointReplacedError(
        f"{self.api}: the processes reading {self.board.path!r} read "
        f"different saves of it ({step}: {values}): it was replaced "
        "meanwhile; nothing of it is returned"
      )

  def replaced(self) -> None:
    """This process found the checkpoint replaced: it tells the others at
    each step it has not reached (they then read again too)."""
    for step in ("open", "read"):
      if self.board is not None and step not in self.posted:
        with contextlib.suppress(reader.CheckpointReplacedError):
          self.on(step, _REPLACED)


_REPLACED = "replaced"


def _save_id(api: str, path: str, opened: Opened) -> str:
  """The id of the save ``opened`` (its record's; "" where it has none)."""
  data = (
    opened.record_data()
    if isinstance(opened, restore_shards.Manifest)
    else opened.record
  )
  if data is None:
    return ""
  where = f"the record {format.RECORD!r} of {path!r}"
  return format.decode_record(api, where, data).save_id


def delete_arrays(tree: Any) -> None:
  """Deletes the jax.Arrays of a read whose result is dropped."""
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array) and not x.is_deleted():
      x.delete()


def check_target(api: str, path: str, overwrite: bool) -> None:
  """Refuses, before anything is written: an existing path without
  overwrite, a directory save did not write, a directory where an
  ``.npz`` goes, a file among the parents, a parent this process cannot
  write (a read-only file system); creates missing parent directories.
  ``path`` is absolute (``open``)."""
  exists = os.path.lexists(path)
  if exists and not overwrite:
    raise FileExistsError(
      f"{api}: {path!r} exists; pass overwrite=True to replace it"
    )
  if exists and format.is_npz(path):
    if os.path.islink(path) or not os.path.isfile(path):
      raise FileExistsError(
        f"{api}: {path!r} exists and is not a file (overwrite replaces an "
        ".npz archive save wrote); nothing was written: remove it first, "
        "or save elsewhere"
      )
  elif exists:
    if not os.path.isdir(path) or os.path.islink(path):
      raise FileExistsError(
        f"{api}: {path!r} exists and is not a directory; remove it first"
      )
    for root, _, files in os.walk(path):
      for name in files:
        if codec.split_name(name) is None and not (
          root == path
          and name in (format.RECORD, format.MANIFEST, format.PACKED)
        ):
          if root == os.path.join(path, lease_lib.PREFIX):
            continue  # a bucket save's writer lease, copied with the files
          raise FileExistsError(
            f"{api}: {path!r} holds {os.path.join(root, name)!r}, which is "
            "not an .npy file; overwrite only replaces directories written "
            "by save"
          )
  parent = os.path.dirname(path)
  if not os.path.isdir(parent):  # one stat where it is there (a manager's)
    _make_parent(api, path, parent)
  if not os.access(parent, os.W_OK | os.X_OK):
    ro = bool(os.statvfs(parent).f_flag & os.ST_RDONLY)
    code = errno.EROFS if ro else errno.EACCES
    why = (
      "is on a read-only file system"
      if ro
      else "is not writable by this process (its permissions)"
    )
    raise (OSError if ro else PermissionError)(
      code,
      f"{api}: cannot save to {path!r}: its directory {parent!r} {why} "
      f"({errno.errorcode[code]}); nothing was written: save to a "
      "writable directory",
      path,
    )


def _make_parent(api: str, path: str, parent: str) -> None:
  """Creates ``parent`` (and its missing ancestors) for a save to ``path``;
  FileExistsError where the nearest existing one is not a directory,
  OSError naming the directory that could not be made."""
  up = parent
  while not os.path.lexists(up) and os.path.dirname(up) != up:
    up = os.path.dirname(up)  # the nearest that exists: a directory?
  if not os.path.isdir(up):
    raise FileExistsError(
      f"{api}: cannot save to {path!r}: {up!r} is not a directory; "
      "nothing was written: remove it, or save elsewhere"
    )
  try:
    commit.make_parents(parent)
  except OSError as err:
    if err.errno is None:
      raise
    made = err.filename or parent
    raise type(err)(
      err.errno,
      f"{api}: cannot save to {path!r}: creating its directory {made!r} "
      f"failed: {err.strerror} ({errno.errorcode.get(err.errno, '?')}); "
      "nothing was written: save to a directory this process can write",
      made,
    ) from err
