"""One new process of train_step_bench: the first step(s) of a program.

Usage::

  train_step_worker.py --jit {jax,jaxworks,equinox}
      --program {mlp,transformer,chain,user} [--task {first,sweep}]
      [--configs N] [--dtype {float32,bfloat16}]
      [--jax-cache DIR] [--jw-cache DIR]

Prints one JSON object: ``script_s`` (the time to first result of the whole
script, from before ``import jax``: the imports, model init with
``jax.random``, eager operations, the train step and an eval step, until
their results are ready), ``first_s`` (from wrapping the step function to
its first result), ``import_s`` (jax and the wrapper's package), and
``sweep_s`` (with ``--task sweep``: 8 configurations from a cold start, the
step function re-created and run once per configuration; ``sweep_rest_s``:
the 7 configurations after the first; ``--configs N``: the first N
configurations only), ``backend_s`` (bringing the backend up, after the
imports: ~15 s on a TPU, where the chip is opened) and ``from_backend_s``
(from the backend up to the last result: the time to first results once
the backend is up), and ``phases`` (where the time
to first result went: import, trace, lower, cache read, deserialize ahead,
first run; and the counts of lowerings and of JAX's cache requests, hits and
misses, from ``jax.monitoring``). ``--jax-cache DIR``
turns on JAX's persistent compilation cache with ``jax.config`` (minimum
compile time and entry size 0); ``--jw-cache DIR`` with
``jit_cache.set_cache_dir`` (the same cache, since jit_cache 0.4.0). Also
imported by the benchmark for the models and the in-process cases.

The models, in plain JAX, one training step = forward, backward and a
hand-written Adam update: a 3-layer MLP (64-256-256-10, GELU, softmax
cross-entropy) on a batch of 32; a 4-layer transformer block stack (d_model
256, 4 heads, MLP 1024, pre-LayerNorm, causal attention, sequence 64, batch
8, vocabulary 512). ``--program user`` runs ``user_script``: the script a
new user writes (an MLP classifier, an optax-style AdamW with clipping, a
jitted data normalisation, train step, metrics helper and eval function).
``--dtype bfloat16``: the model's parameters, optimizer state, inputs and
hyperparameters in bfloat16 (as trained on a TPU).
"""

import argparse
import gc
import json
import os
import sys
import time

try:  # the benchmark's profile (8 host CPU devices, or the chip's)
  import jaxworks_bench

  jaxworks_bench.configure_devices(argv=[])
except ImportError:  # started without the benchmarks' support on the path
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


def hparams(lr, b1, dtype=None):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  dtype = jnp.float32 if dtype is None else dtype
  return {"lr": jnp.asarray(lr, dtype), "b1": jnp.asarray(b1, dtype)}


def cast(tree, dtype):
  """Every floating array of ``tree`` as ``dtype`` (integers kept)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def one(a):
    if jnp.issubdtype(a.dtype, jnp.floating):
      return a.astype(dtype)
    return a

  return jax.tree.map(one, tree)


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


#: The new user's script: a 3-layer MLP classifier (784-512-256-10, ReLU)
#: on batches of 128, an optax-style Adam with weight decay and gradient
#: clipping, written as init/update pairs.
USER = dict(sizes=(784, 512, 256, 10), batch=128, steps=3)


def user_script(jit, cfg=USER):
  """The script a new user writes: data normalised by a jitted helper, an
  MLP initialised with ``jax.random``, an optimizer (Adam with weight decay,
  global-norm clipping: ``init``/``update`` as in optax), a jitted train
  step run ``steps`` times, a jitted eval function and a jitted metrics
  helper, its results printed as Python floats. Returns the metrics."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  sizes, batch = cfg["sizes"], cfg["batch"]
  rng = np.random.default_rng(0)
  images = rng.uniform(0, 255, (4 * batch, sizes[0])).astype(np.float32)
  labels = rng.integers(0, sizes[-1], 4 * batch).astype(np.int32)

  @jit
  def normalise(x):
    mu = x.mean(0, keepdims=True)
    return (x - mu) / (x.std(0, keepdims=True) + 1e-6)

  def init_params(key):
    params = []
    for a, b in zip(sizes[:-1], sizes[1:]):
      key, k = jax.random.split(key)
      w = jax.random.normal(k, (a, b)) * jnp.sqrt(2.0 / a)
      params.append({"w": w, "b": jnp.zeros((b,))})
    return params

  def forward(params, x):
    for layer in params[:-1]:
      x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]

  def loss_fn(params, x, y):
    logits = forward(params, x)
    onehot = jax.nn.one_hot(y, sizes[-1])
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * onehot, -1))

  def adamw(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=1e-4, clip=1.0):
    def init(params):
      zeros = jax.tree.map(jnp.zeros_like, params)
      return {"mu": zeros, "nu": zeros, "count": jnp.zeros((), jnp.int32)}

    def update(grads, state, params):
      norm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
      grads = jax.tree.map(lambda g: g * jnp.minimum(1.0, clip / norm), grads)
      count = state["count"] + 1
      mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["mu"], grads)
      nu = jax.tree.map(
        lambda v, g: b2 * v + (1 - b2) * g * g, state["nu"], grads
      )
      t = count.astype(jnp.float32)
      c1, c2 = 1 - b1**t, 1 - b2**t
      updates = jax.tree.map(
        lambda m, v, p: -lr * ((m / c1) / (jnp.sqrt(v / c2) + eps) + wd * p),
        mu,
        nu,
        params,
      )
      return updates, {"mu": mu, "nu": nu, "count": count}

    return init, update

  opt_init, opt_update = adamw()

  @jit
  def train_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = opt_update(grads, opt_state, params)
    params = jax.tree.map(lambda p, u: p + u, params, updates)
    return params, opt_state, loss

  @jit
  def evaluate(params, x, y):
    logits = forward(params, x)
    return loss_fn(params, x, y), jnp.mean(jnp.argmax(logits, -1) == y)

  @jit
  def metrics(losses):
    return {"loss": jnp.mean(losses), "last": losses[-1]}

  x_all = normalise(jnp.asarray(images))
  y_all = jnp.asarray(labels)
  params = init_params(jax.random.key(0))
  opt_state = opt_init(params)
  losses = []
  for i in range(cfg["steps"]):
    x, y = (
      x_all[i * batch : (i + 1) * batch],
      y_all[i * batch : (i + 1) * batch],
    )
    params, opt_state, loss = train_step(params, opt_state, x, y)
    losses.append(loss)
  summary = metrics(jnp.stack(losses))
  eval_loss, accuracy = evaluate(params, x_all[-batch:], y_all[-batch:])
  return {
    "train_loss": float(summary["loss"]),
    "eval_loss": float(eval_loss),
    "accuracy": float(accuracy),
  }


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


#: jax.monitoring events of the phases of a start (time spans, seconds).
PHASE_EVENTS = {
  "trace": "/jax/core/compile/jaxpr_trace_duration",
  "lower": "/jax/core/compile/jaxpr_to_mlir_module_duration",
  "compile": "/jax/core/compile/backend_compile_duration",
}
#: Events counted: compiles that asked JAX's cache, its hits and misses.
COUNTED = {
  "cache_requests": "/jax/compilation_cache/compile_requests_use_cache",
  "cache_hits": "/jax/compilation_cache/cache_hits",
  "cache_misses": "/jax/compilation_cache/cache_misses",
}
CACHE_READ = "/jax/compilation_cache/cache_retrieval_time_sec"
#: jit_cache's prefetch: an entry read and deserialized off the main thread.
PREFETCH = "/jaxworks/jit_cache/prefetch_deserialize_sec"


class Phases:
  """Where a start's time goes, from ``jax.monitoring`` (public listeners):
  the union of each phase's time spans (nested traces counted once), the
  main thread's cache reads, the counts of lowerings and of JAX's cache
  requests, hits and misses (a miss is an XLA compile)."""

  def __init__(self):
    import jax  # pylint: disable=g-import-not-at-top

    self.spans = {name: [] for name in PHASE_EVENTS}
    self.counts = {name: 0 for name in COUNTED}
    self.cache_read_s = 0.0
    self.prefetch_s = 0.0
    by_event = {e: n for n, e in PHASE_EVENTS.items()}
    by_count = {e: n for n, e in COUNTED.items()}

    def span(event, start, end, **_):
      if event in by_event:
        self.spans[by_event[event]].append((start, end))

    def count(event, **_):
      if event in by_count:
        self.counts[by_count[event]] += 1

    def duration(event, secs, **_):
      if event == CACHE_READ:
        self.cache_read_s += secs
      elif event == PREFETCH:
        self.prefetch_s += secs

    jax.monitoring.register_event_time_span_listener(span)
    jax.monitoring.register_event_listener(count)
    jax.monitoring.register_event_duration_secs_listener(duration)

  @staticmethod
  def _union(spans):
    total, end = 0.0, float("-inf")
    for s, e in sorted(spans):
      if e > end:
        total += e - max(s, end)
        end = e
    return total

  def result(self, import_s: float, script_s: float) -> dict:
    """Seconds per phase; ``first_run`` is the rest (running the programs,
    eager dispatch, the script's Python)."""
    t = {name: self._union(s) for name, s in self.spans.items()}
    out = {
      "import": import_s,
      "trace": t["trace"],
      "lower": t["lower"],
      "cache_read": self.cache_read_s,
      # Hashing the module into JAX's cache key, and XLA on a miss.
      "key_and_compile": max(0.0, t["compile"] - self.cache_read_s),
      "deserialize_background": self.prefetch_s,
    }
    out["first_run"] = script_s - (
      import_s + t["trace"] + t["lower"] + t["compile"]
    )
    out["lowerings"] = len(self.spans["lower"])
    out.update(self.counts)
    return out


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--jit", required=True)
  parser.add_argument("--program", default="mlp")
  parser.add_argument("--task", default="first")
  parser.add_argument("--configs", type=int, default=len(SWEEP))
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--jax-cache", default=None)
  parser.add_argument("--jw-cache", default=None)
  opts = parser.parse_args(argv)

  t_start = t0 = time.perf_counter()
  import jax  # pylint: disable=g-import-not-at-top

  phases = Phases()

  if opts.jax_cache:
    jax.config.update("jax_compilation_cache_dir", opts.jax_cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  jit = wrapper(opts.jit)
  if opts.jw_cache:
    from jaxworks import jit_cache  # pylint: disable=g-import-not-at-top

    jit_cache.set_cache_dir(opts.jw_cache)
  out = {"import_s": time.perf_counter() - t0}
  t0 = time.perf_counter()
  devices = jax.devices()  # the backend up (on a TPU: the chip opened)
  t_backend = time.perf_counter()
  out["backend_s"] = t_backend - t0
  out["devices"] = f"{len(devices)} {devices[0].platform}"
  out["device_kind"] = str(getattr(devices[0], "device_kind", "?"))

  if opts.program == "user":
    gc.collect()
    t0 = time.perf_counter()
    result = user_script(jit)
    out["first_s"] = time.perf_counter() - t0  # the script after its imports
    out["script_s"] = time.perf_counter() - t_start
    out["result"] = result
  elif opts.program == "chain":
    x = jax.random.normal(jax.random.key(0), (2, 2))
    jax.block_until_ready(x)
    make = make_chain()(jit)
    gc.collect()  # see the loop below
    t0 = time.perf_counter()
    jax.block_until_ready(jit(make())(x))
    out["first_s"] = time.perf_counter() - t0
    out["script_s"] = time.perf_counter() - t_start
  else:
    model = init_transformer if opts.program == "transformer" else init
    loss = transformer_loss if opts.program == "transformer" else mlp_loss
    dtype = getattr(jax.numpy, opts.dtype)
    params, opt, x, y, hp = cast(model(), dtype)
    x = x + 0 if opts.program == "mlp" else x * 1  # an eager operation
    configs = [hparams(lr, b1, dtype) for lr, b1 in SWEEP[: opts.configs]]
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
      out["from_backend_s"] = time.perf_counter() - t_backend
      out["steps_s"] = sum(times)
      # The script's eval step, then its time to first result.
      jax.block_until_ready(jit(loss)(new[0], x, y))
      out["script_s"] = time.perf_counter() - t_start
  if "script_s" in out:
    out["phases"] = phases.result(out["import_s"], out["script_s"])
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
