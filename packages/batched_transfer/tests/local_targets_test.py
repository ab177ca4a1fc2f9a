"""Local checkpoints under faults and odd paths:
relative paths made absolute in the call, threads that cannot start,
managers of one process on one directory however it is spelled, a failed
fsync of a directory before and after the commit, and bad targets refused
before anything is written. Every error names the API, the path, the errno
where there is one and whether the new save is committed."""

import errno
import os
import subprocess
import sys
import textwrap
import threading

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxworks import batched_transfer as bt

# Private imports below: a save's steps patched to stall or fail.
from jaxworks.batched_transfer._src.checkpoint import commit
from jaxworks.batched_transfer._src.checkpoint import hostvalue
from jaxworks.batched_transfer._src.checkpoint import job as job_lib
from jaxworks.batched_transfer._src.checkpoint import lease
from jaxworks.batched_transfer._src.checkpoint import pending
from jaxworks.batched_transfer._src.checkpoint import writer

SAVE = "jaxworks.batched_transfer.save"


def tree_of(seed, n=3):
  rng = np.random.default_rng(seed)
  return {f"k{i}": rng.standard_normal((16, 4)).astype(np.float32) for i in
          range(n)}  # fmt: skip


def like(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def check(path, tree):
  out = bt.restore(path, like(tree))
  for k in tree:
    assert np.asarray(out[k]).tobytes() == tree[k].tobytes()


def leftovers(path):
  commit.REAPER.wait()
  return commit.temporaries(str(path))


@pytest.fixture
def writes(monkeypatch):
  """The arrays written (``hostvalue.write_npy`` calls): none may be for a
  save refused in its call."""
  seen = []
  real = hostvalue.write_npy

  def write_npy(f, a, *args, **kwargs):
    seen.append(a.shape)
    return real(f, a, *args, **kwargs)

  monkeypatch.setattr(hostvalue, "write_npy", write_npy)
  return seen


# 12: a relative path is made absolute in the call.


def test_a_relative_path_of_a_background_save_is_resolved_in_the_call(
  tmp_path, monkeypatch
):
  a, b = tmp_path / "a", tmp_path / "b"
  a.mkdir()
  b.mkdir()
  monkeypatch.chdir(a)
  gate = threading.Event()
  real_turn = job_lib.SaveJob.turn

  def turn(self):  # the background thread waits until the caller moved
    assert gate.wait(30)
    real_turn(self)

  monkeypatch.setattr(job_lib.SaveJob, "turn", turn)
  tree = tree_of(0)
  handle = bt.save("ckpt", tree, blocking=False)
  os.chdir(b)
  gate.set()
  handle.wait()
  assert os.listdir(b) == []  # nothing landed, nothing left behind
  check(str(a / "ckpt"), tree)
  assert handle.path == str(a / "ckpt")
  monkeypatch.setattr(job_lib.SaveJob, "turn", real_turn)
  os.chdir(a)
  assert set(bt.metadata("ckpt")) == set(tree)
  check("ckpt", tree)
  check("./sub/../ckpt/", tree)


def test_a_managers_relative_directory_is_resolved_when_it_is_made(
  tmp_path, monkeypatch
):
  a, b = tmp_path / "a", tmp_path / "b"
  a.mkdir()
  b.mkdir()
  monkeypatch.chdir(a)
  with bt.CheckpointManager("run") as mgr:
    assert mgr.directory == str(a / "run")
    os.chdir(b)
    mgr.save(1, tree_of(1), blocking=True)
    assert mgr.all_steps() == [1]
    check(mgr.directory + "/1", tree_of(1))
  assert os.listdir(b) == []


# 14: a thread that cannot start.


def _save_threads():
  return [
    t
    for t in threading.enumerate()
    if t.name.startswith(writer.WRITE_THREAD_PREFIX)
    or t.name.startswith(pending.THREAD_PREFIX)
  ]


@pytest.fixture
def failing_start(monkeypatch):
  """``fail(prefix, n)``: the ``n``-th start of a thread whose name starts
  with ``prefix`` raises as CPython does when it has no thread left."""
  real = threading.Thread.start

  def fail(prefix, n):
    calls = [0]

    def start(self):
      if self.name.startswith(prefix):
        calls[0] += 1
        if calls[0] == n:
          raise RuntimeError("can't start new thread")
      return real(self)

    monkeypatch.setattr(threading.Thread, "start", start)

  yield fail
  monkeypatch.setattr(threading.Thread, "start", real)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_a_writer_thread_that_cannot_start_ends_the_others(
  tmp_path, failing_start, n
):
  path = tmp_path / "ckpt"
  old = tree_of(0, n=8)
  bt.save(path, old)
  failing_start(writer.WRITE_THREAD_PREFIX, n)
  with pytest.raises(RuntimeError) as info:
    bt.save(path, tree_of(1, n=8), overwrite=True, write_threads=4)
  text = str(info.value)
  assert SAVE in text and repr(str(path)) in text
  assert "can't start new thread" in text and "nothing was committed" in text
  assert "write_threads" in text
  assert _save_threads() == []  # every thread started has ended
  check(path, old)
  assert leftovers(path) == []


def test_a_background_save_whose_thread_cannot_start(tmp_path, failing_start):
  path = tmp_path / "ckpt"
  failing_start(pending.THREAD_PREFIX + "-", 1)
  with pytest.raises(RuntimeError) as info:
    bt.save(path, tree_of(0), blocking=False)
  text = str(info.value)
  assert SAVE in text and repr(str(path)) in text
  assert "can't start new thread" in text and "nothing was" in text
  assert not os.path.lexists(path) and leftovers(path) == []
  done = threading.Thread(target=pending.wait_all)  # none left pending
  done.start()
  done.join(10)
  assert not done.is_alive()
  bt.save(path, tree_of(1))  # the path is not held by the failed save
  check(path, tree_of(1))


def test_the_process_exits_after_a_writer_thread_failed_to_start(tmp_path):
  script = textwrap.dedent(f"""
    import threading
    import numpy as np
    from jaxworks import batched_transfer as bt
    from jaxworks.batched_transfer._src.checkpoint import writer

    real, calls = threading.Thread.start, [0]
    def start(self):
      if self.name.startswith(writer.WRITE_THREAD_PREFIX):
        calls[0] += 1
        if calls[0] == 3:
          raise RuntimeError("can't start new thread")
      return real(self)
    threading.Thread.start = start
    tree = {{f"k{{i}}": np.ones(100, np.float32) for i in range(8)}}
    try:
      bt.save({str(tmp_path / "ckpt")!r}, tree, write_threads=4)
    except RuntimeError as err:
      print("raised:", err)
  """)
  env = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
    JAX_PLATFORMS="cpu",
  )
  out = subprocess.run(
    [sys.executable, "-c", script], env=env, capture_output=True, text=True,
    timeout=120,
  )  # fmt: skip
  assert out.returncode == 0, out.stderr
  assert "raised:" in out.stdout and "can't start new thread" in out.stdout


# 15: managers of one process on one directory, however it is spelled.


@pytest.mark.parametrize(
  "spelling", ["symlink", "relative", "trailing slash", "dotdot"]
)
def test_managers_of_one_process_share_the_lease_however_spelled(
  tmp_path, monkeypatch, spelling
):
  real = tmp_path / "run"
  real.mkdir()
  if spelling == "symlink":
    os.symlink(real, tmp_path / "link")
    other = str(tmp_path / "link")
  elif spelling == "relative":
    monkeypatch.chdir(tmp_path)
    other = "run"
  elif spelling == "trailing slash":
    other = str(real) + "/"
  else:
    (tmp_path / "sub").mkdir()
    other = str(tmp_path / "sub" / ".." / "run")
  first = bt.CheckpointManager(str(real))
  second = bt.CheckpointManager(other)
  try:
    first.save(1, tree_of(1), blocking=True)
    second.save(2, tree_of(2), blocking=True)
    assert first._lease is second._lease  # one lease, two references
    assert len(lease_keys(real)) == 1
    # A heartbeat (what ran 10 s later) finds no other generation.
    assert not first._lease.renew() and first._lease.lost is None
    first.save(3, tree_of(3), blocking=True)
    second.save(4, tree_of(4), blocking=True)
    assert first.all_steps() == second.all_steps() == [1, 2, 3, 4]
  finally:
    first.close()
  assert len(lease_keys(real)) == 1  # the second still holds it
  second.save(5, tree_of(5), blocking=True)
  second.close()
  assert lease_keys(real) == []


def test_managers_spelled_apart_never_take_over_each_others_lease(
  tmp_path, monkeypatch
):
  """The identity under which a lease is filed differs (as when one
  directory is reached through two mounts): the second manager finds this
  process's own live lease by its writer id and shares it."""
  real = tmp_path / "run"
  real.mkdir()
  os.symlink(real, tmp_path / "link")
  spelled = iter(["a", "b"])
  keys = {}

  def identity(st):
    return keys.setdefault(st.root, next(spelled))

  monkeypatch.setattr(lease, "identity", identity)
  with bt.CheckpointManager(str(real)) as first:
    with bt.CheckpointManager(str(tmp_path / "link")) as second:
      first.save(1, tree_of(1), blocking=True)
      second.save(2, tree_of(2), blocking=True)
      assert first._lease is second._lease
      assert not first._lease.renew()
      first.save(3, tree_of(3), blocking=True)


def lease_keys(directory):
  d = os.path.join(directory, lease.PREFIX)
  return sorted(os.listdir(d)) if os.path.isdir(d) else []


# 16: a failed fsync of a directory.


def _dir_fsyncs(monkeypatch, fail_at=None):
  """Patches os.fsync: records the path of every directory fsynced, and
  raises EIO at the ``fail_at``-th (from 0)."""
  seen = []
  real = os.fsync

  def fsync(fd):
    link = f"/proc/self/fd/{fd}"
    if os.path.isdir(link):
      seen.append(os.readlink(link))
      if fail_at is not None and len(seen) - 1 == fail_at:
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    return real(fd)

  monkeypatch.setattr(os, "fsync", fsync)
  return seen


@pytest.mark.parametrize("name", ["ckpt", "ckpt.npz"])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_failed_directory_fsync_says_whether_the_save_is_committed(
  tmp_path, monkeypatch, name, overwrite
):
  new = {"a": np.arange(6.0), "sub": {"b": np.ones(3, np.int32)}}
  old = {"a": np.zeros(6), "sub": {"b": np.zeros(3, np.int32)}}
  probe = tmp_path / "probe" / name
  probe.parent.mkdir()
  if overwrite:
    bt.save(probe, old)
  with monkeypatch.context() as m:
    moments = _dir_fsyncs(m)
    bt.save(probe, new, overwrite=overwrite)
  parent = str(probe.parent)
  assert moments[-1] == parent and moments.count(parent) == 1
  for k in range(len(moments)):
    path = tmp_path / f"at{k}" / name
    path.parent.mkdir()
    if overwrite:
      bt.save(path, old)
    with monkeypatch.context() as m:
      _dir_fsyncs(m, fail_at=k)
      with pytest.raises(OSError) as info:
        bt.save(path, new, overwrite=overwrite)
    err = info.value
    text = str(err)
    assert err.errno == errno.EIO, text
    assert SAVE in text and repr(str(path)) in text, text
    assert "Input/output error" in text and "EIO" in text, text
    if k == len(moments) - 1:  # the parent's, after the rename
      assert f"the new checkpoint is committed at {str(path)!r}" in text
      assert ("the old one was replaced" if overwrite else
              "nothing was at the path before") in text  # fmt: skip
      got = bt.restore(path)
      assert np.array_equal(np.asarray(got["a"]), new["a"])
    else:
      assert "nothing was committed" in text, text
      if overwrite:
        got = bt.restore(path)
        assert np.array_equal(np.asarray(got["a"]), old["a"])
      else:
        assert not os.path.lexists(path)
    assert leftovers(path) == []


# 17: bad targets, refused before anything is written.


def test_an_empty_path_is_refused(tmp_path, monkeypatch, writes):
  monkeypatch.chdir(tmp_path)
  for call in (
    lambda: bt.save("", tree_of(0)),
    lambda: bt.save("", tree_of(0), overwrite=True),
    lambda: bt.restore(""),
    lambda: bt.metadata(""),
  ):
    with pytest.raises(ValueError, match="the path is empty") as info:
      call()
    assert "jaxworks.batched_transfer." in str(info.value)
  assert writes == [] and os.listdir(tmp_path) == []


@pytest.mark.parametrize(
  "name", [".", "..", "/", "sub/.", "sub/..", "sub/./", "./"]
)
def test_a_path_naming_a_directory_itself_is_refused(
  tmp_path, monkeypatch, writes, name
):
  work = tmp_path / "work"
  (work / "sub").mkdir(parents=True)
  monkeypatch.chdir(work)
  for overwrite in (False, True):
    with pytest.raises(ValueError, match="itself, not a checkpoint") as info:
      bt.save(name, tree_of(0), overwrite=overwrite)
    text = str(info.value)
    assert SAVE in text and repr(name) in text and "nothing was written" in text
  assert writes == [] and os.listdir(work) == ["sub"]
  assert os.listdir(tmp_path) == ["work"]


def test_an_npz_path_holding_a_directory_is_refused(tmp_path, writes):
  path = tmp_path / "x.npz"
  path.mkdir()
  (path / "keep.txt").write_text("mine")
  for overwrite in (False, True):
    with pytest.raises(FileExistsError) as info:
      bt.save(path, tree_of(0), overwrite=overwrite)
    assert SAVE in str(info.value) and repr(str(path)) in str(info.value)
  assert "is not a file" in str(info.value)
  assert writes == [] and os.listdir(path) == ["keep.txt"]
  assert sorted(os.listdir(tmp_path)) == ["x.npz"]


def test_a_file_among_the_parents_is_named(tmp_path, writes):
  (tmp_path / "file").write_text("x")
  path = tmp_path / "file" / "sub" / "ckpt"
  with pytest.raises(FileExistsError) as info:
    bt.save(path, tree_of(0))
  text = str(info.value)
  assert SAVE in text and repr(str(path)) in text
  assert f"{str(tmp_path / 'file')!r} is not a directory" in text
  assert writes == []


def test_a_manager_save_checks_its_directory_in_few_calls(
  tmp_path, monkeypatch
):
  """A save into a directory that is there creates none (one stat of it:
  each call is a round trip on a network or 9p file system, in the save
  call); missing parents are still made, each durable."""
  mgr = bt.CheckpointManager(tmp_path / "a" / "b", save_interval_steps=1)
  mgr.save(0, tree_of(0), blocking=True)  # makes a/ and a/b/
  assert mgr.all_steps() == [0]
  made = []  # but the save's own new directories (.<name>.jaxworks-new-)
  real = os.makedirs

  def makedirs(name, *args, **kwargs):
    if ".jaxworks-" not in str(name):
      made.append(str(name))
    return real(name, *args, **kwargs)

  monkeypatch.setattr(os, "makedirs", makedirs)
  mgr.save(1, tree_of(1), blocking=True)
  bt.save(tmp_path / "a" / "c", tree_of(2))
  assert made == []
  bt.save(tmp_path / "x" / "y" / "c", tree_of(3))
  assert str(tmp_path / "x" / "y") in made  # (and x, made by makedirs)
  mgr.close()


def test_a_read_only_parent_is_refused_naming_the_path(
  tmp_path, monkeypatch, writes
):
  parent = tmp_path / "ro"
  parent.mkdir()
  path = parent / "ckpt"
  real_access, real_statvfs = os.access, os.statvfs

  class ReadOnly:
    f_flag = os.ST_RDONLY

  monkeypatch.setattr(
    os, "access", lambda p, m, **k: False if str(p) == str(parent)
    else real_access(p, m, **k),
  )  # fmt: skip
  monkeypatch.setattr(
    os, "statvfs", lambda p: ReadOnly() if str(p) == str(parent)
    else real_statvfs(p),
  )  # fmt: skip
  with pytest.raises(OSError) as info:
    bt.save(path, tree_of(0), blocking=False)
  err = info.value
  assert err.errno == errno.EROFS
  text = str(err)
  assert SAVE in text and repr(str(path)) in text and "read-only" in text
  assert "nothing was written" in text and "EROFS" in text
  assert writes == [] and os.listdir(parent) == []


@pytest.mark.parametrize("name", ["jaxworks-ckpt", "jaxworks-ckpt.npz"])
def test_a_directory_where_nothing_can_be_created_names_the_path(writes, name):
  path = f"/proc/{name}"  # /proc takes no new entries (ENOENT, EACCES)
  with pytest.raises(OSError) as info:
    bt.save(path, tree_of(0))
  err = info.value
  text = str(err)
  assert err.errno in (errno.ENOENT, errno.EACCES, errno.EPERM, errno.EROFS)
  assert SAVE in text and repr(path) in text, text
  assert "Nothing was committed" in text or "nothing was" in text
  assert writes == []
  assert not [p for p in os.listdir("/proc") if "jaxworks" in p]


def test_an_erofs_when_the_temporary_is_created_names_the_path(
  tmp_path, monkeypatch, writes
):
  path = tmp_path / "ckpt"
  real_mkdir = os.mkdir

  def mkdir(p, *args, **kwargs):
    if ".jaxworks-new-" in str(p):
      raise OSError(errno.EROFS, os.strerror(errno.EROFS), p)
    return real_mkdir(p, *args, **kwargs)

  monkeypatch.setattr(os, "mkdir", mkdir)
  with pytest.raises(OSError) as info:
    bt.save(path, tree_of(0))
  text = str(info.value)
  assert info.value.errno == errno.EROFS
  assert SAVE in text and repr(str(path)) in text and "read-only" in text
  assert "Nothing was committed" in text
  assert writes == [] and os.listdir(tmp_path) == []


def test_metadata_never_reports_raw_void_dtypes(tmp_path):
  path = tmp_path / "plain"
  path.mkdir()
  np.save(path / "w.npy", np.ones(4, ml_dtypes.bfloat16))  # header: |V2
  # Not a checkpoint save wrote: its dtype is unknown, never void16.
  with pytest.raises((ValueError, FileNotFoundError)) as info:
    bt.metadata(path)
  assert "void" not in str(info.value)
  assert repr(str(path)) in str(info.value)
