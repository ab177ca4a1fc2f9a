"""Checkpoints: ``save``, ``restore`` and ``metadata``, the entry points.

``save`` sorts the tree (writer) and writes it alone (writer, commit,
pending) or with the other processes (multiprocess); ``restore`` opens the
checkpoint once, sorts the target against it (target) and streams the data
(restore_files, or restore_shards for a checkpoint several processes wrote).

>>> import os, shutil, tempfile, jax, numpy as np
>>> from jaxworks.batched_transfer import save
>>> tree = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.int32)}
>>> path = os.path.join(tempfile.mkdtemp(), "ckpt.npz")
>>> save(path, tree)
>>> like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
>>> out = restore(path, like, placement=jax.devices()[1])
>>> out["w"].devices(), np.asarray(out["w"])[1].tolist()
({CpuDevice(id=1)}, [3.0, 4.0, 5.0])
>>> shutil.rmtree(os.path.dirname(path))
"""

from __future__ import annotations

from collections.abc import Callable
import contextlib
import functools
import os
import threading
import time
from typing import Any

import numpy as np

from .. import jax_internals
from .. import targets
from . import commit
from . import format
from . import job as job_lib
from . import multiprocess
from . import pending
from . import reader
from . import remote
from . import restore_files
from . import restore_objects
from . import restore_shards
from . import target as target_lib
from . import writer
from .pending import SaveHandle as SaveHandle
from .storage import LOG
from .storage import SCHEMES

_API = "jaxworks.batched_transfer"
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


@jax_internals.api_boundary
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
  storage_options: dict[str, Any] | None = None,
  compression: str | None = None,
  progress: bool | None = False,
) -> pending.SaveHandle | None:
  """Writes ``tree`` to an .npz file (path ends in .npz) or a directory of .npy files.

  One ``.npy`` file (or member) per array leaf, keyed by its tree path
  (``params/w``), and the record ``jaxworks_dtypes.json``: every array's
  exact dtype (ml_dtypes types, which ``.npy`` headers cannot name, are
  stored as raw bytes and come back as their type), the leaves that are not
  arrays, the tree's nesting and, for a directory, the CRC-32C of each
  8 MiB of every file's data (computed by the writer threads).

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
      per leaf. Missing parent directories are created. An ``s3://``,
      ``gs://`` or ``az://`` URL saves the same files to that prefix of a
      bucket, committed by creating the record last with a conditional put
      (in a collective save, by process 0 once every process uploaded its
      shards; see the README, "Object stores"); other URLs are refused.
    tree: a pytree whose leaves are arrays (numpy or jax.Array of the
      bool, integer, floating, complex and ml_dtypes types JAX holds),
      numpy scalars, Python scalars (stored as the 0-d array
      jax.device_put makes of them, float32 for a float with x64 off, and
      their type), ``str`` or None (stored by value); any other leaf
      (bytes, strings in numpy arrays, objects, datetimes, ...) raises
      TypeError naming its tree path before anything is written, so save
      never writes what restore refuses.
    overwrite: replace an existing file or directory written by save.
      Without it the commit never replaces anything: a path that exists,
      or that a pending ``blocking=False`` save of this process will
      write, raises FileExistsError in the call, and the commit is a
      no-replace rename (``renameat2(RENAME_NOREPLACE)``, ``link`` for an
      .npz), so a checkpoint another process committed at the path
      meanwhile makes this one fail and stays whole.
    blocking: True: return when the checkpoint is durable. False: return
      once every leaf is in host memory (the caller may then donate, delete
      or change the arrays; CPU device buffers are held, not copied: see
      hostvalue), with a ``SaveHandle`` whose
      ``wait()`` returns when the checkpoint is durable; a background thread
      writes. An error in the background is raised by ``wait()`` and by the
      next ``save``; pending saves finish before the process exits. Saves
      of this process to one path commit in call order (each writes once
      the one called before it finished), so the last call's tree stays.
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
    storage_options: for a URL, settings over the cloud's standard
      environment (``endpoint``, ``region``, ``profile``, ``project``,
      ``credentials``, ``max_retries``, ``retry_timeout_s``, the store's
      own keys such as ``access_key_id``; see the README).
    progress: draw a progress bar of the bytes written on stderr (one
      per process; in a bucket, a file counts once its object is written):
      True, False (the
      default: a training loop's saves stay quiet), or None (only when
      stderr is a terminal).
    compression: None (the default) writes raw ``.npy`` files; ``"zstd"``
      writes each array as ``<key>.npy.zst``, a Zstandard frame of the
      same ``.npy`` bytes (needs ``pip install
      'jaxworks-batched-transfer[zstd]'``). It pays on compressible trees
      (an optimizer state at initialisation, masks); on random values it
      costs CPU time. Restore reads either. For a directory checkpoint one
      process saves (not an ``.npz``, not a collective save).

  A collective save raises an error of any process on every process at
  once, the others' ``RuntimeError`` naming it (see the README,
  "Checkpoints written by several processes"); before any shard is
  written, process 0 checks that every process saves the same path and
  tree (``ValueError`` otherwise, nothing written).

  Returns:
    None when ``blocking``, else a ``SaveHandle``.

  Raises:
    FileExistsError: ``path`` exists and overwrite is False, or it is not a
      checkpoint save wrote.
    ValueError: a key that cannot name a file, two leaves that would share
      a file (or a file another leaf needs as a directory), or a URL.
    TypeError: a leaf save cannot store, or a big-endian array (as
      jax.device_put).
    OverflowError: a Python int that does not fit its dtype (as
      jax.device_put).
    OSError: a failed write (``ENOSPC``, ``EFBIG``, ...: the system's errno,
      naming the checkpoint, the file and the fix); nothing is committed,
      the checkpoint at ``path`` stays, the temporary files are removed.
  """
  api = f"{_API}.save"
  # A collective save's number first: any error below is every process's.
  with multiprocess.ticket(api, path, collective) as ticket:
    path = os.fspath(path)
    if is_remote(path):
      return save_url(
        api, path, tree, overwrite=overwrite, blocking=blocking,
        write_threads=write_threads, max_inflight_bytes=max_inflight_bytes,
        storage_options=storage_options, ticket=ticket,
        compression=compression, barrier_timeout_s=barrier_timeout_s,
        progress=progress,
      )  # fmt: skip
    no_options(api, path, storage_options)
    commit.check_local(api, path)
    path = path.rstrip(os.sep) or path
    return run_save(
      api, path, tree, overwrite=overwrite, blocking=blocking,
      write_threads=write_threads, max_inflight_bytes=max_inflight_bytes,
      barrier_timeout_s=barrier_timeout_s, collective=collective,
      prelude=lambda: pending.raise_background_error(api), ticket=ticket,
      compression=compression, progress=progress,
    )  # fmt: skip


def is_remote(path: Any) -> bool:
  """True for an ``s3://``, ``gs://`` or ``az://`` URL."""
  return isinstance(path, str) and path.partition("://")[0].lower() in SCHEMES


def no_options(api: str, path: str, storage_options: Any) -> None:
  if storage_options:
    raise ValueError(
      f"{api}: storage_options are for s3://, gs:// and az:// URLs; "
      f"{path!r} is a local path"
    )


def save_url(
  api: str,
  url: str,
  tree: Any,
  *,
  overwrite: bool,
  blocking: bool,
  write_threads: int | None,
  max_inflight_bytes: int | None,
  storage_options: dict[str, Any] | None,
  ticket: multiprocess.Ticket | None,
  prelude: Callable[[], None] | None = None,
  after: Callable[[], None] | None = None,
  primary_keys: tuple[str, ...] = (),
  compression: str | None = None,
  barrier_timeout_s: float = 300.0,
  progress: bool | None = False,
  lease: bool = True,
) -> pending.SaveHandle | None:
  """A save to an object store, committed by its record created last;
  ``prelude``, ``after`` and ``primary_keys`` as ``run_save``'s; ``lease``:
  a directory save holds the URL's writer lease while it writes (False:
  the caller holds one above it, a CheckpointManager's). A
  directory's files are written straight into their objects (remote.Bucket);
  an ``.npz`` is written locally, then uploaded. With a ``ticket`` (every
  process of the job saves): each process writes its own shards, process 0
  commits once all did (multiprocess)."""
  prelude = prelude or (lambda: pending.raise_background_error(api))
  if ticket is not None:
    dest = remote.Bucket(api, url, storage_options, overwrite, lease=lease)
    try:
      return run_save(
        api, url, tree, overwrite=overwrite, blocking=blocking,
        write_threads=write_threads, max_inflight_bytes=max_inflight_bytes,
        barrier_timeout_s=barrier_timeout_s, collective=True,
        prelude=prelude, after=after, primary_keys=primary_keys,
        ticket=ticket, dest=dest, compression=compression, progress=progress,
      )  # fmt: skip
    except BaseException:
      dest.close()
      raise
  if not url.endswith(".npz"):
    # Saves of this process to one URL commit in call order, as on disk
    # (the job reserves the URL).
    return run_save(
      api, url, tree, overwrite=overwrite, blocking=blocking,
      write_threads=write_threads, max_inflight_bytes=max_inflight_bytes,
      collective=False, primary_keys=primary_keys, compression=compression,
      progress=progress, prelude=prelude, after=after,
      bucket=remote.Bucket(api, url, storage_options, overwrite, lease=lease),
    )  # fmt: skip
  up = remote.NpzUpload(api, url, storage_options, overwrite)
  try:
    # Saves of this process to one URL commit in call order, as on disk.
    held = pending.reserve(api, url, overwrite)
  except BaseException:
    up.abort()
    raise
  try:
    handle = run_save(
      api, up.local, tree, overwrite=False, blocking=blocking,
      write_threads=write_threads, max_inflight_bytes=max_inflight_bytes,
      collective=False, primary_keys=primary_keys, compression=compression,
      progress=progress, prelude=prelude,
      after=functools.partial(_finish_upload, up, held, after),
    )  # fmt: skip
  except BaseException:
    held.release()
    up.abort()
    raise
  if handle is not None:  # a local write that fails never calls after
    threading.Thread(
      target=_release_when_done, args=(handle, held, up),
      name=f"{pending.THREAD_PREFIX}-release", daemon=True,
    ).start()  # fmt: skip
  return handle


def _finish_upload(
  up: Any, held: pending.Reservation, after: Callable[[], None] | None
) -> None:
  """Uploads an ``.npz`` saved to a URL once the saves to its URL called
  before it are done, then runs ``after``."""
  try:
    held.wait_turn()
    up.finish()
  finally:
    held.release()
  if after is not None:
    after()


def _release_when_done(
  handle: pending.SaveHandle, held: pending.Reservation, up: Any
) -> None:
  handle._event.wait()
  held.release()
  up.abort()


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
  ticket: multiprocess.Ticket | None = None,
  compression: str | None = None,
  dest: remote.Bucket | None = None,
  progress: bool | None = False,
  bucket: remote.Bucket | None = None,
) -> pending.SaveHandle | None:
  """save's work: its ``job.SaveJob``, run by this process alone
  (``run_alone``) or by every process (``multiprocess``). ``prelude`` runs
  first (it raises errors of earlier saves); ``after`` once the checkpoint
  is published (on the writing thread, under no lock). Across processes
  both run inside the collective save, whose every error reaches every
  process; the leaves of ``primary_keys`` are process 0's and need not
  agree. ``ticket``: the collective save's, taken by the caller first
  thing (``multiprocess.ticket``). ``dest``: the bucket of a collective
  save to the URL ``path``. ``bucket``: the bucket of a directory save
  this process makes alone to the URL ``path``. ``progress``: save's."""
  positive(api, "write_threads", write_threads, True)
  positive(api, "max_inflight_bytes", max_inflight_bytes, True)
  options = job_lib.Options(
    overwrite=overwrite, blocking=blocking,
    threads=write_threads or writer.DEFAULT_WRITE_THREADS,
    max_inflight_bytes=max_inflight_bytes, barrier_timeout_s=barrier_timeout_s,
    progress=progress, primary_keys=primary_keys, prelude=prelude,
    after=after, local_target=dest is None and bucket is None, bucket=bucket,
  )  # fmt: skip
  job = job_lib.SaveJob(api, path, tree, options, compression)
  if collective is None:
    collective = multiprocess.multi_process()
  spans = multiprocess.spans_processes(job.leaves)
  if spans and not collective:
    raise ValueError(
      f"{api}: {path!r}: with collective=False this process saves alone, "
      "but the tree has arrays spanning devices of several processes; let "
      "every process call save (collective=None)"
    )
  if collective and (spans or multiprocess.multi_process()):
    if job.record.codecs:
      raise ValueError(
        f"{api}: {path!r}: compression={compression!r} is for checkpoints "
        "one process saves; a checkpoint several processes save together "
        "stores raw shards (restore reads the byte ranges it needs): pass "
        "compression=None"
      )
    if path.endswith(".npz"):
      raise ValueError(
        f"{api}: {path!r}: a checkpoint several processes save together is "
        "a directory (one file per shard); drop the .npz suffix"
      )
    return multiprocess.save_across_processes(job, ticket, dest)
  return job.run_alone()


@jax_internals.api_boundary
def restore(
  path: str | os.PathLike[str],
  target: Any = None,
  *,
  placement: Any = None,
  partial_restore: bool = False,
  verify: bool = True,
  max_inflight_bytes: int = 256 * 2**20,
  read_threads: int | None = None,
  progress: bool | None = None,
  storage_options: dict[str, Any] | None = None,
) -> Any:
  """Loads a checkpoint written by ``save`` onto devices, validated and streamed.

  The checkpoint is opened once and only its headers and record are read
  first: every key, shape and data extent is checked against ``target``
  before anything is placed. The data is then read through the same
  descriptors, in batches, a background thread reading ahead while a batch
  is placed with one batched device_put (a failure deletes what was placed
  and stops the thread). Devices never share a buffer, also where a
  replicated mesh axis gives several devices the same slice. Compressed
  members (``np.savez_compressed``) are inflated by the reader.

  Args:
    path: an .npz file or a directory of .npy files, or a directory that
      several processes wrote (a manifest and shard files), read onto the
      same kinds of targets, each process reading only what its devices
      hold.
    target: a pytree whose leaves say what to expect: jax.ShapeDtypeStruct,
      jax.Array or numpy array leaves (their .shape, .dtype and weak_type), or
      Python scalars (a 0-d array of the dtype and weak type jax.device_put
      gives them), as ``jax.eval_shape(init_fn)`` returns; ``str`` leaves
      where str leaves were saved. A dtype other than the stored one is a
      cast, as in orbax (numpy's ``astype``, through float64 between two
      ml_dtypes types numpy cannot cast directly); the stored dtype as JAX
      canonicalizes it (float32 for float64 data with x64 off) is none.
      Unless ``placement`` is given, each leaf's .format / .sharding says
      where it goes (none: the default device). None: the tree as saved
      (nested dicts, lists for sequences, so tuples come back as lists),
      every array on the default device (or ``placement``), str and None
      leaves as saved, Python scalars as their Python type.
    placement: a device_put target (Device, Sharding, Format or a pytree
      prefix of them) overriding the target leaves' placement.
    partial_restore: let ``target`` name a subset of the stored leaves (a
      subtree, say ``{"params": ...}`` of a checkpoint that also holds
      ``opt_state``): only those are read. False: a stored leaf the target
      lacks raises ValueError.
    verify: check every array's data against the checksums save recorded
      (CRC-32C of each 8 MiB of a directory checkpoint's files, the CRC-32
      of each .npz member), in the threads that read it; a mismatch raises
      ValueError naming the file and nothing stays placed.
    max_inflight_bytes: the most bytes read and not yet placed at once. The
      data is read in batches of at most half of it (and at most 16 MiB),
      the next batches while one is placed; a single larger leaf is read
      alone.
    read_threads: threads reading one array's file at once (default: the
      CPU count, at most 8); 1 reads each file on one thread.
    progress: draw a progress bar on stderr: True, False, or None (only when
      stderr is a terminal).
    storage_options: for an ``s3://``, ``gs://`` or ``az://`` URL, settings
      over the cloud's standard environment (as ``save``). A URL's objects
      are read in parallel ranged requests straight into the buffers that
      are placed, no local copy: every check above holds (headers before
      anything is placed, each CRC-32C as the bytes arrive; an object
      truncated, altered or deleted after the commit raises naming its
      URL), onto a sharding only the byte ranges this process's devices
      need are requested, and each array takes one request: its header
      and data together, the header checked against the shape the record
      says when it arrives (a checkpoint of an earlier version: arrays of
      up to 4 MiB read whole while opening, within ``max_inflight_bytes``,
      the others' headers first). A prefix without its record is absent; while
      an overwrite runs, the new checkpoint committed beside the path is
      read.

  Returns:
    A pytree like ``target`` of placed jax.Arrays (weakly typed where the target
    leaf is), with the stored values at its str leaves.

  Raises:
    ValueError: a key missing from or extra in the file, a shape that
      differs from the target's, data shorter or longer than its header
      says, or data failing its checksum (the message names the tree path,
      the checkpoint and the file); raised before any array is placed
      (checksums: while reading, and nothing stays placed). Also a file that
      is not a regular file, or one replaced or modified after it was
      validated (the data is read through the descriptors validated: a
      checkpoint replaced at ``path`` meanwhile is read whole as validated,
      never a mix of the two). What is not a regular file (a FIFO, a device)
      is refused without blocking.
    FileNotFoundError: nothing at ``path``.
    TypeError: a target leaf with no shape and dtype.
  """
  api = f"{_API}.restore"
  path = os.fspath(path)
  if not is_remote(path):
    no_options(api, path, storage_options)
  if not isinstance(max_inflight_bytes, int) or max_inflight_bytes <= 0:
    raise ValueError(
      f"{api}: max_inflight_bytes must be a positive int, got "
      f"{max_inflight_bytes!r}"
    )
  positive(api, "read_threads", read_threads, True)
  read_threads = read_threads or reader.default_read_threads()
  # Small objects in a bucket read whole when opened (not for a partial
  # restore, which reads only its leaves' data).
  budget = 0 if partial_restore else max_inflight_bytes
  start = time.perf_counter()
  with (
    restore_objects.noting(path),
    contextlib.closing(_open(api, path, storage_options, budget)) as opened,
  ):
    arrays, record = opened.contents()
    t = target_lib.Target(api, path, target, arrays, record, partial_restore)
    keys, paths = t.pick(t.keys), t.pick(t.paths)
    specs = [
      target_lib.target_spec(api, where, x)
      for where, x in zip(paths, t.pick(t.leaves))
    ]
    places = t.pick(
      targets.resolve_placement(
        api, placement, t.target, t.treedef, t.leaves, target_lib.placement_of
      )
    )
    args = (keys, paths, specs, places, max_inflight_bytes, read_threads)
    by_several = isinstance(opened, restore_shards.Manifest)
    module = restore_shards if by_several else restore_files
    placed = module.restore_arrays(api, opened, *args, progress, verify)
  placed = [target_lib.weak(y) if s[2] else y for y, s in zip(placed, specs)]
  LOG.info(
    "restored %s (%d arrays) in %.2f s",
    path, len(keys), time.perf_counter() - start,
  )  # fmt: skip
  return t.finish(placed)


def _open(
  api: str,
  path: str,
  storage_options: dict[str, Any] | None = None,
  budget: int = 0,
) -> restore_shards.Manifest | restore_files.Opened:
  """The checkpoint at ``path``, opened once: its data is read through the
  descriptors validated here (a checkpoint several processes wrote: its
  manifest and shard files; else .npy files or an .npz); at a URL, through
  ranged reads of its objects (restore_objects; ``budget``: bytes of small
  objects read whole now)."""
  if is_remote(path):
    return restore_objects.open_checkpoint(api, path, storage_options, budget)
  if not os.path.lexists(path):
    commit.recover(path)  # the old copy of a save killed between two renames
  opened = restore_shards.open_manifest(api, path)
  return restore_files.open_checkpoint(api, path) if opened is None else opened


@jax_internals.api_boundary
def metadata(
  path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> Any:
  """The tree a checkpoint holds, read from its headers, manifest and record
  only (no array data): a ``jax.ShapeDtypeStruct`` (shape, exact dtype, and
  the ``NamedSharding`` or ``SingleDeviceSharding`` a saved jax.Array had,
  where every device it names is one of this job's; else, and for numpy
  leaves, None) per array, the stored value per ``str`` or None
  leaf, nested as ``restore`` without a target nests it. A Python scalar
  leaf is the ShapeDtypeStruct of its 0-d array. ``restore(path,
  metadata(path))`` restores onto the saved shardings.

  >>> import os, tempfile, numpy as np
  >>> from jaxworks.batched_transfer import save
  >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
  >>> save(path, {"w": np.zeros((2, 3), np.float32), "run": "exp-42"})
  >>> metadata(path)
  {'run': 'exp-42', 'w': ShapeDtypeStruct(shape=(2, 3), dtype=float32)}
  """
  api = f"{_API}.metadata"
  if not is_remote(os.fspath(path)):
    no_options(api, os.fspath(path), storage_options)
  return target_lib.as_saved(
    *read_record(api, os.fspath(path), storage_options), with_shardings=True
  )


def read_record(
  api: str, path: str, storage_options: dict[str, Any] | None = None
) -> tuple[dict[str, tuple[tuple[int, ...], np.dtype]], format.Record]:
  """(key -> (shape, exact dtype) of every array, the record) of the
  checkpoint at ``path``, from its headers, manifest and record only."""
  with (
    restore_objects.noting(path),
    contextlib.closing(_open(api, path, storage_options)) as opened,
  ):
    return opened.contents()


def read_values(
  api: str, path: str, storage_options: dict[str, Any] | None = None
) -> dict[str, str | None]:
  """The ``str`` and None leaves of the directory checkpoint at ``path``,
  from its record alone (no header is read)."""
  if is_remote(path):
    st = remote.source(
      api, remote.stores.open_storage(api, path, storage_options)
    )
    data: bytes | None = bytes(st.read(format.RECORD))
  else:
    fd = os.open(path, reader.DIR_FLAGS)
    try:
      data = reader.read_small(api, path, fd, format.RECORD, "the record")
    finally:
      os.close(fd)
  if data is None:
    return {}
  where = f"the record {format.RECORD!r} of {path!r}"
  return format.decode_record(api, where, data).values
