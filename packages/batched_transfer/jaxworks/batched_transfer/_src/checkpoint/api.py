"""Checkpoints: ``save``, ``restore`` and ``metadata``, the entry points.

Each opens its path's ``destination.Destination`` first (the one place a
path or URL is read). ``save`` takes the collective call's ticket, opens
the destination, builds the ``job.SaveJob`` (the tree sorted by writer)
and runs it alone or with the other processes (``multiprocess.run``);
``restore`` opens the checkpoint once through the destination, sorts the
target against it (target) and asks the opened checkpoint to stream the
data (``restore_arrays``: restore_files, or restore_shards for a
checkpoint several processes wrote, each reading a file or a bucket).

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
import dataclasses
import os
import time
from typing import Any

import jax
import numpy as np

from .. import jax_internals
from .. import targets
from . import destination
from . import format
from . import job as job_lib
from . import multiprocess
from . import pending
from . import reader
from . import target as target_lib
from . import writer
from .job import positive
from .pending import SaveHandle as SaveHandle
from .storage import LOG

_API = "jaxworks.batched_transfer"


@jax_internals.api_boundary
def save(
  path: str | os.PathLike[str],
  tree: Any,
  *,
  overwrite: bool = False,
  blocking: bool = True,
  write_threads: int | None = None,
  max_inflight_bytes: int | None = job_lib.DEFAULT_INFLIGHT,
  barrier_timeout_s: float = 300.0,
  collective: bool | None = None,
  storage_options: dict[str, Any] | None = None,
  compression: str | None = None,
  progress: bool | None = False,
  custom_metadata: dict[str, Any] | None = None,
  pack_below: int | None = None,
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
      ``gs://`` or ``az://`` URL saves the same files under a version
      prefix of their own in that prefix of a bucket, committed by one
      conditional write of its head naming the version (in a collective
      save, by process 0 once every process uploaded its shards; see the
      README, "Object stores"); other URLs are refused.
    tree: a pytree whose leaves are arrays (numpy or jax.Array of the
      bool, integer, floating, complex and ml_dtypes types JAX holds),
      numpy scalars, Python scalars (their exact value and type in the
      record, and the 0-d array jax.device_put makes of them, float32 for
      a float with x64 off, where one holds it: an int of any size is
      stored), ``str`` or None (stored by value); its nodes (dicts, lists,
      tuples, named tuples such as optax's states, empty ones such as
      ``EmptyState()``, custom nodes) are recorded for a restore without a
      target; any other leaf
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
      once every leaf is copied (the caller may then donate, delete or
      change the arrays): in host memory, or, for a leaf of 1 MiB or more
      on an accelerator with the memory free, on its devices, the
      device-to-host copy then taken in the background (see hostvalue),
      with a ``SaveHandle`` whose
      ``wait()`` returns when the checkpoint is durable; a background thread
      writes. An error in the background is raised by ``wait()`` and by the
      next ``save``; pending saves finish before the process exits. Saves
      of this process to one path commit in call order (each writes once
      the one called before it finished), so the last call's tree stays.
    write_threads: threads writing files of a directory checkpoint at once
      (default: 4; writing waits on the disk, not on CPUs, but every thread
      takes the GIL between writes); a file of more than 8 MiB is written
      in 8 MiB pieces by several of them.
    max_inflight_bytes: with ``blocking=True``, the most bytes copied to the
      host and not yet written at once (None: no limit); device-to-host
      copies are started this far ahead of the writers. A non-blocking save
      holds its copy of the whole tree until it is written.
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
    custom_metadata: a dict of JSON values (str keys) kept in the
      checkpoint's record, read back by ``custom_metadata(path)`` without
      the arrays (as orbax's ``custom_metadata``).
    pack_below: None (the default): one file per array. A number of bytes:
      the arrays of fewer bytes (biases, norms, scalars, step counters,
      optimizer counts) are stored together, as the members ``<key>.npy``
      of one uncompressed archive ``jaxworks_packed.npz`` beside the other
      files (``numpy.load`` reads it; restore reads each member in place,
      checked against its CRC-32C): one file, and in a bucket one request,
      instead of one each. Where one process saves a directory checkpoint
      (an ``.npz`` is one file already; a collective save writes each
      file on its own). Versions up to 0.6.0 refuse such a checkpoint.

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
    destination.check_name(api, path)
    dest = destination.open(api, path, storage_options, overwrite)
    options = job_lib.Options(
      overwrite=overwrite, blocking=blocking,
      threads=positive(api, "write_threads", write_threads, True)
      or writer.DEFAULT_WRITE_THREADS,
      max_inflight_bytes=positive(
        api, "max_inflight_bytes", max_inflight_bytes, True
      ),
      barrier_timeout_s=barrier_timeout_s, collective=collective,
      compression=compression, progress=progress,
      custom_metadata=format.custom_metadata(api, custom_metadata),
      pack_below=positive(api, "pack_below", pack_below, True),
    )  # fmt: skip
    job = job_lib.SaveJob(api, tree, dest, options)
    return multiprocess.run(job, ticket)


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
  collective: bool | None = None,
  barrier_timeout_s: float = 300.0,
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
      where it goes (none: the default device); a Python scalar target
      leaf where an int no JAX dtype holds was saved gets that int. None:
      the tree as saved (``metadata``'s nesting: dicts, lists, tuples and
      OrderedDicts as such, named tuples as their class where this program
      has loaded it, else as a named tuple of the same name and fields,
      other nodes as dicts of their entries), every array on the default
      device (or ``placement``), str and None leaves as saved, Python
      scalars exactly as saved (a float as float64, an int of any size).
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
      the others' headers first). A prefix without a head (or a record of
      an earlier version) is absent; the head is read once and only the
      version it names is read (one that an overwrite removed meanwhile:
      the new one, or ``OSError`` "replaced while reading").
    collective: whether every process of a jax.distributed job restores
      ``path`` together, in the same order of calls (None: where the target
      or placement has a sharding over several processes' devices). Then
      they read one save: a bucket's version is resolved once, by process
      0, for all of them; the processes check that they opened the same
      save (its record's ``save_id``) and read it whole, or all read the
      path again; an error on one process is raised by every process.
    barrier_timeout_s: in a collective restore, how long a process waits
      for the others at each agreement before it raises TimeoutError.

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
    FileNotFoundError: nothing at ``path``, or a directory or prefix
      without its record (a save that did not commit is no checkpoint).
    CheckpointReplacedError: (a FileNotFoundError) the checkpoint was
      replaced or deleted under each of ``READ_TRIES`` reads in a row (each
      read is of one committed save: one that loses a race with a save or
      a delete reads the path again; nothing of a lost read is returned).
    TypeError: a target leaf with no shape and dtype.
  """
  api = f"{_API}.restore"
  dest = destination.open(api, path, storage_options)
  options = ReadOptions(
    placement=placement, partial_restore=partial_restore, verify=verify,
    max_inflight_bytes=max_inflight_bytes, read_threads=read_threads,
    progress=progress, collective=collective,
    barrier_timeout_s=barrier_timeout_s,
  )  # fmt: skip
  return restore_at(api, dest, target, options)[0]


@dataclasses.dataclass(frozen=True)
class ReadOptions:
  """How ``restore`` reads (its keyword arguments, as documented there)."""

  placement: Any = None
  partial_restore: bool = False
  verify: bool = True
  max_inflight_bytes: int = 256 * 2**20
  read_threads: int | None = None
  progress: bool | None = None
  collective: bool | None = None
  barrier_timeout_s: float = 300.0


#: ``choose(arrays, record)``: the target and partial_restore of a read,
#: decided once the checkpoint it reads is open (a manager's metrics leaf).
Choose = Callable[
  [dict[str, tuple[tuple[int, ...], np.dtype]], format.Record],
  tuple[Any, bool],
]


def restore_at(
  api: str,
  dest: destination.Destination,
  target: Any,
  options: ReadOptions,
  choose: Choose | None = None,
) -> tuple[Any, format.Record]:
  """``restore`` of the checkpoint at ``dest`` (``options`` its keyword
  arguments), and the record of the save it read: one committed save,
  pinned once (``Destination.reading``). ``choose`` (default: ``target``
  and ``options.partial_restore``) decides the target from that save's
  arrays and record, on every read of it."""
  o = options
  path = dest.path
  if not isinstance(o.max_inflight_bytes, int) or o.max_inflight_bytes <= 0:
    raise ValueError(
      f"{api}: max_inflight_bytes must be a positive int, got "
      f"{o.max_inflight_bytes!r}"
    )
  positive(api, "read_threads", o.read_threads, True)
  read_threads = o.read_threads or reader.default_read_threads()
  # Small objects in a bucket read whole when opened (not for a partial
  # restore, which reads only its leaves' data).
  budget = 0 if o.partial_restore else o.max_inflight_bytes
  start = time.perf_counter()
  collective = o.collective
  if collective is None:
    collective = spans(target, o.placement)

  def read(opened: Any) -> tuple[Any, list[Any], list[Any], format.Record]:
    arrays, record = opened.contents()
    want, partial = (
      (target, o.partial_restore) if choose is None else choose(arrays, record)
    )
    t = target_lib.Target(api, path, want, arrays, record, partial)
    keys, paths = t.pick(t.keys), t.pick(t.paths)
    specs = [
      target_lib.target_spec(api, where, x)
      for where, x in zip(paths, t.pick(t.leaves))
    ]
    places = t.pick(
      targets.resolve_placement(
        api, o.placement, t.target, t.treedef, t.leaves,
        target_lib.placement_of,
      )
    )  # fmt: skip
    placed = opened.restore_arrays(
      target_lib.Request(
        api, keys, paths, specs, places, o.max_inflight_bytes, read_threads,
        o.progress, o.verify,
      )
    )  # fmt: skip
    return t, placed, specs, record

  # Onto arrays that span processes, every process restores, the same save.
  with multiprocess.restore_board(
    api, path, o.barrier_timeout_s, bool(collective)
  ) as board:
    t, placed, specs, record = dest.reading(budget, read, board)
  placed = [target_lib.weak(y) if s[2] else y for y, s in zip(placed, specs)]
  LOG.info(
    "restored %s (%d arrays) in %.2f s",
    path, len(placed), time.perf_counter() - start,
  )  # fmt: skip
  return t.finish(placed), record


@jax_internals.api_boundary
def metadata(
  path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> Any:
  """The tree a checkpoint holds, read from its headers, manifest and record
  only (no array data): a ``jax.ShapeDtypeStruct`` (shape, exact dtype, and
  the ``NamedSharding`` or ``SingleDeviceSharding`` a saved jax.Array had,
  where every device it names is one of this job's; else, and for numpy
  leaves, None) per array, the stored value per ``str``, None or Python
  scalar leaf (exactly as saved; a checkpoint of 0.6 and before: the
  ShapeDtypeStruct of a Python scalar's 0-d array), every node, empty ones
  included, as ``restore`` without a target builds it. ``restore(path,
  metadata(path))`` restores onto the saved shardings.

  >>> import os, tempfile, numpy as np
  >>> from jaxworks.batched_transfer import save
  >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
  >>> save(path, {"w": np.zeros((2, 3), np.float32), "run": "exp-42"})
  >>> metadata(path)
  {'run': 'exp-42', 'w': ShapeDtypeStruct(shape=(2, 3), dtype=float32)}
  """
  api = f"{_API}.metadata"
  dest = destination.open(api, path, storage_options)
  return saved_tree(api, dest.path, *read_record(dest))


def saved_tree(
  api: str,
  path: str,
  arrays: dict[str, tuple[tuple[int, ...], np.dtype]],
  record: format.Record,
) -> Any:
  """``metadata``'s tree of one save's arrays and record (read together)."""
  for key, (_, dtype) in arrays.items():
    if isinstance(dtype, np.dtypes.VoidDType) and dtype.fields is None:
      raise ValueError(
        f"{api}: the array {key!r} of {path!r} is stored as raw "
        f"{dtype.itemsize}-byte values with no dtype record, so its type is "
        f"unknown (several types are {dtype.itemsize} bytes wide); write the "
        "checkpoint with jaxworks.batched_transfer.save, which records "
        "exact dtype names"
      )
  return target_lib.as_saved(arrays, record, with_shardings=True)


@jax_internals.api_boundary
def custom_metadata(
  path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> dict[str, Any]:
  """The ``custom_metadata`` saved with the checkpoint at ``path`` (``{}``
  where none was, as orbax), read from its record alone.

  >>> import os, tempfile, numpy as np
  >>> from jaxworks.batched_transfer import save
  >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
  >>> save(path, {"w": np.zeros(2)}, custom_metadata={"lr": 1e-3})
  >>> custom_metadata(path)
  {'lr': 0.001}
  """
  api = f"{_API}.custom_metadata"
  dest = destination.open(api, path, storage_options)
  return dict(read_record(dest)[1].custom_metadata or {})


def read_record(
  dest: destination.Destination,
) -> tuple[dict[str, tuple[tuple[int, ...], np.dtype]], format.Record]:
  """(key -> (shape, exact dtype) of every array, the record) of the
  checkpoint at ``dest``, from its headers, manifest and record only."""
  return dest.reading(0, lambda opened: opened.contents())


def spans(target: Any, placement: Any) -> bool:
  """Whether a sharding in ``target`` or ``placement`` spans devices of
  several processes (then every process restores)."""
  for x in jax.tree.leaves((target, placement)):
    sharding = x if isinstance(x, jax.sharding.Sharding) else None
    sharding = getattr(x, "sharding", sharding)
    if isinstance(sharding, jax.sharding.Sharding) and not isinstance(
      getattr(sharding, "mesh", None), jax.sharding.AbstractMesh
    ):  # an abstract mesh names no devices (the target check refuses it)
      if not sharding.is_fully_addressable:
        return True
  return False


def read_values(dest: destination.Destination) -> dict[str, str | None]:
  """The ``str`` and None leaves of the directory checkpoint at ``dest``,
  from its record alone (no header is read)."""
  data = dest.read_record()
  if data is None:
    return {}
  where = f"the record {format.RECORD!r} of {dest.path!r}"
  return format.decode_record(dest.api, where, data).values
