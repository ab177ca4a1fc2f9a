"""Where a checkpoint goes: one ``Destination`` per kind of place.

``open`` is the one place that reads a path or a URL: a local path gives a
``LocalDirectory`` or a ``LocalNpz``, an ``s3://``, ``gs://`` or ``az://``
URL a ``BucketPrefix`` or a ``BucketNpz``; any other URL, ``file://``
included, is refused (naming the local path to write instead), by every
API alike. Every save, restore and CheckpointManager goes through it.

A save (``job.SaveJob``, alone or with the other processes: multiprocess)
drives its destination in these steps:

- ``check()``, in the call, on every process: what cannot be written is
  refused (a checkpoint there without ``overwrite``, a file where a
  directory goes); missing parent directories are created;
- ``begin()``, in the save's turn, on the process that commits: the save
  lock of the parent directory (``commit.locked``) or the path's writer
  lease in a bucket, and the temporary place the files go, whose name the
  other processes of a collective save ``attach`` to;
- ``write(stems, take, done, threads, codecs)``: the arrays' files from
  the writer threads (``<stem>.npy``, ``.npy.zst`` for a stem in
  ``codecs``), their checksums returned by stem;
- ``commit(record, manifest)``: the record (and a collective save's
  manifest) written, the checkpoint published at the path: an atomic
  rename on disk (``commit.publish``), the conditional write of the head
  naming the save's version in a bucket (remote.Bucket);
- ``abort()`` (a failure before the commit: the temporary files go),
  ``end()`` (the lock or lease given back) and ``close()``, once the save
  is over on a process (whatever was opened for it is let go).

The reads (a restore's ``reading``/``open_checkpoint``, the manager's
``committed``, ``children``, ``commit_ns``, ``delete``) need no save.
"""

from __future__ import annotations

import abc
import builtins
from collections.abc import Callable
from collections.abc import Iterator
import contextlib
import errno
import os
import re
import tempfile
from typing import Any
from typing import TypeVar
import zipfile

import jax

from . import codec
from . import commit
from . import format
from . import hostvalue
from . import lease as lease_lib
from . import reader
from . import remote
from . import restore_files
from . import restore_objects
from . import restore_shards
from . import storage
from . import stores
from . import writer
from .storage import LOG

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

#: What a restore opens: its files, or a collective save's manifest.
Opened = restore_files.Opened | restore_shards.Manifest
#: ``take(i)``: the host value of file ``i``; ``done(i)`` once written.
Take = Callable[[int], Any]
Done = Callable[[int], None]
T = TypeVar("T")
#: How many times a read of a bucket's checkpoint starts again when the
#: version it pinned was replaced (and removed) while it read.
READ_ATTEMPTS = 4


def open(  # noqa: A001 (the module's verb: destination.open)
  api: str,
  path: Any,
  storage_options: dict[str, Any] | None = None,
  overwrite: bool = False,
  lease: bool = True,
) -> Destination:
  """The destination of ``path``, a local path or an object-store URL.

  Args:
    api: the API named in errors.
    path: a str or os.PathLike: ``<name>.npz`` for one archive, anything
      else for a directory (a prefix in a bucket).
    storage_options: for a URL, settings over the cloud's environment
      (stores); none for a local path.
    overwrite: a save may replace the checkpoint there.
    lease: a save to a bucket takes the path's writer lease (False: the
      caller holds one above it, a CheckpointManager's).

  Raises:
    ValueError: a URL of another scheme (``file://`` too: write the local
      path), storage_options for a local path, a bad URL.
    TypeError: ``path`` is not a path.
  """
  text = storage.path_text(api, path)
  if not text:
    raise ValueError(
      f"{api}: the path is empty; pass the checkpoint's path (e.g. "
      "'ckpt', '/data/run/ckpt' or 'ckpt.npz') or an s3://, gs:// or az:// "
      "URL"
    )
  url = _SCHEME.match(text)
  if url is None:
    if storage_options:
      raise ValueError(
        f"{api}: storage_options are for s3://, gs:// and az:// URLs; "
        f"{text!r} is a local path"
      )
    # Absolute now, in the call: a later os.chdir (or a background save's
    # thread) never moves it.
    local = os.path.abspath(text)
    kind = LocalNpz if local.endswith(".npz") else LocalDirectory
    return kind(api, local, overwrite)
  if url.group(1).lower() not in storage.SCHEMES:
    raise ValueError(storage.unknown_url(api, text, url.group(1)))
  st = stores.open_storage(api, text, storage_options)
  bucket = BucketNpz if text.endswith(".npz") else BucketPrefix
  return bucket(api, text, st, overwrite, lease)


def open_directory(
  api: str, path: Any, storage_options: dict[str, Any] | None = None
) -> Destination:
  """The destination of a CheckpointManager's ``directory`` (its steps are
  its ``child``ren): a local one as an absolute path, a URL without its
  trailing ``/``. Its saves take no writer lease (the manager holds the
  directory's) and replace nothing."""
  at = open(api, path, storage_options, overwrite=False, lease=False)
  return at.child("")


def check_name(api: str, path: Any) -> None:
  """Refuses, before anything is written, a local path that names no
  place of its own for a checkpoint: ``/``, or a path whose last component
  is ``.`` or ``..`` (a directory that holds the working directory or the
  path's own parent: replacing it fails, or takes what the user did not
  name)."""
  text = storage.path_text(api, path)
  if _SCHEME.match(text):
    return
  parts = [p for p in text.split(os.sep) if p]
  if os.path.abspath(text) == os.path.abspath(os.sep) or (
    parts and parts[-1] in (".", "..")
  ):
    raise ValueError(
      f"{api}: {text!r} names the directory "
      f"{os.path.abspath(text)!r} itself, not a checkpoint inside it; "
      "nothing was written. Name the checkpoint, e.g. "
      f"{os.path.join(text, 'ckpt')!r}"
    )


class Destination(abc.ABC):
  """A place a checkpoint is saved to and read from (the module docstring
  tells the steps of a save).

  Attributes:
    api: the API named in errors.
    path: the path or URL, as errors name it.
    key: the path as the processes of a collective save compare it.
    npz: whether the checkpoint is one ``.npz`` archive.
    overwrite: whether a save may replace the checkpoint there.
  """

  npz = False

  def __init__(self, api: str, path: str, overwrite: bool) -> None:
    self.api, self.path, self.overwrite = api, path, overwrite
    self.key = path

  # The reads.

  @abc.abstractmethod
  def child(self, name: str) -> Destination:
    """The destination of ``name`` inside this directory (prefix)."""

  @abc.abstractmethod
  def children(self) -> list[str]:
    """The names inside this directory (none if it is missing)."""

  def committed_among(self, names: list[str]) -> list[str]:
    """Those of ``names`` that hold a committed checkpoint."""
    return [n for n in names if self.child(n).committed()]

  @abc.abstractmethod
  def committed(self) -> bool:
    """Whether a committed checkpoint is here."""

  @abc.abstractmethod
  def commit_ns(self) -> int | None:
    """When the checkpoint here was committed (ns since the epoch); None
    if there is none."""

  @abc.abstractmethod
  def delete(self) -> bool:
    """Deletes the checkpoint here, never leaving a half-deleted one
    readable; False if there was none."""

  @abc.abstractmethod
  def storage(self) -> storage.Storage:
    """This place as a ``Storage`` (where a writer lease is taken)."""

  def make_directory(self, create: bool) -> None:
    """Before a manager uses this directory: refuses what is not one and,
    with ``create``, makes it (nothing to do in a bucket)."""

  def remove_leftovers(self, pattern: re.Pattern[str]) -> None:
    """Removes what saves killed here left under names matching
    ``pattern`` (a bucket's saves remove their own)."""

  def settle(self) -> None:
    """Returns once the copies that saves and deletes here replaced are
    gone (a local one's go on a background thread; a bucket's at once)."""

  @abc.abstractmethod
  def open_checkpoint(self, budget: int = 0) -> Opened:
    """The checkpoint here, opened once for a restore (``budget``: bytes of
    small objects of a bucket read whole now)."""

  def reading(
    self, budget: int, read: Callable[[Opened], T], board: Any = None
  ) -> T:
    """``read(opened)``: the checkpoint here opened once
    (``open_checkpoint``) and read, with ``noting``'s notes on an error.
    A read that loses a race with a save or a delete of the checkpoint
    reads again (a local directory's and a bucket's say how). ``board``:
    that of a collective restore (``multiprocess.restore_board``; None:
    this process reads alone), where every process reads the same save."""
    with self.noting(), contextlib.closing(self.open_checkpoint(budget)) as o:
      return read(o)

  @abc.abstractmethod
  def read_record(self) -> bytes | None:
    """The bytes of the record of the directory checkpoint here (None
    where it has none)."""

  def noting(self) -> contextlib.AbstractContextManager[None]:
    """Notes added to an error of a restore (what the files are)."""
    return contextlib.nullcontext()

  # A save's steps.

  @abc.abstractmethod
  def check(self) -> None:
    """In the call: refuses what cannot be written; makes the parents."""

  @abc.abstractmethod
  def begin(self) -> str:
    """In the save's turn: the lock (lease) and the temporary place the
    files go, returned as the name the other processes ``attach`` to."""

  def attach(self, name: str) -> None:
    """The other processes of a collective save: where ``begin`` said."""
    raise TypeError(f"{type(self).__name__} is written by one process")

  @abc.abstractmethod
  def write(
    self,
    stems: list[str],
    take: Take,
    done: Done,
    threads: int,
    codecs: dict[str, str],
  ) -> dict[str, list[int]]:
    """Writes file ``i`` from ``take(i)`` (``stems[i]`` and its codec),
    ``done(i)`` once written; the checksums of their data, by stem."""

  @abc.abstractmethod
  def commit(self, record: bytes, manifest: bytes | None = None) -> bool:
    """Publishes the checkpoint with its record (and manifest); False (a
    save has no second round)."""

  def where(self) -> str:
    """Where the files are written (``path``, or a bucket's version)."""
    return self.path

  @abc.abstractmethod
  def abort(self) -> None:
    """The save failed before its commit: its temporary files go."""

  @abc.abstractmethod
  def end(self) -> None:
    """Gives back what ``begin`` took (again: nothing)."""

  def close(self) -> None:
    """The save is over on this process."""
    self.end()


class _Local(Destination):
  """A path on a (shared) file system, written under a temporary name
  beside it and renamed into place (commit)."""

  def __init__(self, api: str, path: str, overwrite: bool) -> None:
    super().__init__(api, path, overwrite)
    self.key = os.path.normpath(path)
    self.tmp: str | None = None
    self._locked = contextlib.ExitStack()

  def child(self, name: str) -> Destination:
    path = os.path.abspath(os.path.join(self.path, name))
    kind = LocalNpz if path.endswith(".npz") else LocalDirectory
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
          _delete_arrays(out)  # another process read another save
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

  def _begin(self, suffix: str) -> str:
    """The save lock of the parent, the leftovers of earlier saves to the
    path removed, the temporary name (``begin``)."""
    self._locked.enter_context(commit.locked(self.path))
    commit.clean(self.path)
    self.tmp = commit.temp_name(self.path, commit.NEW, suffix)
    return os.path.basename(self.tmp)

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

  def begin(self) -> str:
    name = self._begin("")
    assert self.tmp is not None
    try:
      os.mkdir(self.tmp)
    except OSError as err:
      raise writer.write_error(self.api, self.path, self.tmp, err) from err
    return name

  def attach(self, name: str) -> None:
    self.tmp = os.path.join(os.path.dirname(self.path), name)

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

  def commit(self, record: bytes, manifest: bytes | None = None) -> bool:
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
    return False


class LocalNpz(_Local):
  """One uncompressed ``.npz`` archive: the arrays' members written in
  order on the calling thread, the record last, then renamed into place."""

  npz = True

  def __init__(self, api: str, path: str, overwrite: bool) -> None:
    super().__init__(api, path, overwrite)
    self._file: Any = None
    self._zip: zipfile.ZipFile | None = None

  def committed(self) -> bool:
    return os.path.isfile(self.path)

  def read_record(self) -> bytes | None:
    return None  # in the archive: open_checkpoint reads it

  def begin(self) -> str:
    name = self._begin(".npz")
    assert self.tmp is not None
    try:
      self._file = builtins.open(self.tmp, "xb")  # noqa: SIM115
    except OSError as err:
      raise writer.write_error(self.api, self.path, self.tmp, err) from err
    self._zip = zipfile.ZipFile(
      self._file, "w", compression=zipfile.ZIP_STORED, allowZip64=True
    )
    return name

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

  def commit(self, record: bytes, manifest: bytes | None = None) -> bool:
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
    return False

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


def _delete_arrays(tree: Any) -> None:
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
  if exists and path.endswith(".npz"):
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
          root == path and name in (format.RECORD, format.MANIFEST)
        ):
          if root == os.path.join(path, lease_lib.PREFIX):
            continue  # a bucket save's writer lease, copied with the files
          raise FileExistsError(
            f"{api}: {path!r} holds {os.path.join(root, name)!r}, which is "
            "not an .npy file; overwrite only replaces directories written "
            "by save"
          )
  parent = os.path.dirname(path)
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


class BucketPrefix(Destination):
  """A prefix in a bucket: the same files as objects under a version
  prefix of their own, committed by the head naming it (``remote.Bucket``,
  built by ``check``, does the save's steps)."""

  def __init__(
    self,
    api: str,
    url: str,
    st: storage.Storage,
    overwrite: bool,
    lease: bool,
  ) -> None:
    super().__init__(api, url, overwrite)
    self.st, self.lease = st, lease
    self._bucket: remote.Bucket | None = None

  def child(self, name: str) -> Destination:
    url = f"{self.path.rstrip('/')}/{name}" if name else self.path.rstrip("/")
    st = self.st.child(name) if name else self.st
    bucket = BucketNpz if url.endswith(".npz") else BucketPrefix
    return bucket(self.api, url, st, self.overwrite, self.lease)

  def children(self) -> list[str]:
    return self.st.children()

  def committed_among(self, names: list[str]) -> list[str]:
    found = storage.run_parallel(
      lambda n: self.child(n).committed(), names, self.st.concurrency
    )
    return [n for n, ok in zip(names, found) if ok]

  def committed(self) -> bool:
    return remote.committed(self.api, self.st)

  def commit_ns(self) -> int | None:
    return remote.commit_ns(self.api, self.st)

  def delete(self) -> bool:
    if not remote.delete(self.api, self.st):
      return False
    LOG.debug("%s: deleted %r", self.api, self.path)
    return True

  def storage(self) -> storage.Storage:
    return self.st

  def open_checkpoint(
    self, budget: int = 0, pinned: remote.Pinned | None = None
  ) -> Opened:
    return restore_objects.open_at(self.api, self.st, budget, pinned)

  def read_record(self) -> bytes | None:
    for _ in range(READ_ATTEMPTS):
      pinned = remote.source(self.api, self.st)
      try:
        return pinned.read_record(self.api)
      except FileNotFoundError:
        continue  # replaced (and removed) since the head was read
    raise self._replaced(READ_ATTEMPTS)

  def reading(
    self, budget: int, read: Callable[[Opened], T], board: Any = None
  ) -> T:
    """Pins the version the head names (once: on process 0 for a
    collective read's ``board``, posted to the others), then opens and
    reads only it. An error while reading where the head names another
    version now (the writer removed the one pinned) starts again,
    ``READ_ATTEMPTS`` times at most (a collective read raises at once),
    then raises ``OSError`` ("replaced while reading"); where the head is
    gone, ``FileNotFoundError`` ("deleted while reading")."""
    collective = board is not None
    for attempt in range(1, READ_ATTEMPTS + 1):
      if board is not None:  # process 0 resolves the head, for all
        text = (
          remote.source(self.api, self.st).encode(self.st)
          if board.pid == 0
          else ""
        )
        text = board.agree(f"{attempt}/pin", text)[0]
        pinned = remote.Pinned.decode(self.api, self.st, text)
      else:
        pinned = remote.source(self.api, self.st)
      try:
        with (
          self.noting(),
          contextlib.closing(self.open_checkpoint(budget, pinned)) as opened,
        ):
          return read(opened)
      except Exception as err:
        try:
          now = remote.pin(self.api, self.st)
        except Exception:  # the error of the read says more
          raise err from None
        if now is not None and now.ident == pinned.ident:
          raise  # the checkpoint read is still the one committed
        if now is None:
          raise FileNotFoundError(
            f"{self.api}: the checkpoint at {self.path!r} was deleted while "
            f"reading ({type(err).__name__}: {err})"
          ) from err
        if collective or attempt == READ_ATTEMPTS:
          raise self._replaced(attempt) from err
        LOG.info(
          "%s: %s was replaced while reading; reading the new checkpoint",
          self.api, self.path,
        )  # fmt: skip
    raise AssertionError("unreachable")

  def _replaced(self, times: int) -> OSError:
    return OSError(
      f"{self.api}: the checkpoint at {self.path!r} was replaced while "
      f"reading ({times} time{'s' if times > 1 else ''} in a row: another "
      "process saves it over and over); read it again"
    )

  def noting(self) -> contextlib.AbstractContextManager[None]:
    return restore_objects.noting(self.path)

  def check(self) -> None:
    self._bucket = remote.Bucket(
      self.api, self.path, self.st, self.overwrite, lease=self.lease
    )

  @property
  def bucket(self) -> remote.Bucket:
    assert self._bucket is not None, "check() first"
    return self._bucket

  def begin(self) -> str:
    return self.bucket.begin()

  def attach(self, name: str) -> None:
    self.bucket.attach(name)

  def write(
    self,
    stems: list[str],
    take: Take,
    done: Done,
    threads: int,
    codecs: dict[str, str],
  ) -> dict[str, list[int]]:
    def fill(i: int, a: Any, f: Any) -> list[int]:
      use = codecs.get(stems[i])
      if use is None:
        return hostvalue.write_npy(f, a)
      with codec.compressing(use, f) as out:
        return hostvalue.write_npy(out, a, codec.WRITE_STEP)

    names = [codec.file_name(s, codecs.get(s)) for s in stems]
    sums = self.bucket.write(names, take, fill, done, threads)
    return dict(zip(stems, sums))

  def commit(self, record: bytes, manifest: bytes | None = None) -> bool:
    return self.bucket.commit(record, manifest)

  def where(self) -> str:
    return self.bucket.where()

  def abort(self) -> None:
    self.bucket.abort()

  def end(self) -> None:
    if self._bucket is not None:
      self._bucket.end()


class BucketNpz(BucketPrefix):
  """An ``.npz`` in a bucket (one object): written as a ``LocalNpz`` in a
  temporary directory, then uploaded by the commit (created only if
  absent, unless it replaces a committed one, in one put)."""

  npz = True

  def __init__(
    self,
    api: str,
    url: str,
    st: storage.Storage,
    overwrite: bool,
    lease: bool,
  ) -> None:
    super().__init__(api, url, st, overwrite, lease)
    self.parent, self.name = remote.split(api, url, st)
    self.tag: str | None = None  # of the archive replaced (``check``)
    self._tmp: tempfile.TemporaryDirectory[str] | None = None
    self._local: LocalNpz | None = None

  def committed(self) -> bool:
    return self.parent.exists(self.name)

  def commit_ns(self) -> int | None:
    try:
      return self.parent.mtime_ns(self.name)
    except FileNotFoundError:
      return None

  def delete(self) -> bool:
    if not self.committed():
      return False
    self.parent.delete([self.name])
    return True

  def read_record(self) -> bytes | None:
    return None  # in the archive: open_checkpoint reads it

  def check(self) -> None:
    self.tag = self.parent.tag_of(self.name)
    if self.tag is not None and not self.overwrite:
      raise remote.exists_error(self.api, self.path)

  def begin(self) -> str:
    self._tmp = tempfile.TemporaryDirectory(prefix="jaxworks-upload-")
    local = os.path.join(self._tmp.name, self.name)
    self._local = LocalNpz(self.api, local, overwrite=False)
    return self._local.begin()

  @property
  def local(self) -> LocalNpz:
    assert self._local is not None, "begin() first"
    return self._local

  def write(
    self,
    stems: list[str],
    take: Take,
    done: Done,
    threads: int,
    codecs: dict[str, str],
  ) -> dict[str, list[int]]:
    return self.local.write(stems, take, done, threads, codecs)

  def commit(self, record: bytes, manifest: bytes | None = None) -> bool:
    """One conditional put: created if the path had none, else replaced
    if still the archive ``check`` saw. After an error, the object is read
    back: this archive, byte for byte, is committed."""
    self.local.commit(record)
    with builtins.open(self.local.path, "rb") as f:
      data = f.read()
    try:
      if self.tag is None:
        self.parent.create(self.name, data)
      else:
        self.parent.replace(self.name, data, self.tag)
    except BaseException as err:
      if self._is(data):
        LOG.warning(
          "%s: the commit of %s answered %r, but it holds this save: "
          "committed (the answer of a request that was applied got lost)",
          self.api, self.path, err,
        )  # fmt: skip
        return False
      err.add_note(
        f"{self.api}: the save to {self.path!r} was not committed: the "
        "path holds what it held before (or another save's archive)"
      )
      if isinstance(err, FileExistsError):
        raise remote.exists_error(self.api, self.path) from err
      raise
    return False

  def _is(self, data: bytes) -> bool:
    """Whether the object at the path is ``data``."""
    try:
      return (
        self.parent.size(self.name) == len(data)
        and bytes(self.parent.read(self.name)) == data
      )
    except OSError:
      return False

  # Committed at the path itself (the archive is one object, put last).
  where = Destination.where
  reading = Destination.reading  # type: ignore[assignment]

  def abort(self) -> None:
    if self._local is not None:
      self._local.abort()

  def end(self) -> None:
    local, self._local = self._local, None
    if local is not None:
      local.end()
    tmp, self._tmp = self._tmp, None
    if tmp is not None:
      tmp.cleanup()
