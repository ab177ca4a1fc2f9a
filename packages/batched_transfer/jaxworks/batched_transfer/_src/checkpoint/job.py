"""A save as one object: what it writes and how, in the steps of every save.

``SaveJob`` holds the path, the tree's keys, leaves and record (sorted by
``writer.Leaves``) and the ``Options`` of the call. Its steps:

- ``prepare()``, in the call: the earlier saves' errors (the prelude), host
  copies of the host leaves, the target's checks, the reservation of the
  path (saves of a process to one path commit in call order);
- ``stage()``: the host value of each leaf, within ``max_inflight_bytes``
  (a blocking save) or all at once (a non-blocking one);
- ``write(take, done)``: the files and their commit (``writer``'s lock,
  temporary directory, fsync and atomic publication; in a bucket, the
  objects, then the record created last);
- ``release()``, once written or failed; ``after()`` once committed.

``run_alone`` drives a save this process writes alone. A save of several
processes is driven by ``multiprocess.save_across_processes``, which runs the
same ``prepare``, ``turn`` and ``release`` inside its protocol and writes
through its destination (a directory beside the path, or a bucket). A
directory save to a bucket writes each file straight into its object and
commits by the record (``Options.bucket``, remote.Bucket), the same objects
a save of several processes writes; an ``.npz`` to a bucket is written
locally, then uploaded (api.save_url).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
from typing import Any

import jax
import numpy as np

from . import codec
from . import format
from . import hostvalue
from . import pending
from . import remote
from . import writer
from .keys import check_files


@dataclasses.dataclass
class Options:
  """How a save writes (see ``save``'s arguments).

  Attributes:
    prelude: runs first in ``prepare`` (it raises errors of earlier saves).
    after: runs once the checkpoint is committed (on the writing thread, under
      no lock; a collective save: on process 0, inside the save).
    primary_keys: leaves that are process 0's in a collective save (not
      checked against the other processes').
    local_target: check the path on the file system and create its parents
      (False: the path is a bucket's URL).
    bucket: the ``remote.Bucket`` a directory save to a URL writes its
      objects to, straight from the writer threads (no local copy).
  """

  overwrite: bool
  blocking: bool
  threads: int
  max_inflight_bytes: int | None
  barrier_timeout_s: float = 300.0
  progress: bool | None = False
  primary_keys: tuple[str, ...] = ()
  prelude: Callable[[], None] | None = None
  after: Callable[[], None] | None = None
  local_target: bool = True
  bucket: Any = None


class SaveJob:
  """One save of ``tree`` to ``path`` (see the module docstring).

  Raises:
    TypeError, ValueError, OverflowError: as ``writer.Leaves`` (a leaf save
      cannot store) and ``compression`` (an unknown codec, or an ``.npz``).
  """

  def __init__(
    self,
    api: str,
    path: str,
    tree: Any,
    options: Options,
    compression: str | None = None,
  ) -> None:
    self.api, self.path, self.options = api, path, options
    saved = writer.Leaves(api, tree)
    self.keys, self.paths = saved.keys, saved.paths
    self.leaves: list[Any] = saved.leaves
    self.record = saved.record
    self.compression = compression
    use = codec.check(api, compression)
    if use is not None:
      if path.endswith(".npz"):
        raise ValueError(
          f"{api}: {path!r}: compression={compression!r} is for a directory "
          "checkpoint (one compressed file per array); drop the .npz suffix "
          "or the compression"
        )
      codec.require(api, compression)
      self.record.codecs = dict.fromkeys(self.keys, use)
    self.held: list[pending.Reservation] = []  # taken by prepare

  def check_files(self) -> None:
    """Raises ValueError for keys that cannot name a file (a directory)."""
    if not self.path.endswith(".npz"):
      check_files(
        self.api,
        [
          (codec.file_name(k, self.record.codecs.get(k)), w)
          for k, w in zip(self.keys, self.paths)
        ],
      )

  def prepare(self) -> None:
    """The call's checks: the prelude, the host leaves checked and copied
    (scalars converted) before anything is written, the target, the
    reservation of the path."""
    o = self.options
    if o.prelude is not None:
      o.prelude()
    for i, (where, x) in enumerate(zip(self.paths, self.leaves)):
      if not isinstance(x, jax.Array):
        self.leaves[i] = writer.host_array(
          self.api, where, x, private=not o.blocking
        )
    if o.local_target:
      writer.check_target(self.api, self.path, o.overwrite)
    self.held.append(pending.reserve(self.api, self.path, o.overwrite))

  def turn(self) -> None:
    """Waits for the saves of this process to the path called before."""
    for r in self.held:
      r.wait_turn()

  def release(self) -> None:
    for r in self.held:
      r.release()

  def after(self) -> None:
    if self.options.after is not None:
      self.options.after()

  def stage(self) -> tuple[Callable[[int], Any], Callable[[int], None]]:
    """(take, done): the host value of leaf ``i``, and its release once
    written. A blocking save copies ahead within ``max_inflight_bytes``; a
    non-blocking one starts every device-to-host copy now and holds the
    host values (numpy leaves were copied by ``prepare``; device buffers
    are held, see hostvalue). The job's leaves are let go."""
    leaves, self.leaves = self.leaves, []
    if self.options.blocking:
      staged = writer.Staged(
        self.api, self.paths, leaves, self.options.max_inflight_bytes
      )
      return staged.take, staged.done
    for x in leaves:
      hostvalue.start_copy(x)
    arrays: list[Any] = [
      x
      if isinstance(x, np.ndarray)
      else writer.host_array(self.api, where, x, private=True)
      for where, x in zip(self.paths, leaves)
    ]
    return arrays.__getitem__, lambda i: arrays.__setitem__(i, None)

  def write(
    self, take: Callable[[int], Any], done: Callable[[int], None]
  ) -> None:
    """Writes the files and commits them at the path."""
    o = self.options
    if o.bucket is not None:
      self._write_objects(o.bucket, take, done)
      return
    writer.write_checkpoint(
      self.api, self.path, self.keys, take, done, o.threads, self.record,
      o.overwrite,
    )  # fmt: skip

  def _write_objects(
    self,
    bucket: remote.Bucket,
    take: Callable[[int], Any],
    done: Callable[[int], None],
  ) -> None:
    """Writes the files as objects of ``bucket`` (the bytes and checksums
    of the files on disk, streamed out by the writer threads), then
    commits them by creating the record (remote.Bucket)."""
    keys, record = self.keys, self.record
    codecs = record.codecs
    dtypes: dict[str, str] = {}

    def fill(i: int, a: Any, f: Any) -> list[int]:
      dtypes[keys[i]] = np.dtype(a.dtype).name
      use = codecs.get(keys[i])
      if use is None:
        return hostvalue.write_npy(f, a)
      with codec.compressing(use, f) as out:
        return hostvalue.write_npy(out, a, codec.WRITE_STEP)

    bucket.begin()  # the path's writer lease, given back by end()
    committed = False
    try:
      names = [codec.file_name(k, codecs.get(k)) for k in keys]
      sums = bucket.write(names, take, fill, done, self.options.threads)
      record.crc32c = dict(zip(keys, sums))
      record.dtypes = {k: dtypes[k] for k in keys}
      data = format.encode_record(record)
      again = bucket.commit(data)
      committed = True  # the copy beside the path stays readable from now
      if again:
        bucket.move()
        bucket.finish(data)
    except BaseException:
      if not committed:
        bucket.abort()
      raise
    finally:
      bucket.end()

  def run_alone(self) -> pending.SaveHandle | None:
    """The save of a checkpoint this process writes alone: ``prepare`` in
    the call, then (here when blocking, else on a background thread) its
    turn, ``write``, ``release`` and ``after``."""
    self.check_files()
    try:
      self.prepare()
      sizes = writer.sizes_of(self.leaves)
      take, done = self.stage()
      bar = writer.Bar("save", sizes, self.options.progress)
    except BaseException:
      self.release()
      raise

    def written(i: int) -> None:
      done(i)
      bar.done(i)

    def work() -> None:
      try:
        self.turn()
        self.write(take, written)
      finally:
        bar.close()
        self.release()
      self.after()

    if self.options.blocking:
      work()
      return None
    return pending.start(self.path, work)
