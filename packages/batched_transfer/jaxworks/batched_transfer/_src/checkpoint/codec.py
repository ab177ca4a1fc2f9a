"""The opt-in checkpoint codec: ``save(..., compression="zstd")``.

Raw ``.npy`` files stay the default format. With ``compression="zstd"`` a
directory checkpoint stores each array as ``<key>.npy.zst``: one Zstandard
frame (level 1) holding exactly the bytes of
the ``.npy`` file the raw save writes, so ``zstd -d`` gives that file back.
The codec is recorded twice, by the file's suffix and in the record
(``codecs``, record format 3), and the record's CRC-32C sums are those of the
uncompressed data, checked as restore decompresses. It pays on compressible
trees (an optimizer state at initialisation, masks, constant buffers); on
random values it costs more CPU than it saves in bytes written. The
``zstandard`` package (``pip install 'jaxworks-batched-transfer[zstd]'``)
is imported on the first compressed save or restore only.

>>> import io, numpy as np
>>> f = io.BytesIO()
>>> with compressing("zstd", f) as out:
...   np.save(out, np.zeros((256, 256), np.float32))
>>> len(f.getvalue()) < 1024  # 256 KiB of zeros
True
>>> open_reader("zstd", io.BytesIO(f.getvalue())).read(6)
b'\\x93NUMPY'
"""

from __future__ import annotations

import types
from typing import Any

#: The codecs save writes, by name, and the suffix of their files.
SUFFIXES = {"zstd": ".zst"}
#: Zstandard's level: the fastest of its regular levels (on compressible
#: arrays the ratio hardly moves with the level, the time does).
LEVEL = 1
#: Bytes handed to the compressor per write (hostvalue.write_npy), each then
#: summed (CRC-32C) while the core's cache still holds it. The compressor
#: copies its input into its own window first; with 8 MiB writes the sums
#: then read the data from memory again. Saving 1 GiB of zeros, interleaved:
#: 8 MiB 161 ms, 2 MiB 156, 1 MiB 149, 512 KiB 150, 64 KiB 290 (the
#: compressor's per-call work).
WRITE_STEP = 1 << 20


def check(api: str, compression: Any) -> str | None:
  """``compression`` if it is a codec save writes (None: raw files)."""
  if compression is None or compression in SUFFIXES:
    return compression
  raise ValueError(
    f"{api}: compression={compression!r} is not a codec save writes; pass "
    f"None (raw .npy files, the default) or one of {sorted(SUFFIXES)}"
  )


def file_name(key: str, codec: str | None) -> str:
  """The name of the file of the array at ``key``."""
  return key + ".npy" + ("" if codec is None else SUFFIXES[codec])


def split_name(name: str) -> tuple[str, str | None] | None:
  """``(key, codec)`` of an array file's name, None for another file."""
  if name.endswith(".npy"):
    return name[:-4], None
  for codec, suffix in SUFFIXES.items():
    if name.endswith(".npy" + suffix):
      return name[: -4 - len(suffix)], codec
  return None


def _zstd(api: str = "jaxworks.batched_transfer") -> types.ModuleType:
  try:
    import zstandard
  except ImportError:
    raise ModuleNotFoundError(
      f"{api}: compression='zstd' needs the zstandard package; install it "
      "with pip install 'jaxworks-batched-transfer[zstd]'",
      name="zstandard",
    ) from None
  return zstandard


def require(api: str, codec: str | None) -> None:
  """Raises ModuleNotFoundError (naming the fix) if ``codec``'s package is
  missing: checked before anything is written."""
  if codec is not None:
    _zstd(api)


def compressing(codec: str, f: Any) -> Any:
  """A context manager: a binary writer whose bytes reach the file ``f``
  compressed (the frame is finished when the context exits)."""
  z = _zstd()
  # No frame checksum: the record's CRC-32C of the uncompressed data is
  # checked as restore decompresses (a second checksum would cost a third
  # of the compression's time).
  compressor = z.ZstdCompressor(level=LEVEL)
  return compressor.stream_writer(f, closefd=False)


def open_reader(codec: str, f: Any) -> Any:
  """A binary reader of the .npy bytes of the compressed file ``f`` (it has
  ``read`` and ``readinto``)."""
  z = _zstd()
  return z.ZstdDecompressor().stream_reader(f, closefd=False)


def errors() -> tuple[type[BaseException], ...]:
  """What reading a damaged compressed file raises."""
  return (_zstd().ZstdError,)
