"""jit_cache's stages are jaxworks.stages_aot's, built from its trace cache.

The stage family (``Traced``, ``Lowered``, ``Compiled``) and the platform
names are stages_aot's; ``jit(f).trace/lower`` builds them from jit_cache's
trace cache, and ``Lowered.export()`` returns stages_aot's ``Exported``
with nothing to register.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import child
import jax
import jax.numpy as jnp
import jaxworks_testing as jwt
import numpy as np

from jaxworks import jit_cache
from jaxworks import stages_aot as sa

# Linear algebra lowers to a different custom call on every platform, so the
# module text shows which platforms it targets.
PLATFORM_CALLS = {
  "cpu": "lapack_sgeqrf_ffi",
  "cuda": "cusolver_geqrf_ffi",
  "tpu": "custom_call @Qr",
}


def qr_fun(x):
  q, r = jnp.linalg.qr(x)
  return q @ r + 1.0


X = jax.ShapeDtypeStruct((4, 4), jnp.float32)


def test_stage_and_platform_names_are_stages_aots():
  for name in (
    "Traced",
    "Lowered",
    "Compiled",
    "KNOWN_PLATFORMS",
    "canonical_platforms",
    "present_platforms",
  ):
    assert getattr(jit_cache, name) is getattr(sa, name), name
    assert name in jit_cache.__all__
  f = jit_cache.jit(jnp.sin)
  lowered = f.lower(jnp.ones(3))
  assert type(f.trace(jnp.ones(3))) is sa.Traced
  assert type(lowered) is sa.Lowered
  assert type(lowered.compile()) is sa.Compiled


def test_from_traced_accepts_jit_cache_traced():
  jt = jit_cache.jit(qr_fun).trace(X)
  traced = sa.Traced.from_traced(jt)
  assert (
    traced is jt and traced.fun_name == "qr_fun" and traced.jaxpr is jt.jaxpr
  )
  lowered = traced.lower(lowering_platforms=("tpu", "cuda"))
  assert lowered.platforms == ("tpu", "cuda")
  assert (
    PLATFORM_CALLS["tpu"] in lowered.as_text()
    and PLATFORM_CALLS["cuda"] in lowered.as_text()
  )
  x = np.eye(4, dtype=np.float32) * 3
  loaded = sa.deserialize(lowered.export(vjp_order=1).serialize())
  np.testing.assert_allclose(
    sa.deserialize(
      traced.lower(lowering_platforms=("cpu", "tpu")).export().serialize()
    )(x),
    qr_fun(x),
    rtol=1e-5,
  )
  assert loaded.platforms == ("tpu", "cuda")


def test_stages_aot_trace_keeps_options_of_a_jit_cache_function():
  calls = []

  def body(x, n):
    calls.append(n)
    return x * n

  f = jit_cache.jit(body, static_argnums=1)
  traced = sa.trace(f, jnp.ones(3), 5)
  assert type(traced) is sa.Traced
  np.testing.assert_array_equal(
    traced.lower().compile()(jnp.ones(3)), np.full(3, 5.0)
  )
  # Traced through f's own trace cache: the call reuses that trace.
  np.testing.assert_array_equal(f(jnp.ones(3), 5), np.full(3, 5.0))
  assert calls == [5]


def test_export_needs_nothing_but_jit_cache():
  """``Lowered.export()`` of a jit_cache program returns stages_aot's
  ``Exported`` in a process that never imported stages_aot itself."""
  jwt.require_child_processes()
  code = (
    "import numpy as np\n"
    "from jaxworks import jit_cache\n"
    "w = np.full((3, 4), 0.5, np.float32)\n"
    "f = jit_cache.jit(lambda w, v: (w @ v).sum())\n"
    "exp = f.lower(w, np.ones(4, np.float32)).export(vjp_order=2)\n"
    "print(type(exp).__module__, type(exp).__name__, exp.vjp_order)\n"
    "print(float(exp(w, np.ones(4, np.float32))))\n"
  )
  lines = child.run("-c", code, timeout=120).stdout.strip().splitlines()
  # The class reports its public module (jaxworks.stages_aot).
  assert lines == ["jaxworks.stages_aot Exported 2", "6.0"]
