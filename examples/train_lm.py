"""Trains a small transformer language model with checkpoints, and resumes.

    ./tools/bazel run //examples:train_lm -- --steps 200 --dir /tmp/lm
    python3 examples/train_lm.py --steps 200 --dir /tmp/lm   # beside the wheels

A 2-layer decoder-only transformer (token and position embeddings, causal
self-attention, an MLP, layer norms; plain JAX), trained with
``optax.chain(clip_by_global_norm(1.0), adamw(...))``, data parallel over
every device: the batch is sharded on the mesh axis ``'data'``, the
parameters and the optimizer state are replicated, and the step is one
``jax.jit`` that donates both. The data are synthetic and deterministic:
the batch of step ``s`` is drawn from ``fold_in(key(seed), s)``, shifted by
an offset that a host-side numpy ``Generator`` draws once per step (a
stand-in for a data pipeline's own state).

Every step calls ``mgr.save(step, items=..., metrics=...)`` of a
``batched_transfer.CheckpointManager``; the manager saves every
``--save-every`` steps (``save_interval_steps``), in the background, and
keeps the last 3. A checkpoint holds three items: ``params``, ``opt_state``
and ``data``, the data iterator's state (the step, the tokens seen, the
``Generator``'s ``bit_generator.state``, 128-bit integers and all). Started
again on the same directory, the program restores the latest step and goes
on from the next one: killed at any moment and restarted until done, it
prints the losses of an uninterrupted run, bit for bit
(``examples/train_lm_test.py`` checks it). Stopped with SIGTERM (what a
scheduler sends before it preempts a job), it saves the step it is at,
waits until that step is committed, prints ``preempted at step <n>`` and
exits 0 (``CheckpointManager.reached_preemption``).

The program adopts jaxworks program-wide: ``jit_cache.install()`` (``jax.jit``
is ``jit_cache.jit``) and ``batched_transfer.install()`` (``jax.device_put``
is ``batched_transfer.device_put``); ``--stock`` runs the same code on stock
JAX's. It prints one line per step, ``step <n> loss <repr(loss)>``, and
``--final PATH`` writes the trained parameters and optimizer state to an
``.npz`` file (one member per leaf, named by its tree path).

The model, the optimizer, the data and the step are importable (``Config``,
``init_state``, ``make_train_step``, ``DataIterator``, ...), so that the
training-loop benchmark of batched_transfer runs this very model.
"""

import os

# Before jax is imported: 8 host CPU devices should the CPU be all JAX finds.
_HOST_DEVICES = "--xla_force_host_platform_device_count"
if _HOST_DEVICES not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
    f for f in (os.environ.get("XLA_FLAGS"), f"{_HOST_DEVICES}=8") if f
  )

# pylint: disable=wrong-import-position
import argparse  # noqa: E402
import dataclasses  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402
from typing import NamedTuple  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jaxworks import batched_transfer as bt  # noqa: E402
from jaxworks import jit_cache  # noqa: E402

#: The key of the frozen array in the parameters (``Config.frozen_mib``).
FROZEN = "frozen"


@dataclasses.dataclass(frozen=True)
class Config:
  """The model, the optimizer and the data."""

  vocab: int = 256
  d_model: int = 128
  n_heads: int = 4
  n_layers: int = 2
  d_ff: int = 512
  seq_len: int = 64
  batch: int = 32  # the global batch: a multiple of the device count
  lr: float = 3e-3
  weight_decay: float = 0.01
  seed: int = 0
  #: MiB of a frozen float32 array among the parameters (not trained;
  #: passed through the step unchanged): a large checkpoint (0: none).
  frozen_mib: int = 0


#: The configuration the test runs: a few seconds on 2 cores.
TINY = Config(vocab=64, d_model=32, n_heads=2, d_ff=64, seq_len=16, batch=16)


class Shardings(NamedTuple):
  """Where things live: parameters and optimizer state replicated, the batch
  sharded over the mesh axis ``'data'``."""

  mesh: jax.sharding.Mesh
  replicated: NamedSharding
  batch: NamedSharding


def make_shardings() -> Shardings:
  """A 1-d mesh ``'data'`` over every device (an Auto axis: the compiler
  partitions the step and averages the gradients)."""
  mesh = jax.make_mesh(
    (jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
  )
  return Shardings(
    mesh, NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
  )


# ------------------------------------------------------------------ the model


def init_params(cfg: Config, key: jax.Array) -> dict[str, Any]:
  """The parameters: embeddings, ``n_layers`` blocks, the final layer norm
  (the output projection is the token embedding, tied)."""
  d, ff = cfg.d_model, cfg.d_ff
  keys = iter(jax.random.split(key, 2 + 4 * cfg.n_layers))

  def dense(shape):
    return jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(shape[0])

  def norm():
    return {
      "scale": jnp.ones(d, jnp.float32),
      "bias": jnp.zeros(d, jnp.float32),
    }

  params: dict[str, Any] = {
    "embed": jax.random.normal(next(keys), (cfg.vocab, d), jnp.float32) * 0.02,
    "pos": jax.random.normal(next(keys), (cfg.seq_len, d), jnp.float32) * 0.02,
    "blocks": [
      {
        "ln1": norm(),
        "qkv": dense((d, 3 * d)),
        "out": dense((d, d)),
        "ln2": norm(),
        "mlp": {
          "w1": dense((d, ff)),
          "b1": jnp.zeros(ff, jnp.float32),
          "w2": dense((ff, d)),
          "b2": jnp.zeros(d, jnp.float32),
        },
      }
      for _ in range(cfg.n_layers)
    ],
    "ln_f": norm(),
  }
  if cfg.frozen_mib:
    # Random values (a pretrained table's are incompressible, zeros are not).
    params[FROZEN] = jax.random.normal(
      jax.random.fold_in(key, 1), (cfg.frozen_mib * 2**20 // 4,), jnp.float32
    )
  return params


def trainable(params: dict[str, Any]) -> dict[str, Any]:
  """The parameters the optimizer updates (all but the frozen array)."""
  return {k: v for k, v in params.items() if k != FROZEN}


def _layer_norm(p, x):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def _attention(cfg: Config, block, x):
  b, t, d = x.shape
  h = cfg.n_heads
  q, k, v = jnp.split(x @ block["qkv"], 3, axis=-1)
  q, k, v = (z.reshape(b, t, h, d // h) for z in (q, k, v))
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // h)
  causal = jnp.tril(jnp.ones((t, t), bool))
  scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
  mixed = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, -1), v)
  return mixed.reshape(b, t, d) @ block["out"]


def forward(cfg: Config, params: dict[str, Any], tokens: jax.Array):
  """Logits ``[batch, time, vocab]`` of ``tokens`` ``[batch, time]``."""
  x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
  for block in params["blocks"]:
    x = x + _attention(cfg, block, _layer_norm(block["ln1"], x))
    m = block["mlp"]
    y = _layer_norm(block["ln2"], x)
    x = x + jax.nn.gelu(y @ m["w1"] + m["b1"]) @ m["w2"] + m["b2"]
  return _layer_norm(params["ln_f"], x) @ params["embed"].T


def loss_fn(cfg: Config, params: dict[str, Any], tokens: jax.Array):
  """The mean next-token cross entropy of ``tokens`` ``[batch, seq+1]``."""
  logits = forward(cfg, params, tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(
    logits, tokens[:, 1:]
  ).mean()


def optimizer(cfg: Config) -> optax.GradientTransformation:
  return optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.adamw(cfg.lr, weight_decay=cfg.weight_decay),
  )


def init_state(cfg: Config, shardings: Shardings):
  """``(params, opt_state)`` of step 0, replicated on every device: made on
  one device by one compiled call, then placed with ``jax.device_put`` (the
  whole tree in one call: ``batched_transfer.device_put`` once installed)."""
  state = jax.jit(lambda: _init(cfg))()
  return jax.device_put(state, shardings.replicated)


def _init(cfg: Config):
  params = init_params(cfg, jax.random.key(cfg.seed))
  return params, optimizer(cfg).init(trainable(params))


def abstract_state(cfg: Config, shardings: Shardings):
  """``(params, opt_state)`` as ``jax.ShapeDtypeStruct`` leaves (from
  ``jax.eval_shape``, nothing computed) with their shardings: the targets
  of a restore."""
  shapes = jax.eval_shape(lambda: _init(cfg))
  return jax.tree.map(
    lambda s: jax.ShapeDtypeStruct(
      s.shape, s.dtype, sharding=shardings.replicated
    ),
    shapes,
  )


def make_train_step(cfg: Config, shardings: Shardings):
  """The training step ``(params, opt_state, tokens) -> (params, opt_state,
  loss)``: one ``jax.jit`` (looked up when called: ``jit_cache.jit`` once
  installed) that donates the parameters and the optimizer state; the
  gradients are averaged over the sharded batch by the compiler."""
  tx = optimizer(cfg)

  def step(params, opt_state, tokens):
    train = trainable(params)
    loss, grads = jax.value_and_grad(lambda p: loss_fn(cfg, p, tokens))(train)
    updates, opt_state = tx.update(grads, opt_state, train)
    new = dict(optax.apply_updates(train, updates))
    if FROZEN in params:
      new[FROZEN] = params[FROZEN]  # passed through: aliases the donated input
    return new, opt_state, loss

  r = shardings.replicated
  return jax.jit(
    step,
    in_shardings=(r, r, shardings.batch),
    out_shardings=(r, r, r),
    donate_argnums=(0, 1),
  )


# ------------------------------------------------------------------- the data


class DataIterator:
  """Synthetic token sequences, deterministic: the batch of step ``s`` is
  ``(start + stride * t + offset) % vocab`` with ``start`` and ``stride`` per
  row drawn from ``fold_in(key(seed), s)`` and ``offset`` drawn per step by
  a numpy ``Generator`` (the host-side state a real pipeline keeps: a
  shuffle, a file position). ``state()`` is what a checkpoint holds, and
  ``DataIterator(cfg, shardings, state)`` resumes from it."""

  def __init__(self, cfg: Config, shardings: Shardings, state=None):
    self.cfg = cfg
    self.rng = np.random.Generator(np.random.PCG64(cfg.seed))
    self.step = 0
    self.tokens_seen = 0
    if state is not None:
      self.step = state["step"]
      self.tokens_seen = state["tokens_seen"]
      self.rng.bit_generator.state = state["rng"]
    key = jax.random.key(cfg.seed)

    def batch(step, offset):
      k1, k2 = jax.random.split(jax.random.fold_in(key, step))
      shape = (cfg.batch, 1)
      start = jax.random.randint(k1, shape, 0, cfg.vocab)
      stride = jax.random.randint(k2, shape, 1, 8)
      t = jnp.arange(cfg.seq_len + 1)[None, :]
      return ((start + stride * t + offset) % cfg.vocab).astype(jnp.int32)

    self._batch = jax.jit(batch, out_shardings=shardings.batch)

  def next(self, step: int) -> jax.Array:
    """The batch of ``step`` (the one after ``self.step``)."""
    if step != self.step + 1:
      raise ValueError(
        f"DataIterator.next: step {step} after step {self.step}; the "
        f"iterator gives step {self.step + 1} next"
      )
    offset = int(self.rng.integers(self.cfg.vocab))
    self.step = step
    self.tokens_seen += self.cfg.batch * (self.cfg.seq_len + 1)
    return self._batch(np.int32(step), np.int32(offset))

  def state(self) -> dict[str, Any]:
    """A new dict: the step, the tokens seen (an int) and the
    ``Generator``'s ``bit_generator.state``."""
    return {
      "step": self.step,
      "tokens_seen": self.tokens_seen,
      "rng": self.rng.bit_generator.state,
    }


# ------------------------------------------------------------ the training job


def restore(mgr: bt.CheckpointManager, cfg: Config, shardings: Shardings):
  """``(step, params, opt_state, data state)`` of the latest committed step,
  placed as the step expects (replicated), or None when there is none."""
  step = mgr.latest_step()
  if step is None:
    return None
  params_t, opt_t = abstract_state(cfg, shardings)
  got = mgr.restore(
    step, items={"params": params_t, "opt_state": opt_t, "data": None}
  )
  return step, got["params"], got["opt_state"], got["data"]


def write_final(path: str, params, opt_state) -> None:
  """``params`` and ``opt_state`` as an ``.npz``, one member per leaf, named
  by its tree path (``jax.tree_util.keystr``)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(
    {"params": params, "opt_state": opt_state}
  )
  arrays = {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}
  with open(path, "wb") as f:
    np.savez(f, **arrays)


def train(args: argparse.Namespace, cfg: Config) -> int:
  shardings = make_shardings()
  mgr = bt.CheckpointManager(
    args.dir, max_to_keep=3, save_interval_steps=args.save_every
  )
  resumed = restore(mgr, cfg, shardings)
  if resumed is None:
    start = 1
    params, opt_state = init_state(cfg, shardings)
    data = DataIterator(cfg, shardings)
  else:
    last, params, opt_state, data_state = resumed
    if data_state["step"] != last:
      raise RuntimeError(
        f"train_lm: step {last} in {args.dir} holds the data state of step "
        f"{data_state['step']}; it was not written by this program"
      )
    start = last + 1
    data = DataIterator(cfg, shardings, data_state)
    print(f"resumed from step {last}", flush=True)
  train_step = make_train_step(cfg, shardings)
  for step in range(start, args.steps + 1):
    tokens = data.next(step)
    params, opt_state, loss = train_step(params, opt_state, tokens)
    loss = float(loss)
    # Every step: the manager saves the steps its interval asks for, in the
    # background (the call returns once the leaves are in host memory, so
    # the next step may donate them).
    mgr.save(
      step,
      items={"params": params, "opt_state": opt_state, "data": data.state()},
      metrics={"loss": loss},
    )
    # A job being stopped (SIGTERM; JAX's preemption sync point under
    # jax.distributed) saves this step (should_save says yes) and exits.
    stop = mgr.reached_preemption(step)
    print(f"step {step} loss {loss!r}", flush=True)
    if stop:
      mgr.wait_until_finished()  # the step is committed
      mgr.close()
      print(f"preempted at step {step}", flush=True)
      return 0
  mgr.wait_until_finished()
  if args.final:
    write_final(args.final, params, opt_state)
  mgr.close()
  return 0


def parse_args(argv=None) -> tuple[argparse.Namespace, Config]:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--dir", required=True, help="the checkpoint directory")
  p.add_argument("--steps", type=int, default=100, help="train to this step")
  p.add_argument(
    "--save-every", type=int, default=10, help="save_interval_steps"
  )
  p.add_argument("--final", default=None, help="write the final state (.npz)")
  p.add_argument(
    "--stock",
    action="store_true",
    help="stock JAX's jax.jit and jax.device_put (no install())",
  )
  p.add_argument(
    "--tiny", action="store_true", help="the test's small configuration"
  )
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  cfg = dataclasses.replace(TINY if args.tiny else Config(), seed=args.seed)
  return args, cfg


def main(argv=None) -> int:
  args, cfg = parse_args(argv)
  if not args.stock:
    jit_cache.install()  # jax.jit is jit_cache.jit
    bt.install()  # jax.device_put is batched_transfer.device_put
  return train(args, cfg)


if __name__ == "__main__":
  sys.exit(main())
