"""One process of disk_cache_test: runs a program through jit_cache.jit with
the disk cache and prints what happened as one JSON line.

Usage: disk_cache_worker.py CACHE_DIR|- PROGRAM[,PROGRAM...] [MAX_BYTES]

With ``WORKER_NO_FLUSH=1`` the stats are read without waiting for the
background writes (which the exit handler then flushes).

PROGRAM is ``chain<k>`` (100 chained adds of ``k``), ``mlp<k>`` (an MLP
training step, forward, backward and an Adam-like update with powers, hidden
width ``8 + k``), ``sharded`` or ``callback``. With ``WORKER_REPEAT=N`` each
program is called N times (its entry is serialized on the writer thread while
these calls run). Lowerings
and XLA compilations are counted with jax's monitoring events before stock
``jax.jit`` runs the same program for the bitwise comparison.
"""

import json
import os
import sys

import jax
from jax import monitoring
import jax.numpy as jnp
import numpy as np

from jaxworks import jit_cache

LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
events = []
monitoring.register_event_duration_secs_listener(
  lambda name, secs, **kw: events.append(name)
)


def chain(k):
  def f(x):
    for _ in range(100):
      x = x + k
    return x * 0.5

  return f


def with_callback(x):
  y = jax.pure_callback(lambda a: np.asarray(a) * 2, x, x)
  return y + 1.0


def mlp_step(params, x, y):
  def loss(p):
    h = jax.nn.gelu(x @ p["w1"] + p["b1"])
    logp = jax.nn.log_softmax(h @ p["w2"])
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(y, logp.shape[-1]), -1))

  value, grads = jax.value_and_grad(loss)(params)
  new = jax.tree.map(
    lambda p, g: p - 1e-2 * g / (jnp.sqrt(g**2) + 1e-8) ** 0.5, params, grads
  )
  return new, value


def program(name):
  """(function, jit options, input) of a program name."""
  x = jnp.arange(8, dtype=jnp.float32)
  if name == "callback":
    return with_callback, {}, x
  if name == "sharded":  # 8 devices, donated input
    mesh = jax.make_mesh((8,), ("i",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("i"))
    return chain(3.0), {"donate_argnums": 0}, jax.device_put(x, sharding)
  if name.startswith("mlp"):
    width = 8 + int(name[len("mlp") :])
    key = jax.random.key(0)
    params = {
      "w1": jax.random.normal(key, (8, width)),
      "b1": jnp.zeros((width,)),
      "w2": jax.random.normal(jax.random.fold_in(key, 1), (width, 4)),
    }
    y = jnp.arange(8) % 4
    return (lambda a: mlp_step(params, a.reshape(1, 8) * 0.1, y[:1])), {}, x
  return chain(float(name[len("chain") :])), {}, x


def main():
  directory, names = sys.argv[1], sys.argv[2].split(",")
  if directory != "-":
    max_bytes = int(sys.argv[3]) if len(sys.argv) > 3 else None
    jit_cache.set_cache_dir(directory, max_bytes=max_bytes)
  out = {
    "results": [],
    "stock": [],
    "explain": [],
    "lowered": [],
    "compiled": [],
  }
  for name in names:
    fun, options, x = program(name)
    f = jit_cache.jit(fun, **options)
    del events[:]
    r = f(x)
    for _ in range(int(os.environ.get("WORKER_REPEAT", "1")) - 1):
      again = f(x)
      assert jax.tree.map(np.asarray, again) is not None
    y = np.concatenate([np.ravel(a) for a in jax.tree.leaves(r)])
    r = jax.tree.leaves(r)[0]
    out["lowered"].append(events.count(LOWER_EVENT))
    out["compiled"].append(events.count(COMPILE_EVENT))
    out["results"].append(
      [str(y.dtype), y.tobytes().hex(), str(r.sharding), x.is_deleted()]
    )
    out["explain"].append(f.explain_miss(program(name)[2]))
  if not os.environ.get("WORKER_NO_FLUSH"):  # else flushed at exit
    jit_cache.config.flush()  # entries are written in the background
  s = jit_cache.stats()
  out["stats"] = {
    k: getattr(s, k)
    for k in (
      "disk_hits",
      "disk_misses",
      "disk_rejected",
      "disk_bytes_read",
      "disk_bytes_written",
      "disk_load_s",
      "compiles",
    )
  }
  out["cache_dir"] = jit_cache.config.cache_dir
  for name in names:
    fun, options, x = program(name)
    r = jax.jit(fun, **options)(x)
    y = np.concatenate([np.ravel(a) for a in jax.tree.leaves(r)])
    r = jax.tree.leaves(r)[0]
    out["stock"].append(
      [str(y.dtype), y.tobytes().hex(), str(r.sharding), x.is_deleted()]
    )
  print(json.dumps(out))


if __name__ == "__main__":
  main()
