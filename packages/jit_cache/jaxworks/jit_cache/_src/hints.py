"""The hint files of ``prefetch.py``: which entries of JAX's persistent cache
a call site, or a whole process, read last time.

A *read* is what JAX's cache read was asked for: the entry's key, the
platform, the device ids and the serialized compile options. Hints live in
``<cache dir>/jaxworks-hints/`` (0700):

* ``<digest>.json``: one call site's read (``FORMAT``). The digest covers
  what is known before tracing: JAX's version, the function's code and
  location, and the arguments' tree, shapes, dtypes and statics.
* ``process-<digest>.json``: the first ``MAX_READS`` reads of a process, in
  order (``PROCESS_FORMAT``); the digest covers JAX's version, the
  interpreter and the command line.

They are JSON and hold no code. A hint is read only from a regular file of
bounded size that the current user owns and nobody else may write, never
through a link, and never waits on a FIFO; entries are read the same way.
Writes replace a hint atomically (a killed writer leaves at most its own
``.tmp-*`` file, which nothing reads).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import stat
import sys
import tempfile
from typing import Any
from typing import NamedTuple

import jax

HINTS = "jaxworks-hints"
FORMAT = "jaxworks-hint/1"
PROCESS_FORMAT = "jaxworks-process-hint/1"
MAX_HINT_BYTES = 1 << 16
MAX_PROCESS_HINT_BYTES = 1 << 22
#: Reads a process hint holds (the start of a process is what it speeds up).
MAX_READS = 512
#: Entries larger than this are left to JAX's own read.
MAX_ENTRY_BYTES = 1 << 31
_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,511}\Z")
_MAX_DEVICES = 1 << 16


class Read(NamedTuple):
  """One read of JAX's persistent cache."""

  key: str
  platform: str
  devices: tuple[int, ...]
  options: bytes


def of_call(key: str, options: Any, backend: Any, devices: Any) -> Read:
  """The ``Read`` of JAX's cache read with these arguments."""
  return Read(
    key,
    backend.platform,
    tuple(d.id for d in devices),
    options.SerializeAsString(),
  )


def code_of(fun: Any) -> Any:
  """The code object of ``fun``, found through jit_cache's weak proxy,
  decorators and partials (None when there is none)."""
  target = fun
  for _ in range(8):
    code = getattr(target, "__code__", None)
    inner = getattr(target, "__wrapped__", None) or getattr(
      target, "func", None
    )
    if code is not None or inner is None:
      return code
    target = inner
  return None


def site_digest(
  fun: Any, leaves: list, treedef: Any, statics: tuple, short: Any
) -> str | None:
  """A call site's hint name: the function's code and the arguments'
  structure, abstract values (``short(leaf)``) and statics; None when
  ``fun`` has no code."""
  code = code_of(fun)
  if code is None:
    return None
  parts = [
    jax.__version__,
    getattr(fun, "__module__", "") or "",
    getattr(fun, "__qualname__", "") or "",
    code.co_filename,
    str(code.co_firstlineno),
    hashlib.sha256(code.co_code).hexdigest(),
    str(treedef),
    ",".join(short(x) for x in leaves),
    repr(statics)[:4096],
  ]
  return _digest(parts)


def process_digest() -> str | None:
  """This process's hint name: the interpreter and the command line (None
  for ``python -c`` and an interactive interpreter)."""
  argv = list(getattr(sys, "argv", None) or [])
  if not argv or argv[0] in ("", "-c", "-"):
    return None
  script = os.path.abspath(argv[0])
  return "process-" + _digest(
    [jax.__version__, sys.executable, script, *argv[1:]]
  )


def _digest(parts: list[str]) -> str:
  return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:40]


# ----------------------------------------------------------------- reading


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


def _json(path: str, limit: int) -> Any:
  data = read_regular(path, limit, own=True)
  if data is None:
    return None
  try:
    return json.loads(data)
  except ValueError:  # JSON or Unicode
    return None


def _read_of(key: Any, platform: Any, devices: Any, options: Any) -> Read:
  """A validated ``Read``; ValueError when a field is malformed."""
  ok = (
    isinstance(key, str)
    and _KEY.match(key) is not None
    and isinstance(platform, str)
    and isinstance(devices, list)
    and 0 < len(devices) <= _MAX_DEVICES
    and all(type(i) is int and i >= 0 for i in devices)  # pylint: disable=unidiomatic-typecheck
    and isinstance(options, str)
  )
  if not ok:
    raise ValueError("malformed read")
  return Read(
    key, platform, tuple(devices), base64.b64decode(options, validate=True)
  )


def read_site(path: str) -> Read | None:
  """The read a call site's hint names, or None (missing or invalid)."""
  hint = _json(path, MAX_HINT_BYTES)
  if not isinstance(hint, dict) or hint.get("format") != FORMAT:
    return None
  try:
    return _read_of(*map(hint.get, ("key", "platform", "devices", "options")))
  except ValueError:
    return None


def read_process(path: str) -> list[Read]:
  """The reads a process hint lists, in order ([] if missing or invalid)."""
  hint = _json(path, MAX_PROCESS_HINT_BYTES)
  if not isinstance(hint, dict) or hint.get("format") != PROCESS_FORMAT:
    return []
  options, reads = hint.get("options"), hint.get("reads")
  if not isinstance(options, list) or not isinstance(reads, list):
    return []
  out = []
  try:
    for r in reads[:MAX_READS]:
      if not isinstance(r, list) or len(r) != 4 or type(r[3]) is not int:  # pylint: disable=unidiomatic-typecheck
        return []
      if not 0 <= r[3] < len(options):
        return []
      out.append(_read_of(r[0], r[1], r[2], options[r[3]]))
  except ValueError:
    return []
  return out


# ----------------------------------------------------------------- writing


def _b64(data: bytes) -> str:
  return base64.b64encode(data).decode()


def write_site(path: str, read: Read) -> None:
  """Replaces a call site's hint."""
  _write(
    path,
    {
      "format": FORMAT,
      "key": read.key,
      "platform": read.platform,
      "devices": list(read.devices),
      "options": _b64(read.options),
    },
  )


def write_process(path: str, reads: list[Read]) -> None:
  """Replaces a process hint."""
  index: dict[bytes, int] = {}
  rows = []
  for r in reads[:MAX_READS]:
    i = index.setdefault(r.options, len(index))
    rows.append([r.key, r.platform, list(r.devices), i])
  _write(
    path,
    {
      "format": PROCESS_FORMAT,
      "options": [_b64(o) for o in index],
      "reads": rows,
    },
  )


def _write(path: str, hint: dict) -> None:
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
      json.dump(hint, f)
    os.replace(tmp, path)
  except OSError:
    with contextlib.suppress(OSError):
      os.unlink(tmp)
