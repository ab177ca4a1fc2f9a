"""Bucket checkpoints under faults, on real servers on 127.0.0.1 (moto's S3,
the GCS emulator, Azurite): a path always reads as the last save that
committed to it, whatever failed in between; objects a bucket can hold that
no save writes are survivable.

Faults are injected into the storage layer's requests that change objects
(every write, create, delete and copy of a save, the writer lease's aside):
the n-th raises ``OSError`` (what a dropped endpoint gives), or the saving
process is killed with SIGKILL there. At the fault, a restore sees what
readers see at that moment; after it, the path must read as exactly that,
and as the save's new tree exactly when the save's error says that the
checkpoint was committed (an error before the commit leaves the old one).
"""

import contextlib
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

#: The storage requests that change objects (``open_write`` starts one).
CHANGES = ("open_write", "write", "upload", "create", "delete", "copy")
LEASE = ".jaxworks-writer"


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


def committed_note(err):
  return any("was committed" in n for n in getattr(err, "__notes__", ()))


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


class Faults:
  """Counts the save's requests that change objects (not the writer
  lease's) on every object-store class; the ``at``-th (from 0) calls
  ``act`` after ``self.seen`` took the seed a restore reads then."""

  def __init__(self, url, at, act, observe=None):
    self.url, self.at, self.act = url, at, act
    self.observe = observe or seed_or_none
    self.count, self.seen = 0, None
    self._lock = threading.Lock()
    self._inside = threading.local()

  def _wrap(self, fn):
    def hooked(st, *args, **kw):
      if getattr(self._inside, "on", False):
        return fn(st, *args, **kw)
      keys = list(args[0]) if fn.__name__ == "delete" else args[:1]
      if fn.__name__ == "delete":
        args = (keys, *args[1:])
      lease = keys and all(
        LEASE in st.where(k).split("/") for k in keys if isinstance(k, str)
      )
      with self._lock:
        hit = not lease and self.count == self.at
        self.count += not lease
      if hit:
        self._inside.on = True
        try:
          self.seen = self.observe(self.url)
        finally:
          self._inside.on = False
        self.act()
      self._inside.on = True
      try:
        return fn(st, *args, **kw)
      finally:
        self._inside.on = False

    return hooked

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


@contextlib.contextmanager
def copies_fail():
  """Every server-side copy (an overwrite's copy round) fails."""
  with pytest.MonkeyPatch.context() as mp:
    for cls in (stores.ObstoreStorage, gcs.GCSStorage):
      mp.setattr(cls, "copy", lambda *a, **k: dropped())
    yield


def faulty_save(url, seed, at, before):
  """Saves ``tree(seed)`` over ``url`` with the ``at``-th request failing;
  the seed the path must read as afterwards (``before``: what it read as)."""
  faults = Faults(url, at, dropped)
  with faults.on():
    try:
      bt.save(url, tree(seed), overwrite=True)
    except OSError as err:
      assert faults.seen in (before, seed), (faults.seen, before, seed)
      # The state at the failure is the state after it, and it is the new
      # checkpoint exactly when the error says it was committed.
      want = seed if committed_note(err) else before
      assert faults.seen == want, (err, getattr(err, "__notes__", None))
      return want, faults.count
  # Done (no request failed, or one the save needed no more failed: the
  # removal of leftovers once the path held the new checkpoint).
  assert faults.seen in (None, before, seed) if faults.count > at else True
  return seed, faults.count


def leftovers(url):
  parent = stores.open_storage("test", url.rsplit("/", 1)[0])
  name = url.rsplit("/", 1)[1]
  return sorted(
    k
    for k in parent.list()
    if k.startswith(f".{name}.jaxworks-")
    or k.startswith(f"{name}/.jaxworks-moved")
  )


def test_two_failed_copy_rounds_read_as_the_last_save(configure):
  """The issue's case: two overwrites in a row whose server-side copies
  fail; the path reads as the second, on every URL; a third that completes
  cleans up."""
  for _ in range(4):
    url = configure()
    bt.save(url, tree(1))
    with copies_fail():
      for seed in (2, 3):
        with pytest.raises(OSError, match="injected") as err:
          bt.save(url, tree(seed), overwrite=True)
        assert committed_note(err.value)
        assert seed_of(url) == seed
        assert bt.metadata(url)["tag"] == f"seed {seed}"
    bt.save(url, tree(4), overwrite=True)
    assert seed_of(url) == 4
    assert leftovers(url) == []


@hypothesis.settings(
  max_examples=12,
  deadline=None,
  derandomize=True,
  suppress_health_check=list(hypothesis.HealthCheck),
)
@hypothesis.given(plan=st.lists(st.integers(0, 40), min_size=1, max_size=4))
def test_overwrites_failing_at_any_request(configure, plan):
  """Sequences of overwrites, each failing at one request of its commit or
  copy round (or none, past its last): the path always reads as the last
  save that committed, bit for bit; a save that completes removes what
  the failed ones left."""
  url = configure()
  bt.save(url, tree(0))
  now = 0
  for i, at in enumerate(plan, 1):
    now, _ = faulty_save(url, i, at, now)
    assert seed_of(url) == now
  bt.save(url, tree(99), overwrite=True)
  assert seed_of(url) == 99 and leftovers(url) == []


def test_every_request_of_an_overwrite_fails_once(configure):
  """Each request of an overwrite of a committed path, and of one whose
  copy round failed before, fails in turn (a deterministic sweep)."""
  url = configure()
  bt.save(url, tree(0))
  _, total = faulty_save(url, 1, 10**6, 0)  # counts the requests
  assert total >= 8
  now = 1
  for at in range(total + 2):
    for first in (True, False):
      if not first:  # a path whose last copy round failed
        with copies_fail(), pytest.raises(OSError):
          bt.save(url, tree(now + 1), overwrite=True)
        now += 1
        assert seed_of(url) == now
      now, _ = faulty_save(url, now + 1, at, now)
      assert seed_of(url) == now


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


def test_sigkill_at_every_request_of_the_copy_round(configure):
  """A saving process killed at each request of an overwrite in turn (on a
  committed path, then on one whose copy round failed): the path reads as
  what it read as at that moment, old or new, never a mix; the next save
  cleans up."""
  url = configure()
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
  env["JAX_PLATFORMS"] = "cpu"
  bt.save(url, tree(0))
  _, total = faulty_save(url, 1, 10**6, 0)
  now = 1
  for at in range(total):
    if at % 2:  # every other one: after a failed copy round
      with copies_fail(), pytest.raises(OSError):
        bt.save(url, tree(now + 1), overwrite=True)
      now += 1
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
  path reads as the old or the new tree, bit for bit, as the error says
  (new exactly when it says the new one was committed); the next save
  works and cleans up."""
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
        want = seed if committed_note(err) else None
      assert faults.count > cut_after  # it went away
      if timer is not None:
        timer.join()
      else:
        proxy.start()
    got = bt.restore(url, storage_options=opts)
    if want is None:  # an error before the commit: the old tree
      want = int(got["seed"])
      assert want < seed
    assert int(got["seed"]) == want
    for k, v in big(want).items():
      np.testing.assert_array_equal(np.asarray(got[k]), v)
  bt.save(url, big(9), overwrite=True, storage_options=opts)
  assert int(bt.restore(url, storage_options=opts)["seed"]) == 9
  assert leftovers(url) == []
  proxy.stop()


def test_a_managers_step_whose_copy_round_failed(configure):
  """A step overwritten (bt.save with overwrite) whose copy round failed is
  committed for the manager too: listed, restored, and deleted with its
  copy beside it."""
  url = configure()
  directory = url.rsplit("/", 1)[0] + "/mgr"
  with bt.CheckpointManager(directory) as m:
    for step in (1, 2):
      m.save(step, tree(step))
    m.wait_until_finished()
  with copies_fail(), pytest.raises(OSError, match="injected") as err:
    bt.save(f"{directory}/2", tree(7), overwrite=True)
  assert committed_note(err.value)
  with bt.CheckpointManager(directory) as m:
    assert m.all_steps() == [1, 2]
    assert int(m.restore(2)["seed"]) == 7
    m.delete(2)
    assert m.all_steps() == [1]
  assert leftovers(f"{directory}/2") == []
  with pytest.raises(FileNotFoundError):
    bt.restore(f"{directory}/2")
