"""One process of persistent_cache_test: runs a corpus and saves results.

Usage: persistent_cache_worker.py MODE CACHE_DIR OUT.npz

MODE ``stock`` runs the corpus with ``jax.jit`` and no cache; ``jaxworks``
turns the cache on with ``jit_cache.set_cache_dir(CACHE_DIR)`` and runs it
with ``jit_cache.jit``. The corpus: LAPACK-backed linear algebra (solve,
eigh, svd, qr, cholesky), ``jax.random`` with typed and raw keys, a typed PRNG
key argument, and a host callback. Prints ``stats()`` as one JSON line.
"""

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np


def corpus(jit):
  rng = np.random.default_rng(0)
  a = rng.standard_normal((6, 6)).astype(np.float32)
  spd = a @ a.T + 6 * np.eye(6, dtype=np.float32)
  b = rng.standard_normal((6, 2)).astype(np.float32)
  out = {}
  out["solve"] = jit(jnp.linalg.solve)(a, b)
  w, v = jit(jnp.linalg.eigh)(spd)
  out["eigh_w"], out["eigh_v"] = w, v
  u, s, vt = jit(jnp.linalg.svd)(a)
  out["svd_u"], out["svd_s"], out["svd_vt"] = u, s, vt
  q, r = jit(jnp.linalg.qr)(a)
  out["qr_q"], out["qr_r"] = q, r
  out["cholesky"] = jit(jnp.linalg.cholesky)(spd)
  out["random"] = jit(lambda k: jax.random.normal(k, (5,)))(jax.random.key(3))
  out["raw_key"] = jit(lambda k: jax.random.uniform(k, (4,)))(
    jax.random.PRNGKey(4)
  )
  keys = jit(lambda k: jax.random.split(k, 3))(jax.random.key(5))
  out["typed_key_arg"] = jax.random.key_data(keys)

  def host(x):
    return jax.pure_callback(
      lambda v: np.asarray(v) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x
    )

  out["callback"] = jit(host)(jnp.arange(4.0))
  return {k: np.asarray(v) for k, v in out.items()}


def main():
  mode, directory, out_path = sys.argv[1:4]
  if mode == "stock":
    results = corpus(jax.jit)
    stats = {}
  else:
    from jaxworks import jit_cache  # pylint: disable=g-import-not-at-top

    jit_cache.set_cache_dir(directory)
    results = corpus(jit_cache.jit)
    stats = dataclasses.asdict(jit_cache.stats())
  np.savez(out_path, **results)
  print(json.dumps(stats))


if __name__ == "__main__":
  main()
