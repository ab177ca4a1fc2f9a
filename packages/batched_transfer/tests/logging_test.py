"""What save and restore log through Python logging, on the package's logger
``jaxworks.batched_transfer``: one INFO record per checkpoint saved or
restored, a DEBUG record per file, nothing above INFO when all goes well,
and nothing printed."""

import logging

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from jaxworks import batched_transfer as bt

LOGGER = "jaxworks.batched_transfer"


def _records(caplog, level):
  return [r for r in caplog.records if r.name == LOGGER and r.levelno == level]


@pytest.mark.parametrize("blocking", [True, False])
def test_save_and_restore_log_one_info_per_checkpoint(
  tmp_path, caplog, capsys, blocking
):
  tree = {"w": np.arange(12.0).reshape(3, 4), "b": {"x": jnp.ones(5), "y": 3}}
  path = str(tmp_path / "ckpt")
  caplog.set_level(logging.DEBUG, logger=LOGGER)
  handle = bt.save(path, tree, blocking=blocking)
  if handle is not None:
    handle.wait()
  infos = _records(caplog, logging.INFO)
  assert [r.getMessage().split(" (")[0] for r in infos] == [f"saved {path}"]
  assert "(3 arrays)" in infos[0].getMessage()
  written = [
    r.getMessage()
    for r in _records(caplog, logging.DEBUG)
    if r.getMessage().startswith("writing ")
  ]
  assert len(written) == 3  # one per array file
  caplog.clear()
  out = bt.restore(path, tree)
  np.testing.assert_array_equal(out["w"], tree["w"])
  infos = _records(caplog, logging.INFO)
  assert [r.getMessage().split(" (")[0] for r in infos] == [f"restored {path}"]
  read = [
    r
    for r in _records(caplog, logging.DEBUG)
    if r.getMessage().startswith("reading ")
  ]
  assert len(read) == 3
  assert not [
    r
    for r in caplog.records
    if r.name.startswith(LOGGER) and r.levelno > logging.INFO
  ]
  assert capsys.readouterr() == ("", "")  # logged, never printed


def test_nothing_at_the_default_level(tmp_path, caplog):
  """A training loop's saves stay quiet unless the user asks for INFO."""
  caplog.set_level(logging.WARNING, logger=LOGGER)
  mesh = jax.make_mesh((8,), ("x",))
  x = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("x")))
  bt.save(str(tmp_path / "c"), {"x": x})
  bt.restore(str(tmp_path / "c"), {"x": x})
  assert not [r for r in caplog.records if r.name.startswith(LOGGER)]


def test_a_failed_save_logs_no_success(tmp_path, caplog):
  caplog.set_level(logging.DEBUG, logger=LOGGER)
  (tmp_path / "c").mkdir()
  (tmp_path / "c" / "user.txt").write_text("mine")
  with pytest.raises(FileExistsError):
    bt.save(str(tmp_path / "c"), {"w": np.ones(2)}, overwrite=True)
  assert not _records(caplog, logging.INFO)
