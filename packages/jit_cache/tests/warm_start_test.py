"""A warm start in a new process: every program comes from the cache.

A child process runs a small training script (a jitted data normalisation,
a train step with Adam, a metrics helper, an eval function) with
``jit_cache.set_cache_dir``, twice: the first run compiles and writes JAX's
persistent cache, the second (a new process, the same command line) must
compile nothing. What happened is counted with ``jax.monitoring``'s public
listeners: backend compiles (JAX's ``backend_compile_duration`` spans),
the compiles that asked the cache, its hits and misses, and lowerings.
"""

import json

import child

SCRIPT = r"""
import json, sys
import jax
import jax.numpy as jnp

counts = {"compiles": 0, "lowerings": 0, "requests": 0, "hits": 0, "misses": 0}
SPANS = {
  "/jax/core/compile/backend_compile_duration": "compiles",
  "/jax/core/compile/jaxpr_to_mlir_module_duration": "lowerings",
}
EVENTS = {
  "/jax/compilation_cache/compile_requests_use_cache": "requests",
  "/jax/compilation_cache/cache_hits": "hits",
  "/jax/compilation_cache/cache_misses": "misses",
}

def span(event, start, end, **_):
  if event in SPANS:
    counts[SPANS[event]] += 1

def event(name, **_):
  if name in EVENTS:
    counts[EVENTS[name]] += 1

jax.monitoring.register_event_time_span_listener(span)
jax.monitoring.register_event_listener(event)

from jaxworks import jit_cache
jit_cache.set_cache_dir(sys.argv[1])
jit = jit_cache.jit

@jit
def normalise(x):
  return (x - x.mean(0)) / (x.std(0) + 1e-6)

def loss(p, x, y):
  h = jax.nn.relu(x @ p["w1"] + p["b1"])
  logp = jax.nn.log_softmax(h @ p["w2"])
  return -jnp.mean(jnp.take_along_axis(logp, y[:, None], 1))

@jit
def train_step(p, m, v, t, x, y):
  value, g = jax.value_and_grad(loss)(p, x, y)
  t = t + 1
  m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m, g)
  v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, v, g)
  c1, c2 = 1 - 0.9 ** t, 1 - 0.999 ** t
  p = jax.tree.map(
    lambda p, m, v: p - 1e-2 * (m / c1) / (jnp.sqrt(v / c2) + 1e-8), p, m, v
  )
  return p, m, v, t, value

@jit
def evaluate(p, x, y):
  h = jax.nn.relu(x @ p["w1"] + p["b1"])
  return loss(p, x, y), jnp.mean(jnp.argmax(h @ p["w2"], -1) == y)

@jit
def metrics(losses):
  return {"mean": jnp.mean(losses), "last": losses[-1]}

k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
x = normalise(jax.random.normal(k1, (64, 16)) * 3.0 + 1.0)
y = jax.random.randint(k2, (64,), 0, 4)
p = {
  "w1": jax.random.normal(k3, (16, 32)) * 0.25,
  "b1": jnp.zeros((32,)),
  "w2": jax.random.normal(k4, (32, 4)) * 0.2,
}
m = v = jax.tree.map(jnp.zeros_like, p)
t = jnp.float32(0)
losses = []
for _ in range(3):
  p, m, v, t, value = train_step(p, m, v, t, x, y)
  losses.append(value)
summary = metrics(jnp.stack(losses))
ev_loss, acc = evaluate(p, x, y)
s = jit_cache.stats()
print(json.dumps({
  "counts": counts,
  "prefetched": s.persistent_prefetched,
  "results": [
    [float(summary["mean"]), float(summary["last"]), float(ev_loss),
     float(acc)],
    jax.tree.map(lambda a: a.tolist(), p),
  ],
}))
"""


def _run(script, directory):
  env = child.env(("JAXWORKS_JIT_CACHE_DIR", "JAX_COMPILATION_CACHE_DIR"))
  proc = child.run(str(script), str(directory), child_env=env, timeout=300)
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_warm_new_process_compiles_nothing_and_matches_bitwise(tmp_path):
  d = tmp_path / "cache"
  script = tmp_path / "train.py"  # a script file: its process has a hint
  script.write_text(SCRIPT)
  cold = _run(script, d)
  warm = _run(script, d)
  c, w = cold["counts"], warm["counts"]
  # The cold process compiled its programs (the 4 jits and the eager
  # operations and jax.random's programs), each through the cache.
  assert c["misses"] >= 4 and c["hits"] == 0, c
  assert c["compiles"] == c["requests"] == c["misses"], c
  # The warm one: every backend compile asked the cache and was a hit, so
  # XLA compiled nothing; each executable was deserialized ahead of JAX's
  # read (prefetch.py).
  assert w["misses"] == 0, w
  assert w["compiles"] == w["requests"] == w["hits"] == c["requests"], w
  assert warm["prefetched"] == w["hits"], (warm["prefetched"], w)
  # Lowering stays: JAX's cache key is a hash of the lowered module, so
  # every program is lowered once, as in the cold process.
  assert w["lowerings"] == c["lowerings"] >= w["hits"], (c, w)
  # Bit for bit the cold run's results (float32 values as Python floats).
  assert warm["results"] == cold["results"]
