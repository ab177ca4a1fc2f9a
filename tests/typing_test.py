"""The READMEs' adoption lines and one call of each public entry point type-
check under mypy and pyright, with no cast.

A user module (below) swaps jaxworks in for stock JAX as the READMEs say
(``jax.jit = jit_cache.jit``, ``jit = jit_cache.jit``, ``jax.device_put``,
``jax.pmap``), then uses what each public entry point returns the natural
way (a renamed function under ``jax.shard_map``, the axis names as a set of
names, a stage's methods). Both checkers run on it against the packages as a
user installs them (one ``jaxworks`` directory holding all five); neither
may report an error, and what they reveal is checked.
"""

import os
import subprocess
import sys
import textwrap

import jax
import pytest

from jaxworks import axis_names
from jaxworks import batched_transfer
from jaxworks import jit_cache
from jaxworks import pmap_chunked
from jaxworks import stages_aot

USER = textwrap.dedent(
  """
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import jit
  from jax import device_put
  from jaxworks import axis_names
  from jaxworks import batched_transfer
  from jaxworks import jit_cache
  from jaxworks import pmap_chunked
  from jaxworks import stages_aot

  # The adoption lines of the READMEs.
  jax.jit = jit_cache.jit
  jit = jit_cache.jit
  jax.device_put = batched_transfer.device_put
  device_put = batched_transfer.device_put
  jax.pmap = pmap_chunked.pmap

  def body(x):
    return jax.lax.psum(x, "i")

  @jit_cache.jit
  def step(x):
    return x * 2

  x = jnp.ones(8)
  lowered: jax.stages.Lowered = step.lower(x)
  compiled: jax.stages.Compiled = lowered.compile()
  renamed = axis_names.rename_axes(body, {"i": "j"})
  mesh = jax.make_mesh((8,), ("j",))
  sharded = jax.shard_map(
    renamed, mesh=mesh, in_specs=jax.P("j"), out_specs=jax.P()
  )
  names = axis_names.used_axis_names(body, x, axis_sizes={"i": 8})
  first: str = sorted(str(n) for n in names)[0]
  closed = axis_names.rename_axes(jax.make_jaxpr(body, axis_env=[("i", 8)])(x), {"i": "j"})
  placed = batched_transfer.device_put({"w": np.ones(3)}, jax.devices()[0])
  pmapped = pmap_chunked.pmap(lambda v: v + 1)
  replicated = pmap_chunked.device_put_replicated(x, jax.devices())
  exported = stages_aot.trace(step, x).lower().export()
  reveal_type(jax.jit(body))
  reveal_type(names)
  reveal_type(renamed)
  reveal_type(closed)
  reveal_type(exported)
  """
)


def _merged_tree(tmp_path):
  """One ``jaxworks`` directory holding the five packages, as pip lays them
  out (so checkers need no namespace-package support across paths)."""
  root = tmp_path / "site"
  (root / "jaxworks").mkdir(parents=True)
  for pkg in (
    axis_names,
    batched_transfer,
    jit_cache,
    pmap_chunked,
    stages_aot,
  ):
    src = os.path.dirname(os.path.abspath(pkg.__file__))
    os.symlink(src, root / "jaxworks" / os.path.basename(src))
  return root


def _site_packages():
  return os.path.dirname(os.path.dirname(os.path.abspath(jax.__file__)))


def _check_reveals(lines):
  reveals = [line for line in lines if "eveal" in line or "Type of" in line]
  assert len(reveals) == 5, lines
  assert "JitFunction" in reveals[0], reveals
  assert "frozenset[" in reveals[1] and "Hashable" in reveals[1], reveals
  assert "Jaxpr" not in reveals[2], reveals  # a function, not a union
  assert "ClosedJaxpr" in reveals[3] and "|" not in reveals[3], reveals
  assert "Exported" in reveals[4], reveals


def test_mypy(tmp_path):
  (tmp_path / "user.py").write_text(USER)
  root = _merged_tree(tmp_path)
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "mypy",
      "--no-error-summary",
      "--follow-imports=silent",
      "--cache-dir",
      str(tmp_path / ".mypy_cache"),
      "user.py",
    ],
    capture_output=True,
    text=True,
    env=dict(os.environ, MYPYPATH=str(root)),
    cwd=tmp_path,
    check=False,
  )
  lines = proc.stdout.strip().splitlines()
  errors = [line for line in lines if ": error:" in line]
  assert not errors, proc.stdout + proc.stderr
  _check_reveals(lines)


def test_pyright(tmp_path):
  pytest.importorskip("basedpyright")
  (tmp_path / "user.py").write_text(USER)
  root = _merged_tree(tmp_path)
  config = (
    '{"typeCheckingMode": "standard", "reportMissingModuleSource": false, '
    f'"extraPaths": ["{root}", "{_site_packages()}"]}}'
  )
  (tmp_path / "pyrightconfig.json").write_text(config)
  proc = subprocess.run(
    [sys.executable, "-m", "basedpyright", "user.py"],
    capture_output=True,
    text=True,
    cwd=tmp_path,
    check=False,
  )
  lines = proc.stdout.strip().splitlines()
  errors = [line for line in lines if " - error:" in line]
  assert not errors and proc.returncode == 0, proc.stdout + proc.stderr
  _check_reveals(lines)
