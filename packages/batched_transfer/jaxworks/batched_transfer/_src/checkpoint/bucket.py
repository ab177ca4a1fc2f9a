"""Checkpoints in buckets (S3, GCS, Azure): a prefix of objects, or one
``.npz`` object (place tells the steps; remote the protocol).

A save to a prefix writes its objects under a version of its own and
commits with one conditional write of the path's head naming it
(``remote.Bucket``); a read pins the version the head names once (for
every process of a collective restore) and reads only it.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
import contextlib
import os
import tempfile
from typing import Any

from . import codec
from . import format
from . import hostvalue
from . import remote
from . import restore_objects
from . import storage
from .local import LocalNpz
from .local import NpzSave
from .local import delete_arrays
from .place import Destination
from .place import Done
from .place import Opened
from .place import Save
from .place import T
from .place import Take
from .storage import LOG

#: How many times a read of a bucket's checkpoint starts again when the
#: version it pinned was replaced (and removed) while it read.
READ_ATTEMPTS = 4


class BucketPrefix(Destination):
  """A prefix in a bucket: the same files as objects under a version
  prefix of their own, committed by the head naming it (``BucketSave``)."""

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

  def child(self, name: str) -> Destination:
    url = f"{self.path.rstrip('/')}/{name}" if name else self.path.rstrip("/")
    st = self.st.child(name) if name else self.st
    bucket = BucketNpz if format.is_npz(url) else BucketPrefix
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
          out = read(opened)
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
        continue
      if board is not None:  # every process read it whole, or all raise
        try:
          board.agree(f"{attempt}/read", "ok")
        except BaseException:
          delete_arrays(out)
          raise
      return out
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
    self._bucket()  # what it may not replace is refused now, in the call

  def _bucket(self, look: bool = True) -> remote.Bucket:
    return remote.Bucket(
      self.api, self.path, self.st, self.overwrite, self.lease, look
    )

  def begin(self) -> Save:
    bucket = self._bucket(look=False)  # its begin looks, in the save's turn
    return BucketSave(bucket, bucket.begin())

  def attach(self, name: str) -> BucketSave:
    bucket = self._bucket(look=False)
    bucket.attach(name)
    return BucketSave(bucket, name)


class BucketSave(Save):
  """A save to a bucket's prefix: its objects streamed under the save's
  version, committed by the conditional write of the head
  (``remote.Bucket``, which holds the path's writer lease)."""

  def __init__(self, bucket: remote.Bucket, name: str) -> None:
    self.bucket, self.name = bucket, name

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

  def put(self, name: str, data: bytes) -> None:
    self.bucket.put(name, data)

  def commit(self, record: bytes, manifest: bytes | None = None) -> None:
    self.bucket.commit(record, manifest)

  def where(self) -> str:
    return self.bucket.where()

  def abort(self) -> None:
    self.bucket.abort()

  def end(self) -> None:
    self.bucket.end()


class BucketNpz(BucketPrefix):
  """An ``.npz`` in a bucket (one object): written as a ``LocalNpz`` in a
  temporary directory, then uploaded by the commit (``NpzUpload``: created
  only if absent, unless it replaces a committed one, in one put)."""

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
    if self.parent.tag_of(self.name) is not None and not self.overwrite:
      raise remote.exists_error(self.api, self.path)

  def begin(self) -> NpzUpload:
    tag = self.parent.tag_of(self.name)  # the archive it replaces, if any
    if tag is not None and not self.overwrite:
      raise remote.exists_error(self.api, self.path)
    tmp = tempfile.TemporaryDirectory(prefix="jaxworks-upload-")
    try:
      local = LocalNpz(self.api, os.path.join(tmp.name, self.name), False)
      return NpzUpload(self, tag, tmp, local.begin())
    except BaseException:
      tmp.cleanup()
      raise

  # Read as one archive (in ``open_checkpoint``), written by one process.
  reading = Destination.reading  # type: ignore[assignment]
  attach = Destination.attach  # type: ignore[assignment]


class NpzUpload(Save):
  """A save of an ``.npz`` to a bucket: the archive written locally (an
  ``NpzSave`` in a temporary directory), then put once, conditionally on
  the archive ``tag`` it replaces (None: on there being none)."""

  def __init__(
    self,
    dest: BucketNpz,
    tag: str | None,
    tmp: tempfile.TemporaryDirectory[str],
    local: NpzSave,
  ) -> None:
    self.api, self.path = dest.api, dest.path
    self.parent, self.name, self.tag = dest.parent, dest.name, tag
    self._tmp: tempfile.TemporaryDirectory[str] | None = tmp
    self.local = local

  def write(
    self,
    stems: list[str],
    take: Take,
    done: Done,
    threads: int,
    codecs: dict[str, str],
  ) -> dict[str, list[int]]:
    return self.local.write(stems, take, done, threads, codecs)

  def commit(self, record: bytes, manifest: bytes | None = None) -> None:
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
        return
      err.add_note(
        f"{self.api}: the save to {self.path!r} was not committed: the "
        "path holds what it held before (or another save's archive)"
      )
      if isinstance(err, FileExistsError):
        raise remote.exists_error(self.api, self.path) from err
      raise

  def _is(self, data: bytes) -> bool:
    """Whether the object at the path is ``data``."""
    try:
      return (
        self.parent.size(self.name) == len(data)
        and bytes(self.parent.read(self.name)) == data
      )
    except OSError:
      return False

  def where(self) -> str:
    return self.path

  def abort(self) -> None:
    self.local.abort()

  def end(self) -> None:
    self.local.end()
    tmp, self._tmp = self._tmp, None
    if tmp is not None:
      tmp.cleanup()
