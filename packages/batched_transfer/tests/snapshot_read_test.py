"""A local read is a snapshot: restore and metadata read one committed save
(the directory at the path, opened once, and then only the files its record
names) or raise a clear error, whatever replaces or deletes the checkpoint
meanwhile, in this process or another; a directory without its record is
not a checkpoint."""

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from jaxworks import batched_transfer as bt

# Private imports below: the reaper that removes replaced copies (waited
# for, so that the race is decided), and the reader's one open of a file.
from jaxworks.batched_transfer._src.checkpoint import commit
from jaxworks.batched_transfer._src.checkpoint import format
from jaxworks.batched_transfer._src.checkpoint import reader


def tree(k, n=6):
  return {f"a{i}": np.full((16, 4), k * 100 + i, np.float32) for i in range(n)}


def check_whole(out, n=6):
  """The k of the tree(k) ``out`` is, asserting that it is one whole tree."""
  assert sorted(out) == [f"a{i}" for i in range(n)], sorted(out)
  k = int(np.asarray(out["a0"])[0, 0]) // 100
  for i in range(n):
    np.testing.assert_array_equal(
      np.asarray(out[f"a{i}"]), np.full((16, 4), k * 100 + i, np.float32)
    )
  return k


def after_directory_open(monkeypatch, path, act):
  """``act()`` runs once, right after the first ``os.open`` of ``path``
  itself (a read's open of its commit point), before anything is read."""
  real, done = os.open, []

  def hooked(p, *args, **kwargs):
    fd = real(p, *args, **kwargs)
    if not done and os.fspath(p) == path and not kwargs.get("dir_fd"):
      done.append(True)
      act()
    return fd

  monkeypatch.setattr(os, "open", hooked)
  return done


def after_first_array_open(monkeypatch, act):
  """``act()`` runs once, right before the first array file is opened (the
  record was read)."""
  real, done = reader.open_file, []

  def hooked(name, dir_fd=None):
    if not done and str(name).endswith(".npy"):
      done.append(True)
      act()
    return real(name, dir_fd)

  monkeypatch.setattr(reader, "open_file", hooked)
  return done


def racing(monkeypatch, path, when, act):
  """``act()`` once, ``when`` the read opened the directory or is about to
  open its first array; the list it appends to once it ran."""
  if when == "directory":
    return after_directory_open(monkeypatch, path, act)
  return after_first_array_open(monkeypatch, act)


def overwrite(path, k):
  def act():
    bt.save(path, tree(k), overwrite=True)
    commit.REAPER.wait()  # the replaced copy's files are gone

  return act


def delete(path):
  def act():
    commit.delete(path)
    commit.REAPER.wait()

  return act


@pytest.mark.parametrize("when", ["directory", "arrays"])
@pytest.mark.parametrize("read", ["restore", "metadata"])
def test_a_read_racing_an_overwrite_returns_the_new_save_whole(
  tmp_path, monkeypatch, when, read
):
  path = str(tmp_path / "ckpt")
  bt.save(path, tree(1))
  done = racing(monkeypatch, path, when, overwrite(path, 2))
  if read == "restore":
    assert check_whole(bt.restore(path)) == 2
  else:
    meta = bt.metadata(path)
    assert sorted(meta) == [f"a{i}" for i in range(6)]
    assert all(m.shape == (16, 4) for m in meta.values())
  assert done
  monkeypatch.undo()
  assert check_whole(bt.restore(path)) == 2


@pytest.mark.parametrize("when", ["directory", "arrays"])
@pytest.mark.parametrize("read", ["restore", "metadata"])
def test_a_read_racing_a_delete_raises_file_not_found(
  tmp_path, monkeypatch, when, read
):
  path = str(tmp_path / "ckpt")
  bt.save(path, tree(1))
  done = racing(monkeypatch, path, when, delete(path))
  with pytest.raises(FileNotFoundError, match=r"ckpt"):
    getattr(bt, read)(path)
  assert done


def test_a_read_replaced_under_every_try_says_so(tmp_path, monkeypatch):
  """A checkpoint replaced under each of READ_TRIES reads: Replaced (a
  FileNotFoundError) with a note, never part of a tree."""
  path = str(tmp_path / "ckpt")
  bt.save(path, tree(1))
  real, k = reader.open_file, [1]

  def hooked(name, dir_fd=None):
    if str(name).endswith(".npy") and name.startswith("a0"):
      k[0] += 1
      monkeypatch.setattr(reader, "open_file", real)
      overwrite(path, k[0])()
      monkeypatch.setattr(reader, "open_file", hooked)
    return real(name, dir_fd)

  monkeypatch.setattr(reader, "open_file", hooked)
  with pytest.raises(
    bt.CheckpointReplacedError, match=r"replaced or deleted"
  ) as e:
    bt.restore(path)
  assert isinstance(e.value, FileNotFoundError)
  assert any(f"{reader.READ_TRIES} reads" in n for n in e.value.__notes__)
  assert k[0] == 1 + reader.READ_TRIES


def test_an_empty_or_unrecorded_directory_is_not_a_checkpoint(tmp_path):
  empty = tmp_path / "empty"
  empty.mkdir()
  for read in (bt.restore, bt.metadata):
    with pytest.raises(FileNotFoundError, match=r"holds no 'jaxworks_dtypes"):
      read(str(empty))
  # Arrays without the record: a save that did not commit.
  partial = tmp_path / "partial"
  bt.save(str(partial), tree(1))
  os.unlink(partial / "jaxworks_dtypes.json")
  with pytest.raises(FileNotFoundError, match=r"no checkpoint at"):
    bt.restore(str(partial))
  with pytest.raises(FileNotFoundError):
    bt.restore(str(tmp_path / "missing"))


def test_a_manager_lists_no_step_without_a_record(tmp_path):
  d = tmp_path / "run"
  mgr = bt.CheckpointManager(str(d))
  (d / "7").mkdir()
  assert mgr.all_steps() == []
  assert mgr.latest_step() is None
  with pytest.raises(FileNotFoundError):
    mgr.restore(7)
  mgr.save(3, tree(3))
  mgr.wait_until_finished()
  assert mgr.all_steps() == [3]
  assert check_whole(mgr.restore()) == 3
  mgr.close()


def step_items(k):
  return {
    "params": tree(k, n=2),
    "data": {"n": 2**40 + k, "run": f"save {k}", "frac": k / 3},
  }


def check_step_whole(items, metrics=None, custom=None):
  """The k of one whole ``step_items(k)`` save (and its metrics and custom
  metadata, where given, of that save)."""
  k = int(np.asarray(items["params"]["a0"])[0, 0]) // 100
  np.testing.assert_array_equal(items["params"]["a1"], tree(k, n=2)["a1"])
  assert items["data"] == {"n": 2**40 + k, "run": f"save {k}", "frac": k / 3}
  assert (
    type(items["data"]["n"]) is int and type(items["data"]["frac"]) is float
  )
  if metrics is not None:
    assert metrics == {"loss": k / 7}, (k, metrics)
    assert custom == {"save": k}, (k, custom)
  return k


@pytest.mark.parametrize("nth", [1, 2, 3, 4])
@pytest.mark.parametrize("read", ["restore", "metadata"])
def test_a_manager_reads_one_save_of_a_step_replaced_meanwhile(
  tmp_path, monkeypatch, nth, read
):
  """The step's items, Python values, metrics and custom metadata come from
  one save, whenever (the ``nth`` record read) another writer replaces the
  step (a manager's restore reads the step's commit point once)."""
  d = tmp_path / "run"
  mgr = bt.CheckpointManager(str(d), read_only=False)
  mgr.save(
    5, items=step_items(1), metrics={"loss": 1 / 7},
    custom_metadata={"save": 1}, blocking=True,
  )  # fmt: skip
  writer = bt.CheckpointManager(str(tmp_path / "other"))
  writer.save(
    5, items=step_items(2), metrics={"loss": 2 / 7},
    custom_metadata={"save": 2}, blocking=True,
  )  # fmt: skip
  writer.close()
  source = str(tmp_path / "other" / "5")

  def replace():  # another writer replaces step 5 with save 2
    bt.save(
      str(d / "5"),
      bt.restore(source),
      overwrite=True,
      custom_metadata=bt.custom_metadata(source),
    )
    commit.REAPER.wait()

  real, calls = format.decode_record, []

  def hooked(*args, **kwargs):
    calls.append(True)
    if len(calls) == nth:
      monkeypatch.setattr(format, "decode_record", real)
      replace()
    return real(*args, **kwargs)

  monkeypatch.setattr(format, "decode_record", hooked)
  if read == "restore":
    items = mgr.restore(5, items={"params": None, "data": None})
    k = check_step_whole(items)
  else:
    m = mgr.metadata(5)
    assert set(m.item_metadata) == {"params", "data"}
    data = m.item_metadata["data"]
    k = check_step_whole(
      {"params": tree(data["n"] - 2**40, n=2), "data": data},
      m.metrics, m.custom_metadata,
    )  # fmt: skip
  assert k in (1, 2)
  mgr.close()


def test_files_the_record_does_not_name_are_not_read(tmp_path):
  path = tmp_path / "ckpt"
  bt.save(str(path), tree(1))
  np.save(path / "stray.npy", np.zeros(3))
  assert check_whole(bt.restore(str(path))) == 1
  assert "stray" not in bt.metadata(str(path))


def test_a_header_with_its_byte_order_flipped_is_refused(tmp_path):
  """The record's checksums are of little-endian data: a header edited to
  say big-endian is damage, not a different array (verify or not)."""
  path = tmp_path / "ckpt"
  bt.save(str(path), {"w": np.arange(8, dtype=np.float32)})
  f = path / "w.npy"
  data = f.read_bytes()
  assert b"'<f4'" in data
  f.write_bytes(data.replace(b"'<f4'", b"'>f4'", 1))
  for verify in (True, False):
    with pytest.raises(ValueError, match=r"big-endian header"):
      bt.restore(str(path), verify=verify)
  with pytest.raises(ValueError, match=r"big-endian header"):
    bt.metadata(str(path))


def test_every_save_has_its_own_id_in_its_record(tmp_path):
  from jaxworks.batched_transfer._src.checkpoint import format as fmt

  ids = set()
  for k in range(3):
    path = tmp_path / "ckpt"
    bt.save(str(path), tree(k), overwrite=True)
    r = fmt.decode_record("t", "r", (path / fmt.RECORD).read_bytes())
    assert len(r.save_id) == 16
    ids.add(r.save_id)
  assert len(ids) == 3


_WRITER = textwrap.dedent(
  """
  import sys, time
  import numpy as np
  from jaxworks import batched_transfer as bt
  path, seconds, kind = sys.argv[1], float(sys.argv[2]), sys.argv[3]
  def tree(k):
    return {f"a{i}": np.full((16, 4), k * 100 + i, np.float32)
            for i in range(6)}
  end, k = time.monotonic() + seconds, 1
  if kind == "save":
    while time.monotonic() < end:
      k += 1
      bt.save(path, tree(k), overwrite=True)
  else:
    mgr = bt.CheckpointManager(
        path, options=bt.CheckpointManagerOptions(max_to_keep=1))
    while time.monotonic() < end:
      k += 1
      mgr.save(k, tree(k), force=True)
      mgr.wait_until_finished()
    mgr.close()
  print(k)
  """
)


@pytest.mark.parametrize("kind", ["save", "manager"])
def test_reads_racing_another_process_are_whole_saves_or_clear_errors(
  tmp_path, kind
):
  """Another process overwrites a checkpoint (or a manager's retention
  deletes the step being read) for 4 s while this one reads it: every read
  is one whole committed save, or (retention) FileNotFoundError."""
  path = str(tmp_path / "ckpt")
  if kind == "save":
    bt.save(path, tree(1))
  else:
    mgr = bt.CheckpointManager(path)
    mgr.save(1, tree(1))
    mgr.close()
  proc = subprocess.Popen(
    [sys.executable, "-c", _WRITER, path, "4", kind],
    stdout=subprocess.PIPE,
    env=dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=""),
  )
  reads = errors = 0
  try:
    end = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < end:
      try:
        if kind == "save":
          check_whole(bt.restore(path))
          meta = bt.metadata(path)
          assert sorted(meta) == [f"a{i}" for i in range(6)], meta
        else:
          ro = bt.CheckpointManager(
            path, options=bt.CheckpointManagerOptions(read_only=True)
          )
          step = ro.latest_step()
          if step is not None:
            assert check_whole(ro.restore(step)) == step
          ro.close()
        reads += 1
      except FileNotFoundError:
        assert kind == "manager"  # the step was deleted by retention
        errors += 1
  finally:
    out, _ = proc.communicate(timeout=60)
  assert proc.returncode == 0
  assert int(out) > 2 and reads > 0, (out, reads, errors)
