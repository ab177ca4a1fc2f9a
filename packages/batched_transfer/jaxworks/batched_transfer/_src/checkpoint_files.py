"""The checkpoint files: .npy headers in a directory or an .npz, the dtype record.

Opening a checkpoint reads only headers: each array becomes a ``Stored`` with
its shape, header dtype, order, the extent of its data and a way to load it.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import json
import os
import struct
from typing import Any
import zipfile
import zlib

import numpy as np

_ZIP_LOCAL_HEADER = struct.Struct(
  "<4s5H3L2H"
)  # 30 bytes; last two: name and extra lengths
# The exact dtype name of every leaf, next to the arrays (a member of the .npz, a file in
# the directory): .npy headers cannot name bfloat16, float8_*, int4, ... types.
DTYPE_RECORD = "jaxworks_dtypes.json"
RECORD_FORMAT = 1


@dataclasses.dataclass
class Stored:
  """One array on disk: its header, where its data lies, and how to get it."""

  shape: tuple[int, ...]
  dtype: (
    np.dtype
  )  # as the .npy header says (may be raw void bytes, may be big-endian)
  fortran: bool
  where: str  # "'<file>'" or "member '<name>' of '<file>'", for messages
  data_bytes: int  # the bytes of data present after the header
  load: Callable[[], np.ndarray]  # memory-mapped where the format allows
  exact: np.dtype | None = None  # the dtype the record names (None: no record)

  @property
  def nbytes(self) -> int:
    """The bytes of data the header describes."""
    return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

  @property
  def value_dtype(self) -> np.dtype:
    """The dtype of the values: the recorded one, else the header's, in native order."""
    if self.exact is not None:
      return self.exact
    return self.dtype.newbyteorder("=")


def _read_header(f: Any) -> tuple[tuple[int, ...], bool, np.dtype]:
  version = np.lib.format.read_magic(f)
  if version == (1, 0):
    return np.lib.format.read_array_header_1_0(f)
  return np.lib.format.read_array_header_2_0(f)


def _mapper(
  file: str, offset: int, shape: tuple[int, ...], dtype: np.dtype, fortran: bool
) -> Callable[[], np.ndarray]:
  def load() -> np.ndarray:
    if int(np.prod(shape, dtype=np.int64)) == 0:
      return np.empty(shape, dtype, order="F" if fortran else "C")
    return np.memmap(
      file,
      dtype=dtype,
      mode="r",
      offset=offset,
      shape=shape,
      order="F" if fortran else "C",
    )

  return load


def open_directory(
  api: str, path: str
) -> tuple[dict[str, Stored], bytes | None]:
  out: dict[str, Stored] = {}
  record = None
  for root, dirs, files in os.walk(path):
    dirs.sort()
    for name in sorted(files):
      file = os.path.join(root, name)
      if root == path and name == DTYPE_RECORD:
        with open(file, "rb") as f:
          record = f.read()
        continue
      if not name.endswith(".npy"):
        continue
      key = os.path.relpath(file, path)[:-4].replace(os.sep, "/")
      try:
        with open(file, "rb") as f:
          shape, fortran, dtype = _read_header(f)
          offset = f.tell()
          size = os.fstat(f.fileno()).st_size
      except (OSError, ValueError, EOFError) as err:
        raise ValueError(
          f"{api}: {file!r} is not a readable .npy file: {err}"
        ) from None
      if dtype.hasobject:
        raise ValueError(
          f"{api}: {file!r} holds Python objects, which restore does not load"
        )
      out[key] = Stored(
        tuple(shape),
        dtype,
        fortran,
        repr(file),
        size - offset,
        _mapper(file, offset, shape, dtype, fortran),
      )
  return out, record


def open_npz(api: str, path: str) -> tuple[dict[str, Stored], bytes | None]:
  out: dict[str, Stored] = {}
  record = None
  try:
    zf = zipfile.ZipFile(path)
  except (OSError, zipfile.BadZipFile) as err:
    raise ValueError(
      f"{api}: {path!r} is not a readable .npz file: {err}"
    ) from None
  with zf, open(path, "rb") as raw:
    file_size = os.fstat(raw.fileno()).st_size
    for info in zf.infolist():
      where = f"member {info.filename!r} of {path!r}"
      try:
        if info.filename == DTYPE_RECORD:
          record = zf.read(info)
          continue
        if not info.filename.endswith(".npy"):
          continue
        key = info.filename[:-4]
        if (
          info.compress_type == zipfile.ZIP_STORED and not info.flag_bits & 0x1
        ):
          raw.seek(info.header_offset)
          fields = _ZIP_LOCAL_HEADER.unpack(raw.read(_ZIP_LOCAL_HEADER.size))
          start = (
            info.header_offset
            + _ZIP_LOCAL_HEADER.size
            + fields[-2]
            + fields[-1]
          )
          raw.seek(start)
          shape, fortran, dtype = _read_header(raw)
          offset = raw.tell()
          # The member's data ends where the archive says it does, and never past the file.
          end = min(
            start + info.file_size, start + info.compress_size, file_size
          )
          data_bytes = end - offset
          load = _mapper(path, offset, shape, dtype, fortran)
        else:  # compressed members cannot be mapped; they are read when their batch comes
          with zf.open(info) as member:
            shape, fortran, dtype = _read_header(member)
            data_bytes = info.file_size - member.tell()
          load = _reader(path, info.filename)
      except (
        OSError,
        ValueError,
        EOFError,
        struct.error,
        zipfile.BadZipFile,
        zlib.error,
      ) as err:
        raise ValueError(
          f"{api}: {where} is not a readable .npy: {err}"
        ) from None
      if dtype.hasobject:
        raise ValueError(f"{api}: {where} holds Python objects")
      out[key] = Stored(tuple(shape), dtype, fortran, where, data_bytes, load)
  return out, record


def _reader(path: str, member: str) -> Callable[[], np.ndarray]:
  def load() -> np.ndarray:
    with zipfile.ZipFile(path) as zf, zf.open(member) as f:
      return np.lib.format.read_array(f, allow_pickle=False)

  return load


def apply_record(
  api: str, path: str, stored: dict[str, Stored], record: bytes | None
) -> None:
  """Sets each stored array's exact dtype from the dtype record written by save."""
  if record is None:
    return
  where = f"the dtype record {DTYPE_RECORD!r} of {path!r}"
  try:
    data = json.loads(record.decode())
    names = data["dtypes"]
    if data.get("format") != RECORD_FORMAT or not isinstance(names, dict):
      raise ValueError(f"unknown format {data.get('format')!r}")
  except (
    UnicodeDecodeError,
    ValueError,
    KeyError,
    TypeError,
    AttributeError,
  ) as err:
    raise ValueError(
      f"{api}: {where} is damaged ({err}); it was written by "
      "jaxworks.batched_transfer.save: write the checkpoint again"
    ) from None
  for key, s in stored.items():
    name = names.get(key)
    if name is None:
      continue
    try:
      exact = np.dtype(name) if isinstance(name, str) else None
    except TypeError:
      exact = None
    if (
      exact is None
      or exact.name != name
      or exact.hasobject
      or exact.fields is not None
    ):
      raise ValueError(
        f"{api}: {where} names the dtype {name!r} for key {key!r}, which is not "
        "a dtype numpy or ml_dtypes knows; is a newer ml_dtypes needed?"
      )
    header = s.dtype.newbyteorder("=")
    if exact.itemsize != s.dtype.itemsize or (
      header.kind != "V" and header != exact
    ):
      raise ValueError(
        f"{api}: {s.where} has a header of dtype {s.dtype.str} but {where} "
        f"says {name}; the checkpoint is damaged"
      )
    s.exact = exact


def load(api: str, where: str, key: str, s: Stored) -> np.ndarray:
  """The data of one stored array, with its exact dtype in native byte order."""
  try:
    a = s.load()
  except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as err:
    raise ValueError(
      f"{api}: the leaf at {where} (key {key!r}): reading {s.where} failed: "
      f"{err}; the file changed or is damaged since restore validated it"
    ) from None
  if a.dtype.kind == "V" and s.exact is not None:
    return a.view(s.exact)
  if not a.dtype.isnative:
    return a.astype(a.dtype.newbyteorder("="))
  return a
