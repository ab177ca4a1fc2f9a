"""The version checks, and that stages_aot needs no other jaxworks package."""

import os
import subprocess
import sys
import types

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest

from jaxworks.stages_aot._src import dep_check
from jaxworks.stages_aot._src import deps


def test_check_version():
  dep_check.check_version(
    "jaxworks.stages_aot", "jaxworks.jit_cache", "0.1.0", "0.1.0"
  )
  dep_check.check_version(
    "jaxworks.stages_aot", "jaxworks.jit_cache", "0.10.0", "0.9.1"
  )
  dep_check.check_version(
    "jaxworks.stages_aot", "jaxworks.jit_cache", "1.0.0rc1", "0.1.0"
  )
  with pytest.raises(
    RuntimeError,
    match=r"jaxworks.stages_aot needs jaxworks.jit_cache >= 0.2.0, but 0.1.9 is installed; upgrade it \(pip install -U 'jaxworks-jit-cache>=0.2.0'\)",
  ):
    dep_check.check_version(
      "jaxworks.stages_aot", "jaxworks.jit_cache", "0.1.9", "0.2.0"
    )


def test_needs_no_other_jaxworks_package():
  """A leaf: no jaxworks minimum to check, and trace -> lower -> export ->
  deserialize and artifacts import no other jaxworks package."""
  assert deps.MINIMUM_VERSIONS == {}
  assert set(deps.written_by()) == {
    "jax",
    "jaxlib",
    "numpy",
    "python",
    "jaxworks.stages_aot",
  }
  code = (
    "import sys, tempfile, numpy as np, jax.numpy as jnp\n"
    "from jaxworks import stages_aot as sa\n"
    "x = np.ones(3, np.float32)\n"
    "lowered = sa.trace(jnp.sin, x).lower(lowering_platforms=('cpu', 'tpu'))\n"
    "exp = sa.deserialize(lowered.export(vjp_order=1).serialize())\n"
    "sa.save_artifact(exp, tempfile.mkdtemp() + '/a')\n"
    "print(type(lowered).__module__, lowered.compile()(x).shape)\n"
    "print(sorted(m for m in sys.modules if m.startswith('jaxworks.')\n"
    "             and not m.startswith('jaxworks.stages_aot')))\n"
  )
  out = subprocess.run(
    [sys.executable, "-c", code],
    env=dict(
      os.environ,
      PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
      JAX_PLATFORMS="cpu",
    ),
    capture_output=True,
    text=True,
    timeout=300,
    check=False,
  )
  assert out.returncode == 0, out.stderr[-4000:]
  # Lowered reports its public module (jaxworks.stages_aot).
  assert out.stdout.splitlines() == [
    "jaxworks.stages_aot (3,)",
    "[]",
  ], out.stdout


def test_incomplete_or_missing_dependency_is_actionable():
  fake = types.ModuleType("jaxworks.jit_cache")
  fake.__version__ = "0.3.0"
  with pytest.raises(
    RuntimeError,
    match=r"jaxworks.stages_aot: jaxworks.jit_cache found at \[\] is "
    r"incomplete \(no jit\); reinstall it \(pip install --force-reinstall "
    r"'jaxworks-jit-cache>=0.1.0'\)",
  ):
    dep_check.require("jaxworks.stages_aot", fake, "0.1.0", attrs=("jit",))
  fake.jit = object()
  assert (
    dep_check.require("jaxworks.stages_aot", fake, "0.1.0", ("jit",)) is fake
  )
  err = dep_check.missing(
    "jaxworks.stages_aot", "jaxworks.jit_cache", "0.1.0", ImportError("gone")
  )
  assert str(err) == (
    "jaxworks.stages_aot needs jaxworks.jit_cache >= 0.1.0, which could not "
    "be imported (gone); install it (pip install 'jaxworks-jit-cache>=0.1.0')"
  )
