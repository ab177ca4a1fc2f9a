"""Restore of a checkpoint one process wrote: .npy files in a directory, or an .npz.

``open_checkpoint`` reads only headers: each array becomes a
``reader.StoredFile``, read later through the descriptor its header came
from (a ``LocalOpened`` holds them). ``restore_arrays`` (``Opened``'s, the
same for a bucket's ``restore_objects.ObjectOpened``) checks every array
against the target before anything is read, then streams them (prefetch)
through the opened checkpoint's reader (``Opened.files``) into buffers of
restore's own, which placing may alias (on CPU the device array takes the
buffer over).
"""

from __future__ import annotations

import abc
import dataclasses
import errno
import math
import os
import stat
import struct
from typing import Any
import zipfile
import zlib

import jax
import numpy as np

from .. import jax_internals
from ..api import place
from . import codec
from . import format
from . import prefetch
from . import reader
from .keys import astype
from .keys import cast_to
from .storage import LOG
from .target import Request
from .target import restore_placement

# A zip member's local header: 30 bytes; the last two: name and extra lengths.
_ZIP_LOCAL_HEADER = struct.Struct("<4s5H3L2H")
_ZIP_ERRORS = (zipfile.BadZipFile, zlib.error)


class Opened(abc.ABC):
  """A checkpoint one process wrote, opened once: its arrays' headers
  (``stored``) and its record, read when it was opened, and what reads its
  arrays (``files``). ``LocalOpened`` holds a directory's or an .npz's
  files, ``restore_objects.ObjectOpened`` a bucket's objects;
  ``close()`` lets go of them."""

  def __init__(self, api: str, path: str) -> None:
    self.api, self.path = api, path
    self.stored: dict[str, reader.Stored] = {}
    self.record: bytes | None = None

  def contents(
    self,
  ) -> tuple[dict[str, tuple[tuple[int, ...], np.dtype]], format.Record]:
    """(key -> (shape, exact dtype) of every array, the record written by
    save, an empty one if there is none); sets each stored array's exact
    dtype and checksums from the record."""
    api, record = self.api, format.Record()
    where = f"the record {format.RECORD!r} of {self.path!r}"
    if self.record is not None:
      record = format.decode_record(api, where, self.record)
    for key, s in self.stored.items():
      s.sums = record.crc32c.get(key)
      if self.record is not None and record.codecs.get(key) != s.codec:
        raise ValueError(
          f"{api}: {s.where} is stored "
          f"{'raw' if s.codec is None else 'with ' + s.codec} but {where} "
          f"says {record.codecs.get(key) or 'raw'}; the checkpoint is "
          "damaged (a file was replaced): write the checkpoint again"
        )
      # A Fortran-order file of the shape recorded is read as numpy reads
      # it where the record does not say C order (earlier versions wrote
      # host copies that came back so, as a TPU's can, in Fortran order).
      differs = format.header_differences(
        s.shape,
        s.dtype,
        s.fortran,
        record_shape=record.shapes.get(key),
        c_order=record.c_order,
      )
      if differs:
        raise ValueError(
          f"{api}: {s.where} has a header that disagrees with {where}: "
          f"{differs}; the checkpoint is damaged (a file was replaced): "
          "write the checkpoint again"
        )
      if self.record is not None and s.dtype.byteorder == ">":
        raise ValueError(
          f"{api}: {s.where} has a big-endian header ({s.dtype.str}), which "
          f"save never writes ({where} names its checksums of little-endian "
          "data); the checkpoint is damaged (a header was edited): write "
          "the checkpoint again"
        )
      name = record.dtypes.get(key)
      if name is None:
        continue
      s.exact = format.exact_dtype(api, where, key, name)
      header = s.dtype.newbyteorder("=")
      if s.exact.itemsize != s.dtype.itemsize or (
        header.kind != "V" and header != s.exact
      ):
        raise ValueError(
          f"{api}: {s.where} has a header of dtype {s.dtype.str} but {where} "
          f"says {name}; the checkpoint is damaged"
        )
    arrays = {k: (s.shape, s.value_dtype) for k, s in self.stored.items()}
    format.check_arrays_present(api, self.path, record, arrays)
    return arrays, record

  @abc.abstractmethod
  def files(
    self, threads: int, verify: bool, order: list[Any], budget: int
  ) -> reader.Reader:
    """What reads the arrays, which restore reads in ``order``
    (restore_objects: from a bucket, ``budget`` bytes ahead)."""

  def restore_arrays(self, request: Request) -> list[Any]:
    """The arrays ``request`` asks for, validated, read and placed."""
    return restore_arrays(self, request)

  def close(self) -> None:
    pass


class LocalOpened(Opened):
  """A checkpoint in local files: every header was read from a descriptor
  held here, and the data is read through the same descriptors, so a
  checkpoint replaced at its path (a save with overwrite=True) while
  restore runs is read whole as it was validated, or fails; ``close()``
  closes them."""

  def __init__(self, api: str, path: str) -> None:
    super().__init__(api, path)
    self.fds: list[int] = []

  def files(
    self, threads: int, verify: bool, order: list[Any], budget: int
  ) -> reader.Files:
    return reader.Files(threads, verify)

  def close(self) -> None:
    fds, self.fds = self.fds, []
    for fd in fds:
      os.close(fd)


def not_a_checkpoint(api: str, path: str) -> FileNotFoundError:
  """The error for a directory without its record: a save that did not
  commit (or was deleted), or a directory save never wrote."""
  return FileNotFoundError(
    errno.ENOENT,
    f"{api}: no checkpoint at {path!r}: the directory holds no "
    f"{format.RECORD!r}, which every checkpoint save commits (a directory "
    "without it is a save that did not commit, a deleted checkpoint, or not "
    "a checkpoint); restore one that save completed",
    path,
  )


def open_checkpoint(api: str, path: str) -> LocalOpened:
  """Opens the .npz ``path`` and reads its headers (a directory: see
  ``open_directory``)."""
  try:
    fd = os.open(path, reader.OPEN_FLAGS | os.O_NONBLOCK)
  except FileNotFoundError:
    raise FileNotFoundError(
      errno.ENOENT,
      f"{api}: no checkpoint at {path!r} (expected an .npz file or a "
      "directory of .npy files written by save)",
      path,
    ) from None
  opened = LocalOpened(api, path)
  opened.fds.append(fd)
  try:
    mode = os.fstat(fd).st_mode
    if stat.S_ISREG(mode):
      _open_npz(api, path, fd, opened)
    elif stat.S_ISDIR(mode):
      raise IsADirectoryError(
        errno.EISDIR, f"{api}: {path!r} is a directory, not an .npz", path
      )
    else:
      raise ValueError(
        f"{api}: {path!r} is neither a directory nor a regular file; restore "
        "reads an .npz file or a directory of .npy files written by save"
      )
  except BaseException:
    opened.close()
    raise
  return opened


def open_directory(api: str, path: str, top: int, record: bytes) -> LocalOpened:
  """The checkpoint one process wrote in the directory ``top`` (a
  descriptor this call takes over), whose ``record`` was read through it:
  exactly the files the record names, each opened relative to ``top`` and
  its header read. A named file that is gone raises ``reader.CheckpointReplacedError``
  (the checkpoint was replaced or deleted meanwhile); files it does not
  name are not part of the checkpoint."""
  opened = LocalOpened(api, path)
  opened.fds.append(top)
  opened.record = record
  try:
    where = f"the record {format.RECORD!r} of {path!r}"
    decoded = format.decode_record(api, where, record)
    names = decoded.files()
    if names is None:  # format 1 named no files: those there
      names = _listed(top)
    for rel in names:
      if rel == format.PACKED and decoded.packed:
        _open_packed(api, path, top, decoded.packed, opened)
      else:
        _open_file(api, path, top, rel, opened)
  except BaseException:
    opened.close()
    raise
  return opened


def _listed(top: int) -> list[str]:
  """The array files in the directory ``top`` (for a record that names
  none), relative to it, sorted."""
  out = []
  for root, dirs, names, _ in os.fwalk(".", dir_fd=top):
    dirs.sort()
    for name in sorted(names):
      rel = os.path.normpath(os.path.join(root, name))
      if codec.split_name(rel) is not None:
        out.append(rel)
  return out


def _open_file(
  api: str, path: str, top: int, rel: str, opened: LocalOpened
) -> None:
  """Opens the array file ``rel`` of the directory ``top`` and reads its
  header into ``opened.stored``."""
  out = opened.stored
  file = os.path.join(path, rel)
  split = codec.split_name(rel)
  if split is None:
    raise ValueError(f"{api}: {file!r} is not an array file save writes")
  key, use = split[0].replace(os.sep, "/"), split[1]
  fd, st = reader.open_named(api, file, top, rel, key)
  try:
    with open(fd, "rb", closefd=False) as f:
      if use is None:
        shape, fortran, dtype = reader.read_header(f)
        offset = f.tell()
      else:
        shape, fortran, dtype = reader.read_header(codec.open_reader(use, f))
        offset = 0
  except reader.codec_errors(use, OSError, ValueError, EOFError) as err:
    os.close(fd)
    raise ValueError(
      f"{api}: {file!r} is not a readable .npy file: {err}"
    ) from None
  if len(opened.fds) <= reader.HELD_FILES:
    opened.fds.append(fd)
  else:  # opened again, relative to the directory, when read
    os.close(fd)
    fd = -1
  if dtype.hasobject:
    raise ValueError(
      f"{api}: {file!r} holds Python objects, which restore does not load"
    )
  # A compressed file's data is as long as its header says, or reading
  # it raises (the frame is decompressed whole, and its end checked).
  present = (
    st.st_size - offset if use is None else math.prod(shape) * dtype.itemsize
  )
  out[key] = reader.StoredFile(
    tuple(shape), dtype, fortran, repr(file), present, file,
    offset, None, fd=fd, dir_fd=top, name=rel, stamp=reader.stamp(st),
    codec=use,
  )  # fmt: skip


def _open_packed(
  api: str, path: str, top: int, keys: list[str], opened: LocalOpened
) -> None:
  """Opens the archive of the packed leaves (``format.PACKED``) of the
  directory ``top`` and reads the headers of its members, which must be
  exactly the ``keys`` its record packed."""
  file = os.path.join(path, format.PACKED)
  fd, _ = reader.open_named(api, file, top, format.PACKED, keys[0])
  opened.fds.append(fd)
  members = LocalOpened(api, file)
  _open_npz(api, file, fd, members)
  if (
    set(members.stored) != set(keys)
    or members.record is not None
    or any(s.member is not None for s in members.stored.values())
  ):
    raise ValueError(
      f"{api}: {file!r} does not hold exactly the uncompressed members its "
      "record packed; the checkpoint is damaged (a file was replaced): "
      "write the checkpoint again"
    )
  opened.stored.update(members.stored)


@dataclasses.dataclass
class Member:
  """One ``.npy`` member of an .npz archive, as ``npz_members`` read it."""

  key: str
  where: str
  shape: tuple[int, ...]
  fortran: bool
  dtype: np.dtype
  offset: int  # where a stored member's data starts in the archive (else 0)
  data_bytes: int
  member: str | None  # a compressed member's name (read through zipfile)
  header_crc: int  # a stored member's: the CRC-32 of its .npy header
  crc: int  # the archive's CRC-32 of the member


def npz_members(
  api: str, path: str, raw: Any, size: int
) -> tuple[bytes | None, list[Member]]:
  """(the record member's bytes or None, the ``.npy`` members) of the .npz
  archive ``raw`` (a seekable binary file of ``size`` bytes, at ``path``):
  each stored member's header read in place, each compressed one's through
  zipfile.

  Raises:
    ValueError: not a readable archive or member, or a member of objects.
  """
  try:
    zf = zipfile.ZipFile(raw)
  except (OSError, zipfile.BadZipFile) as err:
    raise ValueError(
      f"{api}: {path!r} is not a readable .npz file: {err}"
    ) from None
  record, out = None, []
  with zf:
    for info in zf.infolist():
      where = f"member {info.filename!r} of {path!r}"
      try:
        if info.filename == format.RECORD:
          record = zf.read(info)
          continue
        if not info.filename.endswith(".npy"):
          continue
        if (
          info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1
        ):
          raw.seek(info.header_offset)
          fields = _ZIP_LOCAL_HEADER.unpack(raw.read(_ZIP_LOCAL_HEADER.size))
          start = info.header_offset + _ZIP_LOCAL_HEADER.size + sum(fields[-2:])
          raw.seek(start)
          shape, fortran, dtype = reader.read_header(raw)
          offset = raw.tell()
          raw.seek(start)
          header_crc = zlib.crc32(raw.read(offset - start))
          # The member's data ends where the archive says it does, and never past the file.
          end = min(start + info.file_size, start + info.compress_size, size)
          data_bytes = end - offset
          member = None
        else:  # compressed members are inflated when their batch comes
          with zf.open(info) as f:
            shape, fortran, dtype = reader.read_header(f)
            data_bytes = info.file_size - f.tell()
          offset, member, header_crc = 0, info.filename, 0
      except (OSError, ValueError, EOFError, struct.error, *_ZIP_ERRORS) as err:
        raise reader.unreadable(
          f"{api}: {where} is not a readable .npy", err, "save it again"
        ) from None
      if dtype.hasobject:
        raise ValueError(f"{api}: {where} holds Python objects")
      out.append(
        Member(
          info.filename[:-4], where, tuple(shape), fortran, dtype, offset,
          data_bytes, member, header_crc, info.CRC,
        )
      )  # fmt: skip
  return record, out


def _open_npz(api: str, path: str, fd: int, opened: LocalOpened) -> None:
  st = os.fstat(fd)
  with open(fd, "rb", closefd=False) as raw:
    opened.record, members = npz_members(api, path, raw, st.st_size)
  for m in members:
    opened.stored[m.key] = reader.StoredFile(
      m.shape, m.dtype, m.fortran, m.where, m.data_bytes, path, m.offset,
      m.member, fd=fd, stamp=reader.stamp(st), header_crc=m.header_crc,
      zip_crc=m.crc if m.member is None else None,
    )  # fmt: skip


def _dtype_text(dtype: np.dtype) -> str:
  return dtype.name if dtype.isnative else dtype.str


def _check_leaf(
  api: str, where: str, key: str, s: reader.Stored, shape: tuple[int, ...]
) -> None:
  """Shape, dtype and data extent of one stored array against its target
  leaf (a dtype other than the stored one is a cast, see load)."""
  if s.exact is None and s.dtype.kind == "V" and s.dtype.fields is None:
    raise ValueError(
      f"{api}: the leaf at {where} (key {key!r}) is stored in {s.where} as raw "
      f"{s.dtype.itemsize}-byte values with no dtype record, so its type is unknown (several "
      f"types are {s.dtype.itemsize} bytes wide); write the checkpoint with "
      "jaxworks.batched_transfer.save, which records exact dtype names"
    )
  if s.shape != shape:
    raise ValueError(
      f"{api}: the leaf at {where} (key {key!r}) is stored in {s.where} as "
      f"{_dtype_text(s.value_dtype)}{list(s.shape)} but the target expects "
      f"shape {list(shape)}; restore into a target of the stored shape "
      "(bt.metadata(path) lists them)"
    )
  if s.data_bytes != s.nbytes:
    raise ValueError(
      f"{api}: the leaf at {where} (key {key!r}): {s.where} holds {s.data_bytes} bytes of "
      f"data but its header ({_dtype_text(s.value_dtype)}{list(s.shape)}) needs {s.nbytes}; the file "
      "is truncated or damaged. Nothing was placed"
    )


def _default_memory(sharding: Any) -> bool:
  """Whether ``sharding`` places arrays in its devices' default memory."""
  if sharding is None:
    return False
  kind = sharding.memory_kind
  return kind is None or all(
    d.default_memory().kind == kind for d in sharding.device_set
  )


def place_pieces(a: reader.Pieces, sharding: Any) -> Any:
  """The array ``a`` was read for (``reader.Pieces``): each device's part
  placed on it from its own buffer, without a copy on CPU."""
  index_map = sharding.addressable_devices_indices_map(a.shape)
  shard_shape = tuple(sharding.shard_shape(a.shape))
  row = math.prod(a.shape[1:]) * a.dtype.itemsize
  parts = [a.part(idx[0].indices(a.shape[0])[0] * row, shard_shape)
           for idx in index_map.values()]  # fmt: skip
  aval = jax_internals.device_put_aval(
    jax_internals.ShapedArray(a.shape, a.dtype), sharding
  )
  with jax_internals.explicit_device_put_scope():
    return jax_internals.batched_device_put(
      aval, sharding, parts, list(index_map), True, False
    )


def restore_arrays(opened: Opened, request: Request) -> list[Any]:
  """The arrays of ``request.keys`` (restore sorted the target), validated,
  then read and placed; the placed arrays in order."""
  api, keys, paths, specs = (
    request.api,
    request.keys,
    request.paths,
    request.specs,
  )
  places, max_inflight_bytes = request.places, request.max_inflight_bytes
  stored = opened.stored
  normalized: dict[int, Any] = {}
  for p, where, key, (want_shape, _, _) in zip(places, paths, keys, specs):
    _check_leaf(api, where, key, stored[key], want_shape)
    restore_placement(api, p, where, want_shape, normalized)
  casts = [cast_to(stored[k].value_dtype, s[1]) for k, s in zip(keys, specs)]
  # Arrays split in rows whose blocks would start off alignment in one
  # buffer: a buffer per device (reader.Pieces), placed without a copy.
  pieces: dict[int, Any] = {}  # index -> its sharding
  for i, (p, key) in enumerate(zip(places, keys)):
    s = stored[key]
    sharding, layout, _ = normalized[id(p)]
    s.pieces = None
    if (
      casts[i] is None
      and layout is None
      and s.codec is None
      and s.member is None
      and not s.fortran
      and s.dtype == s.value_dtype
      and jax.dtypes.canonicalize_dtype(s.dtype) == s.dtype
      and s.nbytes >= reader.OWN_MAP
      and _default_memory(sharding)
    ):
      s.pieces = reader.device_pieces(s.shape, s.dtype, sharding)
      if s.pieces is not None:
        pieces[i] = sharding
  # Arrays in a bucket are read ahead, concurrently, up to half the budget
  # (the batches read and not yet placed hold the rest).
  order = [stored[k] for k in keys]
  files = opened.files(
    request.read_threads, request.verify, order, max_inflight_bytes // 2
  )

  def read(batch: list[int]) -> list[np.ndarray]:
    out = []
    for i in batch:
      LOG.debug("reading %s", stored[keys[i]].where)
      a = reader.load(api, paths[i], keys[i], stored[keys[i]], files)
      cast = casts[i]
      out.append(a if cast is None else astype(a, cast))
    return out

  def place_batch(batch: list[int], arrays: Any) -> Any:
    if not pieces:
      return place(arrays, [places[i] for i in batch], restored=True, api=api)
    out = [
      place_pieces(a, pieces[i]) if i in pieces else None
      for i, a in zip(batch, arrays)
    ]
    rest = [j for j, i in enumerate(batch) if i not in pieces]
    if rest:
      placed = place(
        [arrays[j] for j in rest],
        [places[batch[j]] for j in rest],
        restored=True,
        api=api,
      )
      for j, y in zip(rest, placed):
        out[j] = y
    return out

  sizes = [stored[k].nbytes for k in keys]
  try:
    return prefetch.stream(
      sizes, max_inflight_bytes, read, place_batch, request.progress
    )
  finally:
    files.close()
