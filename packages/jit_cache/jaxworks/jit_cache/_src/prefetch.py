"""Warm starts: an executable read from JAX's persistent cache while its
function is traced and lowered.

JAX finds a program in its persistent cache only after tracing, lowering and
hashing it; only then does it read and deserialize the executable, which for
a training step takes as long as the trace (150 ms for a 4-layer transformer
block step on CPU). A ``jit_cache.jit`` function's first call in a process
does both at once:

* After a compile that went through the cache, process 0 writes a *hint*:
  ``<cache dir>/jaxworks-hints/<digest>.json`` names the entry JAX used, with
  the compile options and devices it was read with. The digest covers what
  is known before tracing: JAX's version, the function's code and location,
  and the arguments' tree, shapes, dtypes and statics. A hint is JSON; it
  holds no code.
* At the first call for the same digest in a later process, a background
  thread deserializes that entry (``deserialize_executable`` releases the
  GIL) while this thread traces and lowers.
* JAX's own cache read then takes the prefetched executable only when it asks
  for the same key with the same compile options and devices, which is what
  it would have deserialized itself. Anything else (no hint, a stale or
  planted one, a failure in the background) is dropped and JAX reads its
  entry as always. The call waits for its prefetch before it returns, so
  nothing outlives it.

Trust: a hint is read only from a regular file of at most ``MAX_HINT_BYTES``
that the current user owns and nobody else may write, never through a link,
and never blocks (a FIFO is not waited on); entries are read the same way.
Another user who can write into the cache directory (``set_cache_dir`` warns
about such a directory) cannot plant a hint; XLA aborts on compile options
that contradict the executable, so a hint the user forged by hand could, as
an entry forged by hand could crash stock JAX. Hints are replaced atomically;
a process killed while writing one leaves at most a ``.tmp-*`` file of its
own, which nothing reads. Bounded caches (``max_bytes``) and
``jax_compilation_cache_check_contents`` are left to JAX's own reads.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import stat
import tempfile
import threading
from typing import Any

import jax

from . import persistent as _persistent

HINTS = "jaxworks-hints"
MAX_HINT_BYTES = 1 << 16
#: Entries larger than this are left to JAX's own read.
MAX_ENTRY_BYTES = 1 << 31
FORMAT = "jaxworks-hint/1"
_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,511}\Z")
_NULL = contextlib.nullcontext()

#: Digests of the call sites compiled in this process: later misses of the
#: same site (a re-created closure) reuse in-process and need no prefetch.
_SEEN: set[str] = set()
_SEEN_MAX = 4096
_LOCK = threading.Lock()
#: JAX cache key -> the prefetch that will answer JAX's read of it.
_PENDING: dict[str, _Prefetch] = {}
_local = threading.local()
_config = jax.config
_process_index = jax.process_index


def _ji():
  from . import jax_internals  # pylint: disable=g-import-not-at-top

  return jax_internals


def hints_dir() -> str | None:
  """The hint directory of JAX's persistent cache, or None where there is
  nothing to prefetch from: no cache, one not on a local file system, or one
  that checks or bounds its entries on each read (JAX's LRU bookkeeping)."""
  directory = getattr(_config, "jax_compilation_cache_dir")
  if not directory or "://" in directory:
    return None
  if getattr(_config, "jax_compilation_cache_max_size") != -1:
    return None
  if getattr(_config, "jax_compilation_cache_check_contents"):
    return None
  return os.path.join(directory, HINTS)


def digest(fun: Any, leaves: list, treedef: Any, statics: tuple) -> str | None:
  """What a hint is filed under: the function's code and the arguments'
  structure, abstract values and statics (None when ``fun`` has no code)."""
  target, code = fun, None
  for _ in range(8):  # through jit_cache's proxy, decorators and partials
    code = getattr(target, "__code__", None)
    inner = getattr(target, "__wrapped__", None) or getattr(
      target, "func", None
    )
    if code is not None or inner is None:
      break
    target = inner
  if code is None:
    return None
  ji = _ji()
  parts = [
    jax.__version__,
    getattr(fun, "__module__", "") or "",
    getattr(fun, "__qualname__", "") or "",
    code.co_filename,
    str(code.co_firstlineno),
    hashlib.sha256(code.co_code).hexdigest(),
    str(treedef),
    ",".join(ji.shaped_abstractify(x).str_short() for x in leaves),
    repr(statics)[:4096],
  ]
  return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:40]


def first_compile(fun: Any, leaves: list, treedef: Any, statics: tuple) -> Any:
  """A context for a top-level call that may compile: prefetches while it
  runs when a hint exists, and writes or refreshes the hint afterwards."""
  if (
    not _persistent.config.prefetch
    or getattr(_local, "session", None) is not None
  ):
    return _NULL
  directory = hints_dir()
  if directory is None or not _ji().persistent_cache_enabled():
    return _NULL
  try:
    name = digest(fun, leaves, treedef, statics)
  except Exception:  # pylint: disable=broad-except
    return _NULL  # an abstract value without a short form: no prefetch
  if name is None:
    return _NULL
  with _LOCK:
    if name in _SEEN:
      return _NULL
    if len(_SEEN) >= _SEEN_MAX:
      _SEEN.clear()
    _SEEN.add(name)
  return _Session(directory, name)


class _Session:
  """One call's prefetch and what JAX read during it."""

  def __init__(self, directory: str, name: str):
    self.path = os.path.join(directory, name + ".json")
    self.entries = os.path.dirname(directory)
    self.hint: dict | None = None
    self.prefetch: _Prefetch | None = None
    self.read: tuple | None = None  # (key, options, backend, devices)

  def __enter__(self) -> _Session:
    _local.session = self
    _ji().wrap_cache_read(_cache_read)
    self.hint = read_hint(self.path)
    if self.hint is not None:
      p = _Prefetch(self.hint, self.entries)
      try:
        p.thread.start()
      except RuntimeError:  # no thread to be had: JAX reads as always
        return self
      self.prefetch = p
      with _LOCK:
        _PENDING.setdefault(p.key, p)
    return self

  def __exit__(self, *exc: Any) -> None:
    _local.session = None
    p = self.prefetch
    if p is not None:
      with _LOCK:
        if _PENDING.get(p.key) is p:
          del _PENDING[p.key]
      p.thread.join()  # nothing runs in the background after the call
      p.result = None
    if self.read is not None and exc[0] is None:
      self._write()

  def _write(self) -> None:
    assert self.read is not None
    key, options, backend, devices = self.read
    hint = {
      "format": FORMAT,
      "key": key,
      "platform": backend.platform,
      "devices": [d.id for d in devices],
      "options": base64.b64encode(options.SerializeAsString()).decode(),
    }
    if self.hint is not None and all(
      self.hint[k] == v for k, v in hint.items()
    ):
      return
    if _process_index() != 0:
      return
    write_hint(self.path, hint)


@contextlib.contextmanager
def building():
  """Marks the compile of the session's function: the cache read it makes is
  the one its hint names."""
  _local.building, _local.taken = True, False
  try:
    yield
  finally:
    _local.building = False


def took() -> bool:
  """Whether the last compile marked by ``building`` took a prefetch."""
  return getattr(_local, "taken", False)


def _cache_read(read, cache_key, compile_options, backend, devices):
  """JAX's persistent-cache read, answered by a matching prefetch."""
  session = getattr(_local, "session", None)
  if session is not None and getattr(_local, "building", False):
    session.read = (cache_key, compile_options, backend, devices)
  with _LOCK:
    p = _PENDING.pop(cache_key, None)
  if p is not None:
    got = p.take(compile_options, backend, devices)
    if got is not None:
      _persistent.TOTALS.prefetched += 1
      _local.taken = True
      return got
  return read(cache_key, compile_options, backend, devices)


class _Prefetch:
  """A background deserialization of one entry of JAX's cache."""

  def __init__(self, hint: dict, entries: str):
    self.entries = entries
    self.key: str = hint["key"]
    self.platform: str = hint["platform"]
    self.device_ids: tuple = tuple(hint["devices"])
    self.options: bytes = hint["options_bytes"]
    self.backend: Any = None
    self.result: tuple | None = None
    self.thread = threading.Thread(
      target=self._run, name="jaxworks-prefetch", daemon=True
    )

  def _run(self) -> None:
    try:
      ji = _ji()
      backend = ji.get_backend(self.platform)
      by_id = {d.id: d for d in backend.devices()}
      devices = ji.DeviceList(tuple(by_id[i] for i in self.device_ids))
      options = ji.compile_options_from_bytes(self.options)
      # XLA aborts the process on options that contradict themselves; a
      # hint this user wrote holds the options JAX read its entry with.
      if options.num_replicas != 1 or options.num_partitions != len(devices):
        return
      entry = read_regular(
        os.path.join(self.entries, self.key + "-cache"), MAX_ENTRY_BYTES
      )
      if entry is None:
        return
      serialized, compile_time = ji.executable_and_time(entry)
      exe = backend.deserialize_executable(serialized, devices, options)
      self.backend, self.result = backend, (exe, compile_time)
    except Exception:  # pylint: disable=broad-except
      # JAX reads the entry itself and reports what is wrong with it.
      self.result = None

  def take(self, compile_options, backend, devices) -> tuple | None:
    """The executable, if it is what JAX asks for; else None."""
    if tuple(d.id for d in devices) != self.device_ids:
      return None
    if compile_options.SerializeAsString() != self.options:
      return None
    self.thread.join()
    if self.backend is not backend:
      return None
    result, self.result = self.result, None
    return result


def read_regular(path: str, limit: int, own: bool = False) -> bytes | None:
  """The bytes of ``path`` if it is a regular file (not a link) of at most
  ``limit`` bytes (and, with ``own``, one that this user owns and nobody
  else may write), else None. Never blocks on a FIFO or device."""
  flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
  flags |= getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
  try:
    fd = os.open(path, flags)
  except OSError:
    return None
  chunks: list[bytes] = []
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
      return None
    getuid = getattr(os, "getuid", None)
    if own and getuid is not None:
      if st.st_uid != getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None
    left = st.st_size + 1
    while left > 0:  # a file that grew after fstat is refused below
      chunk = os.read(fd, min(left, 1 << 24))
      if not chunk:
        break
      chunks.append(chunk)
      left -= len(chunk)
  except OSError:
    return None
  finally:
    os.close(fd)
  data = b"".join(chunks)
  return data if len(data) <= limit else None


def read_hint(path: str) -> dict | None:
  """The hint at ``path`` if it is a valid one that this user wrote, else
  None."""
  data = read_regular(path, MAX_HINT_BYTES, own=True)
  if data is None:
    return None
  try:
    hint = json.loads(data)
    ok = (
      isinstance(hint, dict)
      and hint.get("format") == FORMAT
      and isinstance(hint.get("key"), str)
      and _KEY.match(hint["key"]) is not None
      and isinstance(hint.get("platform"), str)
      and isinstance(hint.get("devices"), list)
      and 0 < len(hint["devices"]) <= 1 << 16
      and all(type(i) is int and i >= 0 for i in hint["devices"])  # pylint: disable=unidiomatic-typecheck
      and isinstance(hint.get("options"), str)
    )
    if not ok:
      return None
    options = base64.b64decode(hint["options"], validate=True)
  except ValueError:  # JSON, Unicode or base64
    return None
  return dict(hint, options_bytes=options)


def write_hint(path: str, hint: dict) -> None:
  """Replaces the hint at ``path`` atomically (best effort: a hint only
  saves time)."""
  directory = os.path.dirname(path)
  try:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
  except OSError:
    return
  try:
    with os.fdopen(fd, "w") as f:
      json.dump({k: v for k, v in hint.items() if k != "options_bytes"}, f)
    os.replace(tmp, path)
  except OSError:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
