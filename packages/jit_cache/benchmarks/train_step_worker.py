"""One new process of train_step_bench: the first step(s) of a program.

Usage::

  train_step_worker.py --jit {jax,jaxworks,equinox}
      --program {mlp,transformer,chain} [--task {first,sweep}]
      [--jax-cache DIR] [--jw-cache DIR]

Prints one JSON object: ``script_s`` (the time to first result of the whole
script, from before ``import jax``: the imports, model init with
``jax.random``, eager operations, the train step and an eval step, until
their results are ready), ``first_s`` (from wrapping the step function to
its first result), ``import_s`` (jax and the wrapper's package), and
``sweep_s`` (with ``--task sweep``: 8 configurations from a cold start, the
step function re-created and run once per configuration; ``sweep_rest_s``:
the 7 configurations after the first). ``--jax-cache DIR``
turns on JAX's persistent compilation cache with ``jax.config`` (minimum
compile time and entry size 0); ``--jw-cache DIR`` with
``jit_cache.set_cache_dir`` (the same cache, since jit_cache 0.4.0). Also
imported by the benchmark for the models and the in-process cases.

The models, in plain JAX, one training step = forward, backward and a
hand-written Adam update: a 3-layer MLP (64-256-256-10, GELU, softmax
cross-entropy) on a batch of 32; a 4-layer transformer block stack (d_model
256, 4 heads, MLP 1024, pre-LayerNorm, causal attention, sequence 64, batch
8, vocabulary 512).
"""

import argparse
import gc
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

SIZES = (64, 256, 256, 10)
BATCH = 32
#: The sweep: (learning rate, beta1) per configuration, passed as arguments.
SWEEP = [(lr, b1) for lr in (1e-3, 3e-4, 1e-4, 3e-5) for b1 in (0.9, 0.95)]


#: The transformer: layers, d_model, heads, MLP width, sequence, batch, vocab.
TRANSFORMER = dict(
  layers=4, d=256, heads=4, mlp=1024, seq=64, batch=8, vocab=512
)


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


def init_transformer(seed=0, cfg=TRANSFORMER):
  """(params, opt_state, tokens, targets, hparams) for the transformer."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  d, mlp, vocab = cfg["d"], cfg["mlp"], cfg["vocab"]
  key = jax.random.key(seed)

  def dense(k, a, b):
    return jax.random.normal(k, (a, b), jnp.float32) / jnp.sqrt(float(a))

  keys = iter(jax.random.split(key, 6 * cfg["layers"] + 3))
  layers = []
  for _ in range(cfg["layers"]):
    layers.append(
      {
        "qkv": dense(next(keys), d, 3 * d),
        "out": dense(next(keys), d, d),
        "up": dense(next(keys), d, mlp),
        "down": dense(next(keys), mlp, d),
        "ln1": jnp.ones((d,)),
        "ln2": jnp.ones((d,)),
      }
    )
  params = {
    "embed": dense(next(keys), vocab, d),
    "layers": layers,
    "head": dense(next(keys), d, vocab),
  }
  zeros = jax.tree.map(jnp.zeros_like, params)
  opt = (zeros, zeros, jnp.zeros((), jnp.int32))
  shape = (cfg["batch"], cfg["seq"])
  tokens = jax.random.randint(next(keys), shape, 0, vocab)
  targets = jnp.roll(tokens, -1, axis=1)
  return params, opt, tokens, targets, hparams(*SWEEP[0])


def transformer_loss(params, tokens, targets, heads=TRANSFORMER["heads"]):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def norm(h, scale):
    mu = h.mean(-1, keepdims=True)
    var = ((h - mu) ** 2).mean(-1, keepdims=True)
    return (h - mu) * jax.lax.rsqrt(var + 1e-5) * scale

  h = params["embed"][tokens]
  b, t, d = h.shape
  mask = jnp.tril(jnp.ones((t, t), bool))
  for layer in params["layers"]:
    q, k, v = jnp.split(norm(h, layer["ln1"]) @ layer["qkv"], 3, -1)
    q, k, v = (z.reshape(b, t, heads, d // heads) for z in (q, k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d / heads)
    att = jax.nn.softmax(jnp.where(mask, scores, -1e9), -1)
    mixed = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
    h = h + mixed @ layer["out"]
    h = h + jax.nn.gelu(norm(h, layer["ln2"]) @ layer["up"]) @ layer["down"]
  logp = jax.nn.log_softmax(h @ params["head"])
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))


def hparams(lr, b1):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  return {"lr": jnp.float32(lr), "b1": jnp.float32(b1)}


def mlp_loss(params, x, y):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  h = x
  for layer in params[:-1]:
    h = jax.nn.gelu(h @ layer["w"] + layer["b"])
  logits = h @ params[-1]["w"] + params[-1]["b"]
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(y, logits.shape[-1]), -1))


def make_step(b2=0.999, eps=1e-8, loss=None):
  """A new train step function (a new closure on every call) of ``loss``
  (default: the MLP's)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  loss = mlp_loss if loss is None else loss

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


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--jit", required=True)
  parser.add_argument("--program", default="mlp")
  parser.add_argument("--task", default="first")
  parser.add_argument("--jax-cache", default=None)
  parser.add_argument("--jw-cache", default=None)
  opts = parser.parse_args(argv)

  t_start = t0 = time.perf_counter()
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
    gc.collect()  # see the loop below
    t0 = time.perf_counter()
    jax.block_until_ready(jit(make())(x))
    out["first_s"] = time.perf_counter() - t0
  else:
    model = init_transformer if opts.program == "transformer" else init
    loss = transformer_loss if opts.program == "transformer" else mlp_loss
    params, opt, x, y, hp = model()
    x = x + 0 if opts.program == "mlp" else x * 1  # an eager operation
    configs = [hparams(lr, b1) for lr, b1 in SWEEP]
    jax.block_until_ready((params, opt, x, y, configs))
    if opts.task != "sweep":
      configs = configs[:1]
    times = []
    for hp in configs:  # the step function re-created per configuration
      # A full collection first, for every wrapper: a collection that earlier
      # allocations made due (up to ~50 ms with JAX's heap) otherwise lands in
      # one side's timed call or the other's by where its imports left the
      # collector's counters, not by the work timed.
      gc.collect()
      t0 = time.perf_counter()
      new = jit(make_step(loss=loss))(params, opt, x, y, hp)
      jax.block_until_ready(new)
      times.append(time.perf_counter() - t0)
    if times:
      out["first_s"] = times[0]
      out["sweep_s"] = sum(times)
      out["sweep_rest_s"] = sum(times[1:])  # the re-created configurations
      # The script's eval step, then its time to first result.
      jax.block_until_ready(jit(loss)(new[0], x, y))
      out["script_s"] = time.perf_counter() - t_start
  if opts.jw_cache:
    from jaxworks import jit_cache  # pylint: disable=g-import-not-at-top

    s = jit_cache.stats()
    out["persistent_hits"] = s.persistent_hits
    out["persistent_misses"] = s.persistent_misses
    out["persistent_prefetched"] = s.persistent_prefetched
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
