"""Side-by-side benchmark of jaxworks.batched_transfer (one process).

Rows (``jaxworks_bench``; medians of interleaved repeats; speedup =
reference / jaxworks, so above 1 jaxworks is faster):

* device_put of 10/100/1000 small leaves (numpy -> one device, device ->
  device, numpy -> NamedSharding): against ``jax.device_put`` of the same list
  (stock-jax; goal: at most 1.1x its time) and a per-leaf ``jax.device_put``
  loop (naive; goal at 1000 leaves for numpy -> one device and device ->
  device: at least 2x faster).
* grouping of 10k/100k leaves: the C++ pass against the same algorithm in
  Python (ablation; goal: at least 10x).
* restore of a directory of .npy files (page cache warm), files -> arrays on
  devices with the target shardings (one device; rows split over 8 devices):
  against the raw read of the same files (naive: each whole file read with
  ``os.preadv`` into a new 64-byte-aligned host buffer and nothing else: no
  parsing, no checks, no placing; an unaligned buffer reads up to 3x slower
  here. Timed on the calling thread and on a new thread, and the faster
  counts: glibc gives each thread its own heap, and a thread's heap can hand
  back freed memory without new page faults, which made a threaded read of
  4 MiB files 2x faster here; goal: restore at least 0.9x its bandwidth),
  against the same raw read by as many threads as restore reads with, in
  8 MiB chunks (naive, no goal: what restore's own threads could reach),
  against
  ``np.load`` + ``jax.device_put`` (stock-jax), and against orbax-checkpoint's
  ``StandardCheckpointer`` restoring the same tree onto the same shardings
  from its own files, saved first in the same temporary directory (peer).
  orbax runs in a process of its own (same devices, same medians): left in
  this process, its threads and allocations made the jaxworks restores timed
  after it 3-15x slower here (their page faults stalled; the raw reads were
  not slowed), which would have flattered orbax.
* restore of a checkpoint two processes wrote (jax.distributed, 4 CPU
  devices each, rows over the 8; random values): by this one process onto
  one device and rows over 8 devices, against orbax's restore of the same
  random tree (peer, own process; goal: at least 3x faster) and against
  restore of the same tree one process wrote (naive).
* restore with the CRC-32C checks against restore(verify=False) of the same
  checkpoint (ablation; goal: at least 0.95x: the checks should hide behind
  the read. Where the read is CPU-bound on every core, as a warm page cache
  on 2 cores is, the checks' own CPU time shows: the read of the bytes into
  new memory, zeroing and copying, goes at a few GB/s; the CRC-32C at about
  100 GB/s per core on data in L2 (AVX-512 VPCLMULQDQ) and 30 GB/s on data
  in L3. So restore reads and sums 256 KiB at a time in C++
  (cc/_checked_read_module.cc), one call per 8 MiB chunk without the GIL: each
  step is summed while in L2, and no step hands the GIL over between read
  threads, which 1 MiB steps in Python did twice). Timed as a pair of their
  own, each call right after the other's: among the seven calls of the
  other restore rows, verify=False always came right after a checked
  restore and the checked one mostly after a raw read, and that order alone
  moved the ratio (0.75x as listed, 0.88x with the two swapped, 0.89-0.93x
  as a pair; 5-9 repeats each). This VM (Firecracker) reports freed memory to its host,
  and a page the host took back is slow to touch again, so what ran
  before a call, and how long ago it freed its memory, shows in the call's
  time.

save: bt.save (durable) against numpy.save of the same bytes with each file
  fsynced (durable against durable; goal: 16 large leaves at least 1.2x its
  bandwidth, writing and fsyncing files on several threads; 1,000 small
  leaves at least 0.9x; the compressible tree 0.8x). Like bt.save with
  ``overwrite=True``, that reference writes new files (a new directory per
  save, fsynced, the previous one removed): rewriting the previous save's
  files in place, which the reference did before, allocates and frees no
  blocks and is no checkpoint (a crash midway leaves no whole save); here,
  on ext4 mounted with ``discard`` in a VM, it took 0.25-0.4 s for 1,000
  files of 128 KiB where writing them new took 0.5-1.1 s, slower as the
  run went on, in a plain Python script with no jaxworks (one more row
  keeps it, for scale). And
  without fsync (the page cache's bandwidth, for scale: no durable save can
  reach it where the disk is slower than memory), and against orbax's save
  (own process; it fsyncs too, through tensorstore). The trees hold random
  values: orbax compresses, and constant arrays flattered it 3x. One more
  row saves a compressible tree (zeros: an optimizer state at
  initialisation) to one device, against orbax, which compresses: raw
  bytes with no goal, the opt-in ``compression="zstd"`` with one. Every
  timed save starts with nothing dirty in the page cache (``os.sync``
  between calls, untimed: the non-durable numpy.save's writeback otherwise
  ran during the next save, 0.79x for 1,000 leaves over 8 devices where
  1.13x without it).
  save(blocking=False)'s blocked time against orbax's async save call.

On an accelerator (``--platform tpu``: the devices JAX picks, one chip;
``chip_rows``), in this one process, interleaved, medians, each row with the
fraction of its limit measured in the same run. Each limit is the fastest of
several plain ways of doing the same work, since on a TPU machine the
obvious one is not always the fastest (several transfers in flight beat one
large one; on its 9p file system one sequential read beats parallel ones):
the host-to-device link (``LINK_WAYS``), device-to-host (one 1 GiB
``jax.device_get``), the disk's read (the raw parallel reads above, of the
same files, or ``np.load`` of each) and write (the same bytes from host
memory by 8 threads or one, each file and the directory fsynced) bandwidth.
Where a goal is beyond a row's limit, BENCHMARKS.md says the most the limit
allows:

* device_put of 16 leaves of 64 MiB against ``jax.device_put`` of the list
  (goal 1.0x) and against one 1 GiB transfer (goal 0.95x);
* device_put of 1,000 leaves of 4 KiB against ``jax.device_put`` of the list
  (goal 1.5x) and a per-leaf loop;
* restore of 1 GiB in 16 .npy files (random values) onto the chip against
  ``np.load`` + ``jax.device_put`` (goal 1.05x) and orbax's
  ``StandardCheckpointer`` in this process (goal 2x; skipped, with the
  reason, where orbax is not importable); the limit: the read and the
  transfer overlapped (the slower of the two), the serial sum in a note;
* save of 1 GiB in 16 leaves from the chip against ``jax.device_get`` +
  ``numpy.save`` + fsync (goal 1.2x) and orbax (goal 3x); the limit: the
  device-to-host copy and the write overlapped. Every save gets a tree fresh
  on the chip (a copy made between calls, untimed): a jax.Array keeps its
  host copy once made, and a second ``device_get`` of it moves nothing.

Rows of the cpu profile that need more devices (device to device, rows over
8 devices), two processes (jax.distributed over TCP) or only the host (the
grouping ablations) are not run there; the output says so.

Usage: batched_transfer_bench.py [--quick] [--save-only] [--restore-only]
  [--json PATH] [--platform P] [--budget-s S]
"""

from __future__ import annotations

import os

import jaxworks_bench as jb

PROFILE = jb.configure_devices()  # before jax: 8 host CPU devices on cpu

import argparse  # noqa: E402
from collections.abc import Callable  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import operator  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402
import numpy as np  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402
from jaxworks.batched_transfer import _checked_read  # noqa: E402
from jaxworks.batched_transfer._src import grouping  # noqa: E402
from jaxworks.batched_transfer._src import jax_internals  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import checksum  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import commit  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import reader  # noqa: E402

sys.path.insert(  # the pure-Python grouping twin lives with the tests
  0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
)

import grouping_twin  # noqa: E402

PACKAGE = "batched_transfer"
LIST_GOAL = 1 / 1.1  # at most 1.1x jax.device_put of the list
LOOP_GOAL = 2.0  # at least 2x faster than a per-leaf loop (1000 leaves)
GROUPING_GOAL = 10.0  # C++ at least 10x the Python twin
RAW_READ_GOAL = 0.9  # restore at least 0.9x the raw read bandwidth
SAVE_RAW_GOAL = 0.8  # sync save at least 0.8x numpy.save's (both durable)
SAVE_LARGE_GOAL = 1.2  # 16 large leaves: 1.2x (several threads write, fsync)
SAVE_MANY_GOAL = 0.9  # 1,000 small leaves: 0.9x (a file and fsync per leaf)
VERIFY_GOAL = 0.95  # the CRC-32C checks hide behind the read
SMALL_READ = 256 << 10  # a limit's read calls (9p: small calls on threads win)
SMALL_WRITE = 1 << 20  # a limit's write calls


def transfer_rows(report: jb.Report, sizes, repeats, min_reps=5) -> None:
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("x",))
  named = NamedSharding(mesh, P("x"))
  rng = np.random.default_rng(0)
  for n in sizes:
    host = [rng.standard_normal((8, 32)).astype(np.float32) for _ in range(n)]
    on0 = jax.block_until_ready(jax.device_put(host, devices[0]))
    cases = [
      ("numpy -> one device", host, devices[1]),
      ("device -> device", on0, devices[2]),
      ("numpy -> NamedSharding over 8", host, named),
    ]
    for name, tree, target in cases:
      reps = max(min_reps, repeats * 100 // max(n, 100))
      m = jb.median_interleaved(
        {
          "ours": lambda: bt.device_put(tree, target),
          "list": lambda: jax.device_put(tree, target),
          "loop": lambda: [jax.device_put(x, target) for x in tree],
        },
        reps,
        warmup=True,
      )
      case = f"device_put {n} leaves {name}"
      report.add(
        case, m["ours"], m["list"], "stock-jax", "jax.device_put(list)",
        goal=LIST_GOAL,
      )  # fmt: skip
      loop_goal = (
        LOOP_GOAL if n == 1000 and not name.endswith("over 8") else None
      )
      report.add(
        f"{case} (vs a loop)", m["ours"], m["loop"], "naive",
        "per-leaf jax.device_put loop", goal=loop_goal,
      )  # fmt: skip


def grouping_rows(report: jb.Report, sizes, repeats) -> None:
  """C++ pass vs the straightforward Python loop (same keys, same byte counts).

  Inputs: numpy leaves of a checkpoint going to one device; jax.Arrays on 8
  devices drawn from a pool of 1000 (each single-device jax.Array has its own
  sharding object, so each such object recurs n / 1000 times, as in a tree
  whose leaves share shardings); a mix of both with per-leaf targets; and n
  distinct single-device jax.Arrays (no sharding object recurs: the worst case
  for the C++ pass's caches).
  """
  devices = jax.devices()
  rng = np.random.default_rng(1)
  host_pool = [
    np.zeros(int(k) + 1, np.float32) for k in rng.integers(0, 64, 1000)
  ]
  dev_pool = []
  for d in devices:
    dev_pool += jax.device_put([np.ones(4, np.float32)] * 125, d)
  jax.block_until_ready(dev_pool)
  shardings = [SingleDeviceSharding(d) for d in devices[:4]] + [None]
  default = SingleDeviceSharding(devices[0])
  for n in sizes:
    picks = rng.integers(0, 2, n)
    inputs = [
      ("numpy", [host_pool[i % 1000] for i in range(n)], [shardings[1]] * n),
      ("jax.Array", [dev_pool[i % 1000] for i in range(n)], [shardings[1]] * n),
      (
        "mixed, per-leaf targets",
        [
          host_pool[i % 1000] if p else dev_pool[i % 1000]
          for i, p in enumerate(picks)
        ],
        [shardings[k] for k in rng.integers(0, len(shardings), n)],
      ),
      (
        "jax.Array, all distinct",
        jax.block_until_ready(
          jax.device_put([np.ones(4, np.float32)] * n, devices[2])
        ),
        [shardings[1]] * n,
      ),
    ]
    for name, leaves, dsts in inputs:
      timed = {
        "cpp": lambda: grouping.group_leaves(leaves, dsts, default),
        "py": lambda: grouping_twin.group_leaves_python(leaves, dsts, default),
      }
      distinct = name == "jax.Array, all distinct"
      if distinct:
        timed["getters"] = lambda: _sharding_getters(leaves)
      m = jb.median_interleaved(timed, repeats, warmup=True)
      groups = len(grouping.group_leaves(leaves, dsts, default))
      case = f"grouping {n} leaves, {name} ({groups} groups)"
      report.add(
        case, m["cpp"], m["py"], "ablation",
        "the same grouping in pure Python", goal=GROUPING_GOAL,
      )  # fmt: skip
      if name != "numpy":
        hot = {k: hot_seconds(timed[k], repeats) for k in ("cpp", "py")}
        per = {k: v / n * 1e9 for k, v in {**m, **_hot(hot)}.items()}
        report.note(
          f"{case}: timed cold, as every row (after a gc.collect(), which "
          f"evicts the leaves from the CPU's caches): {per['cpp']:.0f} ns a "
          f"leaf, the twin {per['py']:.0f}; hot (the same call again at "
          f"once): {per['hot_cpp']:.0f} ns, the twin {per['hot_py']:.0f}, "
          f"{hot['py'] / hot['cpp']:.1f}x. The difference is the first "
          "touch of each leaf's objects."
        )
      if distinct:
        report.note(
          f"{case}: jaxlib's getters the Python twin calls for each leaf "
          "here (._sharding, and ._internal_device_list and .memory_kind of "
          "its sharding, a new object per leaf), called alone from C (map, "
          f"attrgetter): {m['getters'] * 1e3:.2f} ms, "
          f"{m['py'] / m['getters']:.1f}x under the twin's "
          f"{m['py'] * 1e3:.2f} ms; the C++ pass ({m['cpp'] * 1e3:.2f} ms) "
          "loads those fields from jaxlib's objects instead (FieldReader, "
          "tools/cc/attr_reader.h) and compares device lists by device."
        )


def hot_seconds(fn, repeats: int) -> float:
  """Median seconds of a call of ``fn`` right after another (what it reads
  still in the CPU's caches), the GC off."""
  times = []
  was = gc.isenabled()
  gc.disable()
  try:
    for _ in range(repeats):
      fn()
      start = time.perf_counter()
      fn()
      times.append(time.perf_counter() - start)
  finally:
    if was:
      gc.enable()
  return statistics.median(times)


def _hot(seconds: dict[str, float]) -> dict[str, float]:
  return {f"hot_{k}": v for k, v in seconds.items()}


def _sharding_getters(leaves: list[jax.Array]) -> None:
  shardings = list(map(operator.attrgetter("_sharding"), leaves))
  list(map(operator.attrgetter("_internal_device_list"), shardings))
  list(map(operator.attrgetter("memory_kind"), shardings))


def placements() -> list[tuple[str, jax.sharding.Sharding]]:
  """(name, sharding) of the two placements every checkpoint row times: one
  device, and rows over every device."""
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), ("x",))
  return [
    ("one device", SingleDeviceSharding(devices[0])),
    (f"rows over {len(devices)} devices", NamedSharding(mesh, P("x"))),
  ]


def _like(keys, shape, sharding) -> dict:
  return {
    k: jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding) for k in keys
  }


def aligned_bytes(size: int) -> np.ndarray:
  """A new uint8 buffer of ``size`` bytes starting on a 64-byte boundary."""
  raw = np.empty(size + 64, np.uint8)
  start = -raw.ctypes.data % 64
  return raw[start : start + size]


def crc_seconds(nbytes: int, repeats: int = 5) -> float:
  """Seconds one core takes for the CRC-32C checks of ``nbytes``, a step in
  cache at a time as restore's checked reads sum them (just read)."""
  step, crc = _sum_step()
  data = np.random.default_rng(0).integers(0, 255, step, np.uint8).data
  crc(data)
  best = min(jb.per_call(lambda: crc(data), 64) for _ in range(repeats))
  return best * nbytes / step


def _sum_step() -> tuple[int, Any]:
  """(bytes, function) of each sum of restore's checked reads on this CPU."""
  if _checked_read.FAST:
    return reader.FAST_SUM_STEP, _checked_read.crc32c
  return reader.SUM_STEP, checksum.crc


def checks_pair(path: str, like: Any, repeats: int) -> dict[str, float]:
  """Medians of restore of ``path`` onto ``like`` with and without the
  checks, timed as a pair of their own (see the docstring), 3x ``repeats``
  each: a difference of a few percent between two calls that both move by
  +-20% on this VM needs more samples than the other rows."""
  return jb.median_interleaved(
    {
      "restore": lambda: bt.restore(path, like, progress=False),
      "unverified": lambda: bt.restore(
        path, like, progress=False, verify=False
      ),
    },
    3 * repeats,
    warmup=True,
  )


def verify_note(
  report: jb.Report, case: str, checked: float, unverified: float,
  crc_s: float, threads: int, raw: dict[str, float] | None = None,
) -> None:  # fmt: skip
  """The checks' ceiling, modelled and measured: where the read already
  keeps every core busy (unverified restore), their CPU time adds to the
  wall time, shared by the read threads; ``raw``, if given, times the same
  reads outside restore (``checked_read_parallel``), with and without the
  checks, which is the measured ceiling."""
  ceiling = unverified / (
    unverified + crc_s / min(threads, os.cpu_count() or 1)
  )
  measured = ""
  if raw is not None:
    measured = (
      f" The same reads outside restore, into the same huge-page buffers on "
      f"{threads} threads: whole {checksum.CHUNK >> 20} MiB chunks "
      f"{raw['whole'] * 1e3:.0f} ms, checked (in {_step_text()}, each summed "
      f"while in cache) "
      f"{raw['checked'] * 1e3:.0f} ms: measured ceiling "
      f"{raw['whole'] / raw['checked']:.2f}x."
    )
  report.note(
    f"{case}: the CRC-32C checks cost {crc_s * 1e3:.0f} ms of one core "
    f"({_sum_step()[0] >> 10} KiB steps in cache); with {threads} read "
    f"threads on {os.cpu_count()} cores busy reading (verify=False "
    f"{unverified * 1e3:.0f} ms) they cannot hide: modelled ceiling "
    f"{ceiling:.2f}x, measured {unverified / checked:.2f}x.{measured}"
  )


def verify_limit(
  unverified: float, crc_s: float, threads: int,
  raw: dict[str, float] | None = None,
) -> tuple[str, float]:  # fmt: skip
  """The limit of a checked restore (``verify_note``): the unchecked
  restore slowed as the same reads outside restore are by their checks
  (``raw``), else by the checks' CPU time shared by the read threads."""
  if raw is not None:
    return (
      f"checked reads outside restore, {_step_text()}",
      unverified * raw["checked"] / raw["whole"],
    )
  cores = min(threads, os.cpu_count() or 1)
  return (
    f"the checks' CPU time on {cores} cores, {_step_text()}",
    unverified + crc_s / cores,
  )


def _step_text() -> str:
  """How restore's checked reads go on this CPU."""
  if _checked_read.FAST:
    return f"{reader.FAST_SUM_STEP >> 10} KiB steps in C++, without the GIL"
  return (
    f"{reader.SUM_STEP >> 10} KiB steps read in C++, summed in Python (no "
    "vector CRC-32C on this CPU)"
  )


def checked_read_parallel(
  files: list[str], threads: int, check: bool
) -> list[np.ndarray]:
  """Each file into a buffer restore would allocate (``reader.HostMemory``:
  an anonymous map with transparent huge pages) by ``threads`` threads, in
  ``checksum.CHUNK`` chunks: read whole, or with ``check`` as restore's
  checked reads go (a step at a time, each followed by its CRC-32C while the
  CPU's cache holds it: ``reader.FAST_SUM_STEP`` bytes in C++ where the CPU
  has the vector CRC-32C, else ``reader.SUM_STEP`` read in C++ and summed in
  Python). The two bound
  what checking costs the read itself, outside restore."""
  memory = reader.HostMemory()
  out = []
  with ThreadPoolExecutor(threads) as pool:
    for name in files:
      fd = os.open(name, os.O_RDONLY)
      try:
        size = os.fstat(fd).st_size
        buf, flat = memory.empty((size,), np.dtype(np.uint8))
        view = flat.data
        step = reader.SUM_STEP if check else checksum.CHUNK

        def read(lo: int, fd=fd, view=view, step=step) -> int:
          value, end = 0, min(lo + checksum.CHUNK, len(view))
          if check and _checked_read.FAST:
            done, value = _checked_read.read_crc32c(
              fd, [view[lo:end]], lo, reader.FAST_SUM_STEP
            )
            if done < end - lo:
              raise EOFError(name)
            return value
          for a in range(lo, end, step):  # as reader.read_range reads
            b = min(a + step, end)
            if (
              _checked_read.read_into(fd, [view[a:b]], a, reader.READ_STEP)
              < b - a
            ):
              raise EOFError(name)
            if check:
              value = checksum.crc(view[a:b], value)
          return value

        list(pool.map(read, range(0, size, checksum.CHUNK)))
      finally:
        os.close(fd)
      out.append(buf)
  return out


def raw_read(files: list[str]) -> list[np.ndarray]:
  """Each file's bytes in a new aligned host buffer: os.preadv, nothing else."""
  out = []
  for name in files:
    fd = os.open(name, os.O_RDONLY)
    try:
      buf = aligned_bytes(os.fstat(fd).st_size)
      view, done = memoryview(buf), 0
      while done < buf.size:
        n = os.preadv(fd, [view[done:]], done)
        if n == 0:
          raise EOFError(name)
        done += n
    finally:
      os.close(fd)
    out.append(buf)
  return out


def raw_read_parallel(
  files: list[str], threads: int, step: int | None = None
) -> list[np.ndarray]:
  """raw_read with ``threads`` threads reading 8 MiB chunks of each file
  (the split restore uses; the reference for restore's own threads), each
  chunk in one call or, with ``step``, ``step`` bytes a call."""
  chunk = 8 * 2**20
  out = []
  with ThreadPoolExecutor(threads) as pool:
    for name in files:
      fd = os.open(name, os.O_RDONLY)
      try:
        buf = aligned_bytes(os.fstat(fd).st_size)
        view = memoryview(buf)

        def read(lo: int, fd=fd, view=view) -> None:
          hi, done = min(lo + chunk, len(view)), lo
          while done < hi:
            end = hi if step is None else min(done + step, hi)
            n = os.preadv(fd, [view[done:end]], done)
            if n == 0:
              raise EOFError(name)
            done += n

        list(pool.map(read, range(0, buf.size, chunk)))
      finally:
        os.close(fd)
      out.append(buf)
  return out


def raw_read_on_a_thread(files: list[str]) -> list[np.ndarray]:
  """raw_read on a new thread (as restore reads on its reader thread)."""
  out: list = []
  thread = threading.Thread(target=lambda: out.extend(raw_read(files)))
  thread.start()
  thread.join()
  if len(out) != len(files):
    raise RuntimeError("raw_read_on_a_thread: the read failed")
  return out


def reused_read(files: list[str], bufs: list[np.ndarray]) -> None:
  """The same reads into buffers allocated (and touched) once, for the note."""
  for name, buf in zip(files, bufs):
    with open(name, "rb", buffering=0) as f:
      f.readinto(buf)


# Saves the tree with orbax, then times StandardCheckpointer.restore onto each
# sharding (as restore_rows builds them); prints {where: median seconds}.
_ORBAX = """
import gc, json, os, statistics, sys, time
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax, numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.sharding import SingleDeviceSharding
tmp, n_files, rows, cols, repeats, kind = sys.argv[1:]
n_files, rows, cols, repeats = int(n_files), int(rows), int(cols), int(repeats)
devices = jax.devices()
mesh = jax.make_mesh((len(devices),), ("x",))
keys = [f"t{k:03d}" for k in range(n_files)]
path = os.path.join(tmp, "orbax")
ckpt = ocp.StandardCheckpointer()
def value(i):  # random values: orbax compresses, constant arrays flatter it
  if kind == "random":
    return np.random.default_rng(i).random((rows, cols), np.float32)
  return np.full((rows, cols), i, np.float32)
ckpt.save(path, {k: value(i) for i, k in enumerate(keys)})
ckpt.wait_until_finished()
out = {}
for where, sharding in [("one device", SingleDeviceSharding(devices[0])),
                        ("rows", NamedSharding(mesh, P("x")))]:
  like = {k: jax.ShapeDtypeStruct((rows, cols), np.float32, sharding=sharding)
          for k in keys}
  jax.block_until_ready(ckpt.restore(path, like))
  times = []
  for _ in range(repeats):
    gc.collect()
    t0 = time.perf_counter()
    jax.block_until_ready(ckpt.restore(path, like))
    times.append(time.perf_counter() - t0)
  out[where] = statistics.median(times)
print(json.dumps(out))
"""


def restore_rows(report: jb.Report, total_bytes, n_files, repeats) -> None:
  devices = jax.devices()
  tmp = tempfile.mkdtemp(prefix="bt-bench-")
  try:
    cols = 1024
    rows = total_bytes // n_files // 4 // cols // len(devices) * len(devices)
    tree = {
      f"t{k:03d}": np.full((rows, cols), k, np.float32) for k in range(n_files)
    }
    path = os.path.join(tmp, "ckpt")
    bt.save(path, tree)
    files = sorted(
      os.path.join(path, n) for n in os.listdir(path) if n.endswith(".npy")
    )
    keys = [os.path.basename(f)[:-4] for f in files]
    nbytes = rows * cols * 4 * n_files
    size = f"{n_files} .npy files, {nbytes / 2**20:.0f} MiB"
    del tree
    _, orbax_s = jb.run_fresh(
      _ORBAX,
      args=[tmp, str(n_files), str(rows), str(cols), str(repeats), "full"],
    )
    reused = [aligned_bytes(os.path.getsize(f)) for f in files]
    threads = reader.default_read_threads()
    for where, sharding in placements():
      like = _like(keys, (rows, cols), sharding)
      m = jb.median_interleaved(
        {
          "restore": lambda: bt.restore(path, like, progress=False),
          "unverified": lambda: bt.restore(
            path, like, progress=False, verify=False
          ),
          "raw_main": lambda: raw_read(files),
          "raw_thread": lambda: raw_read_on_a_thread(files),
          "raw_par": lambda: raw_read_parallel(files, threads),
          "stock": lambda: jax.device_put(
            {k: np.load(f) for k, f in zip(keys, files)},
            {k: sharding for k in keys},
          ),
          "reused": lambda: reused_read(files, reused),
        },
        repeats,
        warmup=True,
        rotate=3,
      )
      m["orbax"] = orbax_s["one device" if where == "one device" else "rows"]
      m["raw"] = min(m["raw_main"], m["raw_thread"])
      case = f"restore {size} -> {where}"
      report.add(
        f"{case} (vs raw read)", m["restore"], m["raw"], "naive",
        "raw read of the files into new host buffers (faster thread)",
        goal=RAW_READ_GOAL,
      )  # fmt: skip
      report.add(
        f"{case} (vs raw read, {threads} threads)", m["restore"],
        m["raw_par"], "naive",
        f"raw read of the files by {threads} threads in 8 MiB chunks (as "
        "restore reads them)",
      )  # fmt: skip
      report.add(
        f"{case} (vs stock)", m["restore"], m["stock"], "stock-jax",
        "np.load + jax.device_put",
      )  # fmt: skip
      report.add(
        f"{case} (vs orbax)", m["restore"], m["orbax"], "peer",
        "orbax StandardCheckpointer (own process)",
      )  # fmt: skip
      pair = checks_pair(path, like, repeats)
      raw = jb.median_interleaved(
        {
          "whole": lambda: checked_read_parallel(files, threads, False),
          "checked": lambda: checked_read_parallel(files, threads, True),
        },
        repeats,
        warmup=True,
      )
      report.add(
        f"{case} (checksums checked vs not)", pair["restore"],
        pair["unverified"], "ablation",
        "restore(verify=False): the CRC-32C checks' cost (a pair of its own)",
        goal=VERIFY_GOAL,
        limit=verify_limit(pair["unverified"], crc_seconds(nbytes), threads, raw),
      )  # fmt: skip
      verify_note(
        report, f"restore {where}", pair["restore"], pair["unverified"],
        crc_seconds(nbytes), threads, raw,
      )  # fmt: skip
      gbs = {k: nbytes / v / 1e9 for k, v in m.items()}
      report.note(
        f"restore {where}: {gbs['restore']:.2f} GB/s; raw read into new "
        f"buffers {gbs['raw']:.2f} GB/s (calling thread "
        f"{gbs['raw_main']:.2f}, new thread {gbs['raw_thread']:.2f}, "
        f"{threads} threads in chunks {gbs['raw_par']:.2f}; restore reads "
        f"with {threads} threads; "
        f"restore {m['raw'] / m['restore']:.2f}x"
        f" of it, goal >= {RAW_READ_GOAL}x: "
        f"{'yes' if m['raw'] / m['restore'] >= RAW_READ_GOAL else 'no'}); "
        f"np.load + jax.device_put {gbs['stock']:.2f} GB/s; orbax "
        f"{gbs['orbax']:.2f} GB/s. For scale, the same reads into buffers "
        f"allocated and touched once: {gbs['reused']:.2f} GB/s (restore "
        f"{m['reused'] / m['restore']:.2f}x of it; a restore's arrays are new "
        "memory, which the kernel must zero and map first)."
      )
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


# One of two jax.distributed processes (4 CPU devices each) saving the
# benchmark's random tree, rows over the 8 devices: a manifest checkpoint.
_TWO_PROCESS_SAVE = """
import os, sys
pid, port, path, n_files, rows, cols = sys.argv[1:]
n_files, rows, cols = int(n_files), int(rows), int(cols)
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                           num_processes=2, process_id=int(pid),
                           initialization_timeout=120)
from jaxworks import batched_transfer as bt
sharding = NamedSharding(jax.make_mesh((8,), ("x",)), P("x"))
tree = {}
for i in range(n_files):
  v = np.random.default_rng(i).random((rows, cols), np.float32)
  tree[f"t{i:03d}"] = jax.make_array_from_callback(
      v.shape, sharding, lambda idx, v=v: v[idx])
bt.save(path, tree)
print("saved", flush=True)
"""


def _save_two_processes(path, n_files, rows, cols) -> None:
  """The random tree saved by two jax.distributed processes at ``path``."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  env["JAX_PLATFORMS"] = "cpu"
  args = [path, str(n_files), str(rows), str(cols)]
  procs = [
    subprocess.Popen(
      [sys.executable, "-c", _TWO_PROCESS_SAVE, str(pid), str(port), *args],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for pid in (0, 1)
  ]
  for proc in procs:
    out, _ = proc.communicate(timeout=600)
    if proc.returncode != 0:
      raise RuntimeError(f"the two-process save failed:\n{out[-3000:]}")


def manifest_restore_rows(report: jb.Report, total_bytes, n_files, repeats):
  """restore of a tree (random values) two processes wrote (a manifest
  checkpoint) by this one process, against orbax's restore of the same tree
  and against restore of the same tree one process wrote."""
  tmp = tempfile.mkdtemp(prefix="bt-bench-")
  try:
    cols = 1024
    rows = total_bytes // n_files // 4 // cols // 8 * 8
    nbytes = rows * cols * 4 * n_files
    keys = [f"t{i:03d}" for i in range(n_files)]
    two = os.path.join(tmp, "two")
    _save_two_processes(two, n_files, rows, cols)
    one = os.path.join(tmp, "one")
    bt.save(
      one,
      {
        k: np.random.default_rng(i).random((rows, cols), np.float32)
        for i, k in enumerate(keys)
      },
    )
    _, orbax_s = jb.run_fresh(
      _ORBAX,
      args=[tmp, str(n_files), str(rows), str(cols), str(repeats), "random"],
    )
    size = f"{n_files} leaves, {nbytes / 2**20:.0f} MiB, random"
    for where, sharding in placements():
      like = _like(keys, (rows, cols), sharding)
      m = jb.median_interleaved(
        {
          "two": lambda: bt.restore(two, like, progress=False),
          "one": lambda: bt.restore(one, like, progress=False),
        },
        repeats,
        warmup=True,
      )
      pair = checks_pair(two, like, repeats)
      m["orbax"] = orbax_s["one device" if where == "one device" else "rows"]
      case = f"restore, written by 2 processes, {size} -> {where}"
      report.add(
        f"{case} (vs orbax)", m["two"], m["orbax"], "peer",
        "orbax StandardCheckpointer restore of the same tree (own process)",
        goal=3.0,
      )  # fmt: skip
      report.add(
        f"{case} (vs written by 1 process)", m["two"], m["one"], "naive",
        "restore of the same tree written by one process",
      )  # fmt: skip
      report.add(
        f"{case} (checksums checked vs not)", pair["restore"],
        pair["unverified"], "ablation",
        "restore(verify=False): the CRC-32C checks' cost (a pair of its own)",
        goal=VERIFY_GOAL,
        limit=verify_limit(
          pair["unverified"], crc_seconds(nbytes),
          reader.default_read_threads(),
        ),
      )  # fmt: skip
      verify_note(
        report, f"restore {where}, written by two processes",
        pair["restore"], pair["unverified"], crc_seconds(nbytes),
        reader.default_read_threads(),
      )  # fmt: skip
      gbs = {k: nbytes / v / 1e9 for k, v in m.items()}
      report.note(
        f"restore {where}, written by two processes: {gbs['two']:.2f} GB/s; "
        f"written by one {gbs['one']:.2f} GB/s; orbax {gbs['orbax']:.2f} GB/s "
        f"({m['orbax'] / m['two']:.2f}x, goal >= 3x)."
      )
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


# Times orbax's StandardCheckpointer save of the same tree: the call (what an
# async save blocks the caller) and save + wait_until_finished (the whole
# write); prints {where: {"blocked": s, "total": s}}.
_ORBAX_SAVE = """
import gc, json, os, shutil, statistics, sys, time
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import jax, numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.sharding import SingleDeviceSharding
tmp, n_leaves, rows, cols, repeats, values, wheres = sys.argv[1:]
n_leaves, rows, cols, repeats = int(n_leaves), int(rows), int(cols), int(repeats)
devices = jax.devices()
mesh = jax.make_mesh((len(devices),), ("x",))
ckpt = ocp.StandardCheckpointer()
out = {}
for where, sharding in [("one device", SingleDeviceSharding(devices[0])),
                        ("rows", NamedSharding(mesh, P("x")))]:
  if where not in wheres.split(","):
    continue
  rng = np.random.default_rng(0)  # incompressible, as trained weights are
  if values == "zeros":  # an optimizer state at initialisation: compressible
    tree = {f"t{k:04d}": jax.device_put(np.zeros((rows, cols), np.float32), sharding)
            for k in range(n_leaves)}
  else:
    tree = {f"t{k:04d}": jax.device_put(rng.random((rows, cols), np.float32), sharding)
            for k in range(n_leaves)}
  blocked, total = [], []
  for r in range(repeats + 1):
    path = os.path.join(tmp, f"orbax-{r}")
    gc.collect()
    t0 = time.perf_counter()
    ckpt.save(path, tree)
    t1 = time.perf_counter()
    ckpt.wait_until_finished()
    t2 = time.perf_counter()
    shutil.rmtree(path)
    if r:  # the first is a warm-up
      blocked.append(t1 - t0)
      total.append(t2 - t0)
  out[where] = {"blocked": statistics.median(blocked),
                "total": statistics.median(total)}
print(json.dumps(out))
"""


def settle_disk() -> None:
  """Untimed, between timed saves: the copies bt.save replaced, which its
  reaper thread removes after the call returns, gone; nothing left dirty
  in the page cache."""
  commit.REAPER.wait()
  os.sync()


def _numpy_save(path: str, arrays: dict, fsync: bool) -> None:
  os.makedirs(path, exist_ok=True)
  for k, a in arrays.items():
    with open(os.path.join(path, k + ".npy"), "wb") as f:
      np.save(f, a)
      if fsync:
        f.flush()
        os.fsync(f.fileno())


def _numpy_save_step(base: str, arrays: dict) -> None:
  """numpy.save of every array into a new directory, each file and the
  directory fsynced, then the previous save's directory removed: the file
  system work of a durable per-step save with retention, which bt.save
  (overwrite=True: new files, the old checkpoint removed once committed)
  also does. Rewriting the same files in place is cheaper on a file system
  (no new inodes or blocks allocated, none freed) but is no checkpoint: a
  crash midway leaves neither the old nor the new one."""
  _in_new_step(base, lambda path: _numpy_save(path, arrays, True))


def _in_new_step(base: str, fill: Callable[[str], None]) -> None:
  """``fill(path)`` writes files into ``path``, a new directory under
  ``base``; then ``path`` is fsynced and the previous steps under ``base``
  removed (the file system work of a durable save with retention)."""
  os.makedirs(base, exist_ok=True)
  old = os.listdir(base)
  path = os.path.join(base, f"step-{time.monotonic_ns()}")
  os.makedirs(path)
  fill(path)
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
  for name in old:
    shutil.rmtree(os.path.join(base, name))


def save_rows(
  report: jb.Report, total_bytes, n_leaves, repeats, values="random"
) -> None:
  """bt.save (sync and blocking=False) against numpy.save of the same bytes
  and against orbax's save, one device and rows over every device.
  ``values="zeros"``: a compressible tree (an optimizer state at
  initialisation), one device only; orbax compresses it: raw bytes have
  no goal against it there, ``compression="zstd"`` has."""
  devices = jax.devices()
  zeros = values == "zeros"
  wheres = ["one device"] if zeros else ["one device", "rows"]
  tmp = tempfile.mkdtemp(prefix="bt-bench-save-")
  try:
    cols = 256 if n_leaves > 100 else 1024
    rows = total_bytes // n_leaves // 4 // cols // len(devices) * len(devices)
    rows = max(rows, len(devices))
    nbytes = rows * cols * 4 * n_leaves
    size = f"{n_leaves} leaves, {nbytes / 2**20:.0f} MiB"
    if zeros:
      size += ", zeros (an optimizer state at init)"
    save_goal = (
      SAVE_RAW_GOAL
      if zeros
      else SAVE_MANY_GOAL
      if n_leaves >= 100
      else SAVE_LARGE_GOAL
    )
    _, orbax_s = jb.run_fresh(
      _ORBAX_SAVE,
      args=[
        tmp, str(n_leaves), str(rows), str(cols), str(repeats), values,
        ",".join(wheres),
      ],
    )  # fmt: skip
    for where, sharding in placements():
      key = "one device" if where == "one device" else "rows"
      if key not in wheres:
        continue
      rng = np.random.default_rng(0)  # the bytes orbax writes (not zeros:
      # orbax compresses; trained weights do not compress)
      tree = {
        f"t{k:04d}": jax.device_put(
          np.zeros((rows, cols), np.float32)
          if zeros
          else rng.random((rows, cols), np.float32),
          sharding,
        )
        for k in range(n_leaves)
      }
      path = os.path.join(tmp, "bt")
      handles = []

      def async_save() -> None:
        handles.append(bt.save(path, tree, overwrite=True, blocking=False))

      def finish() -> None:
        while handles:
          handles.pop().wait()

      timed = {
        "sync": lambda: bt.save(path, tree, overwrite=True),
        "numpy_fsync": lambda: _numpy_save_step(
          os.path.join(tmp, "npf"), jax.device_get(tree)
        ),
        "numpy_fsync_in_place": lambda: _numpy_save(
          os.path.join(tmp, "npi"), jax.device_get(tree), True
        ),
        "numpy": lambda: _numpy_save(
          os.path.join(tmp, "np"), jax.device_get(tree), False
        ),
        "copy": lambda: [
          np.array(x, copy=True) for x in jax.device_get(tree).values()
        ],
      }
      if zeros:  # the opt-in codec, where it pays
        timed["zstd"] = lambda: bt.save(
          os.path.join(tmp, "bt-zstd"), tree, overwrite=True, compression="zstd"
        )
      # Each call starts with nothing dirty in the page cache: the
      # non-durable numpy.save leaves the tree there, and its writeback ran
      # during (and was billed to) whichever durable save came next.
      m = jb.median_interleaved(
        timed, repeats, warmup=True, rotate=3, settle=settle_disk
      )
      blocked = []
      for _ in range(repeats):
        t0 = time.perf_counter()
        async_save()
        blocked.append(time.perf_counter() - t0)
        finish()
      m["async_blocked"] = sorted(blocked)[len(blocked) // 2]
      m["orbax"] = orbax_s[key]["total"]
      m["orbax_blocked"] = orbax_s[key]["blocked"]
      case = f"save {size} -> {where}"
      report.add(
        f"{case} (vs numpy.save + fsync)", m["sync"], m["numpy_fsync"],
        "naive", "numpy.save of the same arrays into a new directory, each "
        "file and the directory fsynced, the previous save's removed",
        goal=save_goal,
      )  # fmt: skip
      report.add(  # less file system work, and no checkpoint: for scale
        f"{case} (vs numpy.save + fsync, same files rewritten in place)",
        m["sync"], m["numpy_fsync_in_place"], "naive",
        "numpy.save over the previous save's files, each fsynced (no new "
        "files; a crash midway leaves no whole save)",
      )  # fmt: skip
      report.add(  # not durable: the page cache's bandwidth, for scale
        f"{case} (vs numpy.save, no fsync)", m["sync"], m["numpy"], "naive",
        "numpy.save of the same arrays into the page cache, not durable",
      )  # fmt: skip
      report.add(
        f"{case} (vs orbax)", m["sync"], m["orbax"], "peer",
        "orbax StandardCheckpointer save + wait_until_finished (own process)"
        + (", which compresses" if zeros else ""),
        goal=None if zeros else 1.0,
      )  # fmt: skip
      if zeros:
        report.add(
          f'{case}, compression="zstd" (vs orbax)', m["zstd"], m["orbax"],
          "peer", "orbax StandardCheckpointer save + wait_until_finished "
          "(own process), which compresses", goal=1.0,
        )  # fmt: skip
        report.add(
          f'{case}, compression="zstd" (vs raw .npy files)', m["zstd"],
          m["sync"], "ablation", "bt.save of the same tree, raw (the default)",
        )  # fmt: skip
      report.add(
        f"{case}, blocking=False: time blocked (vs orbax)",
        m["async_blocked"], m["orbax_blocked"], "peer",
        "orbax StandardCheckpointer.save call (async; own process)", goal=1.0,
      )  # fmt: skip
      gbs = {k: nbytes / v / 1e9 for k, v in m.items()}
      report.note(
        f"save {size} {where}: sync {gbs['sync']:.2f} GB/s (durable: files, "
        f"directories and parent fsynced); numpy.save {gbs['numpy']:.2f} GB/s, "
        f"with fsync {gbs['numpy_fsync']:.2f}; orbax {gbs['orbax']:.2f} GB/s. "
        f"blocking=False blocks {m['async_blocked'] * 1e3:.1f} ms (a host "
        f"copy of the tree takes {m['copy'] * 1e3:.1f} ms), orbax's async "
        f"save {m['orbax_blocked'] * 1e3:.1f} ms."
      )
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------ on a chip


def _gbs(nbytes: int, seconds: float) -> str:
  return f"{nbytes / seconds / 1e9:.2f} GB/s"


def _random_arrays(n: int, rows: int, cols: int, seed: int = 0) -> dict:
  """``n`` float32 arrays of random values (incompressible, as trained
  weights are: orbax compresses constant arrays)."""
  rng = np.random.default_rng(seed)
  return {
    f"t{k:03d}": rng.random((rows, cols), dtype=np.float32) for k in range(n)
  }


def _fresh_on_device(tree: dict) -> dict:
  """A copy of ``tree`` made on its devices: arrays with no host copy yet
  (a jax.Array keeps the host copy its first ``device_get`` made)."""
  return jax.block_until_ready(jax.tree.map(lambda a: a + 0, tree))


def raw_write_parallel(
  base: str, arrays: dict, threads: int, step: int = 64 << 20
) -> None:
  """Each array's bytes written to a file of its own in a new directory by
  ``threads`` threads, ``step`` bytes a call, each file and the directory
  fsynced, the previous directory removed: the disk's write bandwidth for
  these bytes."""
  _in_new_step(base, lambda path: _write_files(path, arrays, threads, step))


def _write_files(path: str, arrays: dict, threads: int, step: int) -> None:
  def write(item) -> None:
    key, a = item
    fd = os.open(os.path.join(path, key), os.O_WRONLY | os.O_CREAT, 0o644)
    try:
      view = memoryview(np.ascontiguousarray(a)).cast("B")
      done = 0
      while done < len(view):
        done += os.write(fd, view[done : done + step])
      os.fsync(fd)
    finally:
      os.close(fd)

  with ThreadPoolExecutor(threads) as pool:
    list(pool.map(write, arrays.items()))


def raw_write_pieces(
  base: str, arrays: dict, threads: int, piece: int = 8 << 20
) -> None:
  """raw_write_parallel, but every file cut into pieces of ``piece`` bytes
  that ``threads`` threads write at once (os.pwrite, SMALL_WRITE bytes a
  call), each file fsynced after its last piece: on a file system whose
  calls are round trips (9p on a TPU VM) more writes in flight move more."""
  _in_new_step(base, lambda path: _write_pieces(path, arrays, threads, piece))


def _write_pieces(path: str, arrays: dict, threads: int, piece: int) -> None:
  fds = {
    key: os.open(os.path.join(path, key), os.O_WRONLY | os.O_CREAT, 0o644)
    for key in arrays
  }
  views = {
    k: memoryview(np.ascontiguousarray(a)).cast("B") for k, a in arrays.items()
  }
  jobs = [(k, lo) for k, v in views.items() for lo in range(0, len(v), piece)]

  def write(job) -> None:
    key, lo = job
    view, fd = views[key], fds[key]
    for at in range(lo, min(lo + piece, len(view)), SMALL_WRITE):
      chunk = view[at : min(at + SMALL_WRITE, lo + piece, len(view))]
      done = 0
      while done < len(chunk):
        done += os.pwrite(fd, chunk[done:], at + done)

  try:
    with ThreadPoolExecutor(threads) as pool:
      list(pool.map(write, jobs))
      list(pool.map(os.fsync, fds.values()))
  finally:
    for fd in fds.values():
      os.close(fd)


#: Threads of the limit's writes in pieces (raw_write_pieces).
PIECE_THREADS = (16, 32)


def _orbax():
  """orbax.checkpoint, or None (and why) where it is not importable."""
  try:
    import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  except Exception as err:  # pylint: disable=broad-except
    return None, f"orbax.checkpoint is not importable: {err}"
  return ocp, ""


#: The ways of moving the same bytes to the chip whose fastest is the link's
#: limit (transfer_rows_chip).
LINK_WAYS = {
  "one": "one 1 GiB array",
  "list": "jax.device_put of the 16 leaves",
  "threads": "a jax.device_put per leaf from 16 threads",
  "pieces": "jax.device_put of 64 pieces of 16 MiB",
}


class ChipLimits:
  """The machine's limits measured in this run: the link both ways (one
  large transfer each) and the disk's read and write bandwidth."""

  def __init__(self) -> None:
    self.h2d_bps: float | None = None
    self.d2h_bps: float | None = None
    self.read_bps: float | None = None
    self.write_bps: float | None = None

  def h2d(self, nbytes: int) -> tuple[str, float] | None:
    if self.h2d_bps is None:
      return None
    text = f"link {self.h2d_bps / 1e9:.2f} GB/s"
    return text, nbytes / self.h2d_bps


def transfer_rows_chip(
  report: jb.Report, limits: ChipLimits, host: dict, quick: bool, deadline
) -> None:
  """device_put of the 16 leaves of ``host`` against jax.device_put of the
  list and against one transfer of the same bytes (the link), then 1,000
  leaves of 4 KiB against jax.device_put of the list and a loop."""
  dev = jax.devices()[0]
  leaves = list(host.values())
  n = len(leaves)
  leaf_mib = leaves[0].nbytes >> 20
  nbytes = sum(a.nbytes for a in leaves)
  one = np.concatenate([a.ravel() for a in leaves])
  pieces = [p for a in leaves for p in np.split(a.reshape(-1), 4)]

  def from_threads() -> list:
    with ThreadPoolExecutor(n) as pool:
      return list(pool.map(lambda a: jax.device_put(a, dev), leaves))

  m = jb.median_interleaved(
    {
      "ours": lambda: bt.device_put(leaves, dev),
      "list": lambda: jax.device_put(leaves, dev),
      "one": lambda: jax.device_put(one, dev),
      "threads": from_threads,
      "pieces": lambda: jax.device_put(pieces, dev),
    },
    3 if quick else 7,
    warmup=True,
    deadline=deadline,
  )
  # The link's limit: the fastest way seen to move these bytes (several
  # transfers in flight beat one large one on a TPU).
  limits.h2d_bps = nbytes / min(m[k] for k in LINK_WAYS)
  size = f"{n} leaves of {leaf_mib} MiB numpy -> the chip"
  link = limits.h2d(nbytes)
  report.add(
    f"device_put {size}", m["ours"], m["list"], "stock-jax",
    "jax.device_put(list)", goal=1.0, limit=link,
  )  # fmt: skip
  report.add(
    f"device_put {size} (vs one transfer of the same bytes)", m["ours"],
    m["one"], "naive",
    f"one jax.device_put of a {nbytes >> 20} MiB array: the link's limit",
    goal=0.95, limit=link,
  )  # fmt: skip
  ways = ", ".join(f"{LINK_WAYS[k]} {_gbs(nbytes, m[k])}" for k in LINK_WAYS)
  report.note(
    f"The host-to-device link, the fastest of {len(LINK_WAYS)} ways of "
    f"moving the same {nbytes >> 20} MiB (medians: {ways}): "
    f"{limits.h2d_bps / 1e9:.2f} GB/s; device_put of {size}: "
    f"{_gbs(nbytes, m['ours'])}."
  )
  small = [
    a.reshape(32, 32)
    for a in _random_arrays(1000 if not quick else 100, 1, 1024).values()
  ]
  nsmall = sum(a.nbytes for a in small)
  one_device = SingleDeviceSharding(dev)
  put = jax_internals.batched_device_put

  def floor() -> list:
    """One jaxlib transfer per leaf and nothing else: the runtime's
    per-transfer cost, which a call of one transfer per leaf cannot beat."""
    return [
      put(
        jax_internals.ShapedArray(x.shape, x.dtype),
        one_device,
        [x],
        [dev],
        True,
        False,
      )
      for x in small
    ]

  m = jb.median_interleaved(
    {
      "ours": lambda: bt.device_put(small, dev),
      "list": lambda: jax.device_put(small, dev),
      "loop": lambda: [jax.device_put(x, dev) for x in small],
      "floor": floor,
    },
    5 if quick else 21,
    warmup=True,
    deadline=deadline,
  )
  size = f"{len(small)} leaves of 4 KiB numpy -> the chip"
  link = limits.h2d(nsmall)
  per_transfer = (
    f"one jaxlib batched_device_put per leaf {jb.fmt_seconds(m['floor'])}",
    m["floor"],
  )
  report.add(
    f"device_put {size}", m["ours"], m["list"], "stock-jax",
    "jax.device_put(list)", goal=1.5,
    limit=per_transfer if link is None or m["floor"] > link[1] else link,
  )  # fmt: skip
  report.add(
    f"device_put {size} (vs a loop)", m["ours"], m["loop"], "naive",
    "per-leaf jax.device_put loop",
  )  # fmt: skip


def restore_rows_chip(
  report: jb.Report, limits: ChipLimits, host: dict, quick: bool, deadline
) -> None:
  """restore of ``host`` saved as .npy files onto the chip against np.load
  + jax.device_put and orbax in this process; the fastest raw read of the
  same files (restore's number of threads reading 8 MiB chunks, or
  ``np.load`` of each) measures the disk's read bandwidth."""
  dev = jax.devices()[0]
  sharding = SingleDeviceSharding(dev)
  tree = host
  n = len(tree)
  rows, cols = next(iter(tree.values())).shape
  tmp = tempfile.mkdtemp(prefix="bt-bench-chip-")
  try:
    nbytes = sum(a.nbytes for a in tree.values())
    path = os.path.join(tmp, "ckpt")
    bt.save(path, tree)
    files = sorted(
      os.path.join(path, f) for f in os.listdir(path) if f.endswith(".npy")
    )
    keys = [os.path.basename(f)[:-4] for f in files]
    like = _like(keys, (rows, cols), sharding)
    threads = reader.default_read_threads()
    timed = {
      "ours": lambda: bt.restore(path, like, progress=False),
      "stock": lambda: jax.device_put(
        {k: np.load(f) for k, f in zip(keys, files)},
        {k: sharding for k in keys},
      ),
      "raw_par": lambda: raw_read_parallel(files, threads),
      "raw_steps": lambda: raw_read_parallel(files, threads, SMALL_READ),
      "np_load": lambda: [np.load(f) for f in files],
    }
    ocp, why = _orbax()
    if ocp is not None:
      ckpt = ocp.StandardCheckpointer()
      opath = os.path.join(tmp, "orbax")
      ckpt.save(opath, tree)
      ckpt.wait_until_finished()
      timed["orbax"] = lambda: ckpt.restore(opath, like)
    m = jb.median_interleaved(
      timed, 3 if quick else 5, warmup=True, rotate=2, deadline=deadline
    )
    # The disk's limit: the fastest of three ways of reading the files (on
    # a 9p file system small reads on several threads beat large ones).
    read = min(m["raw_par"], m["raw_steps"], m["np_load"])
    limits.read_bps = nbytes / read
    link = nbytes / limits.h2d_bps if limits.h2d_bps else 0.0
    overlapped = max(read, link)
    limit = (
      f"max(read {_gbs(nbytes, read)}, link "
      f"{_gbs(nbytes, link) if link else '?'})",
      overlapped,
    )
    size = f"{n} .npy files, {nbytes >> 20} MiB -> the chip"
    report.add(
      f"restore {size}", m["ours"], m["stock"], "stock-jax",
      "np.load + jax.device_put", goal=1.05, limit=limit,
    )  # fmt: skip
    if "orbax" in m:
      report.add(
        f"restore {size} (vs orbax)", m["ours"], m["orbax"], "peer",
        "orbax StandardCheckpointer restore (this process)", goal=2.0,
        limit=limit,
      )  # fmt: skip
    else:
      report.skip(f"restore {size} (vs orbax)", why)
    report.add(
      f"restore {size} (vs raw read of the files)", m["ours"], read,
      "naive",
      "the fastest raw read of the files into new host buffers (np.load of "
      f"each, or {threads} threads reading 8 MiB chunks in one call or "
      f"{SMALL_READ >> 10} KiB a call): the disk's read, no transfer",
      limit=limit,
    )  # fmt: skip
    serial = read + link
    report.note(
      f"restore {size}: {_gbs(nbytes, m['ours'])}; np.load + "
      f"jax.device_put {_gbs(nbytes, m['stock'])}"
      + (f"; orbax {_gbs(nbytes, m['orbax'])}" if "orbax" in m else "")
      + f". The limits measured in this run: reading the files "
      f"{jb.fmt_seconds(read)} ({_gbs(nbytes, read)}; {threads} threads "
      f"{_gbs(nbytes, m['raw_par'])}, in {SMALL_READ >> 10} KiB calls "
      f"{_gbs(nbytes, m['raw_steps'])}, np.load {_gbs(nbytes, m['np_load'])}), "
      "the transfer at the link's "
      f"bandwidth {jb.fmt_seconds(link)}: overlapped at best "
      f"{jb.fmt_seconds(overlapped)} ({100 * overlapped / m['ours']:.0f}% "
      f"of it reached), one after the other {jb.fmt_seconds(serial)} "
      f"({100 * serial / m['ours']:.0f}%). Above 100% of the serial sum, "
      "restore overlaps reading and transferring."
    )
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def save_rows_chip(
  report: jb.Report, limits: ChipLimits, host: dict, quick: bool, deadline
) -> None:
  """bt.save of ``host`` placed on the chip against jax.device_get +
  numpy.save + fsync and orbax in this process; the device-to-host copy
  and the fastest of 8 threads (64 MiB or 1 MiB a call) or one writing and
  fsyncing the same host bytes are the limits."""
  dev = jax.devices()[0]
  n = len(host)
  tmp = tempfile.mkdtemp(prefix="bt-bench-chip-save-")
  try:
    nbytes = sum(a.nbytes for a in host.values())
    state = {"tree": jax.device_put(host, dev)}
    jax.block_until_ready(state["tree"])
    threads = min(8, os.cpu_count() or 1)
    orbax_dirs: list[str] = []
    timed = {
      "ours": lambda: bt.save(
        os.path.join(tmp, "bt"), state["tree"], overwrite=True
      ),
      "stock": lambda: _numpy_save_step(
        os.path.join(tmp, "npf"), jax.device_get(state["tree"])
      ),
      "d2h": lambda: jax.device_get(state["tree"]),
      "write_par": lambda: raw_write_parallel(
        os.path.join(tmp, "wp"), host, threads
      ),
      "write_one": lambda: raw_write_parallel(os.path.join(tmp, "w1"), host, 1),
      "write_steps": lambda: raw_write_parallel(
        os.path.join(tmp, "ws"), host, threads, SMALL_WRITE
      ),
    }
    for t in PIECE_THREADS:
      timed[f"write_pieces{t}"] = functools.partial(
        raw_write_pieces, os.path.join(tmp, f"wp{t}"), host, t
      )
    ocp, why = _orbax()
    if ocp is not None:
      ckpt = ocp.StandardCheckpointer()

      def orbax_save() -> None:
        path = os.path.join(tmp, f"orbax-{len(orbax_dirs)}")
        orbax_dirs.append(path)
        ckpt.save(path, state["tree"])
        ckpt.wait_until_finished()

      timed["orbax"] = orbax_save

    def settle() -> None:
      """Untimed, after every call: nothing left dirty in the page cache,
      a tree fresh on the chip (no host copy kept), old orbax saves gone."""
      settle_disk()
      state["tree"] = _fresh_on_device(state["tree"])
      for old in orbax_dirs[:-1]:  # the newest stays (its name is taken)
        shutil.rmtree(old, ignore_errors=True)
      # Raw writes remove nothing while timed.
      for base in ("wp", "w1", "ws", *(f"wp{t}" for t in PIECE_THREADS)):
        shutil.rmtree(os.path.join(tmp, base), ignore_errors=True)

    m = jb.median_interleaved(
      timed, 3 if quick else 5, warmup=True, rotate=2, settle=settle,
      deadline=deadline,
    )  # fmt: skip
    # The disk's limit: the fastest of three ways of writing the bytes.
    pieces = {t: m[f"write_pieces{t}"] for t in PIECE_THREADS}
    write = min(
      m["write_par"], m["write_one"], m["write_steps"], *pieces.values()
    )
    limits.write_bps = nbytes / write
    limits.d2h_bps = nbytes / m["d2h"]
    overlapped = max(write, m["d2h"])
    limit = (
      f"max(device-to-host {_gbs(nbytes, m['d2h'])}, write "
      f"{_gbs(nbytes, write)})",
      overlapped,
    )
    size = f"{n} leaves, {nbytes >> 20} MiB, from the chip"
    report.add(
      f"save {size} (vs jax.device_get + numpy.save + fsync)", m["ours"],
      m["stock"], "naive",
      "jax.device_get, then numpy.save of each array into a new directory, "
      "each file and the directory fsynced, the previous save's removed",
      goal=1.2, limit=limit,
    )  # fmt: skip
    if "orbax" in m:
      report.add(
        f"save {size} (vs orbax)", m["ours"], m["orbax"], "peer",
        "orbax StandardCheckpointer save + wait_until_finished (this "
        "process)", goal=3.0, limit=limit,
      )  # fmt: skip
    else:
      report.skip(f"save {size} (vs orbax)", why)
    report.note(
      f"save {size} (durable: files and directories fsynced): "
      f"{_gbs(nbytes, m['ours'])}; jax.device_get + numpy.save + fsync "
      f"{_gbs(nbytes, m['stock'])}"
      + (f"; orbax {_gbs(nbytes, m['orbax'])}" if "orbax" in m else "")
      + f". The limits measured in this run: the device-to-host copy "
      f"{jb.fmt_seconds(m['d2h'])} ({_gbs(nbytes, m['d2h'])}), writing the "
      f"same bytes from host memory durably (each file and the directory "
      f"fsynced; {threads} threads {_gbs(nbytes, m['write_par'])}, in "
      f"{SMALL_WRITE >> 20} MiB calls {_gbs(nbytes, m['write_steps'])}, one "
      f"thread {_gbs(nbytes, m['write_one'])}, in 8 MiB pieces on "
      + ", ".join(f"{t} threads {_gbs(nbytes, v)}" for t, v in pieces.items())
      + f") {jb.fmt_seconds(write)} "
      f"({_gbs(nbytes, write)}): overlapped at best "
      f"{jb.fmt_seconds(overlapped)} ({100 * overlapped / m['ours']:.0f}% "
      f"of it reached), one after the other "
      f"{jb.fmt_seconds(m['d2h'] + write)}."
    )
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def chip_rows(report: jb.Report, quick: bool, budget: jb.Budget) -> None:
  """The rows on an accelerator (``--platform tpu``), in one process: the
  link first (every other row's limit needs it), then restore and save."""
  limits = ChipLimits()
  # One set of 16 leaves of 64 MiB of random values (incompressible, as
  # trained weights are: orbax compresses constant arrays) for every part.
  host = _random_arrays(16, (4 if quick else 64) * 2**20 // 4 // 1024, 1024)
  parts = [
    ("device_put", transfer_rows_chip, 0.15, 10),
    ("restore", restore_rows_chip, 0.45, 20),
    ("save", save_rows_chip, 1.0, 25),
  ]
  for name, part, share, min_s in parts:
    report.section(
      name,
      lambda part=part, share=share: part(
        report, limits, host, quick, budget.until(share)
      ),
      budget=budget,
      min_s=min_s,
    )
  devices = len(jax.devices())
  report.skip(
    "device -> device and rows over 8 devices (the cpu profile's)",
    f"{devices} device(s) here",
  )
  report.skip(
    "restore of a checkpoint two processes wrote",
    "two jax.distributed processes over TCP (no socket opens on a TPU "
    "machine) and 8 devices",
  )
  report.skip(
    "grouping: C++ vs its Python twin",
    "host-only, the same code as in the cpu rows",
  )
  report.skip(
    "save of 1,000 small leaves, of zeros with zstd, blocking=False",
    "not in the TPU round's budget; the cpu profile has them",
  )


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--quick", action="store_true", help="small sizes, few repeats (< 30 s)"
  )
  parser.add_argument(
    "--save-only", action="store_true", help="only the save rows"
  )
  parser.add_argument(
    "--restore-only", action="store_true", help="only the restore rows"
  )
  jb.add_arguments(parser)
  args = parser.parse_args()
  start = time.perf_counter()
  print(
    f"jax {jax.__version__}, {jax.device_count()} "
    f"{jax.devices()[0].platform} devices, jaxworks.batched_transfer "
    f"{bt.__version__}{' (quick)' if args.quick else ''}"
  )
  report = jb.Report(PACKAGE, "batched_transfer_bench")
  report.finish_on_signal(args)
  if PROFILE != "cpu":
    chip_rows(report, args.quick, jb.Budget(args.budget_s))
  elif args.save_only:
    if args.quick:
      save_rows(report, 32 * 2**20, 16, repeats=2)
      save_rows(report, 2**20, 100, repeats=2)
      save_rows(report, 32 * 2**20, 16, repeats=2, values="zeros")
    else:
      save_rows(report, 2**30, 16, repeats=3)
      save_rows(report, 128 * 2**20, 1000, repeats=3)
      save_rows(report, 2**30, 16, repeats=3, values="zeros")
  elif args.restore_only:
    if args.quick:
      restore_rows(report, 32 * 2**20, 8, repeats=2)
      manifest_restore_rows(report, 64 * 2**20, 16, repeats=2)
    else:
      restore_rows(report, 2**30, 16, repeats=9)
      manifest_restore_rows(report, 2**30, 16, repeats=9)
  elif args.quick:
    transfer_rows(report, [10, 100], repeats=3, min_reps=3)
    grouping_rows(report, [10_000], repeats=3)
    restore_rows(report, 32 * 2**20, 8, repeats=2)
    manifest_restore_rows(report, 64 * 2**20, 16, repeats=2)
    save_rows(report, 32 * 2**20, 16, repeats=2)
    save_rows(report, 2**20, 100, repeats=2)
    save_rows(report, 32 * 2**20, 16, repeats=2, values="zeros")
  else:
    transfer_rows(report, [10, 100, 1000], repeats=30)
    grouping_rows(report, [10_000, 100_000], repeats=7)
    restore_rows(report, 2**30, 16, repeats=9)
    manifest_restore_rows(report, 2**30, 16, repeats=9)
    save_rows(report, 2**30, 16, repeats=5)
    save_rows(report, 128 * 2**20, 1000, repeats=5)
    save_rows(report, 2**30, 16, repeats=5, values="zeros")
  report.note(f"total {time.perf_counter() - start:.1f} s")
  report.finish(args)
  return report.exit_status()


if __name__ == "__main__":
  sys.exit(main())
