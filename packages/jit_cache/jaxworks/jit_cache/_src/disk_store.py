"""Entry files of the disk cache: format, validation, atomic writes, LRU.

An entry file is ``MAGIC``, a fixed header (format version, key length,
payload length, SHA-256 of the payload), the full key (canonical JSON) and
the payload. Any mismatch (truncated or extended file, flipped payload byte,
another format, another key) rejects the entry with a reason. Writes go to a
temporary file in the same directory, renamed over the entry (atomic on
POSIX and Windows): a reader sees the old entry, the new one, or none. The
directory is bounded: the least recently used entries (by mtime, touched on
every hit) are deleted beyond ``max_bytes``; temporary files of writers dead
for an hour go too.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import time

from . import disk_key as _key

MAGIC = b"JWJITX\r\n"
HEADER = struct.Struct("<IIQ32s")  # format, key length, payload length, sha
SUFFIX = ".jwx"
TMP_PREFIX = ".tmp-"
FORMAT_VERSION = _key.FORMAT_VERSION
_STALE_TMP_S = 3600.0


def why(stored: dict, key: dict) -> str:
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
  if stored_key != _key.key_bytes(key):
    try:
      stored = json.loads(stored_key)
      if not isinstance(stored, dict):
        raise ValueError("not an object")
    except ValueError:
      return None, "corrupt: unreadable key"
    return None, why(stored, key)
  payload = data[head + key_len :]
  if hashlib.sha256(payload).digest() != sha:
    return None, "corrupt: payload checksum mismatch"
  return payload, ""


def write_entry(directory: str, name: str, key: dict, payload: bytes) -> int:
  """Writes an entry atomically; returns the bytes written."""
  key_bytes = _key.key_bytes(key)
  header = MAGIC + HEADER.pack(
    FORMAT_VERSION,
    len(key_bytes),
    len(payload),
    hashlib.sha256(payload).digest(),
  )
  fd, tmp = tempfile.mkstemp(
    prefix=TMP_PREFIX, suffix=SUFFIX + ".part", dir=directory
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
    if e.name.startswith(TMP_PREFIX):
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


def touch(path: str) -> None:
  """Marks an entry used now (least recently used goes first)."""
  try:
    os.utime(path)
  except OSError:
    pass


def rejected_sibling(directory: str, key: dict, name: str) -> str:
  """Why an entry of the same program for another environment (another
  jaxlib, machine, configuration) does not apply here, or ""."""
  prefix = key["program"][:32] + "-"
  try:
    siblings = [
      os.path.join(directory, n)
      for n in os.listdir(directory)
      if n.startswith(prefix) and n.endswith(SUFFIX) and n != name
    ]
  except OSError:
    return ""
  for path in siblings[:4]:
    _, reason = read_entry(path, key)
    if reason and reason != "absent":
      return f"{os.path.basename(path)}: {reason}"
  return ""
