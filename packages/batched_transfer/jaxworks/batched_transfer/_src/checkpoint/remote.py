"""Checkpoints in object stores: immutable versions, committed by one head.

A save to the prefix ``P`` writes every object of its checkpoint (the files
a local save writes, same names and bytes: the arrays' ``.npy`` files, a
collective save's manifest, the record ``jaxworks_dtypes.json``) under a
version prefix of its own, ``P/.jaxworks-v/<save id>/`` (a random id), and
nothing written there is modified afterwards. The commit is one conditional
write of the small head object ``P/jaxworks_head.json`` (``HEAD``: the
format, the save id, the record's size and CRC-32C): created only if absent
on a new path (``Storage.create``), replaced only if still the version read
when the save began on an overwrite (``Storage.replace``: S3 and Azure
``If-Match``, GCS ``ifGenerationMatch``). So a reader sees the old
checkpoint or the new one, whole, and of two saves to one path one commits.

Commits that can tell: after any error at the head's request (a retried
conditional write whose first attempt applied, its answer lost, says the
object exists or changed), the head is read back; it names this save's id
or it does not, and the save returns (committed) or raises with a note
saying it was not committed. ``abort`` never removes what the head names.

Once committed, the writer (it holds the path's writer lease, ``lease``;
a CheckpointManager holds its directory's) removes the versions the head no
longer names (the replaced one, those of killed saves) and what 0.6.x left
at and beside the path. A reader pins one version: it reads the head once
(``source``) and then only that version's objects, its record checked
against the head; one that loses a race with the removal (an object gone)
finds the head changed and reads again (``destination.BucketPrefix``).

A prefix without a head is read as 0.6.x wrote it (``committed_at``): its
record at the path, else the copy beside that its ``.jaxworks-moved``
names, else the newest committed 0.6.0 ``.jaxworks-new-`` copy. A save
over such a path (``overwrite=True``) commits a head and then removes the
old layout, even a damaged one. An ``.npz`` is one object: written
locally, then committed by one conditional put (``destination.BucketNpz``).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import json
import secrets
from typing import Any

from . import checksum
from . import codec
from . import format
from . import lease as lease_lib
from . import storage
from .storage import LOG
from .storage import Storage
from .storage import in_writer_threads

#: The commit point of a checkpoint in a bucket, and its format.
HEAD = "jaxworks_head.json"
HEAD_FORMAT = 1
#: The prefix of the saves' versions under a checkpoint's prefix.
VERSIONS = ".jaxworks-v"
#: 0.6.x's copies beside a path: an overwrite's (``_NEXT``), and 0.6.0's.
_NEXT = ".jaxworks-next-"
_NEW = ".jaxworks-new-"
#: 0.6.x: the object at a path naming the copy beside it that an
#: overwrite committed, while the path itself held no record.
MOVED = ".jaxworks-moved"
_HEX = frozenset("0123456789abcdef")
#: Bytes of an ``.npy`` file that ``metadata`` reads (its header).
HEADER_BYTES = 64 * 1024
#: The most bytes of a head read.
_HEAD_MAX = 64 * 1024


@dataclasses.dataclass(frozen=True)
class Head:
  """A checkpoint's head: the version it names and its record's size and
  CRC-32C."""

  save: str
  record_size: int
  record_crc32c: int

  def encode(self) -> bytes:
    return json.dumps(
      {
        "format": HEAD_FORMAT,
        "save": self.save,
        "record": {"size": self.record_size, "crc32c": self.record_crc32c},
      },
      sort_keys=True,
    ).encode()

  @classmethod
  def of(cls, save: str, record: bytes) -> Head:
    return cls(save, len(record), checksum.crc(record))

  @classmethod
  def decode(cls, api: str, where: str, data: bytes) -> Head:
    """The head in ``data``; ValueError naming ``where`` for anything
    else."""
    try:
      d = json.loads(bytes(data).decode("utf-8"))
      if d.get("format") != HEAD_FORMAT:
        raise ValueError(f"format {d.get('format')!r}, not {HEAD_FORMAT}")
      save, rec = d["save"], d["record"]
      if not _is_id(save):
        raise ValueError(f"save id {save!r}")
      return cls(save, int(rec["size"]), int(rec["crc32c"]))
    except (ValueError, KeyError, TypeError, AttributeError) as err:
      raise ValueError(
        f"{api}: {where!r} is not a checkpoint head ({err}); it was "
        "damaged or written by a newer version: upgrade, or save the "
        "checkpoint again with overwrite=True"
      ) from None


def _is_id(save: Any) -> bool:
  return isinstance(save, str) and 8 <= len(save) <= 64 and set(save) <= _HEX


def version(st: Storage, save: str) -> Storage:
  """The storage of the version ``save`` of the checkpoint at ``st``."""
  return st.child(f"{VERSIONS}/{save}")


def read_head(api: str, st: Storage) -> tuple[Head | None, str | None]:
  """(the head at ``st``, its tag for ``Storage.replace``); (None, None)
  where there is none.

  Raises:
    ValueError: a damaged head (``Head.decode``).
  """
  tagged = st.read_tagged(HEAD)
  if tagged is None:
    return None, None
  return Head.decode(api, st.where(HEAD), tagged[0][:_HEAD_MAX]), tagged[1]


@dataclasses.dataclass
class Pinned:
  """One committed checkpoint as a reader pinned it: ``st`` holds its
  objects (a version prefix, or the place 0.6.x wrote it), ``head`` the
  head that named it (None: a 0.6.x checkpoint)."""

  st: Storage
  head: Head | None

  @property
  def ident(self) -> str:
    """What tells two pins of a path apart."""
    return self.head.save if self.head is not None else f"0.6:{self.st.url}"

  def read_record(self, api: str) -> bytes:
    """The record, checked against the head.

    Raises:
      FileNotFoundError: no record (removed since the head was read).
      ValueError: a record that is not the one the head names.
    """
    return self.check_record(api, bytes(self.st.read(format.RECORD)))

  def check_record(self, api: str, data: bytes) -> bytes:
    """``data``, the record read, if it is the one the head names.

    Raises:
      ValueError: a record that is not the one the head names.
    """
    h = self.head
    if h is not None and (
      len(data) != h.record_size or checksum.crc(data) != h.record_crc32c
    ):
      raise ValueError(
        f"{api}: {self.st.where(format.RECORD)!r} is not the record its "
        f"head names ({len(data)} bytes, CRC-32C {checksum.crc(data)}; the "
        f"head says {h.record_size} bytes, CRC-32C {h.record_crc32c}): the "
        "object was replaced after the checkpoint was committed; save the "
        "checkpoint again"
      )
    return data

  def encode(self, root: Storage) -> str:
    """This pin as text (for the other processes of a restore)."""
    if self.head is not None:
      return json.dumps({"head": self.head.encode().decode()})
    rel = "" if self.st.url == root.url else self.st.location.name
    return json.dumps({"legacy": rel})

  @classmethod
  def decode(cls, api: str, root: Storage, text: str) -> Pinned:
    d = json.loads(text)
    if "head" in d:
      head = Head.decode(api, root.where(HEAD), d["head"].encode())
      return cls(version(root, head.save), head)
    rel = d["legacy"]
    return cls(root.parent().child(rel) if rel else root, None)


def pin(api: str, st: Storage) -> Pinned | None:
  """The checkpoint committed at ``st``, pinned (the head read once); None
  where there is none."""
  head, _ = read_head(api, st)
  if head is not None:
    return Pinned(version(st, head.save), head)
  at = committed_at(api, st)
  return None if at is None else Pinned(at, None)


def source(api: str, st: Storage) -> Pinned:
  """``pin``, or FileNotFoundError naming the URL."""
  found = pin(api, st)
  if found is None:
    raise FileNotFoundError(
      f"{api}: no checkpoint at {st.url!r}: no {HEAD} there, nor a "
      f"{format.RECORD} of an earlier version (a prefix without them is "
      "not a checkpoint, or a save that did not commit)"
    )
  return found


def _is_copy(name: str, copy: str, marker: str = _NEXT) -> bool:
  """Whether ``copy`` is a ``.<name><marker><16 hex>`` copy's name."""
  start = f".{name}{marker}"
  tail = copy[len(start) :]
  return copy.startswith(start) and len(tail) == 16 and set(tail) <= _HEX


def _copies(parent: Storage, name: str) -> list[str] | None:
  """0.6.x's copies beside ``name`` in ``parent`` (both kinds); None where
  the parent cannot be listed (a stray key there: the copies are left)."""
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
      "overwrite=True (which replaces it)"
    )
  return copy


def committed_at(
  api: str,
  st: Storage,
  copies: list[str] | None = None,
  has_record: bool | None = None,
) -> Storage | None:
  """Where the 0.6.x checkpoint committed at ``st`` is (a path without a
  head): ``st`` if it has a record; else the copy beside it that its
  ``MOVED`` object names (if that has its record); else (0.6.0's
  overwrites left no name) the newest committed ``.jaxworks-new-`` copy
  beside it; else None.

  Args:
    copies: the copies beside ``st`` (``_copies``) where the caller listed
      them: no name is looked for without a copy to name (an overwrite
      removes its name before its copy).
    has_record: whether ``st`` has a record, where the caller looked.

  Raises:
    ValueError: a damaged ``MOVED``; two 0.6.0 copies committed at the
      same time (their records differ: which is newer cannot be told).
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
  done = sorted(
    (
      (c.mtime_ns(format.RECORD), c.url, c)
      for c in old
      if c.exists(format.RECORD)
    ),
    key=lambda t: t[:2],
  )
  if not done:
    return None
  newest = [d for d in done if d[0] == done[-1][0]]
  if len({bytes(d[2].read(format.RECORD)) for d in newest}) > 1:
    # Last-Modified has whole seconds on S3: saves within one tie, and a
    # random name must not choose (it chose the older one in 0.6.0).
    names = ", ".join(repr(d[1]) for d in newest)
    raise ValueError(
      f"{api}: {st.url!r} has no record, and 0.6.0 overwrites left "
      f"{len(newest)} committed copies beside it at the same time: {names}; "
      "which is newer cannot be told. Restore the one you want by its URL "
      f"and save it to {st.url!r} with overwrite=True (that replaces them "
      "all)"
    )
  return newest[-1][2]  # the same record: the same checkpoint


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
    names += record.files() or []
    data = bytes(at.read(format.MANIFEST, 0, format.MAX_MANIFEST_BYTES))
    arrays = format.parse_manifest(data)
  except (FileNotFoundError, *format.DAMAGED):
    return names
  return names + sorted({s.file for a in arrays.values() for s in a.shards})


def _ours(key: str) -> bool:
  """Whether ``key`` (under a checkpoint's prefix) is a save's own object
  that is no checkpoint content: a version's, the writer lease's."""
  top = key.split("/", 1)[0]
  return top in (VERSIONS, lease_lib.PREFIX)


def _written(key: str) -> bool:
  """Whether 0.6.x saves wrote objects named ``key`` at a path (then a
  save over it removes them)."""
  return (
    key in (format.RECORD, format.MANIFEST, MOVED)
    or codec.split_name(key) is not None
  ) and not _ours(key)


def _nested(keys: list[str]) -> list[str]:
  """The checkpoints committed below a prefix of ``keys``: their heads and
  records at a deeper level (not a version's or a 0.6.x shard file's)."""
  out = []
  for k in keys:
    parts = k.split("/")
    if len(parts) > 1 and parts[-1] in (HEAD, format.RECORD):
      if not any(p in (VERSIONS, lease_lib.PREFIX) for p in parts):
        out.append(k.rpartition("/")[0])
  return sorted(set(out))


class Bucket:
  """The bucket side of a directory save to ``url`` (see the module
  docstring): checked in the call; ``begin`` (process 0, in the save's
  turn) takes the path's writer lease and names the save's version (the
  other processes of a collective save ``attach`` to it); every process
  ``write``s its objects there; process 0 ``commit``s (the head) and
  removes what the head no longer names; ``end`` (process 0, once done or
  failed) gives the lease back.

  Args:
    lease: take the path's writer lease in ``begin`` (False: the caller
      holds one on a directory above, a CheckpointManager's).

  Raises:
    FileExistsError: a checkpoint is committed at ``url``, the prefix holds
      other objects, or another live process is saving there, and not
      ``overwrite``; a checkpoint is committed below ``url`` (overwrite
      replaces a checkpoint, never a prefix of checkpoints); ``commit``:
      another save committed there meanwhile.
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
    look: bool = True,
  ) -> None:
    self.api, self.url, self.overwrite = api, url, overwrite
    self.lease = lease
    self._held: lease_lib.Lease | None = None
    self.st = st
    self.parent, self.name = split(api, url, st)
    self.save = ""  # this save's id (``begin``/``attach``)
    self.target = self.st
    self.state: bool | None = False  # committed (None: cannot tell)
    self._trying = False  # the head's request was made
    self.head: Any = None
    self.tag: Any = None
    if look:  # in the call (``begin`` looks again, in the save's turn)
      self._look()

  def where(self) -> str:
    return self.target.url

  def _look(self) -> None:
    """What is at the path (the first request of a save names the path in
    any error): its head, its objects, 0.6.x's layout; refuses what this
    save may not replace."""
    try:
      self.head, self.tag = read_head(self.api, self.st)
      damaged: ValueError | None = None
    except ValueError as err:  # replaced by an overwrite, as it is
      self.head, damaged = None, err
      self.tag = self.st.read_tagged(HEAD)[1]  # type: ignore[index]
    try:
      self.keys: list[str] | None = list(self.st.list())
    except storage.StrayKeyError as err:
      LOG.warning("%s; looking only for the objects jaxworks writes", err)
      self.keys = None
    self.copies: list[str] = []
    self.legacy: Storage | None = None
    if self.tag is None:
      has = (
        format.RECORD in self.keys
        if self.keys is not None
        else self.st.exists(format.RECORD)
      )
      self.copies = _copies(self.parent, self.name) or []
      try:
        self.legacy = committed_at(self.api, self.st, self.copies, has)
      except ValueError as err:  # a damaged 0.6.x layout
        damaged = err
    committed = self.tag is not None or self.legacy is not None
    if damaged is not None and not self.overwrite:
      raise damaged
    if committed and not self.overwrite:
      raise exists_error(self.api, self.url)
    nested = _nested(self.keys or [])
    if nested:
      shown = ", ".join(repr(f"{self.url}/{n}") for n in nested[:3])
      raise FileExistsError(
        f"{self.api}: {self.url!r} holds committed checkpoints below it "
        f"({shown}); overwrite replaces a checkpoint, never a prefix of "
        "checkpoints: save to another path, or delete them first"
      )
    present = [k for k in self.keys or () if not _ours(k)]
    if present and not self.overwrite:
      shown = ", ".join(repr(k) for k in present[:3])
      raise FileExistsError(
        f"{self.api}: {self.url!r} holds objects ({shown}"
        f"{', ...' if len(present) > 3 else ''}) and no checkpoint; a save "
        "writes only to an empty prefix: save to another path, or remove "
        "them (overwrite=True leaves them and saves beside them)"
      )

  def begin(self) -> str:
    """Process 0, in the save's turn, before any object is written: the
    path's writer lease taken (``end`` gives it back), what is at the path
    looked at again, and the id of this save's version, which the other
    processes ``attach`` to."""
    if self.lease and self._held is None:
      self._held = lease_lib.acquire(
        self.api, self.st, self.url, self._conflict
      )
    try:
      self._look()  # the saves called before this one may have committed
    except BaseException:
      self.end()
      raise
    self.attach(secrets.token_hex(8))
    return self.save

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
    lease over (this one's heartbeat had stopped): before the commit."""
    lost = None if self._held is None else self._held.lost
    if lost is not None:
      raise lease_lib.WriterConflictError(
        f"{self.api}: {self.url!r} is now saved by "
        f"{lease_lib.describe(lost)}, which took over this save's writer "
        f"lease (its heartbeat had stopped for {lease_lib.EXPIRY_S:g} s: "
        "was this process suspended?); this save stops before its commit: "
        "save again once that one is done, or to another path"
      )

  def attach(self, name: str) -> None:
    """Where this process writes: the version ``name`` (``begin``)."""
    if not _is_id(name):
      raise ValueError(f"{self.api}: {name!r} names no save's version")
    self.save = name
    self.target = version(self.st, name)

  def write(
    self,
    names: list[str],
    take: Callable[[int], Any],
    fill: Callable[[int, Any, Any], Any],
    done: Callable[[int], None],
    threads: int,
  ) -> list[Any]:
    """Writes this process's objects ``names`` to the version
    (``_upload``); what each ``fill`` returned (the checksums)."""
    return _upload(self.target, names, take, fill, done, threads)

  def put(self, name: str, data: bytes) -> None:
    """Writes the object ``name`` of this save's version in one request."""
    self.target.write(name, data)

  def commit(self, record: bytes, manifest: bytes | None = None) -> bool:
    """Process 0, every process's objects written: the manifest and the
    record written to the version, then the head (the commit); then what
    the head no longer names removed. False (nothing to move)."""
    self._still()
    if manifest is not None:
      self.target.write(format.MANIFEST, manifest)
    self.target.write(format.RECORD, record)
    head = Head.of(self.save, record).encode()
    self._trying = True
    try:
      if self.tag is None:
        self.st.create(HEAD, head)
      else:
        self.st.replace(HEAD, head, self.tag)
      self.state = True
    except BaseException as err:
      self.state = self._read_back()
      if not self.state:
        self._note(err)
        if self.state is False and isinstance(err, FileExistsError):
          if self.tag is None:
            raise exists_error(self.api, self.url) from err
          raise FileExistsError(
            f"{self.api}: another save committed at {self.url!r} while this "
            "one wrote (its head changed since this save began); this one "
            "was not committed: save again to replace that one"
          ) from err
        raise
      LOG.warning(
        "%s: the commit of %s answered %r, but its head names this save: "
        "committed (the answer of a request that was applied got lost)",
        self.api, self.url, err,
      )  # fmt: skip
    self._tidy()
    return False

  def _read_back(self) -> bool | None:
    """Whether the head names this save: True, False, or None where it
    cannot be read."""
    for _ in range(3):
      try:
        head, _ = read_head(self.api, self.st)
      except ValueError:
        return False
      except OSError as err:
        LOG.warning("%s; reading the head again", err)
        continue
      return head is not None and head.save == self.save
    return None

  def _note(self, err: BaseException) -> None:
    if self.state is None:
      err.add_note(
        f"{self.api}: whether the save to {self.url!r} was committed could "
        f"not be read back (its head {self.st.where(HEAD)!r} names version "
        f"{self.save} if it was); restore it to see"
      )
    else:
      err.add_note(
        f"{self.api}: the save to {self.url!r} was not committed (its head "
        "does not name it): the path reads as before"
      )

  def _tidy(self) -> None:
    """Once committed: the versions the head does not name, and 0.6.x's
    objects at and beside the path, removed. A failure is only logged (the
    save is committed; the next one removes the rest)."""
    try:
      self._remove_old()
    except OSError as err:
      LOG.warning(
        "%s; %s is saved, the next save removes what is left", err, self.url
      )

  def _remove_old(self) -> None:
    mine = f"{VERSIONS}/{self.save}/"
    if self.keys is not None:
      keys = self.keys
    else:  # a stray key: the objects the replaced record names
      keys = [
        f"{VERSIONS}/{self.head.save}/{k}"
        for k in _named(self.api, version(self.st, self.head.save))
      ] if self.head is not None else []  # fmt: skip
      keys += _named(self.api, self.legacy or self.st)
    old = [
      k
      for k in keys
      if (k.startswith(VERSIONS + "/") and not k.startswith(mine))
      or _written(k)
    ]
    if old:
      self.st.delete(old)
    for copy in self.copies:
      self.parent.child(copy).delete_prefix()

  def abort(self) -> None:
    """Process 0, the save failed: its version removed, unless the head
    names it (or that cannot be told: then the next save removes it)."""
    if not self.save or self.state is not False:
      return
    if self._trying and self._read_back() is not False:
      return
    try:
      self.target.delete_prefix()
    except OSError as err:
      LOG.warning("%s; the next save to %s removes it", err, self.url)

  def end(self) -> None:
    """Process 0, the save done or failed: the writer lease given back
    (again: nothing)."""
    held, self._held = self._held, None
    if held is not None:
      lease_lib.release(held)

  def close(self) -> None:
    """Nothing is held locally; the lease, if still held, given back."""
    self.end()


def committed(api: str, st: Storage) -> bool:
  """Whether a checkpoint is committed at ``st`` (a head, or 0.6.x's)."""
  if st.exists(HEAD):
    return True
  try:
    return committed_at(api, st) is not None
  except ValueError:
    return True  # committed, and damaged: restore says how


def commit_ns(api: str, st: Storage) -> int | None:
  """When the checkpoint at ``st`` was committed; None if there is none."""
  try:
    return st.mtime_ns(HEAD)
  except FileNotFoundError:
    pass
  at = committed_at(api, st)
  return None if at is None else at.mtime_ns(format.RECORD)


def delete(api: str, st: Storage) -> bool:
  """Deletes the checkpoint committed at ``st`` (a manager's step): first
  what commits it (its head; 0.6.x: its record, the name of its copy), so
  it is never half read, then its versions and 0.6.x's objects. False if
  there was none."""
  has_head = st.exists(HEAD)
  try:
    at = None if has_head else committed_at(api, st)
  except ValueError:
    at = st
  if not has_head and at is None:
    return False
  try:
    keys = [k for k in st.list() if _written(k) or k.startswith(VERSIONS + "/")]
  except storage.StrayKeyError as err:
    LOG.warning("%s; deleting only the objects jaxworks wrote there", err)
    keys = _named(api, st) if at is st else [format.RECORD, MOVED]
    if has_head:
      head, _ = read_head(api, st)
      if head is not None:
        ver = version(st, head.save)
        keys += [f"{VERSIONS}/{head.save}/{k}" for k in _named(api, ver)]
  st.delete([HEAD, format.RECORD, MOVED])
  st.delete(keys)
  loc = st.location
  parent = st.parent()
  for copy in _copies(parent, loc.name) or []:
    parent.child(copy).delete_prefix()
  return True
