"""A process saving to moto's S3 server (on 127.0.0.1, started by this test)
killed with SIGKILL at random moments: the URL holds a complete checkpoint
(old or new, bit for bit) or none, never a mix; the next save cleans up.
"""

import os
import random
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

# Private imports below: the bucket opened directly to list what a kill left.
from jaxworks.batched_transfer._src.checkpoint import stores  # noqa: E402

TRIALS = 8

SAVER = textwrap.dedent(
  """
  import sys
  import numpy as np
  from jaxworks import batched_transfer as bt

  def tree(seed):
    return {f"x{i}": np.full(2**18, seed * 100 + i, np.float32)
            for i in range(12)} | {"seed": seed}

  url, first = sys.argv[1], int(sys.argv[2])
  for seed in range(first, first + 1000):
    bt.save(url, tree(seed), overwrite=True)
    print(seed, flush=True)
  """
)


def tree(seed):
  return {
    f"x{i}": np.full(2**18, seed * 100 + i, np.float32) for i in range(12)
  } | {"seed": seed}


@pytest.fixture(scope="module")
def endpoint():
  with object_servers.s3_server() as endpoint:
    object_servers.s3_bucket(endpoint, "kill")
    yield endpoint


def test_sigkill_while_saving(endpoint, monkeypatch):
  for k, v in object_servers.S3_ENV.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
  url = f"s3://kill/run-{uuid.uuid4().hex}/ckpt"
  rng = random.Random(0)
  # The seeds a save may have committed: those it reported, and the one
  # each killed process was saving.
  possible, newest = set(), -1
  first = 0
  for trial in range(TRIALS):
    child = subprocess.Popen(
      [sys.executable, "-c", SAVER, url, str(first)],
      stdout=subprocess.PIPE,
      env=env,
      text=True,
    )
    time.sleep(rng.uniform(2.0, 5.0))  # jax's import, then saves
    os.kill(child.pid, signal.SIGKILL)
    out, _ = child.communicate(timeout=60)
    done = [int(s) for s in out.split()]
    possible |= set(done) | {(done[-1] if done else first - 1) + 1}
    newest = max([newest, *done])
    try:
      got = bt.restore(url)
    except FileNotFoundError:
      assert newest < 0, f"trial {trial}: step {newest} vanished"
    else:
      seed = got["seed"]
      assert seed in possible and seed >= newest, (trial, seed, newest)
      for k, v in tree(seed).items():
        np.testing.assert_array_equal(got[k], v)
    first += 1000
  bt.save(url, tree(7), overwrite=True)  # cleans what the killed ones left
  out = bt.restore(url)
  assert out["seed"] == 7
  parent = stores.open_storage("test", url.rsplit("/", 1)[0])
  assert not [k for k in parent.list() if ".jaxworks-new-" in k]
