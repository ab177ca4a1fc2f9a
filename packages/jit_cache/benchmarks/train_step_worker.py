"""One new process of train_step_bench: the first step(s) of a program.

Usage::

  train_step_worker.py --jit {jax,jaxworks,equinox} --program {mlp,chain}
      [--task {first,sweep}] [--jax-cache DIR] [--jw-cache DIR]

Prints one JSON object: ``first_s`` (from wrapping the step function to its
first result being ready), ``import_s`` (jax and the wrapper's package), and
``sweep_s`` (with ``--task sweep``: 8 configurations from a cold start,
the step function re-created and run once per configuration). With ``--task
phases`` (the MLP, ``--jit jax`` or ``jaxworks``) the first step is taken in
stages, each timed: ``trace_s``, ``lower_s`` and ``compile_s`` (jax: lowering,
then compiling or loading from its cache) or ``load_s`` (jaxworks: the call
after the trace, which keys, looks up and loads or compiles), and ``run_s``
(the first run, until its result is ready). Also imported by the benchmark
for the model and the in-process cases.

The model: a 3-layer MLP (64-256-256-10, GELU, softmax cross-entropy) on a
batch of 32, one training step = forward, backward and a hand-written Adam
update, in plain JAX.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

SIZES = (64, 256, 256, 10)
BATCH = 32
#: The sweep: (learning rate, beta1) per configuration, passed as arguments.
SWEEP = [(lr, b1) for lr in (1e-3, 3e-4, 1e-4, 3e-5) for b1 in (0.9, 0.95)]


def init(sizes=SIZES, batch=BATCH, seed=0):
  """(params, opt_state, x, y, hparams) for the step."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  key = jax.random.key(seed)
  params = []
  for a, b in zip(sizes[:-1], sizes[1:]):
    k, key = jax.random.split(key)
    w = jax.random.normal(k, (a, b), jnp.float32) / jnp.sqrt(float(a))
    params.append({"w": w, "b": jnp.zeros((b,), jnp.float32)})
  zeros = jax.tree.map(jnp.zeros_like, params)
  opt = (zeros, zeros, jnp.zeros((), jnp.int32))
  kx, ky = jax.random.split(key)
  x = jax.random.normal(kx, (batch, sizes[0]), jnp.float32)
  y = jax.random.randint(ky, (batch,), 0, sizes[-1])
  return params, opt, x, y, hparams(*SWEEP[0])


def hparams(lr, b1):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  return {"lr": jnp.float32(lr), "b1": jnp.float32(b1)}


def make_step(b2=0.999, eps=1e-8):
  """A new train step function (a new closure on every call)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def loss(params, x, y):
    h = x
    for layer in params[:-1]:
      h = jax.nn.gelu(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(y, logits.shape[-1]), -1))

  def step(params, opt, x, y, hp):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    m, v, t = opt
    t = t + 1
    b1 = hp["b1"]
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, grads)
    c1 = 1 - b1 ** t.astype(jnp.float32)
    c2 = 1 - b2 ** t.astype(jnp.float32)

    def update(p, m, v):
      return p - hp["lr"] * (m / c1) / (jnp.sqrt(v / c2) + eps)

    params = jax.tree.map(update, params, m, v)
    return params, (m, v, t), value

  return step


def make_chain():
  """jit_add_chain: 100 calls of one jitted add inside a new outer function
  (the inner function is jitted once, by the same wrapper)."""
  import jax  # pylint: disable=g-import-not-at-top

  def build(jit):
    inner = jit(lambda a, b: jax.lax.add(a, b))

    def make():
      def f(v):
        for _ in range(100):
          v = inner(v, v)
        return v

      return f

    return make

  return build


def wrapper(name):
  """The jit of ``name``: jax.jit, jaxworks.jit_cache.jit, equinox.filter_jit."""
  if name == "jax":
    import jax  # pylint: disable=g-import-not-at-top

    return jax.jit
  if name == "jaxworks":
    from jaxworks import jit_cache  # pylint: disable=g-import-not-at-top

    return jit_cache.jit
  if name == "equinox":
    import equinox  # pylint: disable=g-import-not-at-top

    return equinox.filter_jit
  raise ValueError(f"train_step_worker: --jit {name!r}")


def phases(jit, name: str, args: tuple) -> dict:
  """The first step of a new process in timed stages (see the docstring)."""
  import jax  # pylint: disable=g-import-not-at-top

  f = jit(make_step())
  t0 = time.perf_counter()
  traced = f.trace(*args)
  t1 = time.perf_counter()
  if name == "jax":
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    out = compiled(*args)
    jax.block_until_ready(out)
    t5 = time.perf_counter()
    return {
      "trace_s": t1 - t0,
      "lower_s": t2 - t1,
      "compile_s": t3 - t2,
      "run_s": t5 - t3,
      "first_s": t5 - t0,
    }
  out = f(*args)  # the trace is cached: keys, looks up, loads or compiles
  t2 = time.perf_counter()
  jax.block_until_ready(out)
  t3 = time.perf_counter()
  return {
    "trace_s": t1 - t0,
    "load_s": t2 - t1,
    "run_s": t3 - t2,
    "first_s": t3 - t0,
  }


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--jit", required=True)
  parser.add_argument("--program", default="mlp")
  parser.add_argument("--task", default="first")
  parser.add_argument("--jax-cache", default=None)
  parser.add_argument("--jw-cache", default=None)
  opts = parser.parse_args(argv)

  t0 = time.perf_counter()
  import jax  # pylint: disable=g-import-not-at-top

  if opts.jax_cache:
    jax.config.update("jax_compilation_cache_dir", opts.jax_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  jit = wrapper(opts.jit)
  if opts.jw_cache:
    from jaxworks import jit_cache  # pylint: disable=g-import-not-at-top

    jit_cache.set_cache_dir(opts.jw_cache)
  out = {"import_s": time.perf_counter() - t0}

  if opts.program == "chain":
    x = jax.random.normal(jax.random.key(0), (2, 2))
    jax.block_until_ready(x)
    make = make_chain()(jit)
    t0 = time.perf_counter()
    jax.block_until_ready(jit(make())(x))
    out["first_s"] = time.perf_counter() - t0
  else:
    params, opt, x, y, hp = init()
    configs = [hparams(lr, b1) for lr, b1 in SWEEP]
    jax.block_until_ready((params, opt, x, y, configs))
    if opts.task == "phases":
      out.update(phases(jit, opts.jit, (params, opt, x, y, configs[0])))
      configs = []
    elif opts.task != "sweep":
      configs = configs[:1]
    times = []
    for hp in configs:  # the step function re-created per configuration
      t0 = time.perf_counter()
      jax.block_until_ready(jit(make_step())(params, opt, x, y, hp))
      times.append(time.perf_counter() - t0)
    if times:
      out["first_s"] = times[0]
      out["sweep_s"] = sum(times)
  if opts.jw_cache:
    from jaxworks import jit_cache  # pylint: disable=g-import-not-at-top

    s = jit_cache.stats()
    out["persistent_hits"] = s.persistent_hits
    out["persistent_misses"] = s.persistent_misses
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
