"""Restore of a checkpoint that several processes wrote: its manifest and
shard files (their format: see format), opened relative to one directory
descriptor and validated before anything is placed.

Then, as for a checkpoint one process wrote, batches are read ahead of the
batch being placed (prefetch): the region each of this process's devices
holds is read with ``preadv`` from the overlapping shard files
(``read_tasks``, by ``read_threads`` threads) into a new aligned buffer,
and the regions of an array are placed with one batched transfer (on CPU a
device takes its buffer over), relaid out after where the target has a
layout.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
import concurrent.futures
import dataclasses
import math
import os
import threading
from typing import Any
from typing import NamedTuple

import jax
from jax.experimental.layout import Format
import numpy as np

from .. import jax_internals
from .. import targets
from ..api import place
from . import checksum
from . import format
from . import prefetch
from . import reader
from .format import Bounds
from .format import Entry
from .format import Shard
from .keys import astype
from .keys import cast_to
from .target import Request
from .target import restore_placement

#: Runs of fewer bytes are read as one block of whole rows and copied.
SMALL_RUN = 256 * 2**10


def open_manifest(
  api: str, path: str, dir_fd: int, data: bytes, record: bytes
) -> LocalManifest:
  """The manifest checkpoint in the directory ``dir_fd`` (a descriptor this
  call takes over), whose manifest ``data`` and ``record`` were read
  through it."""
  try:
    file = os.path.join(path, format.MANIFEST)
    try:
      arrays = format.parse_manifest(data)
    except format.DAMAGED as err:
      raise ValueError(
        f"{api}: the manifest {file!r} is damaged ({type(err).__name__}: "
        f"{err}); write the checkpoint again"
      ) from None
  except BaseException:
    os.close(dir_fd)
    raise
  return LocalManifest(api, path, dir_fd, arrays, record)


class Manifest(abc.ABC):
  """An opened manifest checkpoint: the arrays, and the shard files opened
  and validated so far (``stored``, by name), planned and read the same way
  wherever they lie. ``LocalManifest`` reads them through descriptors
  relative to the directory's, ``restore_objects.ObjectManifest`` in
  ranged requests to a bucket; ``close()`` lets go of them."""

  def __init__(self, api: str, path: str, arrays: dict[str, Entry]) -> None:
    self.api, self.path, self.arrays = api, path, arrays
    # By file name: reader.StoredFile (LocalManifest) or
    # restore_objects.StoredObject (ObjectManifest).
    self.stored: dict[str, Any] = {}

  def close(self) -> None:
    pass

  def contents(
    self,
  ) -> tuple[dict[str, tuple[tuple[int, ...], np.dtype]], format.Record]:
    """(key -> (shape, dtype) of every array, the checkpoint's record, read
    relative to the directory and checked against the manifest's dtypes; an
    empty one where there is none)."""
    arrays = {k: (e.shape, e.dtype) for k, e in self.arrays.items()}
    data = self.record_data()
    if data is None:
      return arrays, format.Record()
    where = f"the record {format.RECORD!r} of {self.path!r}"
    record = format.decode_record(self.api, where, data)
    for key, name in record.dtypes.items():
      entry = self.arrays.get(key)
      if (
        entry is not None
        and format.exact_dtype(self.api, where, key, name) != entry.dtype
      ):
        raise ValueError(
          f"{self.api}: {where} says {name} for {key!r} but the manifest "
          f"says {entry.dtype.name}; the checkpoint is damaged"
        )
    format.check_arrays_present(self.api, self.path, record, arrays)
    return arrays, record

  def restore_arrays(self, request: Request) -> list[Any]:
    """The arrays ``request`` asks for, validated, read and placed."""
    return restore_arrays(self, request)

  @abc.abstractmethod
  def record_data(self) -> bytes | None:
    """The record's bytes (None: there is none)."""

  def read_threads(self, threads: int) -> int:
    """Threads reading shards (restore_objects: at least the requests in
    flight a bucket takes)."""
    return threads

  def open_shards(self, needed: list[tuple[str, Entry, Shard]]) -> None:
    """Opens the shard files ``needed`` ((key, entry, shard) triples)
    before ``pieces`` asks for them (restore_objects: all at once)."""
    for key, entry, shard in needed:
      self.open_shard(key, entry, shard)

  @abc.abstractmethod
  def handles(self, used: dict[str, Any]) -> dict[str, Any]:
    """What ``reader.read_range`` reads each file of ``used`` through (by
    name)."""

  @abc.abstractmethod
  def unchanged(self, fds: dict[str, Any], used: dict[str, Any]) -> None:
    """Raises ValueError if a file of ``used`` was modified while read."""

  @abc.abstractmethod
  def release(self, fds: dict[str, Any], used: dict[str, Any]) -> None:
    """Lets go of what ``handles`` opened."""

  @abc.abstractmethod
  def open_shard(self, key: str, entry: Entry, shard: Shard) -> reader.Stored:
    """The validated shard file ``shard`` of ``key``."""

  def pieces(
    self, key: str, entry: Entry, want: Bounds
  ) -> list[tuple[reader.Stored, Shard]]:
    """The validated shard files overlapping the region ``want`` of ``key``
    (ValueError if they do not cover it)."""
    out, covered = [], 0
    for shard in entry.overlapping(want):
      inter = format.intersect(shard, want)
      if inter is None:
        continue
      out.append((self.open_shard(key, entry, shard), shard))
      covered += math.prod(b - a for a, b in inter)
    if covered != math.prod(hi - lo for lo, hi in want):
      raise ValueError(
        f"{self.api}: the shards of {key!r} in the manifest of {self.path!r} "
        f"do not tile the array (region {list(want)}); the checkpoint is damaged"
      )
    return out


class LocalManifest(Manifest):
  """A manifest checkpoint in a local directory: its descriptor, and the
  shard files' (``reader.StoredFile``), each validated when opened and read
  through the same descriptor (or opened again and checked to be the same
  file); ``close()`` closes them."""

  def __init__(
    self,
    api: str,
    path: str,
    dir_fd: int,
    arrays: dict[str, Entry],
    record: bytes | None = None,
  ) -> None:
    super().__init__(api, path, arrays)
    self.dir_fd, self.record = dir_fd, record
    self._held = 0
    self._headers: dict[bytes, tuple[Any, bool, np.dtype, int]] = {}

  def close(self) -> None:
    for s in self.stored.values():
      if s.fd >= 0:
        os.close(s.fd)
        s.fd = -1
    if self.dir_fd >= 0:
      os.close(self.dir_fd)
      self.dir_fd = -1

  def record_data(self) -> bytes | None:
    """The record's bytes, read with the manifest when it was opened."""
    return self.record

  def handles(self, used: dict[str, Any]) -> dict[str, Any]:
    """Each file's descriptor, opened again and checked where it was closed."""
    fds: dict[str, int] = {}
    try:
      for name, s in used.items():
        fds[name] = s.fd if s.fd >= 0 else _reopen(self.api, s)
    except BaseException:
      self.release(fds, used)
      raise
    return fds

  def unchanged(self, fds: dict[str, Any], used: dict[str, Any]) -> None:
    """Raises ValueError if a file of ``used`` was modified while read."""
    for name, s in used.items():
      if reader.stamp(os.fstat(fds[name])) != s.stamp:
        raise ValueError(
          f"{self.api}: {s.where} was modified while restore read it; "
          "restore again"
        )

  def release(self, fds: dict[str, Any], used: dict[str, Any]) -> None:
    """Closes the descriptors ``handles`` opened again."""
    for name, fd in fds.items():
      if fd != used[name].fd:
        os.close(fd)

  def open_shard(
    self, key: str, entry: Entry, shard: Shard
  ) -> reader.StoredFile:
    """The validated shard file (opened relative to the directory)."""
    s = self.stored.get(shard.file)
    if s is not None:
      return s
    api, file = self.api, os.path.join(self.path, shard.file)
    fd, st = reader.open_named(
      api, file, self.dir_fd, shard.file, key,
      f"the shard file {file!r} of {key!r}",
    )  # fmt: skip
    try:
      try:
        shape, fortran, dtype, offset = reader.read_npy_header(
          fd, self._headers
        )
      except (OSError, ValueError, EOFError) as err:
        raise reader.unreadable(
          f"{api}: the shard file {file!r} of {key!r} is not a readable .npy "
          "file",
          err,
          "save it again",
        ) from None
      s = reader.StoredFile(
        tuple(shape), dtype, fortran, repr(file), st.st_size - offset, file,
        offset, None, fd=fd, dir_fd=self.dir_fd, name=shard.file,
        stamp=reader.stamp(st),
        sums=None if shard.crc32c is None else list(shard.crc32c),
      )  # fmt: skip
      check_shard(api, file, key, entry, shard, s)
    except BaseException:
      os.close(fd)
      raise
    if self._held < reader.HELD_FILES:
      self._held += 1
    else:  # opened again, relative to the directory, when read
      os.close(fd)
      s.fd = -1
    self.stored[shard.file] = s
    return s


def check_shard(
  api: str, file: str, key: str, entry: Entry, shard: Shard, s: reader.Stored
) -> None:
  """Raises ValueError unless the shard file ``s`` (at ``file``) holds what
  the manifest says."""
  header = s.dtype.newbyteorder("=")
  bad = ""
  if s.shape != shard.shape:
    bad = f"holds {list(s.shape)}, the manifest says {list(shard.shape)}"
  elif s.dtype.itemsize != entry.dtype.itemsize or not (
    (s.dtype.kind == "V" and s.dtype.fields is None)
    or (s.dtype.isnative and header == entry.dtype)
  ):
    bad = f"holds {s.dtype.str}, the manifest says {entry.dtype.name}"
  elif s.data_bytes != s.nbytes:
    bad = (
      f"holds {s.data_bytes} bytes of data but its header needs "
      f"{s.nbytes}; it is truncated or damaged"
    )
  if bad:
    raise ValueError(
      f"{api}: the shard file {file!r} of {key!r} {bad}. Nothing was placed"
    )


def read_tasks(
  pieces: list[tuple[reader.Stored, Shard]],
  want: Bounds,
  out: np.ndarray,
  fds: dict[str, Any],
  chunk: int,
  verified: set[tuple[str, int]] | None = None,
  blocks: dict[tuple[str, int, int], _Shared] | None = None,
) -> list[Callable[[], None]]:
  """Calls that together read the region ``want`` into ``out`` (C order, of
  the region's shape) from the shard files, through ``fds`` (by file name).

  With ``verified`` (a set), a call that reads one whole checksum chunk of
  a file checks it, and ``(file name, chunk)`` is added to the set. With
  ``blocks`` (a dict shared by the calls of one batch), the rows of a file
  that several regions copy from are read once."""
  if not out.size:
    return []
  itemsize = out.dtype.itemsize
  dst = out.reshape(-1).view(np.uint8)
  tasks: list[Callable[[], None]] = []
  dshape = tuple(hi - lo for lo, hi in want) + (itemsize,)
  for s, shard in pieces:
    inter = format.intersect(shard, want)
    if inter is None:
      continue
    sshape = shard.shape + (itemsize,)
    lo = tuple(a - st for (a, _), st in zip(inter, shard.start)) + (0,)
    ext = tuple(b - a for a, b in inter) + (itemsize,)
    dlo = tuple(a - w0 for (a, _), (w0, _) in zip(inter, want)) + (0,)
    name = s.name
    k = _tail_dim(ext, sshape, dshape)
    if s.fortran or (len(ext) > 1 and math.prod(ext[k:]) < SMALL_RUN):
      copy = _Copy(sshape, lo, ext, dshape, dlo)
      tasks.append(_block_task(s, fds, copy, dst, verified, blocks))
      continue
    run = math.prod(ext[k:])
    sstr, dstr = _strides(sshape), _strides(dshape)
    for lead in np.ndindex(*ext[:k]):
      src_off = sum((lo[i] + t) * sstr[i] for i, t in enumerate(lead + (0,)))
      dst_off = sum((dlo[i] + t) * dstr[i] for i, t in enumerate(lead + (0,)))
      for a in range(0, run, chunk):
        n = min(chunk, run - a)
        at = src_off + a  # in the file's data
        whole = (
          verified is not None
          and s.sums is not None
          and at % checksum.CHUNK == 0
          and n == min(checksum.CHUNK, s.nbytes - at)
        )
        if whole and verified is not None:
          verified.add((name, at // checksum.CHUNK))
        tasks.append(
          _run_task(
            fds,
            s,
            s.offset + at,
            dst[dst_off + a : dst_off + a + n],
            at // checksum.CHUNK if whole else None,
          )
        )
  return tasks


def _strides(shape: tuple[int, ...]) -> list[int]:
  return [math.prod(shape[i + 1 :]) for i in range(len(shape))]


def _tail_dim(ext: tuple, sshape: tuple, dshape: tuple) -> int:
  """The first dimension from which one copy is contiguous in both arrays."""
  k = len(ext) - 1
  while k > 0 and ext[k] == sshape[k] == dshape[k]:
    k -= 1
  return k


def _run_task(
  fds: dict[str, Any],
  s: reader.Stored,
  offset: int,
  view: np.ndarray,
  chunk: int | None = None,
) -> Callable[[], None]:
  """Reads ``view.size`` bytes at ``offset``; checks them as checksum chunk
  ``chunk`` of the file (None: no check)."""

  def task() -> None:
    try:
      sums = None if chunk is None else s.sums
      reader.read_checked(
        fds[s.name], view.data, offset, 0, view.size, sums, chunk
      )
    except (OSError, EOFError, ValueError) as err:
      raise ValueError(f"{s.where} failed: {err}") from None

  return task


def verify_tasks(
  used: dict[str, reader.Stored],
  fds: dict[str, Any],
  verified: set[tuple[str, int]],
) -> list[Callable[[], None]]:
  """Calls that check the checksum chunks of the files in ``used`` that no
  read call checked (regions that cut through a chunk): each reads its
  chunk into a scratch buffer."""
  tasks: list[Callable[[], None]] = []
  for name, s in used.items():
    if s.sums is None:
      continue
    for k, at in enumerate(range(0, s.nbytes, checksum.CHUNK)):
      if (name, k) not in verified:
        n = min(checksum.CHUNK, s.nbytes - at)
        tasks.append(_run_task(fds, s, s.offset + at, np.empty(n, np.uint8), k))
  return tasks


class _Shared:
  """Rows of a file that several regions copy from: read by the first task
  that needs them, dropped when the last one is done."""

  def __init__(self) -> None:
    self.lock = threading.Lock()
    self.block: np.ndarray | None = None
    self.users = 0

  def get(self, load: Callable[[], np.ndarray]) -> np.ndarray:
    with self.lock:  # the others wait for the first read
      if self.block is None:
        self.block = load()
      return self.block

  def done(self) -> None:
    with self.lock:
      self.users -= 1
      if not self.users:
        self.block = None


class _Copy(NamedTuple):
  """Where one shard's part of a region lies, in bytes (the last dimension
  is the item's): the shard's shape and the part's start in it, the
  part's extent, and the region's shape and the part's start in it."""

  sshape: tuple[int, ...]
  lo: tuple[int, ...]
  ext: tuple[int, ...]
  dshape: tuple[int, ...]
  dlo: tuple[int, ...]


def _block_task(
  s: reader.Stored,
  fds: dict[str, Any],
  copy: _Copy,
  dst: np.ndarray,
  verified: set[tuple[str, int]] | None = None,
  blocks: dict[tuple[str, int, int], _Shared] | None = None,
) -> Callable[[], None]:
  """Reads whole rows of the shard ``s`` (all of a Fortran-ordered one) and
  copies the region's part (``copy``) into ``dst``: for regions whose
  contiguous runs are small. With ``verified`` (a set), rows that are whole
  checksum chunks of the file are checked as read, and added to it (a chunk
  is read once); with ``blocks``, the same rows are read once for every
  region that copies from them."""
  name = s.name
  sshape, lo, ext, dshape, dlo = copy
  if s.fortran:
    rows, first = sshape[0], 0
  else:
    rows, first = ext[0], lo[0]
  row = math.prod(sshape[1:])
  start, end = first * row, (first + rows) * row
  check_from = None
  if (
    verified is not None
    and s.sums is not None
    and end > start
    and start % checksum.CHUNK == 0
    and (end % checksum.CHUNK == 0 or end == s.nbytes)
  ):
    check_from = start // checksum.CHUNK
    last = -(-end // checksum.CHUNK)
    verified.update((name, k) for k in range(check_from, last))

  shared = None
  if blocks is not None:
    shared = blocks.setdefault((name, start, end), _Shared())
    shared.users += 1

  def load() -> np.ndarray:
    block = np.empty(end - start, np.uint8)
    try:
      reader.read_range(fds[name], block.data, s.offset + start, 0, block.size)
      if check_from is not None:
        checksum.check(s.sums, block.data, check_from)
    except (OSError, EOFError, ValueError) as err:
      raise ValueError(f"{s.where} failed: {err}") from None
    return block

  def task() -> None:
    block = load() if shared is None else shared.get(load)
    if s.fortran:  # the bytes of each element stay together
      n = len(sshape) - 1
      src = block.reshape(sshape[:-1][::-1] + sshape[-1:]).transpose(
        list(range(n - 1, -1, -1)) + [n]
      )
      src = src[tuple(slice(a, a + n) for a, n in zip(lo, ext))]
    else:
      src = block.reshape((rows,) + sshape[1:])
      src = src[
        (slice(None),) + tuple(slice(a, a + n) for a, n in zip(lo[1:], ext[1:]))
      ]
    region = dst.reshape(dshape)
    region[tuple(slice(a, a + n) for a, n in zip(dlo, ext))] = src
    if shared is not None:
      shared.done()

  return task


@dataclasses.dataclass
class _Leaf:
  key: str
  entry: Entry
  sharding: Any
  layout: Any
  aval: Any
  committed: bool
  devices: list[Any]
  regions: list[Bounds]  # per device
  pieces: dict[Bounds, list]  # per distinct region: (Stored, Shard)
  cast: np.dtype | None = None  # the target's dtype, where it differs

  @property
  def nbytes(self) -> int:
    size = self.entry.dtype.itemsize
    return sum(math.prod(b - a for a, b in r) * size for r in self.pieces)


def restore_arrays(opened: Manifest, request: Request) -> list[Any]:
  """The arrays of ``request.keys`` (restore sorted the target), validated,
  then read (ahead, on a background thread) and placed; the arrays in
  order."""
  api, verify = request.api, request.verify
  plan = _plan(
    api, opened, request.keys, request.paths, request.specs, request.places
  )
  memory = reader.HostMemory()
  pool = concurrent.futures.ThreadPoolExecutor(
    opened.read_threads(request.read_threads),
    thread_name_prefix=reader.READ_THREAD_PREFIX,
  )

  def read(batch: list[int]) -> list[dict[Bounds, np.ndarray]]:
    return _read(api, opened, [plan[i] for i in batch], memory, pool, verify)

  def place_batch(batch: list[int], regions: Any) -> Any:
    return (_put(api, plan[i], bufs) for i, bufs in zip(batch, regions))

  sizes = [leaf.nbytes for leaf in plan]
  try:
    return prefetch.stream(
      sizes, request.max_inflight_bytes, read, place_batch, request.progress
    )
  finally:
    pool.shutdown(wait=True)


def _plan(
  api: str,
  opened: Manifest,
  keys: list[str],
  paths: list[str],
  specs: list[tuple[tuple[int, ...], np.dtype, bool]],
  places: list[Any],
) -> list[_Leaf]:
  """Checks shapes, placements and shard files; what to read."""
  path, arrays = opened.path, opened.arrays
  normalized: dict[int, Any] = {}
  plan = []
  needed: dict[str, tuple[str, Entry, Shard]] = {}
  for key, where, (shape, dtype, _), p in zip(keys, paths, specs, places):
    entry = arrays[key]
    stored = entry.dtype
    if entry.shape != shape:
      raise ValueError(
        f"{api}: the leaf at {where} (key {key!r}) is stored in the "
        f"checkpoint {path!r} (its manifest {format.MANIFEST!r}) as "
        f"{stored.name}{list(entry.shape)} but the target expects shape "
        f"{list(shape)}; restore into a target of the stored shape "
        "(bt.metadata(path) lists them)"
      )
    cast = cast_to(stored, dtype)
    sharding, layout, committed = restore_placement(
      api, p, where, shape, normalized
    )
    if sharding is None:
      sharding = targets.single_device_sharding(jax_internals.default_device())
    index_map = sharding.addressable_devices_indices_map(shape)
    aval = jax_internals.ShapedArray(
      shape, jax.dtypes.canonicalize_dtype(stored if cast is None else cast)
    )
    if committed:
      aval = jax_internals.device_put_aval(aval, sharding)
    regions = [format.bounds(idx, shape) for idx in index_map.values()]
    for r in dict.fromkeys(regions):
      for shard in entry.overlapping(r):
        if format.intersect(shard, r) is not None:
          needed.setdefault(shard.file, (key, entry, shard))
    plan.append(_Leaf(
      key, entry, sharding, layout, aval, committed, list(index_map), regions,
      {}, cast,
    ))  # fmt: skip
  opened.open_shards(list(needed.values()))
  for leaf in plan:
    leaf.pieces = {
      r: opened.pieces(leaf.key, leaf.entry, r)
      for r in dict.fromkeys(leaf.regions)
    }
  return plan


def _read(
  api: str,
  opened: Manifest,
  leaves: list[_Leaf],
  memory: reader.HostMemory,
  pool: concurrent.futures.ThreadPoolExecutor,
  verify: bool = True,
) -> list[dict[Bounds, np.ndarray]]:
  """The distinct regions of ``leaves``, each in a new aligned buffer."""
  used = {
    s.name: s for leaf in leaves for p in leaf.pieces.values() for s, _ in p
  }
  fds = opened.handles(used)
  try:
    out, tasks = [], []
    verified: set[tuple[str, int]] | None = set() if verify else None
    blocks: dict[tuple[str, int, int], _Shared] = {}
    for leaf in leaves:
      bufs = _buffers(memory, leaf)
      for want, pieces in leaf.pieces.items():
        tasks += read_tasks(
          pieces, want, bufs[want], fds, reader.CHUNK, verified, blocks
        )
      out.append(bufs)
    if verified is not None:  # chunks that no read covered whole
      tasks += verify_tasks(used, fds, verified)
    futures = [pool.submit(t) for t in tasks]
    concurrent.futures.wait(futures)  # every read ends before fds close
    try:
      for f in futures:
        f.result()
    except (OSError, ValueError, EOFError) as err:
      raise reader.unreadable(
        f"{api}: reading",
        err,
        "the file changed or is damaged since restore validated it",
      ) from None
    opened.unchanged(fds, used)
  finally:
    opened.release(fds, used)
  return out


def _buffers(memory: reader.HostMemory, leaf: _Leaf) -> dict[Bounds, Any]:
  """A new aligned buffer per distinct region of ``leaf``: parts of one map
  of their own for an array of ``OWN_MAP`` bytes or more (huge pages for the
  whole array, however small its regions), else from ``memory``'s slabs."""
  dtype = leaf.entry.dtype
  shapes = {r: tuple(b - a for a, b in r) for r in leaf.pieces}
  sizes = {r: math.prod(x) * dtype.itemsize for r, x in shapes.items()}
  total = sum(n + (-n % reader.ALIGN) for n in sizes.values())
  if len(shapes) == 1 or total < reader.OWN_MAP:
    return {r: memory.empty(x, dtype)[0] for r, x in shapes.items()}
  buf, offset, out = reader.anonymous_map(total), 0, {}
  for r, x in shapes.items():
    out[r] = np.ndarray(x, dtype, buffer=buf, offset=offset)
    offset += sizes[r] + (-sizes[r] % reader.ALIGN)
  return out


def _reopen(api: str, s: reader.StoredFile) -> int:
  try:
    fd, st = reader.open_file(s.name, s.dir_fd)
  except FileNotFoundError:
    raise reader.gone(api, s.file, s.name, s.dir_fd) from None
  except (OSError, ValueError) as err:
    raise reader.unreadable(
      f"{api}: {s.where} cannot be read", err, "save it again"
    ) from None
  if reader.stamp(st) != s.stamp:
    os.close(fd)
    raise ValueError(
      f"{api}: {s.where} was replaced after restore validated it; restore again"
    )
  return fd


def _put(api: str, leaf: _Leaf, bufs: dict[Bounds, np.ndarray]) -> Any:
  """One array from its regions (a device may take its buffer over)."""
  put = jax_internals.batched_device_put
  if leaf.cast is not None:
    bufs = {r: astype(b, leaf.cast) for r, b in bufs.items()}
  shards = [bufs[r] for r in leaf.regions]
  devices = leaf.devices
  with jax_internals.explicit_device_put_scope():
    if len(bufs) < len(shards) or 0 in leaf.aval.shape:
      # A region several devices hold: each gets a copy of its own (a buffer
      # backing two shards would let a donation on one change the other).
      memory_kind = leaf.sharding.memory_kind
      shards = [
        put(
          jax_internals.ShapedArray(x.shape, leaf.aval.dtype),
          jax.sharding.SingleDeviceSharding(d, memory_kind=memory_kind),
          [x], [d], True, True,
        )
        for x, d in zip(shards, devices)
      ]  # fmt: skip
    y = put(leaf.aval, leaf.sharding, shards, devices, leaf.committed, False)
  if leaf.layout is not None:
    y = place(y, Format(leaf.layout, leaf.sharding), donate=True, api=api)
  return y
