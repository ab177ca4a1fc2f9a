"""stages_aot under the drop-in swap (``jax.jit = jaxworks.jit_cache.jit``, ...).

Each case runs in a fresh process, where the swap happens before stages_aot is
imported (the harder order: binding ``jax.jit`` at import would then bind the
swapped one). The core stages run and their results are compared with stock
JAX computed before the swap. A second run swaps in tripwires that fail when
called from stages_aot's own code, so a call-time lookup of ``jax.jit`` (or
``jax.device_put``, ``jax.pmap``, ``jax.export.export``) in stages_aot fails
even where the jaxworks replacement would have given the right answer.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
  """
    import os, sys, tempfile
    import numpy as np
    import jax
    import jax.numpy as jnp

    MODE = sys.argv[1]

    def f(x, w):
        return jnp.tanh(x @ w).sum(axis=1)

    X = np.linspace(-1, 1, 24, dtype=np.float32).reshape(3, 8)
    W = np.linspace(-1, 1, 16, dtype=np.float32).reshape(8, 2)

    # Stock results, before any swap.
    stock_out = np.asarray(jax.jit(f)(X, W))
    stock_grad = np.asarray(jax.grad(lambda x: jax.jit(f)(x, W).sum())(X))
    stock_vmap = np.asarray(jax.vmap(jax.jit(f), in_axes=(0, None))(np.stack([X, 2 * X]), W))
    stock_exp = jax.export.export(jax.jit(f), platforms=("cpu", "tpu"))(X, W)
    stock_serialized = bytes(stock_exp.serialize())

    from jaxworks import jit_cache
    swapped = {"jit": jit_cache.jit}
    try:
        from jaxworks import batched_transfer
        swapped["device_put"] = batched_transfer.device_put
    except ImportError:
        pass
    try:
        from jaxworks import pmap_chunked
        swapped["pmap"] = pmap_chunked.pmap
    except ImportError:
        pass

    STAGES_AOT_DIR = None
    calls_from_stages_aot = []

    def tripwire(name, replacement):
        def wrapper(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if STAGES_AOT_DIR and caller.startswith(STAGES_AOT_DIR):
                calls_from_stages_aot.append((name, caller))
                raise AssertionError(f"stages_aot looked up jax.{name} at call time ({caller})")
            return replacement(*args, **kwargs)
        return wrapper

    if MODE == "tripwire":
        stock_export = jax.export.export
        jax.export.export = tripwire("export.export", stock_export)
        for name, fn in swapped.items():
            setattr(jax, name, tripwire(name, fn))
    else:
        for name, fn in swapped.items():
            setattr(jax, name, fn)

    from jaxworks import stages_aot as sa
    STAGES_AOT_DIR = os.path.dirname(sa.__file__)

    # trace -> lower -> compile
    traced = sa.trace(f, X, W)
    compiled = traced.lower().compile()
    np.testing.assert_array_equal(compiled(X, W), stock_out)
    # from a jitted function (the swapped jax.jit when not a tripwire)
    if MODE == "plain":
        np.testing.assert_array_equal(sa.trace(jax.jit(f), X, W).lower().compile()(X, W), stock_out)
    # multi-platform lowering compiled for cpu
    np.testing.assert_array_equal(traced.lower(lowering_platforms=("cpu", "tpu")).compile()(X, W), stock_out)
    # export -> serialize -> deserialize -> call, under jit, grad, vmap
    exp = traced.lower(lowering_platforms=("cpu", "tpu")).export(vjp_order=1)
    loaded = sa.deserialize(exp.serialize())
    np.testing.assert_array_equal(loaded(X, W), stock_out)
    np.testing.assert_array_equal(sa.deserialize(stock_serialized)(X, W), stock_out)
    np.testing.assert_allclose(jax.grad(lambda x: loaded(x, W).sum())(X), stock_grad, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(jax.vmap(loaded, in_axes=(0, None))(np.stack([X, 2 * X]), W), stock_vmap)
    # artifacts
    with tempfile.TemporaryDirectory() as tmp:
        sa.save_artifact(exp, os.path.join(tmp, "art"))
        art = sa.load_artifact(os.path.join(tmp, "art"))
        np.testing.assert_array_equal(art(X, W), stock_out)
    assert not calls_from_stages_aot, calls_from_stages_aot
    print("OK", MODE, sorted(swapped))
    """
)


def run_script(mode):
  env = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
    JAX_PLATFORMS="cpu",
  )
  return subprocess.run(
    [sys.executable, "-c", SCRIPT, mode],
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )


@pytest.mark.parametrize("mode", ["plain", "tripwire"])
def test_core_stages_under_the_swap(mode):
  r = run_script(mode)
  assert r.returncode == 0, r.stderr[-4000:]
  assert f"OK {mode} " in r.stdout and "'jit'" in r.stdout, r.stdout
