"""The place a checkpoint lives, and one save of it: the interface every
kind of place implements (destination says which kinds there are).

A ``Destination`` is a place: a local directory or ``.npz``, a prefix or
``.npz`` in a bucket. It reads (``reading`` a restore's opened checkpoint,
``committed``, ``children``, ``commit_ns``, ``delete``) and makes saves. A
save (``job.SaveJob``, alone or with the other processes: multiprocess)
goes:

- ``check()``, in the call, on every process: what cannot be written is
  refused (a checkpoint there without ``overwrite``, a file where a
  directory goes); missing parent directories are created;
- ``begin()``, in the save's turn, on the process that commits, returns
  the ``Save``: the save lock of the parent directory (``commit.locked``)
  or the path's writer lease in a bucket taken, and the temporary place
  the files go, whose ``name`` the other processes of a collective save
  ``attach`` to (each getting its own ``Save``);
- ``Save.write(stems, take, done, threads, codecs)``: the arrays' files
  from the writer threads, their checksums returned by stem;
- ``Save.commit(record, manifest)``: the record (and a collective save's
  manifest) written, the checkpoint published in one atomic step: a
  rename on disk (``commit.publish``), the conditional write of the head
  naming the save's version in a bucket (remote.Bucket);
- ``Save.abort()`` (a failure before the commit: what it wrote goes) and
  ``Save.end()`` (the lock or lease given back).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
import contextlib
import re
from typing import Any
from typing import TypeVar

from . import restore_files
from . import restore_shards
from . import storage

#: What a restore opens: its files, or a collective save's manifest.
Opened = restore_files.Opened | restore_shards.Manifest
#: ``take(i)``: the host value of file ``i``; ``done(i)`` once written.
Take = Callable[[int], Any]
Done = Callable[[int], None]
T = TypeVar("T")


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

  # A save.

  @abc.abstractmethod
  def check(self) -> None:
    """In the call: refuses what cannot be written; makes the parents."""

  @abc.abstractmethod
  def begin(self) -> Save:
    """In the save's turn, on the process that commits: the save of a
    checkpoint here (its lock or lease taken, its temporary place made)."""

  def attach(self, name: str) -> Save:
    """The other processes of a collective save: the save that ``begin``
    made on the committing process, by its ``name``."""
    raise TypeError(f"{type(self).__name__} is written by one process")


class Save(abc.ABC):
  """One save of a checkpoint to a ``Destination``: what it took and
  wrote, in the steps the module docstring tells; made by ``begin`` (or
  ``attach``), given back by ``end``.

  Attributes:
    name: what the other processes of a collective save ``attach`` to.
  """

  name = ""

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

  def put(self, name: str, data: bytes) -> None:
    """Writes the small file ``name`` (``format.PACKED``) beside the array
    files, durably, before the commit: a directory checkpoint's
    (``DirectorySave``, ``BucketSave``); an ``.npz`` is one file already."""
    raise TypeError(f"{type(self).__name__} holds no file {name!r}")

  @abc.abstractmethod
  def commit(self, record: bytes, manifest: bytes | None = None) -> None:
    """Publishes the checkpoint with its record (and manifest): the one
    atomic step after which readers find it; an error says whether it
    committed."""

  @abc.abstractmethod
  def where(self) -> str:
    """Where the files are written (the path, or a bucket's version)."""

  @abc.abstractmethod
  def abort(self) -> None:
    """The save failed before its commit: what it wrote goes."""

  @abc.abstractmethod
  def end(self) -> None:
    """Gives back what ``begin`` took (again: nothing)."""
