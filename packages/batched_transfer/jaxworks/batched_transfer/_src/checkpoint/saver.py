"""save: a pytree to an .npz file or a directory of .npy files, durably.

Device-to-host copies of every device leaf start at once (within the byte
budget), several threads write and fsync the files, and the checkpoint
becomes visible in one atomic step (see commit). With ``blocking=False`` the
call returns once every leaf is on the host, and a background thread writes.
"""

from __future__ import annotations

from collections.abc import Callable
import errno
import os
import queue
import threading
from typing import Any
import zipfile

import jax
import numpy as np

from . import commit
from . import hostvalue
from . import pending
from . import record as record_lib
from . import sharded
from . import shardings
from .keys import check_files
from .keys import leaf_keys
from .keys import path_kinds
from .keys import python_scalar_dtype
from .keys import saved_leaf

_API = "jaxworks.batched_transfer"
DEFAULT_INFLIGHT = 1024 * 2**20
#: Name prefix of the threads that write files.
WRITE_THREAD_PREFIX = "jaxworks-save-write"


#: Threads writing one checkpoint by default. Writing and fsyncing wait on
#: the disk with the GIL released, so more threads than CPUs help: 1 GiB in
#: 16 files took 0.5-0.6 s on 2 threads and 0.41-0.45 s on 8 on a 2-core
#: machine here.
DEFAULT_WRITE_THREADS = 8


def default_write_threads() -> int:
  """Threads writing one checkpoint: 8, whatever the CPU count."""
  return DEFAULT_WRITE_THREADS


def _nbytes(x: Any) -> int:
  return int(getattr(x, "nbytes", 0) or 0)


def host_array(
  api: str, path: str, x: Any, private: bool = False
) -> np.ndarray | hostvalue.Shards:
  """The host value of one leaf; ``private``: a copy nothing else can change
  (for numpy leaves; a jax.Array's host value is its own immutable buffers,
  see hostvalue)."""
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
    return hostvalue.of(x)
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
  return np.array(a, copy=True, order="K") if private else a


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

  def __init__(self, api: str, tree: Any) -> None:
    keys, paths, leaves, _ = leaf_keys(api, tree, saved_leaf)
    kinds = path_kinds(tree)
    nesting: list[tuple[str, ...]] = []
    self.record = record_lib.Record(tree=nesting)
    self.keys: list[str] = []
    self.paths: list[str] = []
    self.leaves: list[Any] = []
    described: dict[int, dict | None] = {}
    for key, where, x, k in zip(keys, paths, leaves, kinds):
      empty = record_lib.EMPTY.get(type(x)) if x is not None else None
      nesting.append((key, k) if empty is None else (key, k, empty))
      if empty is not None:
        continue
      if x is None or isinstance(x, str):
        self.record.values[key] = x
        continue
      if python_scalar_dtype(x) is not None:
        self.record.python[key] = _base(x)
      if isinstance(x, jax.Array):
        s = x.sharding
        if id(s) not in described:
          described[id(s)] = shardings.describe(s)
        desc = described[id(s)]
        if desc is not None:
          self.record.shardings[key] = desc
      self.keys.append(key)
      self.paths.append(where)
      self.leaves.append(x)


def _base(x: Any) -> str:
  """The name of ``x``'s Python scalar type (for a subclass, such as an
  IntEnum, the type it comes from)."""
  for name in ("bool", "int", "float", "complex"):
    if isinstance(x, record_lib.PYTHON_TYPES[name]):
      return name
  raise TypeError(type(x).__name__)  # pragma: no cover - python_scalar_dtype


_FIXES = {
  errno.ENOSPC: "free space on that file system, or save elsewhere",
  errno.EDQUOT: "free space within your disk quota, or save elsewhere",
  errno.EFBIG: "raise the file-size limit (ulimit -f, RLIMIT_FSIZE) or save "
  "to a file system that holds larger files",
}


def write_error(api: str, path: str, file: str, err: OSError) -> OSError:
  """The OSError to raise for a failed write of ``file`` of the checkpoint
  at ``path``: the errno kept, the checkpoint, the file and the fix named."""
  code = err.errno
  fix = _FIXES.get(code or 0, "check the file system, then save again")
  text = err.strerror or (os.strerror(code) if code else str(err))
  out = OSError(
    code,
    f"{api}: writing the checkpoint {path!r} failed: {text} while writing "
    f"{file!r}; {fix}. Nothing was committed: the checkpoint that was at "
    "the path (if any) is still there",
    file,
  )
  return out


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


class _Leaves:
  """Host values of the leaves in order: device-to-host copies are started
  ahead of use while the bytes started and not yet written fit the budget."""

  def __init__(
    self, api: str, paths: list[str], leaves: list[Any], budget: int | None
  ) -> None:
    self.api, self.paths, self.leaves = api, paths, leaves
    self.sizes = [_nbytes(x) for x in leaves]
    self.budget = budget
    self.started = 0
    self.inflight = 0
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


def write_directory(
  api: str,
  path: str,
  tmp: str,
  keys: list[str],
  take: Any,
  done: Any,
  threads: int,
) -> tuple[dict[str, np.dtype], dict[str, list[int]]]:
  """Writes every leaf as ``tmp/<key>.npy`` on ``threads`` threads; the
  dtypes and the checksums of the files' data, by key.

  Plain threads, not concurrent.futures: a non-blocking save may still be
  writing while the interpreter exits, when executors refuse new work.
  """
  dtypes: dict[str, np.dtype] = {}
  sums: dict[str, list[int]] = {}
  for key in keys:
    sub = os.path.dirname(os.path.join(tmp, *key.split("/")))
    os.makedirs(sub, exist_ok=True)
  todo: queue.Queue = queue.Queue(maxsize=threads)
  errors: list[BaseException] = []

  def work() -> None:
    while True:
      item = todo.get()
      if item is None:
        return
      i, a = item
      try:
        if not errors:
          name = keys[i] + ".npy"
          file = os.path.join(tmp, *name.split("/"))
          sums[keys[i]] = write_file(
            api, path, file, lambda f: hostvalue.write_npy(f, a)
          )
      except BaseException as err:  # raised below, on the calling thread
        errors.append(err)
      finally:
        del a, item
        done(i)

  workers = [
    threading.Thread(target=work, name=f"{WRITE_THREAD_PREFIX}-{n}")
    for n in range(min(threads, max(1, len(keys))))
  ]
  for w in workers:
    w.start()
  try:
    for i in range(len(keys)):
      if errors:
        break
      a = take(i)
      dtypes[keys[i]] = a.dtype
      todo.put((i, a))
      del a
  finally:
    for _ in workers:
      todo.put(None)
    for w in workers:
      w.join()
  if errors:
    raise errors[0]
  return dtypes, sums


def _write_npz(
  api: str,
  path: str,
  tmp: str,
  keys: list[str],
  take: Any,
  done: Any,
  record: record_lib.Record,
) -> None:
  dtypes = record.dtypes

  def fill(f: Any) -> None:
    with zipfile.ZipFile(
      f, "w", compression=zipfile.ZIP_STORED, allowZip64=True
    ) as zf:
      for i, key in enumerate(keys):
        a = take(i)
        dtypes[key] = a.dtype.name
        with zf.open(key + ".npy", "w", force_zip64=True) as member:
          hostvalue.write_npy(member, a)  # the archive's CRC-32 guards it
        del a
        done(i)
      zf.writestr(record_lib.NAME, record_lib.encode(record))

  write_file(api, path, tmp, fill)


def write_checkpoint(
  api: str,
  path: str,
  keys: list[str],
  take: Any,
  done: Any,
  threads: int,
  record: record_lib.Record,
  overwrite: bool,
) -> None:
  """Writes, fsyncs and publishes a checkpoint at ``path`` under its lock
  (replacing one only with ``overwrite``); removes what earlier saves to
  ``path`` left behind."""
  with commit.locked(path):
    commit.clean(path)
    npz = path.endswith(".npz")
    tmp = commit.temp_name(path, commit.NEW, ".npz" if npz else "")
    try:
      if npz:
        _write_npz(api, path, tmp, keys, take, done, record)
      else:
        os.mkdir(tmp)
        dtypes, record.crc32c = write_directory(
          api, path, tmp, keys, take, done, threads
        )
        record.dtypes = {k: dtypes[k].name for k in keys}
        data = record_lib.encode(record)
        write_file(
          api, path, os.path.join(tmp, record_lib.NAME), lambda f: f.write(data)
        )
        for dirpath, _, _ in os.walk(tmp, topdown=False):
          commit.fsync_path(dirpath)
      commit.publish(api, tmp, path, overwrite)
    except BaseException:
      commit.remove(tmp)
      raise


def check_target(api: str, path: str, overwrite: bool) -> None:
  """Refuses URLs, an existing path without overwrite, and a directory save
  did not write; creates missing parent directories."""
  if os.path.lexists(path) and not overwrite:
    raise FileExistsError(
      f"{api}: {path!r} exists; pass overwrite=True to replace it"
    )
  if os.path.lexists(path) and not path.endswith(".npz"):
    _check_replaceable(api, path)
  parent = os.path.dirname(os.path.abspath(path))
  if os.path.lexists(parent) and not os.path.isdir(parent):
    raise FileExistsError(
      f"{api}: cannot save to {path!r}: {parent!r} is not a directory"
    )
  commit.make_parents(parent)


def _positive(api: str, name: str, value: Any, none_ok: bool) -> None:
  if value is None and none_ok:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
    raise ValueError(
      f"{api}: {name} must be a positive int{' or None' if none_ok else ''}, "
      f"got {value!r}"
    )


def save(
  path: str | os.PathLike[str],
  tree: Any,
  *,
  overwrite: bool = False,
  blocking: bool = True,
  write_threads: int | None = None,
  max_inflight_bytes: int | None = DEFAULT_INFLIGHT,
  barrier_timeout_s: float = 300.0,
  collective: bool | None = None,
) -> pending.SaveHandle | None:
  """Writes ``tree`` to an .npz file (path ends in .npz) or a directory of .npy files.

  The checkpoint becomes visible at ``path`` in one atomic step after its
  files and directories are fsynced; with ``overwrite=True`` a save killed
  at any point leaves the complete old or the complete new checkpoint at
  ``path`` (see the README, "Crash safety and durability"). When the save
  is finished (the call with ``blocking=True``, ``wait()`` of the handle
  otherwise) the data is durable: the files, their directories and the
  parent directory are fsynced.

  Args:
    path: "<name>.npz" for one uncompressed archive (restore reads its
      members in place), anything else for a directory with one "<key>.npy"
      per leaf. Missing parent directories are created. URLs (``gs://...``)
      are refused: save writes local or mounted file systems.
    tree: a pytree whose leaves are arrays (numpy or jax.Array of the
      numeric and ml_dtypes types JAX holds), Python scalars (stored as the
      0-d array jax.device_put makes of them, and their type), ``str`` or
      None (stored by value); any other leaf raises TypeError naming its
      tree path before anything is written.
    overwrite: replace an existing file or directory written by save.
      Without it the commit never replaces anything: a path that exists,
      or that a pending ``blocking=False`` save of this process will
      write, raises FileExistsError in the call, and a checkpoint another
      process committed at the path meanwhile makes this one fail.
    blocking: True: return when the checkpoint is durable. False: return
      once every leaf is in host memory (the caller may then donate, delete
      or change the arrays; CPU device buffers are held, not copied: see
      hostvalue), with a ``SaveHandle`` whose
      ``wait()`` returns when the checkpoint is durable; a background thread
      writes. An error in the background is raised by ``wait()`` and by the
      next ``save``; pending saves finish before the process exits.
    write_threads: threads writing files of a directory checkpoint at once
      (default: 8; writing waits on the disk, not on CPUs).
    max_inflight_bytes: with ``blocking=True``, the most bytes copied to the
      host and not yet written at once (None: no limit); device-to-host
      copies are started this far ahead of the writers. A non-blocking save
      holds the whole tree in host memory until it is written.
    barrier_timeout_s: with arrays spanning processes (jax.distributed),
      how long a process waits for the others to finish writing, and for
      process 0's commit, before it raises ``TimeoutError`` (a process
      that died; nothing is committed then).
    collective: whether every process of a jax.distributed job saves this
      one checkpoint together (None: when jax.distributed runs more than
      one process). A collective save of a tree whose arrays span no
      processes is written once, by process 0, after every process's
      leaves were checked to be equal to process 0's. False: this process
      writes the checkpoint alone (its own path; arrays spanning processes
      are refused).

  Arrays spanning several processes: every process calls save with the
  same path and tree; each writes the shards its devices hold, process 0
  the manifest, and commits once every process posted its status in
  jax.distributed's key-value store. An error on any process is raised by
  every process at once, the others' ``RuntimeError`` naming it (see the
  README, "Checkpoints written by several processes").

  Returns:
    None when ``blocking``, else a ``SaveHandle``.

  Raises:
    FileExistsError: ``path`` exists and overwrite is False, or it is not a
      checkpoint save wrote.
    ValueError: a key that cannot name a file, two paths with one key, or a
      URL.
  """
  api = f"{_API}.save"
  path = os.fspath(path)
  commit.check_local(api, path)
  path = path.rstrip(os.sep) or path
  return run_save(
    api,
    path,
    tree,
    overwrite=overwrite,
    blocking=blocking,
    write_threads=write_threads,
    max_inflight_bytes=max_inflight_bytes,
    barrier_timeout_s=barrier_timeout_s,
    collective=collective,
    prelude=lambda: pending.raise_background_error(api),
  )


def run_save(
  api: str,
  path: str,
  tree: Any,
  *,
  overwrite: bool,
  blocking: bool,
  write_threads: int | None,
  max_inflight_bytes: int | None,
  barrier_timeout_s: float = 300.0,
  collective: bool | None = None,
  prelude: Callable[[], None] | None = None,
  after: Callable[[], None] | None = None,
  primary_keys: tuple[str, ...] = (),
) -> pending.SaveHandle | None:
  """save's work. ``prelude`` runs first (it raises errors of earlier
  saves); ``after`` once the checkpoint is published (on the writing
  thread, under no lock). Across processes both run inside the collective
  save, whose every error reaches every process (see sharded); the leaves
  of ``primary_keys`` are process 0's and need not agree."""
  _positive(api, "write_threads", write_threads, True)
  _positive(api, "max_inflight_bytes", max_inflight_bytes, True)
  threads = write_threads or default_write_threads()
  sorted_leaves = Leaves(api, tree)
  keys, paths, record = (
    sorted_leaves.keys,
    sorted_leaves.paths,
    sorted_leaves.record,
  )
  leaves = sorted_leaves.leaves
  held: list[pending.Reservation] = []  # taken by prepare

  def release() -> None:
    for r in held:
      r.release()

  def prepare(leaves: list[Any]) -> list[Any]:
    if prelude is not None:
      prelude()
    # Host leaves are checked (and scalars converted) before anything is
    # written.
    for i, (where, x) in enumerate(zip(paths, leaves)):
      if not isinstance(x, jax.Array):
        leaves[i] = host_array(api, where, x, private=not blocking)
    check_target(api, path, overwrite)
    held.append(pending.reserve(api, path, overwrite))
    return leaves

  if collective is None:
    collective = sharded.multi_process()
  spans = sharded.spans_processes(leaves)
  if spans and not collective:
    raise ValueError(
      f"{api}: {path!r}: with collective=False this process saves alone, "
      "but the tree has arrays spanning devices of several processes; let "
      "every process call save (collective=None)"
    )
  if collective and (spans or sharded.multi_process()):
    if path.endswith(".npz"):
      raise ValueError(
        f"{api}: {path!r}: a checkpoint several processes save together is "
        "a directory (one file per shard); drop the .npz suffix"
      )
    return sharded.save_across_processes(
      api,
      path,
      keys,
      paths,
      leaves,
      record,
      prepare=prepare,
      blocking=blocking,
      threads=threads,
      barrier_timeout_s=barrier_timeout_s,
      overwrite=overwrite,
      release=release,
      after=after,
      primary_keys=primary_keys,
    )
  if not path.endswith(".npz"):
    check_files(api, [(k + ".npy", w) for k, w in zip(keys, paths)])
  leaves = prepare(leaves)
  if blocking:
    try:
      staged = _Leaves(api, paths, leaves, max_inflight_bytes)
      write_checkpoint(
        api, path, keys, staged.take, staged.done, threads, record, overwrite
      )
    finally:
      release()
    if after is not None:
      after()
    return None
  try:
    # Every device-to-host copy at once; then the host value of each (numpy
    # leaves were copied above; device buffers are held, see hostvalue).
    for x in leaves:
      hostvalue.start_copy(x)
    arrays = [
      x
      if isinstance(x, np.ndarray)
      else host_array(api, where, x, private=True)
      for where, x in zip(paths, leaves)
    ]
  except BaseException:
    release()
    raise
  del leaves

  def take(i: int) -> np.ndarray | hostvalue.Shards:
    return arrays[i]

  def done(i: int) -> None:
    arrays[i] = None  # type: ignore[call-overload]  # freed once written

  def work() -> None:
    try:
      write_checkpoint(api, path, keys, take, done, threads, record, overwrite)
    finally:
      release()
    if after is not None:
      after()

  return pending.start(path, work)


def _check_replaceable(api: str, path: str) -> None:
  if not os.path.isdir(path) or os.path.islink(path):
    raise FileExistsError(
      f"{api}: {path!r} exists and is not a directory; remove it first"
    )
  for root, _, files in os.walk(path):
    for name in files:
      if not name.endswith(".npy") and not (
        root == path and name in (record_lib.NAME, sharded.MANIFEST)
      ):
        raise FileExistsError(
          f"{api}: {path!r} holds {os.path.join(root, name)!r}, which is not "
          "an .npy file; overwrite only replaces directories written by save"
        )
