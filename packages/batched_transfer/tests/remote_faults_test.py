"""Bucket checkpoints under faults, on real servers on 127.0.0.1 (moto's S3,
the GCS emulator, Azurite): a path always reads as the last save that
committed to it, whatever failed in between, and a save says which it was.

Faults are injected into the storage layer's requests that change objects
(every write, create, conditional replace and delete of a save, the writer
lease's aside), three ways: the n-th request raises ``OSError`` before it
reaches the server (a dropped connection); it is applied and its answer is
lost (``lost``: applied, then ``OSError``, as after the client's last
retry); or it is applied, its answer lost, and the client's retry sends it
again (``retried``: the server's answer to the second one is the caller's,
e.g. 412 for a conditional create or replace that the first one applied).
Or the saving process is killed with SIGKILL there. At the fault, a
restore sees what readers see at that moment; after it, the path must read
as exactly that, or as the new save exactly when the save returned
(committed: an applied commit whose answer was lost is read back).
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import uuid

import hypothesis
from hypothesis import strategies as st
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import object_servers  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402

# Private imports below: the storage classes patched to inject faults.
from jaxworks.batched_transfer._src.checkpoint import gcs  # noqa: E402
from jaxworks.batched_transfer._src.checkpoint import stores  # noqa: E402

s3_endpoint = object_servers.s3_endpoint
gcs_endpoint = object_servers.gcs_endpoint
azure_connection = object_servers.azure_connection

#: The storage requests that change objects (``open_write``: its close).
CHANGES = ("open_write", "write", "upload", "create", "replace", "delete")
LEASE = ".jaxworks-writer"
HEAD = object_servers.HEAD
#: How an injected fault acts (module docstring).
MODES = ("dropped", "lost", "retried")


def tree(seed):
  rng = np.random.default_rng(seed)
  return {
    "w": rng.standard_normal((33, 17)).astype(np.float32),
    "b": np.arange(5, dtype=np.int32) + seed,
    "seed": seed,
    "tag": f"seed {seed}",
  }


def seed_of(url):
  """The seed of the tree the path reads as, checked bit for bit."""
  out = bt.restore(url)
  want = tree(int(out["seed"]))
  for k in ("w", "b"):
    got = np.asarray(out[k])
    assert got.dtype == want[k].dtype and got.tobytes() == want[k].tobytes()
  assert out["tag"] == want["tag"]
  return int(out["seed"])


def notes(err):
  return " ".join(getattr(err, "__notes__", ()))


@pytest.fixture(params=["s3", "gs", "az"])
def configure(request, monkeypatch):
  """Configures the client of one server by the environment; returns a
  function making new URLs there."""
  if request.param == "s3":
    for k, v in object_servers.S3_ENV.items():
      monkeypatch.setenv(k, v)
    ep = request.getfixturevalue("s3_endpoint")
    monkeypatch.setenv("AWS_ENDPOINT_URL", ep)
  elif request.param == "gs":
    ep = request.getfixturevalue("gcs_endpoint")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", ep)
  else:
    conn = request.getfixturevalue("azure_connection")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", conn)
  return lambda: f"{request.param}://ckpt/run-{uuid.uuid4().hex}/ckpt"


class _LostClose:
  """An object writer whose close is applied, then its answer lost."""

  def __init__(self, out, after):
    self._out, self._after = out, after

  def __getattr__(self, name):
    return getattr(self._out, name)

  def close(self):
    self._out.close()
    self._after()


class Faults:
  """Counts the save's requests that change objects (not the writer
  lease's) on every object-store class; at the ``at``-th (from 0), takes
  the seed a restore reads then (``self.seen``) and acts: ``act()`` before
  the request (``mode`` "dropped", or a kill), or after it was applied
  (``lost``: ``OSError``; ``retried``: the request sent again). ``hit``:
  (method, key) of the request it acted on."""

  def __init__(self, url, at, act=None, observe=None, mode="dropped"):
    self.url, self.at, self.act, self.mode = url, at, act or dropped, mode
    self.observe = observe or seed_or_none
    self.count, self.seen, self.hit = 0, None, None
    self._lock = threading.Lock()
    self._inside = threading.local()

  def _wrap(self, fn):
    name = fn.__name__

    def hooked(st, *args, **kw):
      if getattr(self._inside, "on", False):
        return fn(st, *args, **kw)
      keys = list(args[0]) if name == "delete" else args[:1]
      if name == "delete":
        args = (keys, *args[1:])
      lease = keys and all(
        LEASE in st.where(k).split("/") for k in keys if isinstance(k, str)
      )
      with self._lock:
        hit = not lease and self.count == self.at
        self.count += not lease
      if not hit:
        return self._call(fn, st, args, kw)
      self.hit = (name, keys[0] if keys else "")
      self._inside.on = True
      try:
        self.seen = self.observe(self.url)
      finally:
        self._inside.on = False
      if self.mode == "dropped":
        self.act()
        return self._call(fn, st, args, kw)
      out = self._call(fn, st, args, kw)  # applied; its answer is lost
      if name == "open_write":
        return _LostClose(out, self._answer(fn, st, args, kw, out))
      return self._answer(fn, st, args, kw, out)()

    return hooked

  def _answer(self, fn, st, args, kw, out):
    """What the caller gets instead of the lost answer."""
    if self.mode == "lost":
      return dropped
    if fn.__name__ == "open_write":  # the retry: the same bytes again
      return lambda: None
    return lambda: self._call(fn, st, args, kw)

  def _call(self, fn, st, args, kw):
    self._inside.on = True
    try:
      return fn(st, *args, **kw)
    finally:
      self._inside.on = False

  @contextlib.contextmanager
  def on(self):
    with pytest.MonkeyPatch.context() as mp:
      for cls in (stores.ObstoreStorage, gcs.GCSStorage):
        for name in CHANGES:
          mp.setattr(cls, name, self._wrap(getattr(cls, name)))
      yield self


def seed_or_none(url):
  try:
    return seed_of(url)
  except FileNotFoundError:
    return None


def dropped():
  raise OSError("injected: the endpoint dropped the connection")


def faulty_save(url, seed, at, before, mode="dropped", overwrite=True):
  """Saves ``tree(seed)`` to ``url`` with the ``at``-th request faulted
  (``mode``); the seed the path must read as afterwards (``before``: what
  it read as). Returned: committed, the path reads as the new tree. Raised:
  not committed (the error says so where it came at the commit), the path
  reads as before, as at the fault."""
  faults = Faults(url, at, mode=mode)
  with faults.on():
    try:
      bt.save(url, tree(seed), overwrite=overwrite)
    except OSError as err:
      assert "injected" in str(err) or isinstance(err, FileExistsError), err
      assert faults.seen == before, (faults.hit, faults.seen, before)
      if faults.hit[1] == HEAD:
        assert "was not committed" in notes(err), (faults.hit, err)
      assert "was committed" not in notes(err)
      assert seed_or_none(url) == before, (faults.hit, err)
      return before, faults.count
  if faults.count > at:  # the fault came, the save committed anyway
    assert faults.seen in (before, seed), (faults.hit, faults.seen)
  assert seed_of(url) == seed, faults.hit
  return seed, faults.count


def leftovers(url):
  """What saves left at and beside ``url`` besides the head and the
  version it names: versions, 0.6.x's objects and copies."""
  st = stores.open_storage("test", url)
  parent = st.parent()
  name = url.rsplit("/", 1)[1]
  save = json.loads(bytes(st.read(HEAD)))["save"]
  mine = f".jaxworks-v/{save}/"
  return sorted(
    [k for k in st.list() if k != HEAD and not k.startswith(mine)]
    + [k for k in parent.children() if k.startswith(f".{name}.jaxworks-")]
  )


@hypothesis.settings(
  max_examples=12,
  deadline=None,
  derandomize=True,
  suppress_health_check=list(hypothesis.HealthCheck),
)
@hypothesis.given(
  plan=st.lists(
    st.tuples(st.integers(0, 16), st.sampled_from(MODES)),
    min_size=1,
    max_size=4,
  )
)
def test_overwrites_failing_at_any_request(configure, plan):
  """Sequences of overwrites, each faulted at one request (dropped, or its
  answer lost, with and without the client's retry; or none, past its
  last), a reader restoring all along: the path always reads as the last
  save that committed, bit for bit, every read is one whole committed save
  or a clear error, and a save that completes removes what the failed ones
  left."""
  url = configure()
  bt.save(url, tree(0))
  now = 0
  stop, seen, errors = threading.Event(), [], []

  def read():
    while not stop.is_set():
      try:
        seen.append(seed_of(url))
      except OSError as err:  # replaced (and removed) three times in a row
        errors.append(err)

  reader = threading.Thread(target=read)
  reader.start()
  try:
    for i, (at, mode) in enumerate(plan, 1):
      now, _ = faulty_save(url, i, at, now, mode)
      assert seed_of(url) == now
  finally:
    stop.set()
    reader.join()
  assert set(seen) <= set(range(len(plan) + 1)), seen
  for err in errors:
    assert "replaced while reading" in str(err), err
  bt.save(url, tree(99), overwrite=True)
  assert seed_of(url) == 99 and leftovers(url) == []


@pytest.mark.parametrize("mode", MODES)
def test_every_request_of_a_save_and_an_overwrite(configure, mode):
  """Each request of a first save, then of an overwrite, faulted in turn
  (a deterministic sweep): a save that returns committed, one that raises
  did not, and says so when its commit failed; lost answers of the commit
  itself (the conditional create or replace of the head applied, the
  client's retry answered 412) are read back as committed."""
  url = configure()
  _, total = faulty_save(url, 0, 10**6, None, overwrite=False)
  assert total >= 4  # 2 arrays, the record, the head
  committed_by_lost_head = 0
  for at in range(total + 1):
    url = configure()
    faults_seed, _ = faulty_save(url, 1, at, None, mode, overwrite=False)
    if faults_seed is None:  # not committed: the next save works
      bt.save(url, tree(1))
    elif mode != "dropped" and at == total - 1:
      committed_by_lost_head += 1
  assert committed_by_lost_head == (mode != "dropped")
  url = configure()
  bt.save(url, tree(0))
  _, total = faulty_save(url, 1, 10**6, 0)  # counts an overwrite's requests
  now = 1
  for at in range(total + 1):
    now, _ = faulty_save(url, now + 1, at, now, mode)
    assert seed_of(url) == now
  bt.save(url, tree(now + 1), overwrite=True)
  assert seed_of(url) == now + 1 and leftovers(url) == []


@contextlib.contextmanager
def head_fault(url, mode):
  """Faults (``mode``) the next conditional write of the head alone."""
  faults = Faults(url, 0, mode=mode, observe=lambda url: None)
  with pytest.MonkeyPatch.context() as mp:
    for cls in (stores.ObstoreStorage, gcs.GCSStorage):
      for name in ("create", "replace"):
        real = getattr(cls, name)

        def maybe(st, *args, _real=real, _hooked=faults._wrap(real), **kw):
          if args and args[0] == HEAD:
            return _hooked(st, *args, **kw)
          return _real(st, *args, **kw)

        mp.setattr(cls, name, maybe)
    yield faults


@pytest.mark.parametrize("mode", ["lost", "retried"])
def test_a_commit_whose_answer_was_lost(configure, mode):
  """The issue's cases 8 and 9: the head's conditional write (a first save's
  create, an overwrite's replace) is applied and its answer lost: the save
  reads the head back and returns, committed; nothing it wrote is removed."""
  url = configure()
  with head_fault(url, mode) as faults:
    bt.save(url, tree(1))
  assert faults.hit == ("create", HEAD), faults.hit
  assert seed_of(url) == 1
  with head_fault(url, mode) as faults:
    bt.save(url, tree(2), overwrite=True)
  assert faults.hit == ("replace", HEAD), faults.hit
  assert seed_of(url) == 2 and leftovers(url) == []


def test_a_commit_whose_answer_was_lost_on_the_wire(s3_endpoint, monkeypatch):
  """The head's conditional PUT reaches moto's S3 server and is applied,
  and its answer is cut on the wire (a proxy drops it): whatever the client
  makes of it (a retry answered 412, or an error), the save reads the head
  back and returns, committed; a first save and an overwrite."""
  proxy = object_servers.Proxy(s3_endpoint)
  for k, v in object_servers.S3_ENV.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
  url = f"s3://ckpt/run-{uuid.uuid4().hex}/ckpt"
  lost = []
  for name in ("create", "replace"):
    real = getattr(stores.ObstoreStorage, name)

    def cut(st, key, *a, _real=real, **kw):
      if key == HEAD:
        proxy.lose = 1
        lost.append(key)
      return _real(st, key, *a, **kw)

    monkeypatch.setattr(stores.ObstoreStorage, name, cut)
  try:
    bt.save(url, tree(1))
    assert seed_of(url) == 1
    bt.save(url, tree(2), overwrite=True)
    assert seed_of(url) == 2 and leftovers(url) == []
    assert lost == [HEAD, HEAD] and proxy.lose == 0
  finally:
    proxy.stop()


def test_an_abort_never_removes_what_the_head_names(configure, monkeypatch):
  """A commit whose answer was lost and whose head cannot be read back
  either: the save raises saying so and leaves its version (the head names
  it), which reads whole; the next save tidies."""
  from jaxworks.batched_transfer._src.checkpoint import remote

  url = configure()
  bt.save(url, tree(1))
  with monkeypatch.context() as mp:
    mp.setattr(remote.Bucket, "_read_back", lambda self: None)
    with head_fault(url, "lost") as faults:
      with pytest.raises(OSError, match="injected") as err:
        bt.save(url, tree(2), overwrite=True)
  assert faults.hit == ("replace", HEAD), faults.hit
  assert "could not be read back" in notes(err.value)
  assert seed_of(url) == 2  # it was committed, and nothing of it removed
  bt.save(url, tree(3), overwrite=True)
  assert seed_of(url) == 3 and leftovers(url) == []


def test_a_managers_step_with_lost_answers(configure):
  """Each request of a manager's step save (its retention's deletes too)
  has its answer lost in turn: the step is committed exactly when the save
  returned; a failed retention only warns, and the next save retries it;
  the manager keeps saving."""
  url = configure()
  directory = url.rsplit("/", 1)[0] + "/mgr"
  with bt.CheckpointManager(directory, max_to_keep=2) as m:
    for step in (1, 2):
      m.save(step, tree(step))
    m.wait_until_finished()
  count = Faults(url, 10**6, observe=lambda url: None)
  with count.on(), bt.CheckpointManager(directory, max_to_keep=2) as m:
    m.save(3, tree(3))
    m.wait_until_finished()
  assert count.count >= 5  # 2 arrays, the record, the head, retention
  step = 4
  for at in range(count.count + 1):
    faults = Faults(url, at, mode="lost", observe=lambda url: None)
    with faults.on(), bt.CheckpointManager(directory, max_to_keep=2) as m:
      try:
        m.save(step, tree(step))
        m.wait_until_finished()
        ok = True
      except OSError as err:
        assert "injected" in str(err), err
        ok = False
    with bt.CheckpointManager(directory, max_to_keep=2) as m:
      steps = m.all_steps()
      assert (step in steps) == ok, (at, faults.hit, steps)
      if not ok:
        m.save(step, tree(step))  # its prefix holds only its own version
        m.wait_until_finished()
      assert seed_of(f"{directory}/{step}") == step
      assert m.all_steps()[-1] == step
    step += 1
  with bt.CheckpointManager(directory, max_to_keep=2) as m:
    m.save(step, tree(step))
    m.wait_until_finished()
    assert m.all_steps() == [step - 1, step]
    assert int(m.restore(step)["seed"]) == step


KILLED = textwrap.dedent(
  """
  import os, signal, sys
  sys.path.insert(0, sys.argv[4])
  import remote_faults_test as t

  url, seed, at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
  def kill():
    print("seen", faults.seen, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
  faults = t.Faults(url, at, kill)
  with faults.on():
    t.bt.save(url, t.tree(seed), overwrite=True)
  print("done", faults.count, flush=True)
  """
)


def test_sigkill_at_every_request_of_an_overwrite(configure):
  """A saving process killed at each request of an overwrite in turn: the
  path reads as what it read as at that moment, old or new, never a mix;
  the next save cleans up."""
  url = configure()
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
  env["JAX_PLATFORMS"] = "cpu"
  bt.save(url, tree(0))
  _, total = faulty_save(url, 1, 10**6, 0)
  now = 1
  for at in range(total):
    seed = now + 1
    out = subprocess.run(
      [sys.executable, "-c", KILLED, url, str(seed), str(at),
       os.path.dirname(os.path.abspath(__file__))],
      capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    seen = out.stdout.split()
    assert seen[0] == "seen", out.stdout
    saw = None if seen[1] == "None" else int(seen[1])
    assert saw in (now, seed), (at, saw, now, seed)
    assert seed_of(url) == saw
    now = saw
  bt.save(url, tree(1000), overwrite=True)
  assert seed_of(url) == 1000 and leftovers(url) == []


def big(seed):
  """About 40 MiB in 10 arrays: a save of many requests (multipart)."""
  return {
    f"a{i}": np.full(2**20, seed * 100 + i, np.float32) for i in range(10)
  } | {"seed": seed}


@pytest.mark.parametrize("back_after_s", [0.5, None])
def test_the_server_goes_away_mid_save(s3_endpoint, monkeypatch, back_after_s):
  """The S3 endpoint goes away in the middle of a save (every connection
  cut, the port closed), then comes back with its objects (``back_after_s``)
  or not: the save completes through its retries, or raises OSError; the
  path reads as the old or the new tree, bit for bit: new when the save
  returned, old when it raised (unless its error says that whether it was
  committed could not be read back); the next save works and cleans up."""
  proxy = object_servers.Proxy(s3_endpoint)
  for k, v in object_servers.S3_ENV.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
  opts = {"retry_timeout_s": 10, "max_retries": 8}
  url = f"s3://ckpt/run-{uuid.uuid4().hex}/ckpt"
  bt.save(url, big(1), storage_options=opts)
  count = Faults(url, 10**6, None, observe=lambda url: None)
  with count.on():
    bt.save(url, big(1), overwrite=True, storage_options=opts)
  n = count.count
  for seed, cut_after in ((2, n // 4), (3, n // 2), (4, 3 * n // 4)):
    faults = Faults(url, cut_after, proxy.stop, observe=lambda url: None)
    timer = None
    if back_after_s is not None:
      timer = threading.Timer(back_after_s, proxy.start)
    with faults.on():
      try:
        if timer is not None:
          faults.act = lambda t=timer: (proxy.stop(), t.start())
        bt.save(url, big(seed), overwrite=True, storage_options=opts)
        want = seed
      except OSError as err:
        unknown = "could not be read back" in notes(err)
        want = None if unknown else -1
      assert faults.count > cut_after  # it went away
      if timer is not None:
        timer.join()
      else:
        proxy.start()
    got = bt.restore(url, storage_options=opts)
    if want == -1:  # not committed: the old tree
      want = int(got["seed"])
      assert want < seed
    elif want is None:  # the old tree or the new one
      want = int(got["seed"])
      assert want <= seed
    assert int(got["seed"]) == want
    for k, v in big(want).items():
      np.testing.assert_array_equal(np.asarray(got[k]), v)
  bt.save(url, big(9), overwrite=True, storage_options=opts)
  assert int(bt.restore(url, storage_options=opts)["seed"]) == 9
  assert leftovers(url) == []
  proxy.stop()
