"""Host copies of any strides save and restore bit for bit (a TPU hands back column-major copies).

A TPU hands back column-major host copies of device arrays for some shapes
(``(512, 300)`` float32 came back with strides ``(4, 2048)``) and copies of a
3-D array strided neither C nor Fortran (``(3, 17, 33)`` with ``(132, 396,
4)``); save wrote the first as Fortran-order files that restore then
refused as damaged. CI has no TPU: here ``hostvalue.host_copy``, the one
function through which save takes a host copy of a device array, returns
copies of every stride pattern (C, Fortran, axes permuted, negative,
zero, with gaps; different ones for the shards of one array), and numpy
leaves of those strides are saved as they are, through the real writer:
directories, ``.npz``, compressed, non-blocking, sharded arrays, an S3
bucket (moto) and two processes (jax.distributed on 127.0.0.1). Every
file is C order, as its header says, and every array restores with the
bytes of the array saved. Checkpoints that earlier versions wrote with
Fortran-order headers (0.6.0's record has no shapes; later ones say the
shapes) restore on every path, and a header that disagrees with the
record says what differs.

On an accelerator the same tests run on the devices present (the real
host copies too: ``test_real_host_copies``); what needs several devices,
TCP sockets (buckets, two processes) or a dtype the backend lacks skips,
naming it.
"""

import io
import itertools
import json
import math
import os
import socket
import sys
import textwrap
import types
import zipfile

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dtypes  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402

# Private imports below: hostvalue's strided copies and checksums.
from jaxworks.batched_transfer._src.checkpoint import checksum  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import hostvalue  # noqa: E402

RECORD = "jaxworks_dtypes.json"

# The stride patterns of a host copy (or a numpy leaf) of the C-order value
# ``v``; "zero" only for values constant along their first axis.
PATTERNS = (
  "c",
  "fortran",
  "permuted",
  "rotated",
  "reversed",
  "fortran_reversed",
  "gaps",
  "zero",
)

#: The shapes every dtype and pattern meet (pairwise, see ``leaf_specs``).
SHAPES = ((), (7,), (5, 6), (3, 17, 33), (2, 3, 4, 5), (0, 4), (4, 1))

_SUB_BYTE = {"int4", "uint4", "int2", "uint2", "float4_e2m1fn"}

# The old writer (0.6.0 and main until this fix), as it wrote a file: a
# host copy that is Fortran-contiguous (and not C) as a Fortran-order .npy.
OLD_WRITE_NPY = textwrap.dedent("""
    def old_write_npy(f, value, step=8 * 2**20):
      import numpy as np
      from jaxworks.batched_transfer._src.checkpoint import checksum
      from jaxworks.batched_transfer._src.checkpoint import hostvalue
      if isinstance(value, hostvalue.Shards) and not value.by_rows():
        value = value.assemble()
      stored = hostvalue.header_dtype(value.dtype)
      sums = checksum.Sums()

      def header(shape, fortran):
        np.lib.format.write_array_header_1_0(f, {
          "descr": np.lib.format.dtype_to_descr(stored),
          "fortran_order": fortran, "shape": shape})

      if isinstance(value, np.ndarray):
        a = value.view(stored)
        fortran = a.flags.f_contiguous and not a.flags.c_contiguous
        header(a.shape, bool(fortran))
        pieces = [a.T if fortran else a]
      else:
        header(value.shape, False)
        pieces = [a.view(stored) for _, a in value.pieces]
      for a in pieces:
        data = np.ascontiguousarray(a).reshape(-1).view(np.uint8).data
        for lo in range(0, len(data), step):
          part = data[lo : lo + step]
          f.write(part)
          sums.update(part)
      return sums.done()
""")
_namespace: dict = {}
exec(OLD_WRITE_NPY, _namespace)
old_write_npy = _namespace["old_write_npy"]


def restride(v, pattern):
  """An array equal to ``v`` (C order) with the strides of ``pattern``."""
  v = np.array(v, order="C")  # (np.ascontiguousarray makes 0-d ones 1-d)
  nd, rev = v.ndim, (slice(None, None, -1),) * v.ndim
  if pattern not in PATTERNS:
    raise ValueError(pattern)
  if pattern == "c" or not nd:  # a 0-d array has no strides
    out = np.array(v, order="C")
  elif pattern == "fortran":
    out = np.array(v, order="F")
  elif pattern in ("permuted", "rotated"):
    # The memory holds the axes in another order: (1, 0, 2, ...) gives
    # (3, 17, 33) the strides (132, 396, 4) a TPU gave it.
    perm = list(range(nd))
    if nd >= 2 and pattern == "permuted":
      perm[0], perm[1] = 1, 0
    elif nd >= 2:
      perm = perm[-1:] + perm[:-1]
    inverse = list(np.argsort(perm))
    out = np.array(v.transpose(perm), order="C").transpose(inverse)
  elif pattern == "reversed":
    out = np.array(v[rev], order="C")[rev]
  elif pattern == "fortran_reversed":
    out = np.array(v[rev], order="F")[rev]
  elif pattern == "gaps":  # every other element of a larger buffer, offset
    big = np.zeros(tuple(2 * n + 1 for n in v.shape), v.dtype)
    inner = tuple(slice(1, 1 + 2 * n, 2) for n in v.shape)
    big[inner] = v
    out = big[inner]
  elif pattern == "zero":
    out = np.broadcast_to(v[:1], v.shape) if v.shape[0] else v.copy()
  assert out.shape == v.shape and out.dtype == v.dtype
  assert out.tobytes() == v.tobytes(), pattern  # the same values, C order
  return out


def value(rng, shape, dtype, pattern="c"):
  """A C-order array of ``shape`` and ``dtype``: random bytes (every bit
  pattern, NaN payloads too) where every byte is a value, valid values of
  bool and the sub-byte types; constant along axis 0 for "zero"."""
  dtype = np.dtype(dtype)
  n = math.prod(shape)
  if dtype == np.bool_:
    a = rng.integers(0, 2, n).astype(np.bool_)
  elif dtype.name in _SUB_BYTE:
    if dtype.name.startswith("float"):
      a = rng.standard_normal(n).astype(np.float32).astype(dtype)
    else:
      info = ml_dtypes.iinfo(dtype)
      a = rng.integers(int(info.min), int(info.max) + 1, n).astype(dtype)
  else:
    a = rng.integers(0, 256, n * dtype.itemsize, dtype=np.uint8).view(dtype)
  a = a.reshape(shape)
  if pattern == "zero" and a.ndim and shape[0]:
    a = np.ascontiguousarray(np.repeat(a[:1], shape[0], axis=0))
  return a


def c_bytes(a):
  """The C-order bytes of an array (numpy or jax)."""
  return np.ascontiguousarray(np.asarray(a)).tobytes()


# JAX's own per-platform lists (jax._src.test_util.supported_dtypes): a TPU
# aborts the process on some dtypes it lacks, so only these are asked.
_TPU = {
  "bool", "int4", "int8", "int16", "int32", "uint4", "uint8", "uint16",
  "uint32", "bfloat16", "float16", "float32", "complex64", "float8_e4m3fn",
  "float8_e4m3b11fnuz", "float8_e5m2",
}  # fmt: skip
_GPU = {
  "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
  "uint64", "bfloat16", "float16", "float32", "float64", "complex64",
  "complex128", "float8_e4m3fn", "float8_e5m2",
}  # fmt: skip
_X64 = {"int64", "uint64", "float64", "complex128"}


@pytest.fixture(scope="module")
def device_dtypes():
  """The dtypes of ``dtypes.DTYPES`` the backend holds bit for bit: the
  platform's list, then each one asked of the backend (a transfer there
  and back)."""
  platform = jax.default_backend()
  names = {d.name for d in dtypes.DTYPES}
  if platform == "tpu":
    names &= _TPU
  elif platform == "gpu":
    names &= _GPU
  if not jax.config.jax_enable_x64:
    names -= _X64
  out = []
  for d in dtypes.DTYPES:
    if d.name not in names:
      continue
    probe = value(np.random.default_rng(0), (4,), d)
    try:
      back = np.asarray(jax.device_put(probe))
    except Exception:  # noqa: BLE001  (the backend lacks it: skipped)
      continue
    if back.dtype == d and back.tobytes() == probe.tobytes():
      out.append(d)
  assert {"float32", "bfloat16", "int8"} <= {d.name for d in out}, out
  return out


def sockets_or_skip(what):
  """Skips unless TCP sockets open on 127.0.0.1 (not on a TPU VM's
  sandbox), naming ``what`` needs them."""
  try:
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      s.listen(1)
  except OSError as err:
    pytest.skip(f"{what} needs TCP sockets on 127.0.0.1 ({err})")


def zstd_kind():
  """(("z", "zstd"),) where zstandard is installed (compressed saves), else
  () (the TPU machine lacks it: the raw saves still run)."""
  try:
    import zstandard  # noqa: F401
  except ImportError:
    return ()
  return (("z", "zstd"),)


def devices_or_skip(n):
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices, {jax.device_count()} present")
  return jax.devices()[:n]


@pytest.fixture
def host_copies(monkeypatch):
  """``hostvalue.host_copy`` returns copies of the real ones with the
  strides chosen for each array (``chosen``: id -> pattern), or the next of
  a cycle through the patterns (so the shards of one array differ);
  ``seen`` lists (id, pattern) of every copy taken."""

  real = hostvalue.host_copy
  cycle = itertools.cycle([p for p in PATTERNS if p != "zero"])
  copies = types.SimpleNamespace(chosen={}, seen=[])
  # A non-blocking save's device copy (an accelerator's large leaves:
  # hostvalue.copy_on_devices) stands for the array it copies.
  of_copy = {}
  real_on_devices = hostvalue.copy_on_devices

  def copy_on_devices(leaves):
    out = real_on_devices(leaves)
    for i, v in out.items():
      for (_, c), (_, a) in zip(v.pieces, hostvalue.distinct_shards(leaves[i])):
        of_copy[id(c)] = (c, a)  # both kept: their ids stay theirs
    return out

  def host_copy(x):
    v = real(x)
    x = of_copy.get(id(x), (None, x))[1]
    pattern = copies.chosen.get(id(x)) or next(cycle)
    copies.seen.append((id(x), pattern))
    return restride(v, pattern)

  monkeypatch.setattr(hostvalue, "host_copy", host_copy)
  monkeypatch.setattr(hostvalue, "copy_on_devices", copy_on_devices)
  return copies


# --- the writer's C-order bytes of any strides ---------------------------


def test_c_blocks_give_the_c_order_bytes_of_any_strides():
  """``c_blocks`` (what every file's data is written from) gives exactly
  the C-order bytes, in blocks of at most ``step`` bytes (or one element),
  without copying a C-contiguous array; ``digest`` sums those bytes."""
  rng = np.random.default_rng(0)
  shapes = SHAPES + ((1,), (3, 1, 4), (1, 5, 1), (9, 7), (2, 2, 2, 2, 3))
  kinds = [np.uint8, np.float16, np.float32, np.float64, np.complex128]
  cases = 0
  for shape, pattern, kind in itertools.product(shapes, PATTERNS, kinds):
    v = value(rng, shape, kind, pattern)
    a = restride(v, pattern)
    want = v.tobytes()
    for step in (1, 3, 8, 24, 64, 1000, 2**20):
      blocks = list(hostvalue.c_blocks(a, step))
      assert b"".join(b.tobytes() for b in blocks) == want, (shape, pattern)
      assert all(b.dtype == np.uint8 and b.ndim == 1 for b in blocks)
      assert all(b.size <= max(step, a.itemsize) for b in blocks), step
      if a.flags.c_contiguous and a.size:
        assert all(np.shares_memory(b, a) for b in blocks), pattern
      cases += 1
    assert hostvalue.digest(a) == checksum.of(memoryview(want))
  assert cases == len(shapes) * len(PATTERNS) * len(kinds) * 7


def test_no_copy_of_the_whole_array_for_a_fortran_one(monkeypatch):
  """A Fortran-order host copy is converted a block of rows at a time."""
  a = np.asfortranarray(value(np.random.default_rng(1), (512, 300), "f4"))
  real = np.ascontiguousarray
  sizes = []

  def spy(x, *args, **kwargs):
    sizes.append(np.asarray(x).nbytes)
    return real(x, *args, **kwargs)

  monkeypatch.setattr(np, "ascontiguousarray", spy)
  f = io.BytesIO()
  hostvalue.write_npy(f, a, 64 * 1024)
  assert sizes and max(sizes) <= 64 * 1024, sizes
  f.seek(0)
  assert c_bytes(np.load(f)) == c_bytes(a)


# --- one process: directory, .npz, compressed, non-blocking ---------------


def leaf_specs(dts):
  """(key, dtype, shape, pattern) of the leaves of the stride tree: every
  dtype with every pattern, the shapes cycling so each dtype meets every
  shape and each pattern many; the issue's own cases besides."""
  out = []
  for i, d in enumerate(dts):
    for j, pattern in enumerate(PATTERNS):
      shape = SHAPES[(i + j) % len(SHAPES)]
      out.append((f"{d.name}/{pattern}", d, shape, pattern))
  names = {d.name for d in dts}
  for name in ("float32", "bfloat16", "float16", "int8"):
    if name in names:
      d = np.dtype(getattr(ml_dtypes, name, name))
      out.append((f"issue/{name}", d, (512, 300), "fortran"))
  out.append(("issue/3d", np.dtype("float32"), (3, 17, 33), "permuted"))
  # More than one 1 MiB write step of the compressed writer.
  out.append(("large/f", np.dtype("float32"), (1100, 300), "fortran"))
  out.append(("large/p", np.dtype("float32"), (40, 1100, 8), "rotated"))
  return out


def nest(flat_tree):
  """The nested dicts of {"a/b": leaf}."""
  out: dict = {}
  for key, leaf in flat_tree.items():
    *parents, name = key.split("/")
    node = out
    for p in parents:
      node = node.setdefault(p, {})
    node[name] = leaf
  return out


def stride_tree(dts, copies, seed=0):
  """(tree, want): device arrays whose host copies come back with each
  pattern (``copies``), and numpy leaves of each pattern; want: the dtype,
  shape and C-order bytes of each leaf's values, by key."""
  rng = np.random.default_rng(seed)
  leaves, want = {}, {}
  for key, d, shape, pattern in leaf_specs(dts):
    v = value(rng, shape, d, pattern)
    x = jax.device_put(v)
    if copies is not None:
      copies.chosen[id(x)] = pattern
    leaves["dev/" + key] = x
    want["dev/" + key] = (d, shape, c_bytes(x))
    leaves["np/" + key] = restride(v, pattern)
    want["np/" + key] = (d, shape, v.tobytes())
  return nest(leaves), want


def flat(tree):
  """{"a/b": leaf} of a nested dict."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    out["/".join(str(k.key) for k in path)] = leaf
  return out


def check_restored(out, want):
  got = flat(out)
  assert sorted(got) == sorted(want)
  for key, (d, shape, data) in want.items():
    x = got[key]
    assert x.dtype == d and x.shape == shape, (key, x.dtype, x.shape)
    assert c_bytes(x) == data, key


def npy_header(f):
  """(shape, fortran_order, dtype) of the .npy file ``f``."""
  if np.lib.format.read_magic(f) == (1, 0):
    return np.lib.format.read_array_header_1_0(f)
  return np.lib.format.read_array_header_2_0(f)


def check_files(path, want):
  """Every .npy of a directory checkpoint says C order and holds the
  C-order bytes of its leaf (what numpy reads back)."""
  for key, (d, shape, data) in want.items():
    file = os.path.join(path, *key.split("/")) + ".npy"
    with open(file, "rb") as f:
      assert not npy_header(f)[1], key
    assert c_bytes(np.load(file)) == data, key


@pytest.mark.parametrize(
  "kind", ["dir", "dir-nonblocking", "npz", "zstd", "zstd-nonblocking"]
)
def test_every_stride_pattern_saves_and_restores_bit_for_bit(
  tmp_path, host_copies, device_dtypes, kind
):
  if kind.startswith("zstd"):
    pytest.importorskip("zstandard", reason="compression needs zstandard")
  tree, want = stride_tree(device_dtypes, host_copies)
  path = str(tmp_path / ("c.npz" if kind == "npz" else "c"))
  h = bt.save(
    path,
    tree,
    blocking="nonblocking" not in kind,
    compression="zstd" if kind.startswith("zstd") else None,
  )
  if h is not None:
    h.wait()
  # Every device leaf's host copy was taken through the hook, with the
  # pattern chosen for it.
  seen = dict(host_copies.seen)
  device_leaves = flat(tree["dev"]).values()
  assert all(
    seen.get(id(x)) == host_copies.chosen[id(x)] for x in device_leaves
  )
  del tree
  check_restored(bt.restore(path), want)
  meta = flat(bt.metadata(path))
  assert {k: (m.dtype, m.shape) for k, m in meta.items()} == {
    k: (d, s) for k, (d, s, _) in want.items()
  }
  if kind == "dir":
    check_files(path, want)
    with open(os.path.join(path, RECORD)) as f:
      record = json.load(f)
    assert record["c_order"] is True
    assert {k: tuple(s) for k, s in record["shapes"].items()} == {
      k: s for k, (_, s, _) in want.items()
    }


def test_real_host_copies(tmp_path, device_dtypes):
  """The host copies the backend really hands back (on a TPU: column-major
  for some of these shapes), unpatched."""
  rng = np.random.default_rng(2)
  tree, want = {}, {}
  shapes = ((512, 300), (300, 512), (8, 128), (7, 5), (1000,), (3, 17, 33))
  for d in device_dtypes:
    for shape in shapes:
      key = f"{d.name}/{'x'.join(map(str, shape))}"
      x = jax.device_put(value(rng, shape, d))
      tree[key] = x
      want[key] = (d, shape, c_bytes(x))
  tree = nest(tree)
  for name, kind in (("c", None), ("c.npz", None)) + zstd_kind():
    bt.save(str(tmp_path / name), tree, compression=kind)
    check_restored(bt.restore(str(tmp_path / name)), want)


def test_shards_that_come_back_with_different_strides(tmp_path, host_copies):
  """Sharded arrays whose shards' host copies each have other strides:
  shards written in turn (rows), assembled (columns, a 2-D mesh), copied
  whole (under 1 MiB); restored as saved and onto other shardings."""
  devices_or_skip(2)
  n = max(k for k in (2, 4, 8) if k <= jax.device_count())
  devs = jax.devices()[:n]
  mesh = jax.sharding.Mesh(np.array(devs), ("x",))
  grid = jax.sharding.Mesh(np.array(devs).reshape(n // 2, 2), ("a", "b"))
  rng = np.random.default_rng(3)
  specs = {
    "rows": ((1024, 384), "float32", NamedSharding(mesh, P("x"))),
    "cols": ((512, 1024), "bfloat16", NamedSharding(mesh, P(None, "x"))),
    "grid": ((256, 1024), "float32", NamedSharding(grid, P("a", "b"))),
    "rows3": ((16, 17, 1024), "float32", NamedSharding(mesh, P("x"))),
    "int4": ((2048, 1024), "int4", NamedSharding(mesh, P("x"))),
    "f8": ((1024, 1104), "float8_e4m3fn", NamedSharding(mesh, P(None, "x"))),
    "small": ((64, 48), "float32", NamedSharding(mesh, P("x"))),
    "replicated": ((512, 512), "float32", NamedSharding(mesh, P())),
  }
  tree, want = {}, {}
  for key, (shape, name, s) in specs.items():
    d = np.dtype(getattr(ml_dtypes, name, name))
    x = jax.device_put(value(rng, shape, d), s)
    tree[key], want[key] = x, (d, shape, c_bytes(x))
  for name, use in (("c", None), ("c.npz", None)) + zstd_kind():
    host_copies.seen.clear()
    path = str(tmp_path / name)
    bt.save(path, tree, compression=use)
    patterns = {p for _, p in host_copies.seen}
    assert len(host_copies.seen) > len(specs) and len(patterns) > 3, patterns
    check_restored(bt.restore(path), want)
    # Streamed onto other shardings.
    other = {
      k: jax.ShapeDtypeStruct(
        shape, d, sharding=NamedSharding(mesh, P("x") if k != "rows" else P())
      )
      for k, (d, shape, _) in want.items()
    }
    out = bt.restore(path, other)
    check_restored(out, want)
    assert out["cols"].sharding == other["cols"].sharding
  if os.path.isdir(tmp_path / "c"):
    check_files(str(tmp_path / "c"), want)


# --- checkpoints written with Fortran-order headers -----------------------


def rewrite_record(path, version):
  """The record of the checkpoint at ``path`` (directory or .npz) as
  ``version`` wrote it: "0.6.0" (no ``shapes``), "main" (``shapes``, no
  ``c_order``: saves from a TPU between 0.6.0 and this fix)."""

  def edit(data):
    record = json.loads(data)
    assert record.pop("c_order") is True
    if version == "0.6.0":
      record.pop("shapes")
    return json.dumps(record).encode()

  if not path.endswith(".npz"):
    file = os.path.join(path, RECORD)
    with open(file, "rb") as f:
      data = edit(f.read())
    with open(file, "wb") as f:
      f.write(data)
    return
  with zipfile.ZipFile(path) as zf:
    members = [(i, zf.read(i)) for i in zf.infolist()]
  with zipfile.ZipFile(path, "w", allowZip64=True) as zf:
    for info, data in members:
      zf.writestr(info, edit(data) if info.filename == RECORD else data)


def fortran_headers(files):
  """How many of the .npy ``files`` (paths or bytes) say Fortran order."""
  count = 0
  for file in files:
    f = io.BytesIO(file) if isinstance(file, bytes) else open(file, "rb")
    with f:
      count += npy_header(f)[1]
  return count


def old_tree(dts, copies):
  """A tree whose leaves the old writer writes in Fortran order: device
  arrays whose host copies come back so (as a TPU's do), numpy ones in
  Fortran order, and a few of other strides."""
  rng = np.random.default_rng(4)
  leaves, want = {}, {}
  for i, d in enumerate(dts):
    shape = ((512, 300), (7, 5), (3, 17, 33), (2, 3, 4, 5))[i % 4]
    v = value(rng, shape, d)
    x = jax.device_put(v)
    copies.chosen[id(x)] = ("fortran", "fortran", "permuted", "reversed")[i % 4]
    leaves[f"dev/{d.name}"] = x
    want[f"dev/{d.name}"] = (d, shape, c_bytes(x))
    leaves[f"np/{d.name}"] = np.asfortranarray(v)
    want[f"np/{d.name}"] = (d, shape, v.tobytes())
  return nest(leaves), want


@pytest.mark.parametrize(
  "version,kind",
  [("0.6.0", "dir"), ("0.6.0", "npz"), ("main", "dir"), ("main", "npz"),
   ("main", "zstd")],
)  # fmt: skip
def test_checkpoints_with_fortran_headers_restore(
  tmp_path, monkeypatch, host_copies, device_dtypes, version, kind
):
  """Written as the old writer wrote them (Fortran-order files where the
  host copy was Fortran-ordered), with the record of ``version``: restore
  (no target, onto devices and shardings), partial restore and metadata
  give the saved arrays."""
  if kind == "zstd":
    pytest.importorskip("zstandard")
  tree, want = old_tree(device_dtypes, host_copies)
  path = str(tmp_path / ("c.npz" if kind == "npz" else "c"))
  monkeypatch.setattr(hostvalue, "write_npy", old_write_npy)
  bt.save(path, tree, compression="zstd" if kind == "zstd" else None)
  monkeypatch.undo()
  rewrite_record(path, version)
  if kind == "dir":  # what makes this an old checkpoint
    files = [os.path.join(path, *k.split("/")) + ".npy" for k in want]
    assert fortran_headers(files) >= len(want) // 2
  elif kind == "npz":
    with zipfile.ZipFile(path) as zf:
      files = [zf.read(n) for n in zf.namelist() if n.endswith(".npy")]
    assert fortran_headers(files) >= len(want) // 2
  check_restored(bt.restore(path), want)
  meta = flat(bt.metadata(path))
  assert {k: (m.dtype, m.shape) for k, m in meta.items()} == {
    k: (d, s) for k, (d, s, _) in want.items()
  }
  # Streamed onto a device, and rows over devices (several if present).
  n = max(k for k in (1, 2, 4, 8) if k <= jax.device_count())
  rows = NamedSharding(
    jax.make_mesh((n,), ("x",), devices=jax.devices()[:n]), P("x")
  )
  for placement in (jax.devices()[-1], None):
    like = {
      k: jax.ShapeDtypeStruct(
        s, d, sharding=rows if placement is None and s[0] % n == 0 else None
      )
      for k, (d, s, _) in want.items()
    }
    out = bt.restore(path, nest(like), placement=placement)
    check_restored(out, want)
  key = "dev/" + device_dtypes[0].name  # Fortran-order in the file
  d, shape, data = want[key]
  part = nest({key: jax.ShapeDtypeStruct(shape, d)})
  out = bt.restore(path, part, partial_restore=True)
  assert c_bytes(flat(out)[key]) == data


# --- a header that disagrees with the record ------------------------------


def test_a_header_that_disagrees_with_the_record_says_what_differs(tmp_path):
  """Shape vs shape, dtype vs dtype, order vs order: never the old
  "shape (512, 300) in Fortran order but ... says shape (512, 300)"."""
  x = value(np.random.default_rng(5), (512, 300), "f4")
  cases = {
    "order": (np.asfortranarray(x), "Fortran order where the record says C"),
    "shape": (
      x.reshape(300, 512),
      "shape (300, 512) where the record says shape (512, 300)",
    ),
    "dtype": (x.view(np.int32), "dtype <i4 but the record"),
  }
  for name, (replacement, says) in cases.items():
    path = str(tmp_path / name)
    bt.save(path, {"x": x})
    np.save(os.path.join(path, "x.npy"), replacement)
    with pytest.raises(ValueError) as e:
      bt.restore(path)
    text = str(e.value)
    assert says in text and "damaged" in text, text
    assert "(512, 300) in Fortran order but" not in text, text
    if name == "order":  # the shapes agree: none is named as differing
      assert "shape" not in text.split("disagrees")[1], text


# --- buckets ---------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_endpoint():
  sockets_or_skip("a bucket (moto's S3 server)")
  pytest.importorskip("moto", reason="the bucket tests need moto")
  import object_servers

  with object_servers.s3_server() as endpoint:
    object_servers.s3_bucket(endpoint, "ckpt")
    yield endpoint


@pytest.fixture
def s3(s3_endpoint, monkeypatch):
  import object_servers

  for k, v in object_servers.S3_ENV.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
  return "s3://ckpt"


BUCKET_DTYPES = ("bool", "int8", "float32", "bfloat16", "float8_e4m3fn", "int4")


def test_buckets(s3, host_copies, device_dtypes, monkeypatch):
  """To S3 (moto): every pattern raw and compressed, sharded arrays where
  devices allow; checkpoints with Fortran-order files (the old writer's)
  restore with each record version, and an object replaced by a
  Fortran-order one says the order differs."""
  import object_servers

  from jaxworks.batched_transfer._src.checkpoint import stores

  some = [d for d in device_dtypes if d.name in BUCKET_DTYPES]
  tree, want = stride_tree(some, host_copies)
  if jax.device_count() >= 2:
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    for key, spec in (("rows", P("x")), ("cols", P(None, "x"))):
      x = jax.device_put(
        value(np.random.default_rng(6), (512, 1024), "f4"),
        NamedSharding(mesh, spec),
      )
      tree["dev"][key] = x
      want["dev/" + key] = (x.dtype, x.shape, c_bytes(x))
  for use in (None,) + tuple(k for _, k in zstd_kind()):
    url = f"{s3}/new-{use}"
    bt.save(url, tree, compression=use)
    check_restored(bt.restore(url), want)
    meta = flat(bt.metadata(url))
    assert {k: m.shape for k, m in meta.items()} == {
      k: s for k, (_, s, _) in want.items()
    }

  old, old_want = old_tree(some, host_copies)
  for version in ("0.6.0", "main"):
    url = f"{s3}/old-{version}"
    with monkeypatch.context() as m:
      m.setattr(hostvalue, "write_npy", old_write_npy)
      bt.save(url, old)
    st = stores.open_storage("test", url)
    object_servers.to_legacy(st)  # at the path, no head: as 0.6.x wrote it
    record = json.loads(bytes(st.read(RECORD)))
    assert record.pop("c_order") is True
    if version == "0.6.0":
      record.pop("shapes")
    st.write(RECORD, json.dumps(record).encode())
    files = [bytes(st.read(k)) for k in st.list() if k.endswith(".npy")]
    assert fortran_headers(files) >= len(old_want) // 2
    check_restored(bt.restore(url), old_want)
    meta = flat(bt.metadata(url))
    assert {k: m.shape for k, m in meta.items()} == {
      k: s for k, (_, s, _) in old_want.items()
    }

  url = f"{s3}/replaced"
  x = value(np.random.default_rng(7), (512, 300), "f4")
  bt.save(url, {"x": x})
  st = object_servers.version_of(stores.open_storage("test", url))
  f = io.BytesIO()
  np.save(f, np.asfortranarray(x))
  st.write("x.npy", f.getvalue())
  with pytest.raises(ValueError) as e:
    bt.restore(url)
  text = str(e.value)
  assert "Fortran order where the record says C order" in text, text
  assert "(512, 300) in Fortran order but" not in text, text


# --- two processes ---------------------------------------------------------

#: The arrays the two processes save: shape, dtype name and (in the worker)
#: the sharding over their 8 devices.
MP_ARRAYS = {
  "rows": ((64, 48), "float32"),
  "grid": ((16, 12, 5), "bfloat16"),
  "rep": ((8, 6), "int8"),
  "i4": ((32, 16), "int4"),
}


def mp_values():
  """The values of the two-process save, by key: MP_ARRAYS' arrays, and
  the leaves no process spans (saved with other strides on each)."""
  out = {
    k: value(np.random.default_rng(i), s, getattr(ml_dtypes, d, d))
    for i, (k, (s, d)) in enumerate(MP_ARRAYS.items())
  }
  out["np_f"] = out["rows"]
  out["np_z"] = np.repeat(out["rep"][:1], 8, 0)
  return out


WORKER = (
  OLD_WRITE_NPY
  + "\n"
  + textwrap.dedent("""
    import itertools, os, sys
    pid, port, base, url = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    import jax
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=2, process_id=pid,
                               initialization_timeout=60)
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxworks import batched_transfer as bt
    from jaxworks.batched_transfer._src.checkpoint import hostvalue
    sys.path.insert(0, os.environ["STRIDES_TEST_DIR"])
    from strides_test import PATTERNS, mp_values, restride

    # Each shard's host copy with the next pattern: the shards of one
    # array, and the two processes, differ.
    real = hostvalue.host_copy
    cycle = itertools.cycle([p for p in PATTERNS if p != "zero"][pid:])
    seen = []
    def host_copy(x):
      p = next(cycle)
      seen.append(p)
      return restride(real(x), p)
    hostvalue.host_copy = host_copy

    mesh = jax.make_mesh((8,), ("x",))
    grid = jax.make_mesh((4, 2), ("a", "b"))
    shardings = {"rows": NamedSharding(mesh, P("x")),
                 "grid": NamedSharding(grid, P("a", "b")),
                 "rep": NamedSharding(mesh, P()),
                 "i4": NamedSharding(grid, P(None, "a"))}
    values = mp_values()

    def tree(old=False):
      out = {k: jax.make_array_from_callback(values[k].shape, s,
                                             lambda i, k=k: values[k][i])
             for k, s in shardings.items()}
      # Leaves no process spans: equal values, other strides on each (the
      # old writer: C order, as its check of them needed).
      f = "c" if old else "fortran" if pid else "reversed"
      out["np_f"] = restride(values["np_f"], f)
      out["np_z"] = restride(values["np_z"], "c" if old else "zero")
      return out

    other = {"rows": NamedSharding(grid, P("b", "a")),
             "grid": NamedSharding(mesh, P()),
             "rep": NamedSharding(grid, P("a")),
             "i4": NamedSharding(mesh, P("x")),
             "np_f": NamedSharding(mesh, P("x")),
             "np_z": NamedSharding(grid, P("a"))}
    like = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=other[k])
            for k, v in values.items()}

    def check(out):
      for k, v in values.items():
        got = out[k]
        assert got.dtype == v.dtype and got.shape == v.shape, k
        assert got.sharding == other[k], k
        for s in got.addressable_shards:
          assert np.ascontiguousarray(np.asarray(s.data)).tobytes() == \\
              np.ascontiguousarray(v[s.index]).tobytes(), k

    paths = [f"{base}/new", f"{base}/async"] + ([f"{url}/mp"] if url else [])
    for path in paths:
      h = bt.save(path, tree(), blocking=not path.endswith("async"))
      if h is not None:
        h.wait()
      check(bt.restore(path, like))
    assert len(set(seen)) >= 4, seen

    # The old writer: Fortran-order shard files (a TPU's host copies).
    hostvalue.host_copy = lambda x: np.asfortranarray(real(x))
    hostvalue.write_npy = old_write_npy
    bt.save(f"{base}/old", tree(old=True))
    print("WORKER-OK", pid, flush=True)
""")
)


def test_two_processes(tmp_path, monkeypatch, request):
  """Two processes (jax.distributed, 4 CPU devices each) save sharded
  arrays whose shards come back with other strides in each process, and
  leaves no process spans with other strides in each (equal values): to a
  directory, non-blocking, and to S3 (where moto is installed); each
  restores onto other shardings; this process restores them, and the old
  writer's checkpoint of Fortran-order shard files (0.6.0's record), bit
  for bit, and numpy alone reads the files."""
  sockets_or_skip("two processes (jax.distributed)")
  from multiprocess_util import numpy_read
  from multiprocess_util import run_n

  try:
    import moto  # noqa: F401
  except ImportError:
    url = ""
  else:
    url = request.getfixturevalue("s3") + "/two"
  monkeypatch.setenv("STRIDES_TEST_DIR", os.path.dirname(__file__))
  base = str(tmp_path)
  run_n(WORKER, base, 2, timeout=200, extra=(url,))

  want = {k: (v.dtype, v.shape, v.tobytes()) for k, v in mp_values().items()}
  paths = [os.path.join(base, p) for p in ("new", "async", "old")]
  for path in paths:
    # numpy alone reads what the headers say.
    got = numpy_read(path)
    assert {k: c_bytes(v) for k, v in got.items()} == {
      k: w[2] for k, w in want.items()
    }
    files = [
      os.path.join(root, n)
      for root, _, names in os.walk(path)
      for n in names
      if n.endswith(".npy")
    ]
    fortran = fortran_headers(files)
    assert (fortran > 0) == path.endswith("old"), (path, fortran)
    if path.endswith("old"):  # as 0.6.0 wrote its record
      with open(os.path.join(path, RECORD)) as f:
        record = json.load(f)
      del record["c_order"], record["shapes"]
      with open(os.path.join(path, RECORD), "w") as f:
        json.dump(record, f)
  if url:
    paths.append(url + "/mp")
  for path in paths:
    check_restored(bt.restore(path, placement=jax.devices()[0]), want)
    if jax.device_count() >= 2:
      mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
      like = {
        k: jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P("x")))
        for k, (d, s, _) in want.items()
      }
      check_restored(bt.restore(path, like), want)
