"""A persistent executable cache on disk, keyed by program fingerprints.

Off by default. ``set_cache_dir(path)`` (or the environment variable
``JAXWORKS_JIT_CACHE_DIR``) turns it on: an executable compiled for a program
whose structural fingerprint is fully content-based is serialized to the
directory, and a new process tracing the same program loads it instead of
lowering and compiling.

The key is a SHA-256 digest of a canonical encoding of the fingerprint
(equations, primitives, parameters, literals and constants by content), the
argument placements (shardings with device ids, committedness), the trace
context, plus everything that makes an executable valid here: jax, jaxlib and
jaxworks versions, backend platforms and platform versions, devices (ids,
kinds, processes), ``XLA_FLAGS`` and jax's configuration. A program whose key
holds anything compared by identity (a host callback, a large array, a user
object, a primitive jax does not define) is never persisted: when in doubt,
the program is compiled as usual and kept in memory only.

An entry file is ``MAGIC``, a fixed header (format version, key length,
payload length, SHA-256 of the payload), the full key (JSON) and the payload
(a pickled serialized executable). Any mismatch (truncated file, flipped
byte, another version, another machine) rejects the entry with a reason; the
program is compiled and the entry rewritten. Writes go to a temporary file in
the same directory and are renamed over the entry (atomic). The directory is
bounded (``max_bytes``), the least recently used entries (by mtime, touched on
every hit) go first.

Entries are pickles: load them only from a directory you trust, as with
``jax.experimental.serialize_executable``.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
import enum
import hashlib
import json
import os
import pickle
import struct
import sys
import tempfile
import threading
import time
from typing import Any
import warnings
import weakref

import jax
from jax.experimental import serialize_executable as _serialize
from jax.extend import core as jex_core
import jaxlib
import numpy as np

from ..version import __version__ as _jaxworks_version
from . import fingerprint as _fingerprint
from . import jax_internals as ji

# Stock JAX callables bound at import (safe under ``jax.* = ...`` swaps).
_jax_devices = jax.devices
_default_backend = jax.default_backend
_process_count = jax.process_count

#: Environment variable naming the cache directory (read on every lookup
#: while ``set_cache_dir`` has not been called).
ENV_VAR = "JAXWORKS_JIT_CACHE_DIR"
#: Default bound on the directory's entry bytes.
DEFAULT_MAX_BYTES = 1 << 30
#: Format of an entry file; a change rejects older entries.
FORMAT_VERSION = 1
MAGIC = b"JWJITX\r\n"
HEADER = struct.Struct("<IIQ32s")  # format, key length, payload length, sha
SUFFIX = ".jwx"

_UNSET: Any = object()


class _Config:
  """Settings of the disk cache (read ``jit_cache.config.cache_dir``)."""

  def __init__(self):
    self._dir: Any = _UNSET
    self.max_bytes = DEFAULT_MAX_BYTES

  @property
  def cache_dir(self) -> str | None:
    """The directory in use, or None (off)."""
    if self._dir is not _UNSET:
      return self._dir
    return os.environ.get(ENV_VAR) or None

  def __repr__(self) -> str:
    return (
      f"jit_cache.config(cache_dir={self.cache_dir!r}, "
      f"max_bytes={self.max_bytes})"
    )


config = _Config()


def set_cache_dir(
  path: str | os.PathLike | None, max_bytes: int | None = None
) -> None:
  """Turns the persistent executable cache on (a directory) or off (None).

  Args:
    path: directory for entries (created if missing), or None to turn the
      cache off (also when ``JAXWORKS_JIT_CACHE_DIR`` is set).
    max_bytes: bound on the directory's entry bytes (default 1 GiB); least
      recently used entries are deleted beyond it.

  Raises:
    TypeError: ``path`` is not a path or None, or ``max_bytes`` not an int.
    ValueError: ``max_bytes`` is not positive.
  """
  if path is not None and not isinstance(path, (str, os.PathLike)):
    raise TypeError(
      "jaxworks.jit_cache.set_cache_dir: path must be a str, an "
      f"os.PathLike or None, got {type(path).__name__} {path!r:.80}"
    )
  if max_bytes is not None:
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
      raise TypeError(
        "jaxworks.jit_cache.set_cache_dir: max_bytes must be an int, got "
        f"{type(max_bytes).__name__} {max_bytes!r:.80}"
      )
    if max_bytes <= 0:
      raise ValueError(
        "jaxworks.jit_cache.set_cache_dir: max_bytes must be positive, got "
        f"{max_bytes}; pass None to turn the cache off"
      )
    config.max_bytes = max_bytes
  config._dir = None if path is None else os.fspath(path)


def enabled() -> bool:
  return config.cache_dir is not None


# ----------------------------------------------------------------- encoding


class NotPersistable(Exception):
  """A key part with no content-based, process-independent encoding."""


_TRUSTED = frozenset({"jax", "jaxlib", "numpy", "ml_dtypes", "builtins"})


def _type_name(t: type) -> str:
  module = getattr(t, "__module__", "") or ""
  if module.split(".")[0] not in _TRUSTED:
    raise NotPersistable(f"type {module}.{t.__qualname__}")
  return f"{module}.{t.__qualname__}"


class _JaxPrimitives:
  """The primitives jax itself defines: module attributes of jax's modules,
  found lazily (a module at a time) and remembered."""

  def __init__(self):
    self.lock = threading.Lock()
    self.known: dict[int, Any] = {}
    self.scanned: set[str] = set()

  def _modules(self):
    names = [
      n
      for n in list(sys.modules)
      if (n.startswith("jax.") or n.startswith("jaxlib."))
      and n not in self.scanned
    ]
    names.sort(key=lambda n: (not n.startswith("jax._src.lax"), n))
    return names

  def contains(self, prim: Any) -> bool:
    with self.lock:
      if id(prim) in self.known:
        return True
      for name in self._modules():
        self.scanned.add(name)
        d = getattr(sys.modules.get(name), "__dict__", None) or {}
        for v in list(d.values()):
          if isinstance(v, jex_core.Primitive):
            self.known[id(v)] = v
        if id(prim) in self.known:
          return True
      return False


_PRIMITIVES = _JaxPrimitives()


_SLOTS: dict[type, list[str]] = {}


def _slots(t: type) -> list[str]:
  hit = _SLOTS.get(t)
  if hit is not None:
    return hit
  names: list[str] = []
  for klass in t.__mro__:
    s = klass.__dict__.get("__slots__", ())
    names.extend([s] if isinstance(s, str) else s)
  names = [n for n in names if n not in ("__weakref__", "__dict__")]
  _SLOTS[t] = names
  return names


# Encodings of objects JAX treats as immutable values (interned avals,
# equation contexts, primitives, shardings, meshes, dtypes), by identity; the
# object is held so its id stays unique. Sub-program fingerprints (immutable)
# are encoded once, as a digest.
_OBJ_MEMO: dict[int, tuple[Any, str]] = {}
_OBJ_MEMO_MAX = 1 << 15
_FP_MEMO: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_MEMO_LOCK = threading.Lock()


def _memoizable(v: Any) -> bool:
  return isinstance(
    v,
    (
      jex_core.Primitive,
      ji.AbstractValue,
      jax.sharding.Sharding,
      ji.Mesh,
      ji.AbstractMesh,
      np.dtype,
      jax.Device,
      ji.PyTreeDef,
    ),
  )


def _enc_memo(v: Any, out: list, depth: int, encode: Callable) -> None:
  hit = _OBJ_MEMO.get(id(v))
  if hit is not None and hit[0] is v:
    out.append(hit[1])
    return
  part: list = []
  encode(v, part, depth)
  text = "".join(part)
  with _MEMO_LOCK:
    if len(_OBJ_MEMO) >= _OBJ_MEMO_MAX:
      _OBJ_MEMO.clear()
    _OBJ_MEMO[id(v)] = (v, text)
  out.append(text)


def _enc(v: Any, out: list, depth: int = 0) -> None:
  """Appends a canonical, process-independent encoding of ``v`` to ``out``."""
  if type(v) not in _PLAIN and _memoizable(v):
    _enc_memo(v, out, depth, _enc_value)
  else:
    _enc_value(v, out, depth)


_PLAIN = frozenset(
  {
    type(None),
    bool,
    int,
    str,
    bytes,
    float,
    complex,
    tuple,
    list,
    dict,
    frozenset,
    set,
  }
)


def _enc_value(v: Any, out: list, depth: int) -> None:
  if depth > 200:
    raise NotPersistable("too deep")
  t = type(v)
  d = depth + 1
  if v is None or t is bool or t is int:
    out.append(f"{t.__name__[0]}{v!r};")
  elif t is str:
    out.append(f"s{len(v)}:{v}")
  elif t is bytes:
    out.append(f"y{v.hex()};")
  elif t is float:
    out.append(f"f{v.hex()};")
  elif t is complex:
    out.append(f"c{v.real.hex()},{v.imag.hex()};")
  elif t is tuple or t is list:
    out.append(f"{t.__name__[0]}{len(v)}(")
    for x in v:
      _enc(x, out, d)
    out.append(")")
  elif t is dict or t is ji.FrozenDict:
    items = []
    for k, x in v.items():
      kp: list[str] = []
      xp: list[str] = []
      _enc(k, kp, d)
      _enc(x, xp, d)
      items.append("".join(kp) + "=" + "".join(xp))
    out.append("D(" + ",".join(sorted(items)) + ")")
  elif t is frozenset or t is set:
    parts = []
    for x in v:
      p: list = []
      _enc(x, p, d)
      parts.append("".join(p))
    out.append("S(" + ",".join(sorted(parts)) + ")")
  elif isinstance(v, type):
    out.append(f"T{_type_name(v)};")
  elif t is _fingerprint.Fingerprint:
    if v.pins:
      raise NotPersistable("program holds objects by identity")
    with _MEMO_LOCK:
      text = _FP_MEMO.get(v)
    if text is None:
      part: list = []
      _enc(v.key, part, d)
      text = f"F{hashlib.sha256(''.join(part).encode()).hexdigest()};"
      with _MEMO_LOCK:
        _FP_MEMO[v] = text
    out.append(text)
  elif t is _fingerprint._Identity:  # pylint: disable=protected-access
    _enc_memo(v.obj, out, d, _enc_identity)
  elif isinstance(v, np.dtype):
    out.append(f"dt{v.str}:{v.name};")
  elif isinstance(v, np.ndarray):
    if v.dtype != object:
      data = np.ascontiguousarray(v).tobytes()
      out.append(
        f"nd{v.dtype.str}{v.shape}:{hashlib.sha256(data).hexdigest()};"
      )
    else:
      out.append(f"no{v.shape}(")
      for x in v.reshape(-1).tolist():
        _enc(x, out, d)
      out.append(")")
  elif isinstance(v, jax.Device):
    out.append(f"dev{v.platform}:{v.id}:{v.device_kind}:{v.process_index};")
  elif isinstance(v, jax.sharding.NamedSharding):
    out.append("NS(")
    _enc(v.mesh, out, d)
    _enc(v.spec, out, d)
    _enc(v.memory_kind, out, d)
    out.append(")")
  elif isinstance(v, jax.sharding.SingleDeviceSharding):
    out.append("SD(")
    _enc(tuple(v.device_set), out, d)
    _enc(v.memory_kind, out, d)
    out.append(")")
  elif isinstance(v, ji.Mesh):
    out.append("M(")
    _enc(v.devices, out, d)
    _enc(tuple(v.axis_names), out, d)
    _enc(repr(getattr(v, "axis_types", None)), out, d)
    out.append(")")
  elif isinstance(v, ji.AbstractMesh):
    text = repr(v)  # axis names, sizes and types, device kind, platform
    if " at 0x" in text:
      raise NotPersistable("abstract mesh without a value encoding")
    out.append(f"AM{len(text)}:{text}")
  elif isinstance(v, jax.sharding.Sharding):
    raise NotPersistable(f"sharding {t.__name__}")
  elif isinstance(v, ji.PyTreeDef):
    text = str(v)
    if "CustomNode" in text or " at 0x" in text:
      raise NotPersistable("tree with custom nodes")
    out.append(f"tree{len(text)}:{text}")
  elif isinstance(v, jax.Array) or isinstance(v, jax.core.Tracer):
    raise NotPersistable("array or tracer by identity")
  else:
    _enc_object(v, out, d)


def _enc_identity(obj: Any, out: list, depth: int) -> None:
  t = type(obj)
  if isinstance(obj, jex_core.Primitive):
    if not _PRIMITIVES.contains(obj):
      raise NotPersistable(f"primitive {obj.name} not defined by jax")
    out.append(f"P{_type_name(t)}:{obj.name};")
  elif isinstance(obj, type):
    out.append(f"T{_type_name(obj)};")
  else:
    _enc_object(obj, out, depth)


def _enc_object(v: Any, out: list, depth: int) -> None:
  """A jax/numpy object: enum member, object with slots or a plain repr."""
  t = type(v)
  name = _type_name(t)
  if t.__module__ == "builtins":  # functions, methods, modules, ...
    raise NotPersistable(f"object of type {t.__qualname__}")
  if isinstance(v, enum.Enum):
    out.append(f"E{name}.{v.name};")
    return
  slots = _slots(t)
  fields: dict[str, Any] = getattr(v, "__dict__", None) or {}
  if slots or fields:
    out.append(f"O{name}(")
    for s in slots:
      out.append(f"{s}=")
      _enc(getattr(v, s, None), out, depth)
    for k in sorted(fields):
      out.append(f"{k}=")
      _enc(fields[k], out, depth)
    out.append(")")
    return
  text = repr(v)
  if " at 0x" in text or "object at" in text:
    raise NotPersistable(f"object {name} without a value encoding")
  out.append(f"R{name}:{len(text)}:{text}")


def _digest(v: Any) -> str:
  out: list = []
  _enc(v, out)
  return hashlib.sha256("".join(out).encode()).hexdigest()


def _leaf_part(leaf: Any) -> tuple:
  if isinstance(leaf, jax.core.Tracer):
    raise NotPersistable("tracer argument")
  if isinstance(leaf, jax.Array):
    return (
      "array",
      leaf.dtype,
      tuple(leaf.shape),
      leaf.weak_type,
      leaf.sharding,
      getattr(leaf, "_committed", None),
    )
  if isinstance(leaf, (np.ndarray, np.generic)):
    return ("numpy", leaf.dtype, tuple(np.shape(leaf)))
  if type(leaf) in (bool, int, float, complex):
    return ("scalar", type(leaf))
  raise NotPersistable(f"argument of type {type(leaf).__name__}")


_CONFIG_SKIP = ("cache", "log", "explain", "traceback")


_ENV_MEMO: list = []
_PLAIN_SCALARS = frozenset({type(None), bool, int, float, str})


def _environment(platforms: Sequence[str]) -> dict:
  """What makes an executable valid besides its program (memoized while
  jax's configuration, the platforms and the environment variables stay)."""
  state = (
    tuple(platforms),
    tuple(jax.config.values.items()),
    os.environ.get("XLA_FLAGS", ""),
    os.environ.get("LIBTPU_INIT_ARGS", ""),
  )
  memo = _ENV_MEMO[:]
  if memo:
    try:
      if memo[0] == state:
        return memo[1]
    except Exception:  # pylint: disable=broad-except
      pass  # a config value whose == cannot answer: compute anew
  env = _environment_uncached(platforms)
  _ENV_MEMO[:] = [state, env]
  return env


def _environment_uncached(platforms: Sequence[str]) -> dict:
  backends = []
  for platform in sorted(set(platforms)):
    devices = _jax_devices(platform)
    client = devices[0].client
    backends.append(
      {
        "platform": client.platform,
        "platform_version": client.platform_version,
        "devices": [[x.id, x.process_index, x.device_kind] for x in devices],
      }
    )
  cfg = {}
  for k in sorted(jax.config.values):
    if any(s in k for s in _CONFIG_SKIP):
      continue
    v = jax.config.values[k]
    if type(v) in _PLAIN_SCALARS:
      cfg[k] = repr(v)
      continue
    try:
      cfg[k] = _digest(v)
    except NotPersistable:
      cfg[k] = repr(v)
  return {
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "jaxworks_jit_cache": _jaxworks_version,
    "backends": backends,
    "default_backend": _default_backend(),
    "process_count": _process_count(),
    "xla_flags": os.environ.get("XLA_FLAGS", ""),
    "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
    "config": hashlib.sha256(
      json.dumps(cfg, sort_keys=True).encode()
    ).hexdigest(),
  }


def make_key(
  program: Any, params: Any, leaves: Sequence[Any], context: tuple
) -> dict:
  """The full key of an executable (raises NotPersistable)."""
  leaf_parts = tuple(_leaf_part(x) for x in leaves)
  platforms = {_default_backend()}
  for part in leaf_parts:
    if part[0] == "array":
      platforms.update(x.platform for x in part[4].device_set)
  key = {
    "format": FORMAT_VERSION,
    "program": _digest((program, params, leaf_parts, context)),
  }
  key.update(_environment(sorted(platforms)))
  return key


def _key_bytes(key: dict) -> bytes:
  return json.dumps(key, sort_keys=True, separators=(",", ":")).encode()


def _file_name(key: dict) -> str:
  full = hashlib.sha256(_key_bytes(key)).hexdigest()
  return f"{key['program'][:32]}-{full[:16]}{SUFFIX}"


# ----------------------------------------------------------------- counters


class DiskCounters:
  __slots__ = (
    "hits",
    "misses",
    "rejected",
    "writes",
    "bytes_read",
    "bytes_written",
    "load_s",
    "evictions",
    "unpersistable",
  )

  def __init__(self):
    self.reset()

  def reset(self) -> None:
    for name in self.__slots__:
      setattr(self, name, 0)
    self.load_s = 0.0


COUNTERS = DiskCounters()

#: Per trace entry: what the disk cache did for it last (for explain_miss).
_NOTES: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
_NOTES_LOCK = threading.Lock()


def _note(owner: Any, text: str) -> None:
  if owner is None:
    return
  with _NOTES_LOCK:
    try:
      _NOTES[owner] = text
    except TypeError:
      pass


def note_for(owner: Any) -> str | None:
  """What the disk cache last did for ``owner`` (a trace entry), or None."""
  if owner is None:
    return None
  with _NOTES_LOCK:
    return _NOTES.get(owner)


# ----------------------------------------------------------------- entries


def _why(stored: dict, key: dict) -> str:
  """Human reason why an entry's stored key differs from ``key``."""
  reasons = []
  for field in ("format", "jax", "jaxlib", "jaxworks_jit_cache"):
    if stored.get(field) != key.get(field):
      reasons.append(
        f"version mismatch: {field} {stored.get(field)!r} != {key.get(field)!r}"
      )
  for field in ("backends", "default_backend", "process_count"):
    if stored.get(field) != key.get(field):
      reasons.append(
        f"different machine: {field} differs (entry: "
        f"{json.dumps(stored.get(field))[:120]})"
      )
  for field in ("xla_flags", "libtpu_init_args", "config"):
    if stored.get(field) != key.get(field):
      reasons.append(f"different {field}")
  if stored.get("program") != key.get("program"):
    reasons.append("different program")
  extra = set(stored) ^ set(key)
  if extra:
    reasons.append(f"different key fields {sorted(extra)}")
  return "; ".join(reasons) or "key mismatch"


def read_entry(path: str, key: dict) -> tuple[bytes | None, str]:
  """(payload, "") for a valid entry, else (None, reason)."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except FileNotFoundError:
    return None, "absent"
  except OSError as e:
    return None, f"unreadable: {e}"
  head = len(MAGIC) + HEADER.size
  if len(data) < head or data[: len(MAGIC)] != MAGIC:
    return None, "corrupt: bad magic or truncated header"
  fmt, key_len, payload_len, sha = HEADER.unpack_from(data, len(MAGIC))
  if fmt != FORMAT_VERSION:
    return None, f"version mismatch: entry format {fmt} != {FORMAT_VERSION}"
  if len(data) != head + key_len + payload_len:
    return None, (
      f"corrupt: {len(data)} bytes, header says "
      f"{head + key_len + payload_len} (truncated or extended)"
    )
  stored_key = data[head : head + key_len]
  if stored_key != _key_bytes(key):
    try:
      stored = json.loads(stored_key)
      if not isinstance(stored, dict):
        raise ValueError("not an object")
    except ValueError:
      return None, "corrupt: unreadable key"
    return None, _why(stored, key)
  payload = data[head + key_len :]
  if hashlib.sha256(payload).digest() != sha:
    return None, "corrupt: payload checksum mismatch"
  return payload, ""


def write_entry(directory: str, name: str, key: dict, payload: bytes) -> int:
  """Writes an entry atomically; returns the bytes written."""
  key_bytes = _key_bytes(key)
  header = MAGIC + HEADER.pack(
    FORMAT_VERSION,
    len(key_bytes),
    len(payload),
    hashlib.sha256(payload).digest(),
  )
  fd, tmp = tempfile.mkstemp(
    prefix=".tmp-", suffix=SUFFIX + ".part", dir=directory
  )
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(header)
      f.write(key_bytes)
      f.write(payload)
    os.replace(tmp, os.path.join(directory, name))
  except BaseException:
    try:
      os.unlink(tmp)
    except OSError:
      pass
    raise
  return len(header) + len(key_bytes) + len(payload)


_STALE_TMP_S = 3600.0


def evict(directory: str, max_bytes: int, keep: str | None = None) -> int:
  """Deletes least recently used entries until the total fits; returns how
  many were deleted. Stale temporary files of dead writers go too."""
  entries = []
  now = time.time()
  try:
    scan = list(os.scandir(directory))
  except OSError:
    return 0
  for e in scan:
    try:
      st = e.stat()
    except OSError:
      continue
    if e.name.startswith(".tmp-"):
      if now - st.st_mtime > _STALE_TMP_S:
        try:
          os.unlink(e.path)
        except OSError:
          pass
      continue
    if e.name.endswith(SUFFIX):
      entries.append((e.name == keep, st.st_mtime, st.st_size, e.path))
  total = sum(x[2] for x in entries)
  entries.sort()
  removed = 0
  for _, _, size, path in entries:
    if total <= max_bytes:
      break
    try:
      os.unlink(path)
    except OSError:
      continue
    total -= size
    removed += 1
  return removed


def _siblings(directory: str, key: dict, name: str) -> list[str]:
  prefix = key["program"][:32] + "-"
  try:
    return [
      os.path.join(directory, n)
      for n in os.listdir(directory)
      if n.startswith(prefix) and n.endswith(SUFFIX) and n != name
    ]
  except OSError:
    return []


def _rejected_sibling(directory: str, key: dict, name: str) -> str:
  """Why entries of the same program for another environment do not apply."""
  for path in _siblings(directory, key, name)[:4]:
    _, reason = read_entry(path, key)
    if reason and reason != "absent":
      return f"{os.path.basename(path)}: {reason}"
  return ""


# ----------------------------------------------------------------- build


def wrap_build(
  build: Callable[[], Any],
  make: Callable[[Any, float, tuple], Any],
  owner: Any,
  in_tree: Any,
  out_tree: Any,
  leaves: Sequence[Any],
  program: Any,
  params: Any,
  context: tuple,
  counters: Sequence[Any] = (),
) -> Callable[[], Any]:
  """``build`` going through the disk cache.

  Args:
    build: compiles (lowering included); returns an executable record with
      ``compiled``, ``compile_seconds``, ``warnings`` and ``const_args``.
    make: ``make(compiled, compile_seconds, warnings)`` builds that record
      from a loaded ``jax.stages.Compiled``.
    owner: the trace entry (for ``explain_miss``).
    in_tree, out_tree: the trace's argument and output trees.
    leaves: the call's flat arguments.
    program, params: the program's and its parameters' fingerprints.
    context: the trace context values.
    counters: cache counters given ``disk_*`` increments as well.
  """
  directory = config.cache_dir
  if directory is None:
    return build

  def count(field: str, n: Any = 1) -> None:
    setattr(COUNTERS, field, getattr(COUNTERS, field) + n)
    for c in counters:
      attr = "disk_" + field
      if hasattr(c, attr):
        setattr(c, attr, getattr(c, attr) + n)

  def through_disk() -> Any:
    try:
      key = make_key(program, params, leaves, context)
    except NotPersistable as e:
      count("unpersistable")
      _note(owner, f"disk cache: not persisted ({e})")
      return build()
    name = _file_name(key)
    path = os.path.join(directory, name)
    t0 = time.perf_counter()
    payload, reason = read_entry(path, key)
    if payload is not None:
      try:
        record = pickle.loads(payload)
        by_id = {d.id: d for d in _jax_devices(record["platform"])}
        compiled = _serialize.deserialize_and_load(
          record["executable"],
          in_tree,
          out_tree,
          backend=record["platform"],
          execution_devices=[by_id[i] for i in record["devices"]],
        )
        exe = make(
          compiled,
          record["compile_seconds"],
          tuple(UserWarning(m) for m in record["warnings"]),
        )
      except Exception as e:  # pylint: disable=broad-except
        reason = f"corrupt: could not load ({type(e).__name__}: {e})"
      else:
        count("hits")
        count("bytes_read", len(payload))
        count("load_s", time.perf_counter() - t0)
        try:
          os.utime(path)  # least recently used: touched on every hit
        except OSError:
          pass
        _note(owner, f"disk cache: loaded {name}")
        for w in exe.warnings:  # what lowering anew would have said
          warnings.warn(w, stacklevel=6)
        return exe
    count("misses")
    if reason == "absent":
      reason = _rejected_sibling(directory, key, name)
      note = f"disk cache: no entry {name}" + (
        f"; an entry for another environment was rejected: {reason}"
        if reason
        else ""
      )
    else:
      count("rejected")
      note = f"disk cache: entry {name} rejected: {reason}; rewritten"
    exe = build()
    note += _store(directory, name, key, exe, count)
    _note(owner, note)
    return exe

  return through_disk


def _store(
  directory: str, name: str, key: dict, exe: Any, count: Callable[..., None]
) -> str:
  if exe.const_args:
    return " (not written: the executable has constant arguments)"
  try:
    serialized, _, _ = _serialize.serialize(exe.compiled)
    devices = exe.compiled.runtime_executable().local_devices()
    payload = pickle.dumps(
      {
        "executable": serialized,
        "platform": devices[0].platform,
        "devices": [d.id for d in devices],
        "compile_seconds": exe.compile_seconds,
        "warnings": [str(w) for w in exe.warnings],
      },
      protocol=4,
    )
  except Exception as e:  # pylint: disable=broad-except
    return f" (not written: not serializable: {type(e).__name__}: {e})"
  try:
    os.makedirs(directory, exist_ok=True)
    written = write_entry(directory, name, key, payload)
    count("writes")
    count("bytes_written", written)
    count("evictions", evict(directory, config.max_bytes, keep=name))
  except OSError as e:
    warnings.warn(
      f"jaxworks.jit_cache: could not write the disk cache entry "
      f"{name} in {directory}: {e}",
      RuntimeWarning,
    )
    return f" (not written: {e})"
  return ""
