"""The jaxworks tour: one data-parallel training step, every package, checked against stock JAX.

    ./tools/bazel run //examples:tour     # in the repository
    python3 examples/tour.py              # beside the installed jaxworks wheels (the README says how)

It runs on the accelerator JAX finds (a TPU or a GPU: JAX's default backend),
and on 8 host CPU devices where there is none. It tells one story: a small
model's checkpoint is saved (``batched_transfer.save``), restored straight
into the input formats of the compiled training step
(``batched_transfer.restore`` / ``place_for``), trained with a
``pmap_chunked`` step that ``psum``s gradients over the named axis
``'batch'`` (whose collectives ``axis_names`` reports), while ``jit_cache``
counts inner-jit hits and reuses the executable of a re-created step; the step
is exported for cpu and tpu (``stages_aot``) and the cpu artifact reloaded and
run. It ends with a side-by-side timing table against stock JAX. It imports
nothing but JAX, NumPy and jaxworks.

Every section checks its result against stock JAX; a failed check prints
``CHECK FAILED`` with the section and what differed, and the exit status is 1.

On an accelerator it runs on the devices present (a TPU v5e machine has one
chip) and says so: the data-parallel axis is as long as the devices are many,
matrix products run at float32 precision (a TPU's default rounds their inputs
to bfloat16, and the checks compare two programs' numbers), and the warm start
in new processes is left out (one process at a time may hold a TPU, and this
one does). ``JAX_PLATFORMS=cpu`` runs it on the host CPU anyway.
"""

import os

# Before jax is imported: 8 host CPU devices should the CPU be all JAX finds.
# The flag shapes only JAX's CPU backend, so it is set whatever the machine
# has; which backend runs the tour is JAX's choice (JAX_PLATFORMS, if set, or
# the accelerator it finds before the CPU).
_HOST_DEVICES = "--xla_force_host_platform_device_count"
if _HOST_DEVICES not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
    f for f in (os.environ.get("XLA_FLAGS"), f"{_HOST_DEVICES}=8") if f
  )

import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxworks import axis_names  # noqa: E402
from jaxworks import batched_transfer as bt  # noqa: E402
from jaxworks import jit_cache  # noqa: E402
from jaxworks import pmap_chunked  # noqa: E402
from jaxworks import stages_aot  # noqa: E402

# The platform JAX runs on: the devices present on an accelerator, 8 host
# CPU devices where JAX found none.
PLATFORM = jax.default_backend()
ON_ACCELERATOR = PLATFORM != "cpu"
N_DEVICES = jax.device_count() if ON_ACCELERATOR else 8
AXIS = "batch"
FEATURES, HIDDEN, OUTPUTS, DEPTH = 16, 64, 4, 3
PER_DEVICE = 32
LR = 0.05
STEPS = 3

SECTIONS = (
  "0. Setup",
  "1. Save a checkpoint (batched_transfer.save)",
  "2. Restore it into the compiled step's input formats (batched_transfer.restore, place_for)",
  "3. Train with a pmap_chunked step, psum over 'batch' (pmap_chunked, axis_names)",
  "4. Inner-jit hits and executable reuse (jit_cache)",
  "5. Export the step for cpu and tpu, reload the cpu artifact, run it (stages_aot)",
  "6. Side by side with stock JAX",
  "7. Adopt jaxworks program-wide: jax.jit, jax.device_put and jax.pmap swapped (install())",
)


class CheckFailed(AssertionError):
  """A result of the tour differs from what stock JAX computes."""


_current_section = [""]


def section(index):
  title = SECTIONS[index]
  _current_section[0] = title
  print(f"\n== {title} " + "=" * max(3, 100 - len(title)))


def check(ok, what, fix=""):
  """Prints `ok: what`, or raises CheckFailed naming the section (and the fix, when there is one)."""
  if not ok:
    raise CheckFailed(
      f"in section '{_current_section[0]}': {what}"
      + (f"; {fix}" if fix else "")
    )
  print(f"   ok: {what}")


def close(a, b, rtol=1e-5, atol=1e-6):
  """Whether two pytrees of arrays are equal up to float rounding."""
  return jax.tree.structure(a) == jax.tree.structure(b) and all(
    np.allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
  )


# ------------------------------------------------------------------------ timing


def timed_call(fn):
  """``(seconds, result)`` of one call of ``fn()``, its result awaited."""
  start = time.perf_counter()
  result = jax.block_until_ready(fn())
  return time.perf_counter() - start, result


def _per_call(fn, inner):
  """Seconds per call of ``inner`` back-to-back calls, the last awaited."""
  start = time.perf_counter()
  for _ in range(inner - 1):
    fn()
  jax.block_until_ready(fn())
  return (time.perf_counter() - start) / inner


def median_pair(ours, reference, repeats, inner=1):
  """Medians ``(ours, reference)`` of seconds per call. Each repeat times
  both, alternating which goes first, so both share the drift of a busy
  machine; garbage is collected before each timing and the GC kept off
  during it (as ``timeit`` does)."""
  t_ours, t_ref = [], []
  for r in range(repeats):
    order = [(t_ours, ours), (t_ref, reference)]
    for sink, fn in reversed(order) if r % 2 else order:
      gc.collect()
      gc.disable()
      try:
        sink.append(_per_call(fn, inner))
      finally:
        gc.enable()
  return statistics.median(t_ours), statistics.median(t_ref)


def run_fresh(code, env):
  """Runs the snippet ``code`` in a new Python process that imports what
  this one does, with ``env`` added; returns the JSON value it printed last."""
  path = os.pathsep.join(p for p in sys.path if p)
  proc = subprocess.run(
    [sys.executable, "-c", code],
    env=dict(os.environ, PYTHONPATH=path, **env),
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  if proc.returncode != 0:
    raise RuntimeError(
      f"a new process exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    )
  return json.loads(proc.stdout.strip().splitlines()[-1])


def fmt_seconds(seconds):
  """``1.23 ms``-style text with 3 significant digits."""
  for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9)):
    if seconds >= scale or unit == "ns":
      value = seconds / scale
      digits = 0 if value >= 100 else 1 if value >= 10 else 2
      return f"{value:.{digits}f} {unit}"


def fmt_speedup(value):
  """``9.4x``-style text: 3 significant digits, thousands separated."""
  return f"{value:,.0f}x" if value >= 1000 else f"{value:.3g}x"


# ------------------------------------------------------------------------ the model


def dense(x, w, b):
  """One hidden layer: the inner jit the step calls DEPTH times."""
  return jnp.tanh(x @ w + b)


def counted(fun, counter, key):
  """`fun`, counting its Python executions (i.e. traces) in counter[key]."""

  @functools.wraps(fun)
  def wrapper(*args):
    counter[key] = counter.get(key, 0) + 1
    return fun(*args)

  return wrapper


def init_params(seed=0):
  rng = np.random.default_rng(seed)

  def normal(*shape):  # scaled by the fan-in, shape[-2]
    return (rng.normal(size=shape) / np.sqrt(shape[-2])).astype(np.float32)

  return {
    "w_in": normal(FEATURES, HIDDEN),
    "w_hid": normal(DEPTH, HIDDEN, HIDDEN),
    "b_hid": np.zeros((DEPTH, HIDDEN), np.float32),
    "w_out": normal(HIDDEN, OUTPUTS),
  }


def make_batch(seed=1):
  """Per-device slices stacked on a leading axis of size N_DEVICES (the pmap convention)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(N_DEVICES, PER_DEVICE, FEATURES)).astype(np.float32)
  teacher = rng.normal(size=(FEATURES, OUTPUTS)).astype(np.float32)
  return {"x": x, "y": np.sin(x @ teacher)}


def make_loss(layer):
  def loss_fn(params, x, y):
    h = x @ params["w_in"]
    for i in range(DEPTH):
      h = layer(h, params["w_hid"][i], params["b_hid"][i])
    return jnp.mean((h @ params["w_out"] - y) ** 2)

  return loss_fn


def make_train_step(layer, lr=LR):
  """The per-device body: local gradients, psum'd over the named axis, one SGD update."""
  loss_fn = make_loss(layer)

  def train_step(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch["x"], batch["y"])
    grads = jax.tree.map(lambda g: jax.lax.psum(g, AXIS) / N_DEVICES, grads)
    loss = jax.lax.psum(loss, AXIS) / N_DEVICES
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss

  return train_step


# The step's params are broadcast (in_axes=None), its batch split over devices.
STEP_AXES = dict(in_axes=(None, 0), out_axes=(None, None))


def pmapped_step(layer, lr=LR):
  """The jaxworks step."""
  return pmap_chunked.pmap(make_train_step(layer, lr), AXIS, **STEP_AXES)


def stock_train_step(layer=None, lr=LR):
  """The same step with stock JAX only (jax.pmap, jax.jit)."""
  layer = jax.jit(dense) if layer is None else layer
  return jax.pmap(make_train_step(layer, lr), AXIS, **STEP_AXES)


def full_batch_step(params, batch, lr=LR):
  """Single-device reference: the gradient of the mean loss over the whole batch."""
  x = batch["x"].reshape(-1, FEATURES)
  y = batch["y"].reshape(-1, OUTPUTS)
  loss, grads = jax.value_and_grad(make_loss(dense))(params, x, y)
  return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss


def spec_of(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def named_axis_effects(closed_jaxpr):
  """Stock JAX's answer to 'which named axes does this program use': its NamedAxisEffects."""
  return frozenset(
    e.name
    for e in closed_jaxpr.effects
    if type(e).__name__ == "NamedAxisEffect"
  )


# ------------------------------------------------------------------------ sections


def show_setup():
  section(0)
  devices = jax.devices()
  print(
    f"   jax {jax.__version__}, {len(devices)} {devices[0].platform} devices"
  )
  for mod in (axis_names, bt, jit_cache, stages_aot, pmap_chunked):
    print(f"   {mod.__name__:<26} {mod.__version__}")
  if ON_ACCELERATOR:
    # The devices present (one TPU chip: an axis of 1), float32 products.
    jax.config.update("jax_default_matmul_precision", "highest")
    print(
      f"   running on the {len(devices)} {PLATFORM} device(s) present "
      f"({devices[0].device_kind}): the '{AXIS}' axis has {N_DEVICES}; "
      "matrix products at float32 precision; no warm start in new processes"
    )
  check(
    len(devices) >= N_DEVICES,
    f"at least {N_DEVICES} devices (got {len(devices)})",
    fix=f"run with XLA_FLAGS=--xla_force_host_platform_device_count={N_DEVICES} JAX_PLATFORMS=cpu",
  )


def save_checkpoint(tmp, params):
  section(1)
  path = tmp / "ckpt"
  bt.save(path, params)
  files = sorted(p.name for p in path.iterdir())
  for name in files:
    print(f"   {path.name}/{name:<10} {(path / name).stat().st_size:>7} bytes")
  npy = [f for f in files if f.endswith(".npy")]
  check(
    npy == sorted(k + ".npy" for k in params), f"one .npy file per leaf: {npy}"
  )
  check(
    all(
      np.array_equal(np.load(path / (k + ".npy")), v) for k, v in params.items()
    ),
    "numpy reads back every leaf unchanged",
  )
  return path


def restore_checkpoint(path, params, batch, step):
  section(2)
  # pmap_chunked stages the program a call would run; its compiled form has one input per leaf of
  # (params, batch), each with a sharding and a layout.
  compiled = step.lower(spec_of(params), spec_of(batch)).compile()
  formats = jax.tree.leaves(compiled.input_formats[0])
  keyed, treedef = jax.tree_util.tree_flatten_with_path((params, batch))
  flat = [leaf for _, leaf in keyed]
  for (key, leaf), f in zip(keyed, formats):
    print(
      f"   {jax.tree_util.keystr(key):<16} {str(leaf.dtype)}{list(leaf.shape)!s:<12} -> spec {f.sharding.spec}, "
      f"layout {f.layout.major_to_minor}"
    )

  # restore: reads the headers, validates every key/shape/dtype, then streams the data straight
  # into the formats of the step's parameter inputs.
  targets = [
    jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=f)
    for x, f in zip(flat, formats)
  ]
  param_targets, _ = jax.tree.unflatten(treedef, targets)
  restored = bt.restore(path, param_targets)
  # place_for: every positional input of the compiled step at once (restored params are already
  # in place and pass through; the numpy batch is sent in one batched transfer).
  n_params = len(jax.tree.leaves(params))
  placed = jax.tree.leaves(bt.place_for(compiled, (restored, batch)))
  restored, batch_on_devices = jax.tree.unflatten(treedef, list(placed))
  plan = bt.plan(list(placed), list(formats))
  print("   " + str(plan).replace("\n", "\n   "))

  check(
    all(x.format == f for x, f in zip(placed, formats)),
    "every input has exactly the compiled step's format (sharding and layout)",
  )
  check(
    all(x is y for x, y in zip(placed[:n_params], jax.tree.leaves(restored))),
    "place_for passed the restored parameters through (same objects)",
  )
  check(
    plan.copies == 0 and plan.zero_copy == len(flat),
    f"nothing left to move before the step: {plan.zero_copy} of {len(flat)} leaves zero-copy",
  )
  stock = jax.device_put(flat, list(formats))
  check(
    close(list(placed), stock, rtol=0, atol=0),
    "values equal jax.device_put's of the saved arrays",
  )
  return compiled, restored, batch_on_devices


def train(params, batch, restored, batch_on_devices, step, stock_step):
  section(3)
  losses, p = [], restored
  for i in range(STEPS):
    p, loss = step(p, batch_on_devices)
    losses.append(float(loss))
    print(f"   step {i}: loss {losses[-1]:.6f}")
  print(
    f"   output sharding: {p['w_in'].sharding.spec} over mesh {dict(p['w_in'].sharding.mesh.shape)}"
  )

  stock_losses, q = [], params
  for _ in range(STEPS):
    q, loss = stock_step(q, batch)
    stock_losses.append(float(loss))
  check(
    close(losses, stock_losses) and close(p, q),
    f"losses and parameters equal stock jax.pmap's after {STEPS} steps ({stock_losses[-1]:.6f})",
  )
  ref_params, ref_loss = full_batch_step(params, batch)
  first, first_loss = step(restored, batch_on_devices)
  check(
    close(first, ref_params, rtol=1e-4, atol=1e-6)
    and close(first_loss, ref_loss, rtol=1e-5),
    "one step equals a single-device step on the whole batch (the psum'd gradient is the full one)",
  )
  check(losses[-1] < losses[0], "the loss goes down")

  local_batch = jax.tree.map(lambda a: a[0], batch)
  body = make_train_step(jit_cache.jit(dense))
  report = axis_names.collective_report(
    body, params, local_batch, axis_sizes={AXIS: N_DEVICES}
  )
  print(
    "\n   collective report of one device's step (jaxworks.axis_names.collective_report):"
  )
  print("   " + str(report).replace("\n", "\n   "))
  print(f"   total bytes per device per step: {report.total_bytes:.0f}")
  used = axis_names.used_axis_names(
    body, params, local_batch, axis_sizes={AXIS: N_DEVICES}
  )
  stock_used = named_axis_effects(
    jax.make_jaxpr(body, axis_env=[(AXIS, N_DEVICES)])(params, local_batch)
  )
  check(
    used == stock_used == {AXIS},
    f"used_axis_names = {set(used)} = the NamedAxisEffects of the jaxpr",
  )
  n_leaves = len(jax.tree.leaves(params))
  check(
    [(r.axes, r.primitive) for r in report.rows] == [((AXIS,), "psum")]
    and report.rows[0].count == n_leaves + 1,
    f"one psum per gradient leaf plus the loss: {n_leaves + 1}",
  )
  program = step.trace(restored, batch_on_devices).jaxpr
  free = axis_names.used_axis_names(program)
  check(
    free == frozenset() == named_axis_effects(program),
    "the whole pmapped program uses no free axis name (its shard_map binds 'batch')",
  )
  return p, losses


def cache_stats(params, batch, restored, batch_on_devices, layer, traces):
  section(4)
  info = layer.cache_info()
  print(
    f"   inner jit `dense` (jit_cache.jit), called {DEPTH}x per trace of the loss: hits={info.hits} "
    f"misses={info.misses} traces={info.traces} entries={info.entries}"
  )
  print(
    f"   Python executions of dense while tracing: jaxworks {traces.get('jaxworks', 0)} for "
    f"{info.hits + info.misses} inner calls; stock jax.jit {traces.get('jax', 0)}"
  )
  check(
    info.traces == 1 == traces.get("jaxworks") and info.hits >= DEPTH - 1,
    f"dense ran once in Python; every later inner call hit the trace cache ({info.hits} hits)",
  )

  # A re-created step: a new closure with the same code and constants, as a training script makes
  # when it rebuilds its step (e.g. in a loop over runs). jax.pmap traces, lowers and compiles again;
  # jaxworks traces (hitting the inner-jit cache) and reuses the compiled executable.
  before = jit_cache.stats()
  ours, out = timed_call(
    lambda: pmapped_step(layer)(restored, batch_on_devices)
  )
  after = jit_cache.stats()
  stock, stock_out = timed_call(lambda: stock_train_step()(params, batch))
  print(
    f"   first call of a re-created step: jaxworks {fmt_seconds(ours)}, stock jax.pmap {fmt_seconds(stock)}"
  )
  print("   jit_cache.stats() around it:")
  for field in ("hits", "misses", "traces", "compiles", "executable_reuses"):
    print(
      f"     {field:<18} {getattr(before, field):>4} -> {getattr(after, field):>4}"
    )
  print(f"     time saved so far  {after.time_saved_s * 1e3:.0f} ms")
  check(
    after.executable_reuses > before.executable_reuses
    and after.compiles == before.compiles,
    "the re-created step reused the compiled executable (no new compile)",
  )
  check(close(out, stock_out), "its result equals stock jax.pmap's")
  check(after.hits > before.hits, "its trace hit the inner-jit cache")
  if ON_ACCELERATOR:
    print(
      f"   (warm start in new processes: left out on {PLATFORM}, which one "
      "process at a time may hold)"
    )
    return
  warm_start_in_a_second_process()


# A program run by two new processes sharing a cache directory (JAXWORKS_JIT_CACHE_DIR turns on JAX's persistent
# compilation cache): the first compiles and writes every executable, the second loads them (no XLA compile).
WARM_START = """
import json, time
import jax, jax.numpy as jnp, numpy as np
from jaxworks import jit_cache
def loss(w, x):
  return jnp.mean(jnp.tanh(x @ w) ** 2)
w, x = jnp.full((16, 4), 0.1), jnp.arange(32.0).reshape(2, 16) / 32
start = time.perf_counter()
grad = np.asarray(jit_cache.jit(jax.grad(loss))(w, x))
seconds = time.perf_counter() - start
s = jit_cache.stats()
print(json.dumps({"s": seconds, "hits": s.persistent_hits, "misses": s.persistent_misses, "grad": grad.tolist()}))
"""


def warm_start_in_a_second_process():
  with tempfile.TemporaryDirectory(prefix="jaxworks_tour_cache_") as cache:
    env = {"JAXWORKS_JIT_CACHE_DIR": cache}
    first = run_fresh(WARM_START, env)
    second = run_fresh(WARM_START, env)
  print(
    f"   warm start in a second process (JAX's persistent cache): first process {fmt_seconds(first['s'])} "
    f"({first['misses']} entries written), second {fmt_seconds(second['s'])} "
    f"({second['hits']} loaded, {second['misses']} written)"
  )
  check(
    first["misses"] >= 1
    and first["hits"] == 0
    and second["hits"] >= 1
    and second["misses"] == 0,
    "the second process loaded every executable from the persistent cache (no compile)",
  )
  w, x = jnp.full((16, 4), 0.1), jnp.arange(32.0).reshape(2, 16) / 32
  stock = jax.jit(jax.grad(lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2)))(w, x)
  check(
    np.array_equal(np.asarray(second["grad"], np.float32), np.asarray(stock)),
    "its result equals stock jax.jit's, bit for bit",
  )


def export_step(
  tmp, params, batch, restored, batch_on_devices, step, stock_step
):
  section(5)
  traced = stages_aot.Traced.from_traced(step.trace(restored, batch_on_devices))
  lowered = traced.lower(lowering_platforms=("cpu", "tpu"))
  exported = lowered.export()
  print(f"   {exported!r}")
  print(
    f"   StableHLO: {len(lowered.as_text().splitlines())} lines, one module for {lowered.platforms}"
  )
  art = stages_aot.save_artifact(exported, tmp / "train_step")
  files = sorted(pathlib.Path(art.path).iterdir())
  sizes = ", ".join(f"{p.name} ({p.stat().st_size} bytes)" for p in files)
  print(f"   artifact {art.path.name}/: {sizes}")
  loaded = stages_aot.load_artifact(tmp / "train_step")
  here = tuple(p for p in ("cpu", "tpu") if p in stages_aot.present_platforms())
  print(
    f"   reloaded: platforms {loaded.platforms}, runnable here {loaded.runnable_platforms}"
  )
  # The exported program is the pmapped program: one input per leaf of (params, batch).
  out = loaded(*jax.tree.leaves((restored, batch_on_devices)))
  direct = step(restored, batch_on_devices)
  stock = stock_step(params, batch)
  check(
    tuple(loaded.platforms) == ("cpu", "tpu")
    and tuple(loaded.runnable_platforms) == here,
    f"the artifact holds cpu and tpu; {' and '.join(here)} runs here",
  )
  check(
    close(out, direct, rtol=0, atol=0),
    f"the reloaded {PLATFORM} artifact gives exactly the pmapped step's result",
  )
  check(close(out, stock), "and stock jax.pmap's")


def make_chain():
  """A fresh function object each call, with the same code and constants."""

  def chain(x):
    for k in range(40):
      x = jnp.sin(x) * 1.01 + 0.5 / (k + 1)
    return x

  return chain


# The rows of the timing table, in the order timings() measures them:
# package | measure | the stock JAX call timed beside it.
TIMED = """\
axis_names | axis names of the step's jaxpr (repeated) | read jaxpr.effects
batched_transfer | device_put, 64 numpy leaves -> {n} devices | jax.device_put
jit_cache | first call of a re-created function (in-process reuse) | jax.jit
jit_cache | cached call | jax.jit
stages_aot | trace+lower(cpu,tpu)+export+serialize | jax.export
pmap_chunked | training step, cached call | jax.pmap"""


def timings(params, batch, restored, batch_on_devices, step, stock_step):
  """One row per measure, each package's beside the stock JAX call it replaces."""
  section(6)
  times = []  # (jaxworks, stock) seconds per row of TIMED

  # axis_names: which axis names the step's program uses (a repeated query).
  closed = jax.make_jaxpr(
    make_train_step(jax.jit(dense)), axis_env=[(AXIS, N_DEVICES)]
  )(params, jax.tree.map(lambda a: a[0], batch))
  axis_names.used_axis_names(closed)
  ours, stock = (
    lambda: axis_names.used_axis_names(closed),
    lambda: named_axis_effects(closed),
  )
  times.append(median_pair(ours, stock, repeats=5, inner=2000))

  # batched_transfer: 64 small numpy leaves onto the batch sharding (8 devices).
  sharding = batch_on_devices["x"].sharding
  tree = {
    f"leaf{i}": np.full((N_DEVICES, 32), i, np.float32) for i in range(64)
  }
  ours, stock = (
    lambda: bt.device_put(tree, sharding),
    lambda: jax.device_put(tree, sharding),
  )
  check(
    close(ours(), stock(), rtol=0, atol=0),
    "batched_transfer.device_put equals jax.device_put on the timing tree",
  )
  times.append(median_pair(ours, stock, repeats=7, inner=5))

  # jit_cache: the first call of a re-created closure, and a cached call.
  x = jnp.arange(256.0)
  ours, stock = (
    lambda: jit_cache.jit(make_chain())(x),
    lambda: jax.jit(make_chain())(x),
  )
  check(close(ours(), stock()), "jit_cache.jit equals jax.jit")
  times.append(median_pair(ours, stock, repeats=5))
  f_ours, f_stock = jit_cache.jit(make_chain()), jax.jit(make_chain())
  ours, stock = lambda: f_ours(x), lambda: f_stock(x)
  times.append(median_pair(ours, stock, repeats=7, inner=200))

  # stages_aot: trace, lower for cpu+tpu, export and serialize a fresh
  # function each time.
  platforms = ("cpu", "tpu")

  def export_ours():
    traced = stages_aot.trace(make_chain(), x)
    exported = traced.lower(lowering_platforms=platforms).export()
    return np.frombuffer(exported.serialize(), np.uint8)

  def export_stock():
    export = jax.export.export(jax.jit(make_chain()), platforms=platforms)
    return np.frombuffer(export(x).serialize(), np.uint8)

  times.append(median_pair(export_ours, export_stock, repeats=5))

  # pmap_chunked: dispatch of the cached training step, both on the same
  # device-resident inputs.
  ours, stock = (
    lambda: step(restored, batch_on_devices),
    lambda: stock_step(restored, batch_on_devices),
  )
  check(
    close(ours(), stock()),
    "the pmap_chunked step equals jax.pmap's on the restored inputs",
  )
  times.append(median_pair(ours, stock, repeats=7, inner=20))

  print(
    f"   medians of interleaved repeats, {jax.device_count()} "
    + ("host CPU devices" if not ON_ACCELERATOR else f"{PLATFORM} device(s)")
    + "; speedup = stock / jaxworks, > 1: jaxworks faster\n"
  )
  print(
    "   | package | measure | jaxworks | stock JAX | stock call | speedup |\n"
    "   |---|---|---:|---:|---|---:|"
  )
  rows = [line.split(" | ") for line in TIMED.format(n=N_DEVICES).splitlines()]
  for (package, measure, what), (ours, stock) in zip(rows, times):
    print(
      f"   | {package} | {measure} | {fmt_seconds(ours)} | {fmt_seconds(stock)} | {what} | {fmt_speedup(stock / ours)} |"
    )
  check(
    len(times) == len(rows) and len({r[0] for r in rows}) == 5,
    "every package measured side by side with stock JAX",
  )


def adopt_program_wide(params, batch):
  """Code written against stock JAX, run unchanged with jaxworks swapped in for jax.jit/device_put/pmap."""
  section(7)

  def user_code():
    # Plain JAX, as a codebase would have it: every call goes through the jax namespace.
    placed = jax.device_put(params, jax.devices()[0])
    return placed, stock_train_step()(placed, batch)

  stock_placed, stock_loss = user_code()
  stock_names = (jax.jit, jax.device_put, jax.pmap)
  with jit_cache.installed(), bt.installed(), pmap_chunked.installed():
    swapped = (
      jax.jit is jit_cache.jit,
      jax.device_put is bt.device_put,
      jax.pmap is pmap_chunked.pmap,
    )
    print(
      "   with jit_cache.installed(), batched_transfer.installed(), pmap_chunked.installed():"
    )
    print(
      "       jax.jit -> jit_cache.jit, jax.device_put -> batched_transfer.device_put, "
      "jax.pmap -> pmap_chunked.pmap"
    )
    placed, loss = user_code()
  check(
    all(swapped), f"inside the block the three names are jaxworks' ({swapped})"
  )
  check(
    (jax.jit, jax.device_put, jax.pmap) == stock_names,
    "after the block stock JAX's names are back",
  )
  check(
    close(
      jax.tree.leaves(placed), jax.tree.leaves(stock_placed), rtol=0, atol=0
    )
    and close(loss, stock_loss),
    "the unchanged user code gives stock JAX's results",
  )


def main(argv=None):
  del argv  # the tour takes no arguments
  start = time.perf_counter()
  jit_cache.reset_stats()
  traces = {}
  try:
    show_setup()
    layer = jit_cache.jit(counted(dense, traces, "jaxworks"))
    step = pmapped_step(layer)
    stock_step = stock_train_step(jax.jit(counted(dense, traces, "jax")))
    params, batch = init_params(), make_batch()
    with tempfile.TemporaryDirectory(prefix="jaxworks_tour_") as tmp:
      tmp = pathlib.Path(tmp)
      path = save_checkpoint(tmp, params)
      _, restored, batch_on_devices = restore_checkpoint(
        path, params, batch, step
      )
      train(params, batch, restored, batch_on_devices, step, stock_step)
      cache_stats(params, batch, restored, batch_on_devices, layer, traces)
      export_step(
        tmp, params, batch, restored, batch_on_devices, step, stock_step
      )
      timings(params, batch, restored, batch_on_devices, step, stock_step)
      adopt_program_wide(params, batch)
  except CheckFailed as err:
    sys.stdout.flush()
    print(f"\nCHECK FAILED {err}", file=sys.stderr)
    return 1
  print(f"\nAll checks passed ({time.perf_counter() - start:.1f} s).")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
