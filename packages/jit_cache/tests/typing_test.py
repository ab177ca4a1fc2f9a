"""What type checkers see of ``jit(...)``: a JitFunction with its stages and
``cache_info``, as stock's ``JitWrapped`` (mypy on a user snippet)."""

import os
import subprocess
import sys
import textwrap

SNIPPET = textwrap.dedent(
  """
  import jax.numpy as jnp
  from jaxworks import jit_cache

  @jit_cache.jit
  def f(x):
    return x * 2

  @jit_cache.jit(static_argnums=1)
  def g(x, n):
    return x * n

  x = jnp.ones(3)
  reveal_type(f)
  reveal_type(g)
  traced: jit_cache.Traced = f.trace(x)
  lowered: jit_cache.Lowered = f.lower(x)
  shape = f.eval_shape(x)
  info: jit_cache.CacheInfo = g.cache_info()
  misses: int = info.misses
  text: str = g.explain_miss(x, 2)
  f.no_such_attribute
  """
)


def test_mypy_sees_the_wrapper(tmp_path):
  (tmp_path / "user.py").write_text(SNIPPET)
  # Where jaxworks packages are (site-packages, where jax is, mypy finds).
  roots = [
    p
    for p in sys.path
    if "site-packages" not in p and os.path.isdir(os.path.join(p, "jaxworks"))
  ]
  env = dict(os.environ, MYPYPATH=os.pathsep.join(roots))
  proc = subprocess.run(
    [
      sys.executable,
      "-m",
      "mypy",
      "--no-error-summary",
      "--namespace-packages",
      "--follow-imports=silent",
      "--ignore-missing-imports",
      "--cache-dir",
      str(tmp_path / ".mypy_cache"),
      str(tmp_path / "user.py"),
    ],
    capture_output=True,
    text=True,
    env=env,
    cwd=tmp_path,
    check=False,
  )
  lines = proc.stdout.strip().splitlines()
  notes = [line for line in lines if "Revealed type" in line]
  errors = [line for line in lines if ": error:" in line]
  assert len(notes) == 2, proc.stdout + proc.stderr
  assert all("JitFunction" in n for n in notes), notes
  # The one error is the attribute that does not exist: proof that mypy
  # checks attributes of the wrapper instead of treating it as Any.
  assert len(errors) == 1 and "no_such_attribute" in errors[0], lines
