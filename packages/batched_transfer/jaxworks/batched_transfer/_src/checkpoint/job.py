"""A save as one object: what it writes, where and how, in the steps of every save.

``SaveJob(api, tree, destination, options)`` holds the tree's keys, leaves
and record (sorted by ``writer.Leaves``), the ``destination.Destination``
it writes to and the ``Options`` of the call. Its steps:

- ``prepare()``, in the call: the errors of earlier background saves, host
  copies of the host leaves, the destination's ``check``, the reservation
  of the path (saves of a process to one path commit in call order);
- ``stage(leaves, paths)``: the host value of each leaf, within
  ``max_inflight_bytes`` (a blocking save) or all at once (a non-blocking
  one);
- ``write(take, done)``: the files and their commit, through the
  destination (``begin``, ``write``, ``commit``, ``abort``, ``end``);
- ``release()``, once written or failed; ``committed()`` once committed
  (nothing here: a CheckpointManager's job runs its retention there).

``run_alone`` drives a save this process writes alone. A save of several
processes is driven by ``multiprocess.save_across_processes``, which runs
the same ``prepare``, ``stage``, ``turn``, ``committed`` and ``release``
inside its protocol and writes through the same destination
(``multiprocess.run`` chooses).
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
import time
from typing import Any

import jax
import numpy as np

from . import codec
from . import format
from . import hostvalue
from . import pending
from . import reader
from . import writer
from .destination import Destination
from .keys import check_files
from .storage import LOG

#: save's default ``max_inflight_bytes``.
DEFAULT_INFLIGHT = 1024 * 2**20


def positive(api: str, name: str, value: Any, none_ok: bool) -> Any:
  """``value``; ValueError unless it is a positive int (or None)."""
  if value is None and none_ok:
    return None
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(
      f"{api}: {name} must be a positive int{' or None' if none_ok else ''}, "
      f"got {value!r}"
    )
  return value


@dataclasses.dataclass(frozen=True)
class Options:
  """How a save writes (see ``save``'s arguments of the same names).

  Attributes:
    threads: save's ``write_threads``.
    pack_below: save's ``pack_below``: leaves of fewer bytes are stored
      together (``writer.pack``) where one process writes a directory.
    primary_keys: leaves that are process 0's in a collective save (not
      checked against the other processes').
    custom_metadata: save's ``custom_metadata`` (checked:
      ``format.custom_metadata``), kept in the record.
  """

  overwrite: bool = False
  blocking: bool = True
  threads: int = writer.DEFAULT_WRITE_THREADS
  max_inflight_bytes: int | None = DEFAULT_INFLIGHT
  barrier_timeout_s: float = 300.0
  collective: bool | None = None
  compression: str | None = None
  progress: bool | None = False
  primary_keys: tuple[str, ...] = ()
  custom_metadata: dict[str, Any] | None = None
  pack_below: int | None = None


class SaveJob:
  """One save of ``tree`` to ``destination`` (see the module docstring).

  Raises:
    TypeError, ValueError, OverflowError: as ``writer.Leaves`` (a leaf save
      cannot store) and ``compression`` (an unknown codec, or an ``.npz``).
  """

  def __init__(
    self, api: str, tree: Any, destination: Destination, options: Options
  ) -> None:
    self.api, self.destination, self.options = api, destination, options
    self.path = destination.path
    saved = writer.Leaves(api, tree, options.custom_metadata)
    self.keys, self.paths = saved.keys, saved.paths
    self.leaves: list[Any] = saved.leaves
    self.record = saved.record
    compression = options.compression
    use = codec.check(api, compression)
    if use is not None:
      if destination.npz:
        raise ValueError(
          f"{api}: {self.path!r}: compression={compression!r} is for a "
          "directory checkpoint (one compressed file per array); drop the "
          ".npz suffix or the compression"
        )
      codec.require(api, compression)
      self.record.codecs = dict.fromkeys(self.keys, use)
    self.held: list[pending.Reservation] = []  # taken by prepare
    #: A non-blocking save's private host copies (``writer.host_array``).
    self.memory = reader.HostMemory()
    below = options.pack_below
    #: The leaves stored together where this process writes a directory
    #: alone (``run_alone``; a collective save writes each on its own).
    self.packed: list[int] = []
    if below is not None and not destination.npz:
      sizes = writer.sizes_of(self.leaves)
      self.packed = [i for i, n in enumerate(sizes) if n < below]

  def check_files(self) -> None:
    """Raises ValueError for keys that cannot name a file (a directory):
    the files of a save this process writes alone (``packed``)."""
    if self.destination.npz:
      return
    packed = {self.keys[i] for i in self.packed}
    named = [
      (codec.file_name(k, self.record.codecs.get(k)), w)
      for k, w in zip(self.keys, self.paths)
      if k not in packed
    ]
    if packed:
      named.append((format.PACKED, "the packed leaves (pack_below)"))
    check_files(self.api, named)

  def prepare(self) -> None:
    """The call's checks: an earlier background save's error, the host
    leaves checked and copied (scalars converted) before anything is
    written, the destination's, the reservation of the path."""
    pending.raise_background_error(self.api)
    o = self.options
    for i, (where, x) in enumerate(zip(self.paths, self.leaves)):
      if not isinstance(x, jax.Array):
        self.leaves[i] = writer.host_array(
          self.api, where, x, None if o.blocking else self.memory
        )
    self.destination.check()
    self.held.append(pending.reserve(self.api, self.path, o.overwrite))

  def turn(self) -> None:
    """Waits for the saves of this process to the path called before."""
    for r in self.held:
      r.wait_turn()

  def release(self) -> None:
    """This process is done with the save: the path and the destination
    let go."""
    for r in self.held:
      r.release()

  def committed(self) -> None:
    """Runs once the checkpoint is committed (on the writing thread, under
    no lock; a collective save: on process 0, inside the save)."""

  def stage(
    self, leaves: list[Any], paths: list[str]
  ) -> tuple[Callable[[int], Any], Callable[[int], None]]:
    """(take, done) over ``leaves`` (``paths`` name them in errors): the
    host value of leaf ``i``, and its release once written. A blocking save
    copies ahead within ``max_inflight_bytes``; a non-blocking one copies
    the large leaves on their devices where they fit (``hostvalue.
    copy_on_devices``: the writing thread takes their device-to-host
    copies), starts every other device-to-host copy and holds the host
    values (numpy leaves were copied by ``prepare``; device buffers are
    held, see hostvalue): the caller may then donate or change them all."""
    if self.options.blocking:
      staged = writer.Staged(
        self.api, paths, leaves, self.options.max_inflight_bytes
      )
      return staged.take, staged.done
    on_devices = hostvalue.copy_on_devices(leaves)
    for i, x in enumerate(leaves):
      if i not in on_devices:
        hostvalue.start_copy(x)
    arrays: list[Any] = [
      on_devices[i]
      if i in on_devices
      else x
      if isinstance(x, np.ndarray)
      else writer.host_array(self.api, where, x, self.memory)
      for i, (where, x) in enumerate(zip(paths, leaves))
    ]

    def take(i: int) -> Any:
      a = arrays[i]
      if isinstance(a, hostvalue.OnDevice):
        a = arrays[i] = a.host()  # the device copies go
      return a

    return take, lambda i: arrays.__setitem__(i, None)

  def write(
    self, take: Callable[[int], Any], done: Callable[[int], None]
  ) -> None:
    """Writes the files through the destination and commits them."""
    record, keys = self.record, self.keys
    dest = self.destination
    dtypes: dict[str, str] = {}

    def taken(i: int) -> Any:
      a = take(i)
      dtypes[keys[i]] = _dtype_name(np.dtype(a.dtype))
      return a

    packed = self.packed
    rest = sorted(set(range(len(keys))) - set(packed))
    record.packed = [keys[i] for i in packed]
    for key in record.packed:
      record.codecs.pop(key, None)  # stored raw in the archive
    start = time.perf_counter()
    save = dest.begin()
    committed = False
    try:
      sums: dict[str, list[int]] = {}
      if packed:
        archive, sums = writer.pack(
          record.packed,
          lambda j: taken(packed[j]),
          lambda j: done(packed[j]),
        )
        save.put(format.PACKED, archive)
        del archive
      sums.update(
        save.write(
          [keys[i] for i in rest],
          lambda j: taken(rest[j]),
          lambda j: done(rest[j]),
          self.options.threads,
          record.codecs,
        )
      )
      record.crc32c = sums
      record.dtypes = {k: dtypes[k] for k in keys}
      record.save_id = format.new_save_id()
      data = format.encode_record(record)
      save.commit(data)
      committed = True
    except BaseException:
      if not committed:
        save.abort()
      raise
    finally:
      save.end()
    LOG.info(
      "saved %s (%d arrays) in %.2f s",
      self.path, len(keys), time.perf_counter() - start,
    )  # fmt: skip

  def run_alone(self) -> pending.SaveHandle | None:
    """The save of a checkpoint this process writes alone: ``prepare`` in
    the call, then (here when blocking, else on a background thread) its
    turn, ``write``, ``release`` and ``committed``."""
    self.check_files()
    try:
      self.prepare()
      sizes = writer.sizes_of(self.leaves)
      leaves, self.leaves = self.leaves, []  # let go: the stage holds them
      take, done = self.stage(leaves, self.paths)
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
      self.committed()

    if self.options.blocking:
      work()
      return None
    try:
      return pending.start(self.path, work)
    except BaseException:  # no thread: work() never runs
      bar.close()
      self.release()
      raise


@functools.lru_cache(maxsize=256)
def _dtype_name(dtype: np.dtype) -> str:
  """``dtype.name`` (numpy derives it in Python at every call)."""
  return dtype.name
