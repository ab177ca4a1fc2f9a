"""Writing the files of a checkpoint, durably: the leaves sorted as save
stores them, host copies within a budget, the writer threads of a
directory's files (the destination module publishes them, see commit).
"""

from __future__ import annotations

from collections.abc import Iterator
import errno
import functools
import io
import os
import threading
from typing import Any
import zipfile

import jax
import numpy as np

from . import checksum
from . import codec
from . import format
from . import hostvalue
from . import reader
from .keys import python_scalar_dtype
from .keys import saved_leaf
from .keys import structure
from .progress import Progress
from .storage import LOG
from .storage import in_threads

#: Name prefix of the threads that write files.
WRITE_THREAD_PREFIX = "jaxworks-save-write"


#: Threads writing one checkpoint by default, whatever the CPU count.
#: Writing and fsyncing wait on the disk with the GIL released, so more
#: threads than CPUs can help; a file of more than one checksum chunk is
#: written by several of them at once (Pieces). But each thread takes the
#: GIL back after every write and fsync, and a training loop's thread,
#: which needs it between its steps, waits behind them. Measured on a TPU
#: v5e VM (9p, 13 cores), saves interleaved: 16 files of 64 MiB in 0.85 /
#: 0.64 s on 4 threads, 0.83 / 0.75 s on 2, 1.00 / 0.79 s on 16 (medians of
#: 3, two rounds), the best raw durable write of the same bytes 0.65-0.9 s;
#: a training state of 80 leaves (5.2 MB) in 89 ms on 4, 107 ms on 16, and
#: a training loop beside its non-blocking saves lost 59-70 ms per interval
#: on 4 against 74-97 on 16; on ext4 (2 cores) 70 ms on 4, 89 ms on 16, 1
#: GiB as fast on either. (Another round, 16 x 64 MiB fresh from the chip
#: each time: 1.2-2.2 s on 4, 1.0-1.5 s on 16: the 9p file system's speed
#: varies 2-4x from one round to the next; the benchmark's save row was
#: 1.78 s on 4, 1.84 s on 16.)
DEFAULT_WRITE_THREADS = 4


def host_array(
  api: str, path: str, x: Any, private: reader.HostMemory | None = None
) -> np.ndarray | hostvalue.Shards:
  """The host value of one leaf; ``private``: a copy of it in that memory,
  which nothing else can change nor holds (for a non-blocking save: a numpy
  leaf the caller may change, a jax.Array on CPU whose buffers a view would
  hold: JAX then copies the arrays it is asked to donate, at every step
  while the save writes; off CPU the device-to-host copy is its own
  already)."""
  scalar_dtype = python_scalar_dtype(x)
  if scalar_dtype is not None:
    # Stored as jax.device_put would place it (and jax.eval_shape describes it).
    try:
      return np.asarray(x, dtype=scalar_dtype)
    except OverflowError as err:
      raise OverflowError(
        f"{api}: the Python scalar {x!r} at {path} does not fit "
        f"{scalar_dtype.name}, the dtype JAX gives it ({err}); pass a numpy "
        "array of a wider dtype or enable jax_enable_x64"
      ) from None
  if isinstance(x, jax.Array):
    value = hostvalue.of(x)
    if private is not None and hostvalue.on_cpu(x):
      return hostvalue.owned(value, private.empty)
    return value
  if not isinstance(x, (np.ndarray, np.generic)):
    raise TypeError(
      f"{api}: the leaf at {path} is {x!r:.60} of type {type(x).__name__}, "
      "which save cannot store; save arrays, Python scalars (bool, int, "
      "float, complex), str or None (convert it, e.g. with str() or "
      "np.asarray())"
    )
  a = np.asarray(x)
  if not storable(a.dtype):
    raise TypeError(
      f"{api}: the leaf at {path} is an array of dtype {a.dtype}, which JAX "
      "does not hold and restore could not place; save arrays of bool, "
      "integer, floating, complex or ml_dtypes types (convert strings to "
      "str leaves)"
    )
  if not a.dtype.isnative:
    raise TypeError(
      f"{api}: the leaf at {path} has non-native byte order ({a.dtype.str}), "
      "which JAX does not accept (jax.device_put raises TypeError); convert "
      "it first with x.astype(x.dtype.newbyteorder('='))"
    )
  return a if private is None else hostvalue.owned(a, private.empty)


def storable(dtype: np.dtype) -> bool:
  """Whether arrays of ``dtype`` can be saved: the numeric types JAX holds,
  ml_dtypes' included (not strings, objects, datetimes, raw bytes, records)."""
  if dtype.kind in "biufc":
    return True
  return (
    dtype.kind == "V"
    and dtype.fields is None
    and not isinstance(dtype, np.dtypes.VoidDType)
  )


class Leaves:
  """A tree's leaves as save sorts them: the arrays (with their keys and
  paths) and the record's parts for the rest (``str`` and ``None`` leaves
  by value, which arrays were Python scalars, the tree's nesting)."""

  def __init__(
    self,
    api: str,
    tree: Any,
    custom_metadata: dict[str, Any] | None = None,
  ) -> None:
    layout, leaves = structure(api, tree)
    nesting: list[tuple[str, ...]] = []
    self.record = format.Record(
      tree=nesting,
      nodes={k: dict(v) for k, v in layout.nodes.items()},
      custom_metadata=custom_metadata,
    )
    self.keys: list[str] = []
    self.paths: list[str] = []
    self.leaves: list[Any] = []
    described: dict[int, dict | None] = {}
    for key, where, x, k in zip(
      layout.keys, layout.paths, leaves, layout.kinds
    ):
      empty = None
      if x is not None and saved_leaf(x):  # a node without children
        empty = "list" if isinstance(x, (list, tuple)) else "dict"
      nesting.append((key, k) if empty is None else (key, k, empty))
      if empty is not None:
        continue
      if x is None or isinstance(x, str):
        self.record.values[key] = x
        continue
      scalar_dtype = python_scalar_dtype(x)
      if scalar_dtype is not None:  # a subclass: the type it is of
        name = next(
          n for n, t in format.PYTHON_TYPES.items() if isinstance(x, t)
        )
        self.record.python[key] = name
        self.record.scalars[key] = format.encode_scalar(x)
        if not _fits(x, scalar_dtype):
          # By value alone (no JAX array holds it), also among the values,
          # which every reader knows has no file.
          self.record.values[key] = self.record.scalars[key]
          continue
      if isinstance(x, jax.Array):
        s = x.sharding
        if id(s) not in described:
          described[id(s)] = format.describe_sharding(s)
        desc = described[id(s)]
        if desc is not None:
          self.record.shardings[key] = desc
      self.keys.append(key)
      self.paths.append(where)
      self.leaves.append(x)
      # Stored in C order whatever its strides (hostvalue.write_npy): its
      # header's shape.
      self.record.shapes[key] = list(np.shape(x))
    self.record.c_order = True


def _fits(x: Any, dtype: np.dtype) -> bool:
  """Whether the Python scalar ``x`` fits ``dtype``, the dtype
  jax.device_put gives it (an int past int32, or int64 with x64, does not)."""
  try:
    with np.errstate(over="ignore"):  # a float past float32's range: inf
      np.asarray(x, dtype=dtype)
  except OverflowError:
    return False
  return True


_FIXES = {
  errno.ENOSPC: "free space on that file system, or save elsewhere",
  errno.EDQUOT: "free space within your disk quota, or save elsewhere",
  errno.EFBIG: "raise the file-size limit (ulimit -f, RLIMIT_FSIZE) or save "
  "to a file system that holds larger files",
  errno.EROFS: "the file system is read-only: save to a writable directory",
  errno.EACCES: "this process may not write there: save to a writable "
  "directory",
}


def write_error(api: str, path: str, file: str, err: OSError) -> OSError:
  """The OSError to raise for a failed write of ``file`` of the checkpoint
  at ``path``: the errno kept, the checkpoint, the file and the fix named."""
  code = err.errno
  fix = _FIXES.get(code or 0, "check the file system, then save again")
  text = err.strerror or (os.strerror(code) if code else str(err))
  return OSError(
    code,
    f"{api}: writing the checkpoint {path!r} failed: {text} while writing "
    f"{file!r}; {fix}. Nothing was committed: the checkpoint that was at "
    "the path (if any) is still there",
    file,
  )


def write_file(api: str, path: str, file: str, write: Any) -> Any:
  """Creates ``file``, lets ``write(f)`` fill it, and fsyncs it; returns what
  ``write`` returned. A failed write raises ``write_error``'s OSError (naming
  ``file``: a temporary name inside or beside the checkpoint ``path``)."""
  try:
    with open(file, "wb") as f:
      out = write(f)
      f.flush()
      os.fsync(f.fileno())
    return out
  except OSError as err:
    if err.errno is None:  # not a failed system call: as it is
      raise
    raise write_error(api, path, file, err) from err


class Bar:
  """The progress bar of a save (``Progress``; drawn only if ``enabled``,
  None: when stderr is a terminal): ``done(i)`` once leaf ``i`` of
  ``sizes`` bytes is written, ``add(n)`` for other bytes; thread-safe."""

  def __init__(
    self, label: str, sizes: list[int], enabled: bool | None
  ) -> None:
    self.sizes = sizes
    self._bar = Progress(label, sum(sizes), enabled=enabled)
    self._lock = threading.Lock()

  def done(self, i: int) -> None:
    self.add(self.sizes[i])

  def add(self, n: int) -> None:
    if self._bar.enabled:
      with self._lock:
        self._bar.update(n)

  def close(self) -> None:
    self._bar.close()


def sizes_of(leaves: list[Any]) -> list[int]:
  """The bytes of each leaf's data."""
  return [int(getattr(x, "nbytes", 0) or 0) for x in leaves]


class Staged:
  """Host values of the leaves in order: device-to-host copies are started
  ahead of use while the bytes started and not yet written fit the budget."""

  def __init__(
    self, api: str, paths: list[str], leaves: list[Any], budget: int | None
  ) -> None:
    self.api, self.paths, self.leaves = api, paths, leaves
    self.sizes = sizes_of(leaves)
    self.budget = budget
    self.started = self.inflight = 0
    self.cond = threading.Condition()

  def _start_ahead(self, i: int) -> None:
    ahead = sum(self.sizes[i : self.started])
    while self.started < len(self.leaves) and (
      self.started == i
      or self.budget is None
      or ahead + self.sizes[self.started] <= self.budget
    ):
      hostvalue.start_copy(self.leaves[self.started])
      ahead += self.sizes[self.started]
      self.started += 1

  def take(self, i: int) -> np.ndarray | hostvalue.Shards:
    """The host value of leaf ``i``, once it fits the budget."""
    with self.cond:
      while (
        self.budget is not None
        and self.inflight
        and self.inflight + self.sizes[i] > self.budget
      ):
        self.cond.wait()
      self.inflight += self.sizes[i]
    self._start_ahead(i)
    x = self.leaves[i]
    if isinstance(x, np.ndarray):
      return x  # checked by save
    return host_array(self.api, self.paths[i], x)

  def done(self, i: int) -> None:
    with self.cond:
      self.inflight -= self.sizes[i]
      self.cond.notify_all()


def _write_compressed(name: str, f: Any, a: Any) -> list[int]:
  with codec.compressing(name, f) as out:
    return hostvalue.write_npy(out, a, codec.WRITE_STEP)


class Pieces:
  """One .npy file of C-order data (``parts``: flat uint8 arrays, one after
  another) written by several writer threads at once: ``write(k)`` writes
  piece ``k`` (the ``checksum.CHUNK`` bytes of data from ``k * CHUNK``, and
  the header with piece 0) at its offset and sums it; the thread that
  writes the last piece fsyncs the file; ``release()`` once per piece,
  written or not, and the last closes the file and calls ``done()``.

  A file system whose every call is a round trip (9p on a TPU VM, a network
  file system) writes a file several times faster from several threads at
  once than from one; one piece per checksum keeps the checksums those of
  a file written in order.
  """

  def __init__(
    self,
    api: str,
    path: str,
    file: str,
    value: Any,
    parts: list[np.ndarray],
    done: Any,
  ) -> None:
    self.api, self.path, self.file, self.done = api, path, file, done
    self.parts = parts  # hostvalue.c_views(value)
    header = io.BytesIO()
    hostvalue.write_header(header, value.shape, value.dtype)
    self.header = header.getvalue()
    self.nbytes = sum(p.size for p in parts)
    self.count = -(-self.nbytes // checksum.CHUNK)
    self.sums = [0] * self.count
    self._unwritten = self._unreleased = self.count
    self._lock = threading.Lock()
    try:
      self._fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    except OSError as err:
      raise write_error(api, path, file, err) from err

  def _data(self, lo: int, hi: int) -> Iterator[np.ndarray]:
    """The data's bytes ``lo:hi``, as views of at most WRITE_STEP bytes."""
    at = 0
    for part in self.parts:
      a, b = max(lo, at), min(hi, at + part.size)
      for x in range(a, b, hostvalue.WRITE_STEP):
        yield part[x - at : min(b, x + hostvalue.WRITE_STEP) - at]
      at += part.size

  def write(self, k: int) -> None:
    lo = k * checksum.CHUNK
    hi = min(lo + checksum.CHUNK, self.nbytes)
    start = len(self.header) + lo
    try:
      if k == 0:
        _pwrite(self._fd, self.header, 0)
      value = 0
      for view in self._data(lo, hi):
        _pwrite(self._fd, view, start)
        value = checksum.crc(view, value)
        start += view.size
      self.sums[k] = value
      with self._lock:
        self._unwritten -= 1
        last = not self._unwritten
      if last:
        os.fsync(self._fd)
    except OSError as err:
      if err.errno is None:  # not a failed system call: as it is
        raise
      raise write_error(self.api, self.path, self.file, err) from err

  def release(self) -> None:
    with self._lock:
      self._unreleased -= 1
      last = not self._unreleased
    if last:
      os.close(self._fd)
      self.done()


def pack(
  keys: list[str], take: Any, done: Any
) -> tuple[bytes, dict[str, list[int]]]:
  """The uncompressed archive (``format.PACKED``) of the leaves
  ``take(i)``, each the member ``<keys[i]>.npy`` (``done(i)`` once in it),
  and the checksums of each member's data, by key. ``numpy.load`` reads
  the archive; restore reads each member in place."""
  buf = io.BytesIO()
  sums: dict[str, list[int]] = {}
  with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
    for i, key in enumerate(keys):
      a = take(i)
      try:
        with zf.open(key + ".npy", "w") as member:
          sums[key] = hostvalue.write_npy(member, a)
      finally:
        del a
        done(i)
  return buf.getvalue(), sums


def _pwrite(fd: int, data: Any, at: int) -> None:
  view = memoryview(data).cast("B")
  while len(view):
    n = os.pwrite(fd, view, at)
    view, at = view[n:], at + n


def write_directory(
  api: str,
  path: str,
  tmp: str,
  keys: list[str],
  take: Any,
  done: Any,
  threads: int,
  codecs: dict[str, str] | None = None,
) -> tuple[dict[str, np.dtype], dict[str, list[int]]]:
  """Writes every leaf as ``tmp/<key>.npy`` (``.npy.zst`` for a key in
  ``codecs``, see codec) on ``threads`` threads; the dtypes and the
  checksums of the files' (uncompressed) data, by key (the threads:
  ``storage.in_threads``). An uncompressed file of more than one
  checksum's chunk of C-order data is written in ``Pieces`` by several
  threads at once; any other file by one thread.
  """
  dtypes: dict[str, np.dtype] = {}
  sums: dict[str, list[int]] = {}
  for key in keys:
    sub = os.path.dirname(os.path.join(tmp, *key.split("/")))
    os.makedirs(sub, exist_ok=True)

  def whole(i: int, a: Any, file: str, use: str | None) -> None:
    sums[keys[i]] = write_file(
      api, path, file,
      (lambda f: hostvalue.write_npy(f, a)) if use is None
      else (lambda f: _write_compressed(use, f, a)),
    )  # fmt: skip

  def items() -> Iterator[tuple[Any, Any]]:
    for i, key in enumerate(keys):
      a = take(i)
      dtypes[key] = a.dtype
      use = (codecs or {}).get(key)
      name = codec.file_name(key, use)
      file = os.path.join(tmp, *name.split("/"))
      LOG.debug("writing %s", file)
      big = use is None and a.nbytes > checksum.CHUNK
      parts = hostvalue.c_views(a) if big else None
      if parts is None:
        item = (
          functools.partial(whole, i, a, file, use),
          functools.partial(done, i),
        )
        del a
        yield item
        del item
        continue
      try:
        p = Pieces(api, path, file, a, parts, functools.partial(done, i))
      except BaseException:
        done(i)
        raise
      del a, parts
      sums[key] = p.sums
      handed = 0
      try:
        for k in range(p.count):
          handed += 1
          yield functools.partial(p.write, k), p.release
      finally:
        for _ in range(p.count - handed):  # never handed over: released here
          p.release()
      del p

  in_threads(items(), threads, WRITE_THREAD_PREFIX, what=f"{api}: {path!r}")
  return dtypes, sums
