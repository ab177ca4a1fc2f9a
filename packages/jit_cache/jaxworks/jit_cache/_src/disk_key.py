"""Keys of the disk cache: a canonical, process-independent program digest.

A key is the SHA-256 digest of a canonical text encoding of the program's
structural fingerprint (equations, primitives, parameters, literals and
constants by content), the argument placements (shardings with device ids,
committedness) and the trace context, plus the environment that makes an
executable valid: jax, jaxlib and jaxworks versions, backend platforms and
platform versions, devices (ids, kinds, processes), ``XLA_FLAGS`` and jax's
configuration. Anything compared by identity (a host callback, a large
array, a user object, a primitive jax does not define) raises
:class:`NotPersistable`: such a program is never written to disk.

The encoding is built for the first call of a new process: one pass over
the fingerprint, with the type of each value dispatched through a table,
sub-fingerprints encoded once (memoized by object), JAX's interned value
objects (avals, equation contexts, primitives, shardings) encoded once per
process, and sub-tuples the fingerprint shares (the same parameters of a
hundred calls to one inner function) encoded once per key and copied.
"""

from __future__ import annotations

from collections.abc import Sequence
import enum
import hashlib
import json
import os
import sys
import threading
from typing import Any
import weakref

import jax
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

#: Format of an entry file and its key; a change rejects older entries.
FORMAT_VERSION = 2


class NotPersistable(Exception):
  """A key part with no content-based, process-independent encoding."""


_TRUSTED = frozenset({"jax", "jaxlib", "numpy", "ml_dtypes", "builtins"})
_TYPE_TEXT: dict[type, str] = {}


def _type_text(t: type) -> str:
  text = _TYPE_TEXT.get(t)
  if text is None:
    module = getattr(t, "__module__", "") or ""
    if module.split(".")[0] not in _TRUSTED:
      raise NotPersistable(f"type {module}.{t.__qualname__}")
    text = f"T{module}.{t.__qualname__};"
    _TYPE_TEXT[t] = text
    _remember(t, text)  # types are found by the memo of objects too
  return text


class _JaxPrimitives:
  """The primitives jax itself defines: module attributes of jax's modules.

  A primitive is looked up first as ``<name>_p`` in jax's loaded modules,
  lax's first (how jax names nearly all of them), then by a scan of those
  modules' attributes; both remember what they found.
  """

  def __init__(self):
    self.lock = threading.Lock()
    self.known: dict[int, Any] = {}
    self.scanned: set[str] = set()
    self.modules: list[str] = []
    self.seen_modules = -1

  def _jax_modules(self) -> list[str]:
    if len(sys.modules) != self.seen_modules:
      self.seen_modules = len(sys.modules)
      names = [
        n
        for n in list(sys.modules)
        if n.startswith("jax.") or n.startswith("jaxlib.")
      ]
      lax = [n for n in names if n.startswith("jax._src.lax.")]
      self.modules = list(dict.fromkeys(lax + names))
    return self.modules

  def contains(self, prim: Any) -> bool:
    with self.lock:
      if id(prim) in self.known:
        return True
      attr = f"{prim.name}_p"
      modules = sys.modules
      for name in ji.PRIMITIVE_MODULES:  # before listing every module
        if getattr(modules.get(name), attr, None) is prim:
          self.known[id(prim)] = prim
          return True
      names = self._jax_modules()
      for name in names:
        if getattr(modules.get(name), attr, None) is prim:
          self.known[id(prim)] = prim
          return True
      for name in names:
        if name in self.scanned:
          continue
        self.scanned.add(name)
        d = getattr(modules.get(name), "__dict__", None) or {}
        for v in list(d.values()):
          if isinstance(v, jex_core.Primitive):
            self.known[id(v)] = v
        if id(prim) in self.known:
          return True
      return False


PRIMITIVES = _JaxPrimitives()

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

_MEMOIZABLE = (
  jex_core.Primitive,
  ji.AbstractValue,
  jax.sharding.Sharding,
  ji.Mesh,
  ji.AbstractMesh,
  np.dtype,
  jax.Device,
  ji.PyTreeDef,
)


def _remember(v: Any, text: str) -> None:
  with _MEMO_LOCK:
    if len(_OBJ_MEMO) >= _OBJ_MEMO_MAX:
      _OBJ_MEMO.clear()
    _OBJ_MEMO[id(v)] = (v, text)


_SCALARS: dict[type, Any] = {
  type(None): lambda v: "n;",
  bool: lambda v: "bT;" if v else "bF;",
  int: lambda v: f"i{v};",
  str: lambda v: f"s{len(v)}:{v}",
  bytes: lambda v: f"y{v.hex()};",
  float: lambda v: f"f{v.hex()};",
  complex: lambda v: f"c{v.real.hex()},{v.imag.hex()};",
}


class _Encoder:
  """One canonical encoding: ``parts`` joined is the text."""

  __slots__ = ("parts", "spans")

  def __init__(self):
    self.parts: list[str] = []
    # id -> (start, end) in parts of each sequence encoded so far: the key
    # holds it for the whole encoding, so an id names one object.
    self.spans: dict[int, tuple[int, int]] = {}

  def text(self, v: Any) -> str:
    self.enc(v, 0)
    return "".join(self.parts)

  def enc(self, v: Any, depth: int) -> None:
    t = type(v)
    parts = self.parts
    scalar = _SCALARS.get(t)
    if scalar is not None:
      parts.append(scalar(v))
    elif t is tuple or t is list:
      self.seq(v, t, depth)
    else:
      parts.append(self.other(v, t, depth))

  def seq(self, v: Any, t: type, depth: int) -> None:
    """A tuple or list; its children inline (the hot loop of a key)."""
    parts = self.parts
    spans = self.spans
    span = spans.get(id(v))
    if span is not None:
      parts.extend(parts[span[0] : span[1]])
      return
    if depth > 200:
      raise NotPersistable("too deep")
    append = parts.append
    scalars = _SCALARS
    memo = _OBJ_MEMO
    start = len(parts)
    append(f"{'t' if t is tuple else 'l'}{len(v)}(")
    for x in v:
      tx = type(x)
      scalar = scalars.get(tx)
      if scalar is not None:
        append(scalar(x))
      elif tx is tuple or tx is list:
        span = spans.get(id(x))
        if span is not None:
          parts.extend(parts[span[0] : span[1]])
        else:
          self.seq(x, tx, depth + 1)
      else:
        obj = x.obj if tx is _Identity else x
        hit = memo.get(id(obj))
        if hit is not None and hit[0] is obj:
          append(hit[1])
        else:
          append(self.other(x, tx, depth + 1))
    append(")")
    spans[id(v)] = (start, len(parts))

  def other(self, v: Any, t: type, depth: int) -> str:
    """The encoding of a value other than a scalar or a sequence."""
    if t is type or isinstance(v, type):
      return _type_text(v)
    if t is _fingerprint.Fingerprint:
      return _fingerprint_text(v)
    if t is _Identity:
      return _memo_text(v.obj, _identity_text)
    if t is frozenset and not v:
      return "S()"
    if isinstance(v, _MEMOIZABLE):
      return _memo_text(v, _value_text)
    return _value_text(v, depth)

  def sub(self, v: Any, depth: int) -> str:
    """The encoding of ``v`` alone (for sorted containers)."""
    e = _Encoder()
    e.enc(v, depth + 1)
    return "".join(e.parts)


_Identity = _fingerprint._Identity  # pylint: disable=protected-access


def _memo_text(v: Any, encode: Any) -> str:
  hit = _OBJ_MEMO.get(id(v))
  if hit is not None and hit[0] is v:
    return hit[1]
  text = encode(v, 1)
  _remember(v, text)
  return text


def _fingerprint_text(fp: Any) -> str:
  if fp.pins:
    raise NotPersistable("program holds objects by identity")
  with _MEMO_LOCK:
    text = _FP_MEMO.get(fp)
  if text is None:
    body = _Encoder().text(fp.key)
    text = f"F{hashlib.sha256(body.encode()).hexdigest()};"
    with _MEMO_LOCK:
      _FP_MEMO[fp] = text
  return text


def _value_text(v: Any, depth: int) -> str:
  """The encoding of a value other than a scalar, sequence or type."""
  if depth > 200:
    raise NotPersistable("too deep")
  t = type(v)
  e = _Encoder()
  if t is dict or t is ji.FrozenDict:
    items = sorted(
      e.sub(k, depth) + "=" + e.sub(x, depth) for k, x in v.items()
    )
    return "D(" + ",".join(items) + ")"
  if t is frozenset or t is set:
    return "S(" + ",".join(sorted(e.sub(x, depth) for x in v)) + ")"
  if isinstance(v, np.dtype):
    return f"dt{v.str}:{v.name};"
  if isinstance(v, np.ndarray):
    if v.dtype != object:
      data = np.ascontiguousarray(v).tobytes()
      return f"nd{v.dtype.str}{v.shape}:{hashlib.sha256(data).hexdigest()};"
    return f"no{v.shape}" + e.sub(v.reshape(-1).tolist(), depth)
  if isinstance(v, jax.Device):
    return f"dev{v.platform}:{v.id}:{v.device_kind}:{v.process_index};"
  if isinstance(v, jax.sharding.NamedSharding):
    return "NS" + e.sub((v.mesh, v.spec, v.memory_kind), depth)
  if isinstance(v, jax.sharding.SingleDeviceSharding):
    return "SD" + e.sub((tuple(v.device_set), v.memory_kind), depth)
  if isinstance(v, ji.Mesh):
    axis_types = repr(getattr(v, "axis_types", None))
    return "M" + e.sub((v.devices, tuple(v.axis_names), axis_types), depth)
  if isinstance(v, ji.AbstractMesh):
    text = repr(v)  # axis names, sizes and types, device kind, platform
    if " at 0x" in text:
      raise NotPersistable("abstract mesh without a value encoding")
    return f"AM{len(text)}:{text}"
  if isinstance(v, jax.sharding.Sharding):
    raise NotPersistable(f"sharding {t.__name__}")
  if isinstance(v, ji.PyTreeDef):
    text = str(v)
    if "CustomNode" in text or " at 0x" in text:
      raise NotPersistable("tree with custom nodes")
    return f"tree{len(text)}:{text}"
  if isinstance(v, (jax.Array, jax.core.Tracer)):
    raise NotPersistable("array or tracer by identity")
  return _object_text(v, depth)


def _identity_text(obj: Any, depth: int) -> str:
  if isinstance(obj, jex_core.Primitive):
    if not PRIMITIVES.contains(obj):
      raise NotPersistable(f"primitive {obj.name} not defined by jax")
    return f"P{_type_text(type(obj))}:{obj.name};"
  if isinstance(obj, type):
    return _type_text(obj)
  return _object_text(obj, depth)


def _object_text(v: Any, depth: int) -> str:
  """A jax/numpy object: enum member, object with slots or a plain repr."""
  t = type(v)
  name = _type_text(t)
  if t.__module__ == "builtins":  # functions, methods, modules, ...
    raise NotPersistable(f"object of type {t.__qualname__}")
  if isinstance(v, enum.Enum):
    return f"E{name}.{v.name};"
  slots = _slots(t)
  fields: dict[str, Any] = getattr(v, "__dict__", None) or {}
  if slots or fields:
    e = _Encoder()
    parts = [f"O{name}("]
    for s in slots:
      parts.append(f"{s}=" + e.sub(getattr(v, s, None), depth))
    for k in sorted(fields):
      parts.append(f"{k}=" + e.sub(fields[k], depth))
    return "".join(parts) + ")"
  text = repr(v)
  if " at 0x" in text or "object at" in text:
    raise NotPersistable(f"object {name} without a value encoding")
  return f"R{name}:{len(text)}:{text}"


def encode(v: Any) -> str:
  """The canonical encoding of ``v`` (raises NotPersistable)."""
  return _Encoder().text(v)


def digest(v: Any) -> str:
  """SHA-256 hex digest of ``encode(v)``."""
  return hashlib.sha256(encode(v).encode()).hexdigest()


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


# ------------------------------------------------------------- environment

_CONFIG_SKIP = ("cache", "log", "explain", "traceback")
_PLAIN_SCALARS = frozenset({type(None), bool, int, float, str})
_ENV_MEMO: list = []


def _env_state(platforms: tuple, values: dict) -> tuple:
  return (
    platforms,
    tuple(values.items()),
    os.environ.get("XLA_FLAGS", ""),
    os.environ.get("LIBTPU_INIT_ARGS", ""),
  )


def environment(platforms: Sequence[str]) -> dict:
  """What makes an executable valid besides its program (memoized while
  jax's configuration, the platforms and the environment variables stay)."""
  values = jax.config.values  # a new dict per read: read it once
  state = _env_state(tuple(platforms), values)
  memo = _ENV_MEMO[:]
  if memo:
    try:
      if memo[0] == state:
        return memo[1]
    except Exception:  # pylint: disable=broad-except
      pass  # a config value whose == cannot answer: compute anew
  env = _environment(platforms, values)
  _ENV_MEMO[:] = [state, env]
  return env


def _environment(platforms: Sequence[str], values: dict) -> dict:
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
  for k in sorted(values):
    if any(s in k for s in _CONFIG_SKIP):
      continue
    v = values[k]
    if type(v) in _PLAIN_SCALARS:
      cfg[k] = repr(v)
      continue
    try:
      cfg[k] = digest(v)
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
    "program": digest((program, params, leaf_parts, context)),
  }
  key.update(environment(sorted(platforms)))
  return key


def key_bytes(key: dict) -> bytes:
  """The key as stored in an entry (canonical JSON)."""
  return json.dumps(key, sort_keys=True, separators=(",", ":")).encode()


def file_name(key: dict, suffix: str) -> str:
  """``<program digest>-<full key digest><suffix>``: entries of one program
  for several environments share the prefix."""
  full = hashlib.sha256(key_bytes(key)).hexdigest()
  return f"{key['program'][:32]}-{full[:16]}{suffix}"
