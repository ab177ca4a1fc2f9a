"""The C++ checked read (jaxworks.batched_transfer._checked_read): its CRC-32C
against google-crc32c (Google's C library) on both of its paths, the vector
path chosen exactly where the CPU has it, reads into several buffers that
stop where the file ends or fails, and errors for every bad argument."""

import os
import platform

import google_crc32c
import numpy as np
import pytest

# Private imports below: the C++ checked read checked against its Python twin.
from jaxworks.batched_transfer import _checked_read
from jaxworks.batched_transfer._src.checkpoint import checksum
from jaxworks.batched_transfer._src.checkpoint import reader

_RNG = np.random.default_rng(5)
_DATA = _RNG.integers(0, 256, (1 << 20) + 999, np.uint8)


def _cpu_flags() -> set[str]:
  with open("/proc/cpuinfo") as f:
    for line in f:
      if line.startswith("flags"):
        return set(line.split(":", 1)[1].split())
  return set()


def test_the_vector_path_runs_where_the_cpu_has_it():
  flags = _cpu_flags() if platform.machine() == "x86_64" else set()
  want = {"avx512f", "vpclmulqdq", "sse4_2"} <= flags
  assert _checked_read.FAST is want


@pytest.mark.parametrize(
  "n",
  [0, 1, 7, 8, 9, 255, 256, 257, 511, 512, 513, 767, 768, 1023, 1024, 4097]
  + [int(n) for n in _RNG.integers(0, _DATA.size - 64, 24)],
)
def test_crc32c_against_an_independent_implementation(n):
  # Lengths around the 256-byte fold and the two-block start of the vector
  # path, views at odd offsets, continued sums (cut inside and between folds).
  for at in (0, 1, 3, 61):
    part = _DATA[at : at + n]
    want = google_crc32c.value(part.tobytes())
    assert _checked_read.crc32c(memoryview(part)) == want, (n, at)
    assert _checked_read.crc32c(part.tobytes()) == want
    for cut in {n // 3, n - n // 7, min(n, 256)}:
      head = _checked_read.crc32c(memoryview(part[:cut]))
      got = _checked_read.crc32c(memoryview(part[cut:]), head)
      assert got == want, (n, at, cut)
  assert _checked_read.crc32c(b"123456789") == 0xE3069283


def test_crc32c_is_checksum_crc():
  # The checkpoint format's own sums (fastcrc, or crc32c) on whole chunks.
  data = _RNG.integers(0, 256, checksum.CHUNK + 3, np.uint8)
  for lo in (0, 5):
    part = memoryview(data[lo:])
    assert _checked_read.crc32c(part, 77) == checksum.crc(part, 77)


@pytest.mark.parametrize("step", [1, 100, 4096, 1 << 18, 1 << 30])
@pytest.mark.parametrize(
  "sizes",
  [[_DATA.size - 7], [5, 0, 300_000, 1, _DATA.size - 7 - 300_006], [0]],
)
def test_read_crc32c_fills_the_parts_in_order_and_sums_them(
  tmp_path, step, sizes
):
  path = tmp_path / "data"
  path.write_bytes(_DATA.tobytes())
  parts = [np.zeros(n, np.uint8) for n in sizes]
  fd = os.open(path, os.O_RDONLY)
  try:
    done, value = _checked_read.read_crc32c(
      fd, [p.data for p in parts], 7, step, 11
    )
  finally:
    os.close(fd)
  total = sum(sizes)
  assert done == total
  got = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
  np.testing.assert_array_equal(got, _DATA[7 : 7 + total])
  assert value == google_crc32c.extend(11, _DATA[7 : 7 + total].tobytes())


def test_read_crc32c_stops_where_the_file_ends_or_fails(tmp_path):
  path = tmp_path / "data"
  path.write_bytes(_DATA[:1000].tobytes())
  fd = os.open(path, os.O_RDONLY)
  try:
    parts = [np.full(600, 9, np.uint8), np.full(600, 9, np.uint8)]
    done, value = _checked_read.read_crc32c(fd, [p.data for p in parts], 0, 256)
    assert done == 1000  # the rest left as it was
    assert value == google_crc32c.value(_DATA[:1000].tobytes())
    np.testing.assert_array_equal(parts[1][400:], 9)
    past = _checked_read.read_crc32c(fd, [parts[0].data], 5000, 256, 3)
    assert past == (0, 3)
  finally:
    os.close(fd)
  # A descriptor that cannot be read: nothing read, the sum unchanged.
  dir_fd = os.open(tmp_path, os.O_RDONLY)
  try:
    assert _checked_read.read_crc32c(dir_fd, [parts[0].data], 0, 256, 4) == (
      0,
      4,
    )
  finally:
    os.close(dir_fd)
  closed = 2**30  # no such descriptor
  assert _checked_read.read_crc32c(closed, [parts[0].data], 0, 256) == (0, 0)


@pytest.mark.parametrize("step", [1, 4096, 1 << 18, 1 << 30])
def test_read_into_fills_the_parts_in_order(tmp_path, step):
  path = tmp_path / "data"
  path.write_bytes(_DATA.tobytes())
  sizes = [5, 0, 300_000, 1, _DATA.size - 7 - 300_006]
  parts = [np.zeros(n, np.uint8) for n in sizes]
  fd = os.open(path, os.O_RDONLY)
  try:
    done = _checked_read.read_into(fd, [p.data for p in parts], 7, step)
  finally:
    os.close(fd)
  assert done == sum(sizes)
  np.testing.assert_array_equal(np.concatenate(parts), _DATA[7:])


def test_read_into_stops_where_the_file_ends_or_fails(tmp_path):
  path = tmp_path / "data"
  path.write_bytes(_DATA[:1000].tobytes())
  parts = [np.full(600, 9, np.uint8), np.full(600, 9, np.uint8)]
  fd = os.open(path, os.O_RDONLY)
  try:
    assert _checked_read.read_into(fd, [p.data for p in parts], 0, 256) == 1000
    np.testing.assert_array_equal(parts[1][400:], 9)
    assert _checked_read.read_into(fd, [parts[0].data], 5000, 256) == 0
  finally:
    os.close(fd)
  dir_fd = os.open(tmp_path, os.O_RDONLY)
  try:
    assert _checked_read.read_into(dir_fd, [parts[0].data], 0, 256) == 0
  finally:
    os.close(dir_fd)
  assert _checked_read.read_into(2**30, [parts[0].data], 0, 256) == 0


def test_read_into_bad_arguments_raise_python_errors(tmp_path):
  path = tmp_path / "data"
  path.write_bytes(b"x" * 64)
  fd = os.open(path, os.O_RDONLY)
  buf = np.zeros(64, np.uint8)
  read = _checked_read.read_into
  try:
    with pytest.raises(BufferError):  # read-only
      read(fd, [b"y" * 64], 0, 16)
    with pytest.raises(TypeError):
      read(fd, [object()], 0, 16)
    with pytest.raises(TypeError):
      read(fd, None, 0, 16)
    with pytest.raises(ValueError, match="read_into: step must be positive"):
      read(fd, [buf.data], 0, 0)
    with pytest.raises(ValueError, match="read_into: offset must be >= 0"):
      read(fd, [buf.data], -1, 16)
    with pytest.raises(TypeError):
      read(fd, [buf.data], 0, -16)
    with pytest.raises(TypeError):
      read(1.5, [buf.data], 0, 16)
  finally:
    os.close(fd)


def test_bad_arguments_raise_python_errors(tmp_path):
  path = tmp_path / "data"
  path.write_bytes(b"x" * 64)
  fd = os.open(path, os.O_RDONLY)
  buf = np.zeros(64, np.uint8)
  try:
    with pytest.raises(BufferError):  # read-only
      _checked_read.read_crc32c(fd, [b"y" * 64], 0, 16)
    with pytest.raises((BufferError, ValueError)):  # not contiguous
      _checked_read.read_crc32c(fd, [np.zeros(64, np.uint8)[::2].data], 0, 16)
    with pytest.raises(TypeError):
      _checked_read.read_crc32c(fd, [object()], 0, 16)
    with pytest.raises(TypeError):
      _checked_read.read_crc32c(fd, 5, 0, 16)
    with pytest.raises(ValueError, match="step must be positive"):
      _checked_read.read_crc32c(fd, [buf.data], 0, 0)
    with pytest.raises(TypeError):
      _checked_read.read_crc32c(fd, [buf.data], 0, -1)
    with pytest.raises(ValueError, match="offset must be >= 0"):
      _checked_read.read_crc32c(fd, [buf.data], -5, 16)
    with pytest.raises(TypeError):
      _checked_read.read_crc32c(fd, [buf.data], 0, 16, 1 << 32)
    with pytest.raises(TypeError):
      _checked_read.read_crc32c("fd", [buf.data], 0, 16)
    with pytest.raises(TypeError):
      _checked_read.crc32c(object())
    with pytest.raises(TypeError):
      _checked_read.crc32c(b"", -1)
    # A list that a part's buffer request fails in the middle of: the parts
    # held before it are released (a bytearray can be resized again).
    grow = bytearray(8)
    with pytest.raises(BufferError):
      _checked_read.read_crc32c(fd, [grow, b"ro"], 0, 16)
    grow.extend(b"more")
    assert _checked_read.read_crc32c(fd, [grow], 0, 16)[0] == 12
  finally:
    os.close(fd)


@pytest.mark.parametrize("fast", [True, False])
def test_reader_takes_either_loop(tmp_path, monkeypatch, fast):
  # read_checked through the C++ loop, or the Python one where the CPU has
  # no vector CRC-32C (forced here both ways): same bytes, same checks.
  monkeypatch.setattr(_checked_read, "FAST", fast)
  called = []
  real = _checked_read.read_crc32c
  monkeypatch.setattr(
    _checked_read,
    "read_crc32c",
    lambda *a: called.append(a[2]) or real(*a),
  )
  data = _DATA[: 3 * 2**18 + 5]
  path = tmp_path / "data"
  path.write_bytes(b"h" * 3 + data.tobytes())
  fd = os.open(path, os.O_RDONLY)
  try:
    out = np.zeros_like(data)
    reader.read_checked(
      fd, memoryview(out), 3, 0, data.size, checksum.of(data.data)
    )
    np.testing.assert_array_equal(out, data)
  finally:
    os.close(fd)
  assert called == ([3] if fast else [])
