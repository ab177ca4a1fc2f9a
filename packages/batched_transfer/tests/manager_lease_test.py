"""CheckpointManager says what it does: a skipped save logs why (a WARNING
for a step that exists or is older than the last saved, DEBUG for the save
interval), commits, retention and deletes log through the package logger;
and one process writes a manager directory at a time (its writer lease):
another process's save or delete raises WriterConflictError while the
first lives (reads stay allowed), a killed writer's lease is taken over
with a warning, a writer on another host is judged by its heartbeat,
managers of one process share the lease and close() gives it back. On a
local directory, moto's S3 server and gcp-storage-emulator, with real
separate processes."""

import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import object_servers  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402

# Private imports below: the lease's object name; the bucket opened directly.
from jaxworks.batched_transfer._src.checkpoint import lease  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import stores  # noqa: E402

LOGGER = "jaxworks.batched_transfer"
s3_endpoint = object_servers.s3_endpoint
gcs_endpoint = object_servers.gcs_endpoint


def tree(step):
  return {"w": np.full((4, 3), step, np.float32), "n": np.arange(3) + step}


def records(caplog, level):
  return [
    r.getMessage()
    for r in caplog.records
    if r.name == LOGGER and r.levelno == level
  ]


@pytest.fixture(params=["local", "s3", "gs"])
def where(request, tmp_path, monkeypatch):
  """A manager directory: a local path, or a prefix on moto's S3 server or
  gcp-storage-emulator; and the environment a subprocess needs to reach
  it."""
  if request.param == "local":
    return str(tmp_path / "run"), {}
  if request.param == "s3":
    endpoint = request.getfixturevalue("s3_endpoint")
    env = dict(object_servers.S3_ENV, AWS_ENDPOINT_URL=endpoint)
  else:
    env = {"STORAGE_EMULATOR_HOST": request.getfixturevalue("gcs_endpoint")}
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  return f"{request.param}://ckpt/run-{uuid.uuid4().hex}", env


def lease_keys(directory):
  """The lease objects in ``directory`` (a temporary of a write is not one)."""
  st = stores.open_storage("test", directory)
  return sorted(
    k for k in st.list(lease.PREFIX) if k.rpartition("/")[2].isdigit()
  )


# Tasks 1 and 3: what a save, retention and delete say.


def test_a_skipped_save_says_why(tmp_path, caplog):
  caplog.set_level(logging.DEBUG, logger=LOGGER)
  directory = str(tmp_path)
  mgr = bt.CheckpointManager(directory, save_interval_steps=2)
  assert mgr.save(0, tree(0), blocking=True)
  caplog.clear()
  # The interval: the user's own policy, DEBUG only.
  assert not mgr.save(1, tree(1))
  assert records(caplog, logging.WARNING) == []
  (debug,) = [m for m in records(caplog, logging.DEBUG) if "step 1" in m]
  assert "save_interval_steps=2" in debug and "force=True" in debug
  assert mgr.save(4, tree(4), blocking=True)
  caplog.clear()
  # A step that exists: a WARNING naming the step, the directory, the fix.
  assert not mgr.save(4, tree(4))
  (warning,) = records(caplog, logging.WARNING)
  assert "step 4 was not saved: it exists in" in warning
  assert repr(directory) in warning and "delete(4)" in warning
  caplog.clear()
  # An older step (a restart into a used directory): the same, with force.
  again = bt.CheckpointManager(directory, save_interval_steps=2)
  assert not again.save(2, tree(2))
  (warning,) = records(caplog, logging.WARNING)
  assert "step 2 was not saved: it is older than the last saved step 4" in (
    warning
  )
  assert repr(directory) in warning and "force=True" in warning
  assert again.save(2, tree(2), force=True, blocking=True)
  assert again.all_steps() == [0, 2, 4]
  mgr.close()
  again.close()


def test_commits_retention_deletes_and_leftovers_are_logged(tmp_path, caplog):
  caplog.set_level(logging.DEBUG, logger=LOGGER)
  directory = str(tmp_path)
  (tmp_path / ".7.jaxworks-new-0123456789abcdef").mkdir()
  with bt.CheckpointManager(directory, max_to_keep=1) as mgr:
    mgr.save(1, tree(1), blocking=True)
    mgr.save(2, tree(2))  # non-blocking: logged when it commits
    mgr.wait_until_finished()
    mgr.delete(2)
  info = records(caplog, logging.INFO)
  path = os.path.join(directory, "{}")
  assert [m for m in info if "CheckpointManager" in m] == [
    "jaxworks.batched_transfer.CheckpointManager: retention deleted step 1 "
    f"from {directory!r}",
    "jaxworks.batched_transfer.CheckpointManager: deleted step 2 from "
    f"{directory!r}",
  ], info
  for step in (1, 2):  # one INFO line per step saved (the save's own)
    assert len([m for m in info if path.format(step) in m]) == 1, info
  debug = records(caplog, logging.DEBUG)
  for step in (1, 2):
    assert (
      f"jaxworks.batched_transfer.CheckpointManager: step {step} committed at "
      f"{path.format(step)!r}"
    ) in debug, debug
  assert any(
    "left by a killed save" in m and ".7.jaxworks-new-" in m for m in debug
  )
  assert any("holding the writer lease" in m for m in debug), debug
  assert any("released the writer lease" in m for m in debug), debug


# Task 2: one writer per directory.

HOLDER = textwrap.dedent("""
    import sys
    import numpy as np
    from jaxworks import batched_transfer as bt
    mgr = bt.CheckpointManager(sys.argv[1], best_fn=lambda m: m["acc"])
    mgr.save(1, {"w": np.full((4, 3), 1, np.float32), "n": np.arange(3) + 1},
             metrics={"acc": 0.5}, blocking=True)
    print("HOLDING", flush=True)
    for line in sys.stdin:
      if line.strip() == "close":
        mgr.close()
        print("CLOSED", flush=True)
""")


def holder(directory, env):
  """A process that saved step 1 into ``directory`` and holds its lease
  until told "close" (or killed)."""
  p = subprocess.Popen(
    [sys.executable, "-c", HOLDER, directory],
    env=dict(
      os.environ,
      PYTHONPATH=os.pathsep.join(q for q in sys.path if q),
      **env,
    ),
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
  )
  line = p.stdout.readline()
  if line.strip() != "HOLDING":
    p.kill()
    raise AssertionError(line + p.stdout.read())
  return p


def test_a_second_process_cannot_write_while_the_first_lives(where):
  """The reported case: two processes (no jax.distributed) save into one
  directory. The second one's save and delete raise, naming the directory,
  the other writer and the fix; its reads work; once the first closed,
  the second writes."""
  directory, env = where
  first = holder(directory, env)
  try:
    mgr = bt.CheckpointManager(directory, best_fn=lambda m: m["acc"])
    # Observers read freely.
    assert mgr.all_steps() == [1] and mgr.latest_step() == 1
    assert mgr.best_step() == 1 and mgr.metrics(1) == {"acc": 0.5}
    assert float(mgr.restore(1)["w"][0, 0]) == 1.0
    assert mgr.metadata(1).step == 1
    with pytest.raises(bt.WriterConflictError) as err:
      mgr.save(2, tree(2), metrics={"acc": 0.9})
    text = str(err.value)
    assert text.startswith("jaxworks.batched_transfer.CheckpointManager.save")
    assert repr(directory) in text
    assert f"process {first.pid} on host {socket.gethostname()!r}" in text
    assert "jax.distributed.initialize()" in text and "read_only=True" in text
    with pytest.raises(
      bt.WriterConflictError, match="CheckpointManager.delete"
    ):
      mgr.delete(1)
    assert mgr.all_steps() == [1]  # nothing written, nothing deleted
    first.stdin.write("close\n")
    first.stdin.flush()
    assert first.stdout.readline().strip() == "CLOSED"
    assert lease_keys(directory) == []  # close() gave it back
    assert mgr.save(2, tree(2), metrics={"acc": 0.9}, blocking=True)
    assert mgr.all_steps() == [1, 2] and mgr.best_step() == 2
    assert len(lease_keys(directory)) == 1
    mgr.close()
    assert lease_keys(directory) == []
  finally:
    first.kill()
    first.wait()


def test_a_killed_writers_lease_is_taken_over_with_a_warning(where, caplog):
  directory, env = where
  first = holder(directory, env)
  first.send_signal(signal.SIGKILL)
  first.wait()
  (key,) = lease_keys(directory)  # left behind by the killed process
  caplog.set_level(logging.WARNING, logger=LOGGER)
  with bt.CheckpointManager(directory) as mgr:
    assert mgr.save(2, tree(2), blocking=True)
    (warning,) = records(caplog, logging.WARNING)
    assert (
      "took over the writer lease" in warning and repr(directory) in warning
    )
    assert f"process {first.pid} on host" in warning
    (now,) = lease_keys(directory)
    assert now > key  # the next generation
    st = stores.open_storage("test", directory)
    record = json.loads(bytes(st.read(now)))
    assert record["pid"] == os.getpid() and record["directory"] == directory
  assert lease_keys(directory) == []


def test_managers_of_one_process_share_the_lease_and_reopen(tmp_path):
  """Several managers of one process write one directory (they share the
  process's lease, released by the last); a manager closed (or collected)
  and opened again writes again."""
  directory = str(tmp_path)
  a = bt.CheckpointManager(directory)
  assert a.save(1, tree(1), blocking=True)
  b = bt.CheckpointManager(directory)
  assert b.save(2, tree(2), blocking=True)
  b.delete(1)
  a.close()
  assert len(lease_keys(directory)) == 1  # b still holds it
  b.close()
  assert lease_keys(directory) == []
  assert not os.path.exists(os.path.join(directory, lease.PREFIX))
  assert a.save(3, tree(3), blocking=True)  # after close(): taken again
  a.close()
  c = bt.CheckpointManager(directory)
  assert c.save(4, tree(4), blocking=True)
  del c  # never closed: collected, its share goes
  gc.collect()
  assert lease_keys(directory) == []
  with bt.CheckpointManager(directory) as d:
    assert d.save(5, tree(5), blocking=True)
  assert sorted(os.listdir(directory)) == ["2", "3", "4", "5"]


def forge(directory, gen, beat, host="other-host"):
  """Writes the lease record of a writer on another machine."""
  st = stores.open_storage("test", directory)
  record = {
    "format": 1,
    "writer": "feedfacefeedface",
    "host": host,
    "machine": f"{host}/boot/pid:[1]",
    "pid": 4242,
    "pid_start": 1,
    "started": time.time() - 3600,
    "beat": beat,
    "directory": directory,
  }
  st.write(f"{lease.PREFIX}/{gen:020d}", json.dumps(record).encode())


def test_a_writer_on_another_host_is_judged_by_its_heartbeat(
  where, monkeypatch, caplog
):
  """While its heartbeat moves, it is alive (the save raises within a few
  heartbeats); once it stopped for EXPIRY_S, its lease is taken over."""
  directory, _ = where
  monkeypatch.setattr(lease, "HEARTBEAT_S", 0.1)
  monkeypatch.setattr(lease, "EXPIRY_S", 5.0)
  stop = threading.Event()

  def beat():
    while not stop.is_set():
      forge(directory, 3, time.time())
      time.sleep(0.1)

  forge(directory, 3, time.time())
  thread = threading.Thread(target=beat)
  thread.start()
  mgr = bt.CheckpointManager(directory)
  try:
    t0 = time.monotonic()
    with pytest.raises(bt.WriterConflictError, match="host 'other-host'"):
      mgr.save(1, tree(1))
    assert time.monotonic() - t0 < 5.0  # seen alive, before its expiry
  finally:
    stop.set()
    thread.join()
  caplog.set_level(logging.WARNING, logger=LOGGER)
  t0 = time.monotonic()
  assert mgr.save(1, tree(1), blocking=True)  # its heartbeat stopped
  assert time.monotonic() - t0 < 30
  (warning,) = records(caplog, logging.WARNING)
  assert "took over the writer lease" in warning and "other-host" in warning
  assert lease_keys(directory) == [f"{lease.PREFIX}/{4:020d}"]
  # A lease whose heartbeat is long past is taken over at once.
  mgr.close()
  forge(directory, 9, time.time() - 3600)
  t0 = time.monotonic()
  with bt.CheckpointManager(directory) as mgr:
    assert mgr.save(2, tree(2), blocking=True)
  assert time.monotonic() - t0 < 4.0  # no wait for EXPIRY_S


def test_an_unreadable_lease_is_taken_over_only_once_it_stays_still(
  where, monkeypatch
):
  """An unreadable lease record (damaged, or cut by a read racing its
  rewrite) is not a dead writer: it is watched like another host's, taken
  over after EXPIRY_S without change, and one that turns into a live
  record stops the save."""
  directory, _ = where
  monkeypatch.setattr(lease, "EXPIRY_S", 1.0)
  monkeypatch.setattr(lease, "HEARTBEAT_S", 0.2)
  st = stores.open_storage("test", directory)
  st.write(f"{lease.PREFIX}/{3:020d}", b'{"beat": 17960')
  t0 = time.monotonic()
  with bt.CheckpointManager(directory) as mgr:
    assert mgr.save(1, tree(1), blocking=True)
  assert time.monotonic() - t0 >= 1.0  # watched, not taken over at once
  st.write(f"{lease.PREFIX}/{9:020d}", b"\x00garbage")
  timer = threading.Timer(0.3, forge, (directory, 9, time.time()))
  timer.start()
  try:
    with pytest.raises(bt.WriterConflictError, match="host 'other-host'"):
      with bt.CheckpointManager(directory) as mgr:
        mgr.save(2, tree(2))
  finally:
    timer.join()
  assert bt.CheckpointManager(directory, read_only=True).all_steps() == [1]


def test_the_holder_renews_its_heartbeat_until_close(where, monkeypatch):
  directory, _ = where
  monkeypatch.setattr(lease, "HEARTBEAT_S", 0.05)
  st = stores.open_storage("test", directory)
  mgr = bt.CheckpointManager(directory)
  assert mgr.save(1, tree(1), blocking=True)
  (key,) = lease_keys(directory)
  first = json.loads(bytes(st.read(key)))["beat"]
  deadline = time.monotonic() + 30
  while json.loads(bytes(st.read(key)))["beat"] == first:
    assert time.monotonic() < deadline, "no heartbeat"
    time.sleep(0.05)
  mgr.close()
  assert lease_keys(directory) == []
  time.sleep(0.3)  # no heartbeat writes it again
  assert lease_keys(directory) == []


def test_a_writer_whose_lease_was_taken_over_stops_writing(tmp_path):
  directory = str(tmp_path)
  mgr = bt.CheckpointManager(directory)
  assert mgr.save(1, tree(1), blocking=True)
  (key,) = lease_keys(directory)
  # Another host took it over (this process looked dead to it).
  forge(directory, int(key.rpartition("/")[2]) + 1, time.time())
  held = mgr._lease  # renewed every HEARTBEAT_S; now, here
  assert held is not None and held.renew()
  with pytest.raises(bt.WriterConflictError, match="took over this process"):
    mgr.save(2, tree(2))
  assert mgr.all_steps() == [1]
  mgr.close()
  assert len(lease_keys(directory)) == 1  # the other writer's stays


CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from jaxworks import batched_transfer as bt
    mgr = bt.CheckpointManager(sys.argv[1], read_only=True)
    print("READ", mgr.all_steps(), flush=True)
    mgr = bt.CheckpointManager(sys.argv[1])
    try:
      mgr.save(9, {"w": np.zeros(2)}, force=True, blocking=True)
    except bt.WriterConflictError as err:
      print("REFUSED", err, flush=True)
""")


def test_a_process_started_by_the_writer_is_refused_too(tmp_path):
  """The writer's lease is held from its first save; a subprocess it starts
  (which never called jax.distributed.initialize) reads, but may not write."""
  directory = str(tmp_path)
  with bt.CheckpointManager(directory) as mgr:
    mgr.save(1, tree(1), blocking=True)
    out = subprocess.run(
      [sys.executable, "-c", CHILD, directory],
      env=dict(
        os.environ, PYTHONPATH=os.pathsep.join(q for q in sys.path if q)
      ),
      capture_output=True,
      text=True,
      timeout=300,
    )
    assert "READ [1]" in out.stdout, out.stdout + out.stderr
    assert "REFUSED" in out.stdout, out.stdout + out.stderr
    assert f"process {os.getpid()} on host" in out.stdout
    assert mgr.all_steps() == [1]
