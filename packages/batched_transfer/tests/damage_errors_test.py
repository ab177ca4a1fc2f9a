"""A damaged checkpoint fails with an error a user can read and catch.

Every way a checkpoint directory can be damaged (a file missing, extra,
truncated, grown, renamed, emptied; the record deleted, truncated or
garbled; a header garbled) is applied to a fresh checkpoint, which is then
read by ``restore`` (with and without a target), ``metadata`` and
``CheckpointManager.restore``. Each must either read the intact data (the
damage did not touch what is read) or raise a builtin exception class (or
one of the package's public ones) whose message starts with the API's name
and names the checkpoint or the file, with no library frame in the filtered
traceback; never a bare ``KeyError`` or a wrong result.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import builtins
import shutil
import tempfile
import traceback

import jax
import numpy as np
import pytest

from jaxworks import batched_transfer as bt

TREE = {
  "params": {"w": np.arange(12.0, dtype=np.float32).reshape(3, 4)},
  "b": np.ones(5, np.int32),
  "name": "run-1",
}
PACKAGE_DIR = os.path.dirname(os.path.abspath(bt.__file__)) + os.sep


def _files(path):
  return sorted(
    os.path.relpath(os.path.join(d, f), path)
    for d, _, fs in os.walk(path)
    for f in fs
  )


def _damages(path):
  """(label, function damaging the checkpoint at ``path``) pairs."""
  out = []
  for rel in _files(path):
    full = os.path.join(path, rel)
    out += [
      (f"delete {rel}", lambda full=full: os.remove(full)),
      (
        f"truncate {rel}",
        lambda full=full: os.truncate(full, os.path.getsize(full) // 2),
      ),
      (f"empty {rel}", lambda full=full: os.truncate(full, 0)),
      (
        f"grow {rel}",
        lambda full=full: open(full, "ab").write(b"\0" * 7),  # noqa: SIM115
      ),
      (
        f"garble {rel}",
        lambda full=full: _garble(full),
      ),
      (
        f"rename {rel}",
        lambda full=full: os.rename(full, full + ".moved"),
      ),
    ]
  out.append(
    (
      "extra file",
      lambda: np.save(os.path.join(path, "params", "stray.npy"), np.ones(2)),
    )
  )
  return out


def _garble(full):
  with open(full, "r+b") as f:
    data = bytearray(f.read())
    for i in range(0, min(len(data), 64), 3):
      data[i] ^= 0x5A
    f.seek(0)
    f.write(data)


def _readers(path):
  target = jax.tree.map(lambda x: x, TREE)
  return {
    "restore": lambda: bt.restore(path),
    "restore(target)": lambda: bt.restore(path, target),
    "metadata": lambda: bt.metadata(path),
    "CheckpointManager.restore": lambda: bt.CheckpointManager(
      os.path.dirname(path)
    ).restore(1),
  }


def _public(cls):
  if getattr(builtins, cls.__name__, None) is cls:
    return True
  return getattr(bt, cls.__name__, None) is cls


def _check_outcome(label, reader, fn):
  before = jax.config.jax_traceback_filtering
  jax.config.update("jax_traceback_filtering", "remove_frames")
  try:
    out = fn()
  except Exception as e:  # pylint: disable=broad-except
    cls = type(e)
    assert _public(cls), (label, reader, cls)
    assert cls is not KeyError, (label, reader, e)
    message = str(e)
    assert message.startswith("jaxworks.batched_transfer") or (
      isinstance(e, OSError) and "jaxworks.batched_transfer" in message
    ), (label, reader, message)
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if f.filename.startswith(PACKAGE_DIR)]
    assert not ours, (label, reader, [f.name for f in ours])
    return "raised"
  finally:
    jax.config.update("jax_traceback_filtering", before)
  # What was read is the intact data, never something else.
  if reader == "metadata":
    return "read"
  got = out if reader != "CheckpointManager.restore" else out
  np.testing.assert_array_equal(
    np.asarray(got["params"]["w"]), TREE["params"]["w"]
  )
  np.testing.assert_array_equal(np.asarray(got["b"]), TREE["b"])
  return "read"


def test_every_damage_raises_a_readable_error_or_reads_intact_data():
  root = tempfile.mkdtemp()
  try:
    pristine = os.path.join(root, "pristine")
    bt.save(pristine, TREE)
    labels = [label for label, _ in _damages(pristine)]
    assert len(labels) >= 19
    outcomes = {}
    for i, label in enumerate(labels):
      work = os.path.join(root, f"case{i}")
      os.makedirs(work)
      path = os.path.join(work, "1")
      shutil.copytree(pristine, path)
      dict(_damages(path))[label]()
      for reader, fn in _readers(path).items():
        outcomes[(label, reader)] = _check_outcome(label, reader, fn)
    # A deleted array file is always an error (it was a bare KeyError).
    for reader in ("restore", "metadata", "CheckpointManager.restore"):
      key = ("delete params/w.npy", reader)
      assert outcomes[key] == "raised", key
  finally:
    shutil.rmtree(root)


def test_a_deleted_array_file_names_the_tree_path_and_the_fix(tmp_path):
  path = str(tmp_path / "ckpt")
  bt.save(path, TREE)
  os.remove(os.path.join(path, "params", "w.npy"))
  for fn in (lambda: bt.restore(path), lambda: bt.metadata(path)):
    with pytest.raises(FileNotFoundError) as info:
      fn()
    message = str(info.value)
    assert "'params/w'" in message and path in message
    assert "copy the whole checkpoint again" in message


@pytest.mark.parametrize("where", ["open", "read"])
@pytest.mark.parametrize("code", ["EIO", "EACCES"])
def test_an_io_error_of_the_system_stays_an_os_error(
  tmp_path, monkeypatch, where, code
):
  """A disk that fails a read (EIO) or a file the process may not open
  (EACCES) is an OSError of that errno, naming the API and the file, which
  code retrying I/O errors catches: not a ValueError calling the checkpoint
  damaged."""
  import errno  # pylint: disable=g-import-not-at-top

  # Private: the reader's open of a file and read of its data (hooked).
  from jaxworks.batched_transfer._src.checkpoint import reader  # pylint: disable=g-import-not-at-top

  path = str(tmp_path / "ckpt")
  bt.save(path, TREE)
  number = getattr(errno, code)
  if where == "open":
    real = reader.open_file

    def open_file(name, dir_fd=None):
      if name.startswith("b"):
        raise OSError(number, os.strerror(number), name)
      return real(name, dir_fd)

    monkeypatch.setattr(reader, "open_file", open_file)
  else:

    def read(self, s):
      raise OSError(number, os.strerror(number))

    monkeypatch.setattr(reader.Files, "read", read)
  with pytest.raises(OSError) as info:
    bt.restore(path, TREE)
  err = info.value
  assert err.errno == number, err
  assert type(err) is (PermissionError if code == "EACCES" else OSError)
  assert str(err).count("[Errno") == 1, err
  assert "jaxworks.batched_transfer.restore" in str(err), err
  assert "b.npy" in str(err) or "'b'" in str(err), err
