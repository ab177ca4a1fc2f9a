"""Where load_artifact reads StableHLO modules: in-process or in the child.

A module whose sha256 the manifest records was checked by save_artifact and is
not read again; any other module, or every module with ``isolate=True``, goes
to the module reader's child process, which exits when idle.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses
import hashlib
import json
import pathlib
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Private imports below: watches the module reader child process (its pid, its
# reads).
from jaxworks import stages_aot as sa
from jaxworks.stages_aot._src import module_reader

DATA = pathlib.Path(__file__).parent / "data"
X = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)


def f(x):
  return jnp.tanh(x @ x.T).sum(axis=1)


@pytest.fixture(scope="module")
def exported():
  return (
    sa.trace(f, X).lower(lowering_platforms=("cpu", "tpu")).export(vjp_order=1)
  )


@pytest.fixture
def artifact_dir(tmp_path, exported):
  sa.save_artifact(exported, tmp_path / "art")
  return tmp_path / "art"


def children() -> set[int]:
  """Process ids of this process's live children (Linux)."""
  pids = set()
  for task in pathlib.Path("/proc/self/task").iterdir():
    try:
      listed = (task / "children").read_text()
    except FileNotFoundError:  # the thread ended since the listing: no children
      continue
    pids.update(int(p) for p in listed.split())
  return pids


@pytest.fixture
def fresh_reader(monkeypatch):
  """A reader with no child and an empty cache; counts the children started."""
  reader = module_reader._Reader()
  monkeypatch.setattr(module_reader, "_READER", reader)
  started = []
  popen = subprocess.Popen

  def counting_popen(*args, **kwargs):
    proc = popen(*args, **kwargs)
    started.append(proc.pid)
    return proc

  monkeypatch.setattr(module_reader.subprocess, "Popen", counting_popen)
  yield started
  reader.stop()


def test_matching_artifact_loads_without_a_child(artifact_dir, fresh_reader):
  module_reader._READER.stop()
  before = children()
  artifact = sa.load_artifact(artifact_dir)
  assert fresh_reader == []
  assert module_reader.child_pid() is None
  assert children() - before == set()
  np.testing.assert_array_equal(artifact(X), jax.jit(f)(X))
  grad = jax.grad(lambda x: artifact(x).sum())(X)
  np.testing.assert_allclose(
    grad, jax.grad(lambda x: f(x).sum())(X), rtol=1e-5, atol=1e-6
  )


def test_matching_artifact_parses_no_module(artifact_dir, monkeypatch):
  """The files and module digests match the manifest, so the modules are
  the ones save_artifact checked and printed: a load reads none of them
  (nor prints one to compare with module.stablehlo.mlir); isolate=True
  reads and compares every one."""
  read, printed = [], []
  describe = module_reader.describe_modules
  mlir_text = sa.Exported.mlir_text

  def counting_describe(blobs, **kwargs):
    read.extend(blobs)
    return describe(blobs, **kwargs)

  def counting_text(self):
    printed.append(self)
    return mlir_text(self)

  monkeypatch.setattr(module_reader, "describe_modules", counting_describe)
  monkeypatch.setattr(sa.Exported, "mlir_text", counting_text)
  artifact = sa.load_artifact(artifact_dir)
  assert read == [] and printed == []
  np.testing.assert_array_equal(artifact(X), jax.jit(f)(X))
  sa.load_artifact(artifact_dir, isolate=True)
  assert len(read) == 2 and len(printed) == 1  # the program and its VJP


def test_isolate_reads_in_the_child(artifact_dir, fresh_reader):
  artifact = sa.load_artifact(artifact_dir, isolate=True)
  assert len(fresh_reader) == 1
  assert module_reader.child_pid() == fresh_reader[0]
  np.testing.assert_array_equal(artifact(X), jax.jit(f)(X))


def test_deserialize_without_a_manifest_reads_in_the_child(
  exported, fresh_reader
):
  again = sa.deserialize(exported.serialize())
  assert len(fresh_reader) == 1
  np.testing.assert_array_equal(again(X), jax.jit(f)(X))


def test_module_not_recorded_in_the_manifest_goes_to_the_child(
  artifact_dir, fresh_reader
):
  manifest = json.loads((artifact_dir / "manifest.json").read_text())
  manifest["levels"][0]["module_sha256"] = "0" * 64
  (artifact_dir / "manifest.json").write_text(json.dumps(manifest))
  with pytest.raises(sa.ArtifactError, match=r"disagrees .* on levels\[0\]"):
    sa.load_artifact(artifact_dir)
  assert len(fresh_reader) == 1  # the unrecorded module was read there


def rewrite_program(directory: pathlib.Path, blob: bytes, modules) -> None:
  """Replaces exported.bin and makes the manifest agree with it (as someone
  who can write both files would)."""
  (directory / "exported.bin").write_bytes(blob)
  manifest = json.loads((directory / "manifest.json").read_text())
  manifest["files"]["exported.bin"] = {
    "sha256": hashlib.sha256(blob).hexdigest(),
    "size": len(blob),
  }
  manifest["levels"] = [
    {**level, "module_sha256": hashlib.sha256(m).hexdigest()}
    for level, m in zip(manifest["levels"], modules)
  ]
  (directory / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
  "name", ["segfault_module.bin", "runaway_alloc_module.bin"]
)
def test_isolate_refuses_a_crashing_module_with_a_matching_manifest(
  artifact_dir, exported, fresh_reader, name
):
  data = (DATA / name).read_bytes()
  exp = exported.jax_exported
  damaged = dataclasses.replace(exp, mlir_module_serialized=data)
  rewrite_program(
    artifact_dir,
    bytes(damaged.serialize(vjp_order=0)),
    [data],
  )
  with pytest.raises(
    sa.ArtifactError, match="its StableHLO module is unreadable"
  ):
    sa.load_artifact(artifact_dir, isolate=True)
  assert fresh_reader  # read in the child, which died instead of this process


def test_child_exits_when_idle(exported, fresh_reader, monkeypatch):
  monkeypatch.setattr(module_reader, "IDLE_TIMEOUT_S", 0.5)
  blob = exported.serialize()
  sa.deserialize(blob)
  (pid,) = fresh_reader
  assert module_reader.child_pid() == pid and pid in children()
  deadline = time.monotonic() + 30
  while pid in children() and time.monotonic() < deadline:
    time.sleep(0.1)
  assert module_reader.child_pid() is None
  # Exited and reaped.
  assert pid not in children() and not pathlib.Path(f"/proc/{pid}").exists()
  # The next untrusted module starts a fresh child, which also goes idle.
  module_reader._READER._cache.clear()
  again = sa.deserialize(blob)
  assert len(fresh_reader) == 2 and fresh_reader[1] != pid
  np.testing.assert_array_equal(again(X), jax.jit(f)(X))


def test_busy_child_is_not_stopped(exported, fresh_reader, monkeypatch):
  """Requests closer together than the idle timeout keep one child."""
  monkeypatch.setattr(module_reader, "IDLE_TIMEOUT_S", 3.0)
  blob = exported.serialize()
  for i in range(4):
    module_reader._READER._cache.clear()
    sa.deserialize(blob)
    time.sleep(0.5)
  assert len(fresh_reader) == 1
  assert module_reader.child_pid() == fresh_reader[0]


def test_in_process_and_child_readers_answer_alike(exported, fresh_reader):
  modules = [
    bytes(exported.jax_exported.mlir_module_serialized),
    bytes(exported.jax_exported.vjp().mlir_module_serialized),
  ]
  trusted = frozenset(hashlib.sha256(m).hexdigest() for m in modules)
  here = module_reader.describe_modules(modules, trusted=trusted)
  assert fresh_reader == []
  there = module_reader.describe_modules(modules, trusted=trusted, isolate=True)
  assert len(fresh_reader) == 1
  assert here == there and all("inputs" in a for a in here), here
