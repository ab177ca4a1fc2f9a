"""save(progress=...): a bar of the bytes written on stderr (for a bucket
URL on moto's S3 server started by this test: of the objects written, the
only pass over the bytes), for directories, .npz files and non-blocking
saves; silent by default, and with None where stderr is not a terminal."""

import io
import os
import re
import sys

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import object_servers  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402

s3_endpoint = object_servers.s3_endpoint
MIB = 2**20


class Tty(io.StringIO):
  def isatty(self):
    return True


def tree():
  # 24 MiB in all: the bars' totals read 0.02 GiB.
  return {
    "a": np.ones((2 * MIB,), np.float32),
    "b": {"c": jnp.arange(4 * MIB, dtype=jnp.int32)},
    "s": "text",
  }


def bars(text, label):
  """(done, total) of every ``label`` bar drawn, in order."""
  pattern = rf"{label} \[[#.]+\] +\d+% ([\d.]+)/([\d.]+) GiB"
  return [(float(a), float(b)) for a, b in re.findall(pattern, text)]


def terminal(monkeypatch):
  """A terminal as sys.stderr for the rest of the test (set in the test:
  pytest sets its own between a fixture and the test)."""
  out = Tty()
  monkeypatch.setattr(sys, "stderr", out)
  return out


@pytest.mark.parametrize("name", ["dir", "file.npz"])
@pytest.mark.parametrize("blocking", [True, False])
def test_a_bar_of_the_bytes_written(tmp_path, monkeypatch, name, blocking):
  stderr = terminal(monkeypatch)
  path = str(tmp_path / name)
  h = bt.save(path, tree(), progress=True, blocking=blocking)
  if h is not None:
    h.wait()
  drawn = bars(stderr.getvalue(), "save")
  assert drawn, stderr.getvalue()
  assert drawn[-1] == (0.02, 0.02), drawn  # 24 MiB, every byte counted
  assert all(a <= b for a, b in drawn), drawn
  assert stderr.getvalue().endswith("\n")
  assert not bars(stderr.getvalue(), "upload")
  out = bt.restore(path)
  np.testing.assert_array_equal(out["b"]["c"], np.arange(4 * MIB))


def test_silent_by_default_and_with_none_off_a_terminal(tmp_path, monkeypatch):
  stderr = terminal(monkeypatch)
  bt.save(str(tmp_path / "a"), tree())
  bt.save(str(tmp_path / "b"), tree(), progress=False)
  assert stderr.getvalue() == ""
  quiet = io.StringIO()  # not a terminal
  sys.stderr = quiet
  bt.save(str(tmp_path / "c"), tree(), progress=None)
  assert quiet.getvalue() == ""
  sys.stderr = stderr
  bt.save(str(tmp_path / "d"), tree(), progress=None)  # a terminal
  assert bars(stderr.getvalue(), "save")[-1] == (0.02, 0.02)


@pytest.mark.parametrize("blocking", [True, False])
def test_a_bucket_save_draws_the_objects_written(
  s3_endpoint, monkeypatch, blocking
):
  stderr = terminal(monkeypatch)
  for k, v in object_servers.S3_ENV.items():
    monkeypatch.setenv(k, v)
  monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
  url = f"s3://ckpt/progress/one-{blocking}"
  h = bt.save(url, tree(), progress=True, blocking=blocking)
  if h is not None:
    h.wait()
  text = stderr.getvalue()
  drawn = bars(text, "save")
  assert drawn[-1] == (0.02, 0.02), text  # every byte, once in the bucket
  assert all(a <= b for a, b in drawn), drawn
  # One pass: the objects are the save's writes, not a second upload.
  assert not bars(text, "upload"), text
  out = bt.restore(url)
  assert out["s"] == "text"
  np.testing.assert_array_equal(out["a"], np.ones((2 * MIB,), np.float32))
  np.testing.assert_array_equal(out["b"]["c"], np.arange(4 * MIB))
