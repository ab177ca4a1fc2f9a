"""Two processes saving one URL of moto's S3 server (on 127.0.0.1, started
by this test) at the same moment: the committed checkpoint is always one of
the two trees bit for bit, the other save raises a clear error (each save
holds the URL's writer lease while it writes its objects); a saver killed
mid-save does not block the next save; a live saver's lease stops another
before it writes anything; the lease costs a few requests and a
CheckpointManager's saves take none.
"""

import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import object_servers  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402

# Private imports below: the lease's objects and bucket writes, patched.
from jaxworks.batched_transfer._src.checkpoint import lease  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import remote  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import stores  # noqa: E402

ROUNDS = 10


def tree(who, k, n=12, size=2**17):
  return {
    f"x{i}": np.full(size, who * 10000 + k * 100 + i, np.float32)
    for i in range(n)
  } | {"who": who, "k": k}


# The subprocesses build their trees as this test does.
TREE = "import numpy as np\n" + inspect.getsource(tree)

RACER = TREE + textwrap.dedent(
  """
  import json, os, sys, time
  from jaxworks import batched_transfer as bt

  base, rounds, who, overwrite, sync = sys.argv[1:6]
  rounds, who, overwrite = int(rounds), int(who), overwrite == "1"
  for k in range(rounds):
    # Both processes start the save of round k at the same moment.
    open(os.path.join(sync, f"{k}.{who}"), "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(sync, f"{k}.{1 - who}")):
      assert time.monotonic() < deadline, "the other racer never came"
      time.sleep(0.001)
    try:
      bt.save(f"{base}/{k}", tree(who, k), overwrite=overwrite)
      out = {"k": k, "ok": True}
    except Exception as err:
      out = {"k": k, "ok": False, "type": type(err).__name__, "msg": str(err)}
    print(json.dumps(out), flush=True)
  """
)

HOLDER = textwrap.dedent(
  """
  import sys
  from jaxworks.batched_transfer._src.checkpoint import lease, stores

  url = sys.argv[1]
  st = stores.open_storage("holder", url)
  lease.acquire("holder", st, url)
  print("held", flush=True)
  sys.stdin.read()  # until the test closes it (or kills this process)
  """
)


@pytest.fixture(scope="module")
def endpoint():
  with object_servers.s3_server() as endpoint:
    object_servers.s3_bucket(endpoint, "race")
    yield endpoint


@pytest.fixture
def env(endpoint, monkeypatch):
  for k, v in object_servers.S3_ENV.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
  return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


def objects(url):
  return sorted(stores.open_storage("test", url).list())


def check_tree(got, want):
  assert set(got) == set(want)
  for k, v in want.items():
    if isinstance(v, int):
      assert got[k] == v, k
    else:
      np.testing.assert_array_equal(got[k], v)


@pytest.mark.parametrize("overwrite", [False, True])
def test_two_processes_save_one_new_url(env, tmp_path, overwrite):
  base = f"s3://race/run-{uuid.uuid4().hex}"
  racers = [
    subprocess.Popen(
      [
        sys.executable,
        "-c",
        RACER,
        base,
        str(ROUNDS),
        str(who),
        str(int(overwrite)),
        str(tmp_path),
      ],
      stdout=subprocess.PIPE,
      env=env,
      text=True,
    )  # fmt: skip
    for who in (0, 1)
  ]
  outs = []
  for p in racers:
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    outs.append({r["k"]: r for r in map(json.loads, out.split("\n")[:-1])})
  lost = 0
  for k in range(ROUNDS):
    url = f"{base}/{k}"
    ok = [who for who in (0, 1) if outs[who][k]["ok"]]
    errors = [outs[who][k] for who in (0, 1) if not outs[who][k]["ok"]]
    if not overwrite:
      assert len(ok) == 1, (k, outs[0][k], outs[1][k])
    else:
      assert ok, (k, outs[0][k], outs[1][k])
    for e in errors:
      lost += 1
      want = "WriterConflictError" if overwrite else "FileExistsError"
      if e["type"] == "FileExistsError" and not overwrite:
        # the other save committed first, or was writing: either names it
        assert url in e["msg"] and "overwrite=True" in e["msg"], e
      else:
        assert e["type"] == want, e
        assert "is being saved by process" in e["msg"], e
        assert url in e["msg"] and lease.PREFIX in e["msg"], e
    got = bt.restore(url)
    assert got["who"] in ok, (k, got["who"], ok)
    check_tree(got, tree(got["who"], k))
    names = objects(url)
    assert remote.HEAD in names
    assert not [n for n in names if n.startswith(lease.PREFIX)], names
  assert not [k for k in objects(base) if ".jaxworks-new-" in k]
  if not overwrite:
    assert lost == ROUNDS


def test_a_live_savers_lease_stops_another_save(env, caplog):
  url = f"s3://race/run-{uuid.uuid4().hex}/ckpt"
  holder = subprocess.Popen(
    [sys.executable, "-c", HOLDER, url],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True,
  )  # fmt: skip
  try:
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(
      FileExistsError, match="is being saved at .* by process"
    ):
      bt.save(url, tree(0, 0))
    with pytest.raises(bt.WriterConflictError) as err:
      bt.save(url, tree(0, 0), overwrite=True)
    assert f"process {holder.pid} on host" in str(err.value)
    assert f"{url}/{lease.PREFIX}" in str(err.value)
    # Nothing written at the path: only the holder's lease is there.
    assert [n.split("/")[0] for n in objects(url)] == [lease.PREFIX]
  finally:
    os.kill(holder.pid, signal.SIGKILL)
    holder.communicate(timeout=60)
  with caplog.at_level(logging.WARNING, logger="jaxworks.batched_transfer"):
    bt.save(url, tree(0, 1))  # the dead holder's lease taken over
  assert "took over the writer lease" in caplog.text
  check_tree(bt.restore(url), tree(0, 1))
  assert lease.PREFIX not in str(objects(url))


KILLED = TREE + textwrap.dedent(
  """
  import sys
  from jaxworks import batched_transfer as bt

  print("saving", flush=True)
  bt.save(sys.argv[1], tree(1, 0, n=24, size=2**20))
  print("saved", flush=True)
  """
)


def test_a_saver_killed_mid_save_does_not_block_the_next(env, caplog):
  url = f"s3://race/run-{uuid.uuid4().hex}/ckpt"
  child = subprocess.Popen(
    [sys.executable, "-c", KILLED, url],
    stdout=subprocess.PIPE, env=env, text=True,
  )  # fmt: skip
  try:
    assert child.stdout.readline() == "saving\n"
    deadline = time.monotonic() + 120
    while True:  # its lease taken and some of its objects written
      names = objects(url)
      if any(n.endswith(".npy") for n in names):
        break
      assert child.poll() is None and time.monotonic() < deadline, names
      time.sleep(0.01)
    assert any(n.startswith(lease.PREFIX) for n in names), names
  finally:
    os.kill(child.pid, signal.SIGKILL)
    child.communicate(timeout=60)
  assert remote.HEAD not in objects(url)
  with caplog.at_level(logging.WARNING, logger="jaxworks.batched_transfer"):
    bt.save(url, tree(0, 2))
  assert "took over the writer lease" in caplog.text
  check_tree(bt.restore(url), tree(0, 2))
  assert lease.PREFIX not in str(objects(url))
  # A committed checkpoint that a killed saver left its lease in: readers
  # ignore the lease; the next save takes it over.
  st = stores.open_storage("test", url)
  st.write(f"{lease.PREFIX}/{0:020d}", b'{"pid": 1, "machine": "gone"}')
  check_tree(bt.restore(url), tree(0, 2))
  assert set(bt.metadata(url)) == set(tree(0, 2))
  with pytest.raises(FileExistsError, match="a checkpoint exists"):
    bt.save(url, tree(0, 3))
  bt.save(url, tree(0, 3), overwrite=True)
  check_tree(bt.restore(url), tree(0, 3))


def counted(monkeypatch):
  """Every storage request of this process, as (method, key)."""
  calls = []
  cls = type(stores.open_storage("test", "s3://race/x"))
  for name in ("list", "children", "exists", "read", "write", "create",
               "delete", "open_write", "copy", "size", "read_tagged",
               "tag_of", "replace"):  # fmt: skip
    real = getattr(cls, name)

    def spy(self, *a, _real=real, _name=name, **kw):
      calls.append((_name, self.url, a[0] if a else ""))
      return _real(self, *a, **kw)

    monkeypatch.setattr(cls, name, spy)
  return calls


def test_the_lease_costs_a_few_requests(env, monkeypatch):
  url = f"s3://race/run-{uuid.uuid4().hex}/ckpt"
  calls = counted(monkeypatch)
  bt.save(url, tree(0, 4, n=3))
  leased = [c for c in calls if lease.PREFIX in str(c)]
  assert sorted(c[0] for c in leased) == ["create", "delete", "list"], leased
  # Requests: open_write is local until it writes, exists reads a size.
  sent = [c for c in calls if c[0] not in ("open_write", "exists")]
  # 5 objects, the record, the head, the lease's 3, the path's checks (its
  # head, its listing and its parent's, in the call and in the save's turn).
  assert len(sent) <= 5 + 1 + 1 + 3 + 6, [(c[0], c[2]) for c in sent]
  check_tree(bt.restore(url), tree(0, 4, n=3))


def test_a_managers_saves_take_no_lease_per_step(env, monkeypatch):
  directory = f"s3://race/run-{uuid.uuid4().hex}"
  calls = counted(monkeypatch)
  with bt.CheckpointManager(directory) as m:
    for step in range(3):
      m.save(step, tree(0, step, n=2))
    m.wait_until_finished()
  leased = [c for c in calls if lease.PREFIX in str(c)]
  # The manager's own lease on its directory, no step's.
  assert leased and all(c[1] == directory for c in leased), leased
  with bt.CheckpointManager(directory) as m:
    check_tree(m.restore(2), tree(0, 2, n=2))


EXITING = TREE + textwrap.dedent(
  """
  import sys, time
  from jaxworks import batched_transfer as bt
  from jaxworks.batched_transfer._src.checkpoint import stores

  url = sys.argv[1]
  bt.save(url, tree(1, 5, n=24, size=2**20), blocking=False)
  st = stores.open_storage("test", url)
  while not st.list(".jaxworks-writer"):  # its lease taken: exit now
    time.sleep(0.001)
  """
)


def test_a_save_still_writing_at_exit_holds_its_lease(env):
  url = f"s3://race/run-{uuid.uuid4().hex}/ckpt"
  child = subprocess.Popen([sys.executable, "-c", EXITING, url], env=env)
  polls = 0
  while child.poll() is None:
    names = objects(url)
    if remote.HEAD not in names and any(n.endswith(".npy") for n in names):
      # Objects written, not committed: the save must still hold the lease
      # (the interpreter's exit waits for the save thread, then the lease
      # is given back).
      held = [n for n in names if n.startswith(lease.PREFIX)]
      if not held:  # the lease is listed before the objects, so look again
        names = objects(url)
        held = [n for n in names if n.startswith(lease.PREFIX)]
        assert held or remote.HEAD in names, names
      polls += 1
    time.sleep(0.005)
  assert child.wait(timeout=120) == 0
  assert polls, "never saw the save writing"
  check_tree(bt.restore(url), tree(1, 5, n=24, size=2**20))
  assert lease.PREFIX not in str(objects(url))


def test_a_save_whose_lease_was_taken_over_does_not_commit(env, monkeypatch):
  """A saver suspended past the lease's expiry, whose lease another process
  took over meanwhile (a higher generation), stops before its commit."""
  url = f"s3://race/run-{uuid.uuid4().hex}/ckpt"
  real = remote.Bucket.write

  def write(self, *a, **kw):
    out = real(self, *a, **kw)
    other = {"pid": 1, "host": "elsewhere", "writer": "f00d", "started": 0}
    st = self._held.storage
    st.create(lease._key(self._held.gen + 1), json.dumps(other).encode())
    assert self._held.renew()  # what its heartbeat thread would find
    return out

  monkeypatch.setattr(remote.Bucket, "write", write)
  with pytest.raises(bt.WriterConflictError, match="took over this save"):
    bt.save(url, tree(0, 6, n=2))
  names = objects(url)
  assert remote.HEAD not in names, names
  # Its own generation deleted, the taker's left to its taker.
  assert [n for n in names if n.startswith(lease.PREFIX)] == [lease._key(1)], (
    names
  )
