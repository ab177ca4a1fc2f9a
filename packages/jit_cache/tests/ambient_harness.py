"""Differential harness: ambient state, ``jaxworks.jit_cache.jit`` vs ``jax.jit``.

A *dimension* is one kind of ambient state (a trace-context option, the
concrete mesh, the axis environment, a debug flag, the transfer guard, the
argument layout or placement, the closure's constants). Each has two or more
*states*; a state may enter a context, transform the arguments and wrap the
call (under ``vmap(axis_name=...)`` or ``shard_map``), and pick the closure
variant of the program.

A *case* is (program, states A and B, order, mode): the steps run the
program under A then B (order ``AB``) or B then A (``BA``), as one function
object (mode ``same``) or as a closure re-created for each step (mode
``recreated``). The case runs once with stock ``jax.jit`` and once with
``jaxworks.jit_cache.jit`` in this process, and every step's outcome must be
the same: output tree, dtypes, weak types, bits (NaN payloads and ``-0.0``
included), shardings with their device order, committedness, layouts, what
host callbacks saw, and the exception class when either raises.

``repro_line`` prints one mismatch as a command that re-runs exactly that
case with the ``ambient_fuzz`` binary.
"""

from collections.abc import Callable
from collections.abc import Iterator
import contextlib
import dataclasses
import itertools
import random
from typing import Any

import ambient_corpus as corpus
import jax
from jax.experimental.layout import Format
from jax.experimental.layout import Layout
import numpy as np

from jaxworks import jit_cache
from jaxworks.jit_cache._src import jax_internals as ji

P = jax.sharding.PartitionSpec
AUTO = jax.sharding.AxisType.Auto
ORDERS = ("AB", "BA")
MODES = ("same", "recreated")


@dataclasses.dataclass(frozen=True)
class State:
  """One ambient state: context, argument transform, call wrapper, variant."""

  name: str
  enter: Callable[[], Any] = contextlib.nullcontext
  prep: Callable[[tuple, dict], tuple] | None = None
  wrap: Callable[[Callable, tuple], Any] | None = None
  variant: int = 0


@dataclasses.dataclass(frozen=True)
class Dimension:
  """A named set of states; ``tags`` restricts it to programs that fit."""

  name: str
  states: tuple
  tags: frozenset = frozenset()  # empty: every program


def _devices():
  return jax.devices()


def _mesh(devs, names=("i",), shape=None):
  shape = shape or (len(devs),)
  return jax.make_mesh(
    shape, names, axis_types=(AUTO,) * len(names), devices=list(devs)
  )


@contextlib.contextmanager
def _config(name, value):
  old = getattr(jax.config, name)
  jax.config.update(name, value)
  try:
    yield
  finally:
    jax.config.update(name, old)


def _set_mesh(devs_fn, names=("i",), shape=None):
  return lambda: jax.set_mesh(_mesh(devs_fn(), names, shape))


def _with_mesh(devs_fn):
  return lambda: _mesh(devs_fn())


def _abstract_mesh(shape, names):
  return lambda: jax.sharding.use_abstract_mesh(
    jax.sharding.AbstractMesh(shape, names, axis_types=(AUTO,) * len(names))
  )


def _map_arrays(fn, args):
  return jax.tree.map(
    lambda a: fn(a) if isinstance(a, (jax.Array, np.ndarray)) else a, args
  )


def _dynamic(args, jit_kwargs):
  """Indices of positional args that are not static."""
  static = jit_kwargs.get("static_argnums", ())
  static = (static,) if isinstance(static, int) else tuple(static)
  return [i for i in range(len(args)) if i not in static]


def _commit(dev_index):
  def prep(args, jit_kwargs):
    dev = _devices()[dev_index]
    return tuple(
      _map_arrays(lambda a: jax.device_put(a, dev), a)
      if i in _dynamic(args, jit_kwargs)
      else a
      for i, a in enumerate(args)
    )

  return prep


def _numpy_args(args, jit_kwargs):
  del jit_kwargs

  def host(a):
    if isinstance(a, jax.Array) and not jax.dtypes.issubdtype(
      a.dtype, jax.dtypes.prng_key
    ):
      return np.asarray(a)
    return a

  return _map_arrays(host, args)


def _column_major(args, jit_kwargs):
  """Gives the first 2-D array argument a column-major ``Format``, commits
  the others."""
  del jit_kwargs
  done = []

  def fmt(a):
    if not isinstance(a, jax.Array) or a.ndim != 2:
      return a
    if done:  # committed like the first, default layout
      return jax.device_put(a, a.sharding)
    done.append(a)
    return jax.device_put(a, Format(Layout(major_to_minor=(1, 0)), a.sharding))

  return _map_arrays(fmt, args)


def _row_major(args, jit_kwargs):
  """Commits every 2-D array argument, its layout left the default."""
  del jit_kwargs

  def fmt(a):
    if not isinstance(a, jax.Array) or a.ndim != 2:
      return a
    return jax.device_put(a, a.sharding)

  return _map_arrays(fmt, args)


def _sharded(devs_fn):
  def prep(args, jit_kwargs):
    mesh = _mesh(devs_fn())

    def put(a):
      if not isinstance(a, jax.Array) or a.ndim == 0:
        return a
      if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        return a
      spec = P("i") if a.shape[0] % mesh.size == 0 else P()
      return jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))

    return tuple(
      _map_arrays(put, a) if i in _dynamic(args, jit_kwargs) else a
      for i, a in enumerate(args)
    )

  return prep


def _sds(args, jit_kwargs):
  def spec(a):
    return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)

  return tuple(
    _map_arrays(spec, a) if i in _dynamic(args, jit_kwargs) else a
    for i, a in enumerate(args)
  )


def _under_vmap(axis):
  def wrap(g, args):
    """Calls ``g`` with ``axis`` bound by ``vmap`` (arguments not batched)."""
    return jax.vmap(lambda: g(*args), axis_size=2, axis_name=axis)()

  return wrap


def _under_outer_jit(g, args):
  """Calls ``g`` under an outer stock ``jax.jit`` trace."""
  return jax.jit(lambda: g(*args))()


def _under_shard_map(axis):
  def wrap(g, args):
    mesh = _mesh(_devices(), (axis,))

    def body():
      return jax.tree.map(lambda o: o[None], g(*args))

    return jax.shard_map(
      body, mesh=mesh, in_specs=(), out_specs=P(axis), check_vma=False
    )()

  return wrap


def _nearby_device():
  return lambda: jax.default_device(_devices()[5])


def _first_device():
  return lambda: jax.default_device(_devices()[0])


# Alternative values of trace-context options that are not booleans.
_ALTERNATIVES = {
  "jax_random_seed_offset": 7,
  "jax_optimization_level": "O1",
  "jax_memory_fitting_level": "O1",
  "jax_embedded_constants_max_bytes": 0,
  "jax_pgle_profiling_runs": 1,
  "jax_explicit_x64_dtypes": "allow",
  "jax_numpy_dtype_promotion": "strict",
  "jax_error_checking_behavior_nan": "raise",
  "jax_error_checking_behavior_divide": "raise",
  "jax_error_checking_behavior_oob": "raise",
  "jax_numpy_rank_promotion": "raise",
  "jax_default_matmul_precision": "bfloat16",
  "jax_xla_profile_version": 1,
  "jax_hlo_source_file_canonicalization_regex": ".*",
}

# Trace-context entries that are not flags: each is covered by a dimension
# below (or cannot be set on a CPU host), with the reason.
NON_FLAG_CONTEXT = {
  "mesh_context_manager": "dimension with_mesh_*",
  "abstract_mesh_context_manager": "dimension abstract_mesh",
  "compute_on_context_manager": "compute_on needs a host/device split: "
  "not on a CPU-only host",
  "xla_metadata_context_manager": "dimension xla_metadata",
  "pallas_tpu_interpret_mode_context_manager": "Pallas TPU only",
  "user_context": "dimension user_context",
  "axis_env_state": "dimensions axis_vmap, axis_shard_map",
  "jax_default_device": "dimension default_device (and cfg: below)",
  "concrete mesh (jax.set_mesh)": "dimensions set_mesh_*",
}

# Flags whose alternative value cannot run a program here.
SKIPPED_FLAGS = {
  "jax_use_emit_pipeline_primitive": "Pallas TPU pipelines only",
  "jax_pallas_use_mosaic_gpu": "Pallas GPU only",
  "jax_ragged_dot_use_gpu_pallas_triton_lowering": "GPU lowering only",
  "jax_threefry_gpu_kernel_lowering": "GPU lowering only",
}


def trace_context_flags() -> list[tuple[str, Any]]:
  """Every flag in JAX's trace context, with an alternative value."""
  out = []
  for name in ji.trace_context_names():
    if name in NON_FLAG_CONTEXT or name in SKIPPED_FLAGS:
      continue
    if name in _ALTERNATIVES:
      out.append((name, _ALTERNATIVES[name]))
      continue
    value = getattr(jax.config, name)
    if not isinstance(value, bool):
      raise AssertionError(
        f"trace-context option {name}={value!r} has no alternative value in "
        "ambient_harness._ALTERNATIVES: add one (or a reason to skip it)"
      )
    out.append((name, not value))
  return out


USER = jax.make_user_context(default_value=None)


def dimensions() -> dict[str, Dimension]:
  """Every dimension, by name."""
  devs = _devices
  first4 = lambda: devs()[:4]
  last4 = lambda: devs()[4:]
  rev4 = lambda: devs()[:4][::-1]
  all8 = lambda: devs()
  perm8 = lambda: [devs()[i] for i in (1, 0, 3, 2, 5, 4, 7, 6)]
  dims = [
    Dimension(
      "set_mesh_other_devices",
      (
        State("set_mesh(first4)", _set_mesh(first4)),
        State("set_mesh(last4)", _set_mesh(last4)),
      ),
    ),
    Dimension(
      "set_mesh_permuted",
      (
        State("set_mesh(first4)", _set_mesh(first4)),
        State("set_mesh(first4 reversed)", _set_mesh(rev4)),
      ),
    ),
    Dimension(
      "set_mesh_2d",
      (
        State("set_mesh(2x4 i,k)", _set_mesh(all8, ("i", "k"), (2, 4))),
        State(
          "set_mesh(2x4 i,k permuted)", _set_mesh(perm8, ("i", "k"), (2, 4))
        ),
      ),
    ),
    Dimension(
      "set_mesh_vs_none",
      (
        State("no mesh"),
        State("set_mesh(all8)", _set_mesh(all8)),
      ),
    ),
    Dimension(
      "with_mesh_permuted",
      (
        State("with mesh(all8)", _with_mesh(all8)),
        State("with mesh(all8 permuted)", _with_mesh(perm8)),
      ),
    ),
    Dimension(
      "abstract_mesh",
      (
        State("no mesh"),
        State("use_abstract_mesh(8 i)", _abstract_mesh((8,), ("i",))),
      ),
      frozenset({"mesh", "axis"}),
    ),
    Dimension(
      "axis_vmap",
      (
        State("j unbound"),
        State("vmap(axis_name=j)", wrap=_under_vmap("j")),
      ),
    ),
    Dimension(
      "axis_vmap_other_name",
      (
        State("vmap(axis_name=k)", wrap=_under_vmap("k")),
        State("vmap(axis_name=j)", wrap=_under_vmap("j")),
      ),
    ),
    Dimension(
      "outer_jit_vs_vmap",
      (
        State("under outer jax.jit", wrap=_under_outer_jit),
        State("vmap(axis_name=j)", wrap=_under_vmap("j")),
      ),
    ),
    Dimension(
      "axis_shard_map",
      (
        State("j unbound"),
        State("shard_map(axis j)", wrap=_under_shard_map("j")),
      ),
    ),
    Dimension(
      "axis_shard_map_other_name",
      (
        State("shard_map(axis k)", wrap=_under_shard_map("k")),
        State("shard_map(axis j)", wrap=_under_shard_map("j")),
      ),
      frozenset({"axis"}),
    ),
    Dimension(
      "debug_nans",
      (
        State("debug_nans off"),
        State("debug_nans on", lambda: jax.debug_nans(True)),
      ),
    ),
    Dimension(
      "debug_infs",
      (
        State("debug_infs off"),
        State("debug_infs on", lambda: jax.debug_infs(True)),
      ),
    ),
    Dimension(
      "transfer_guard",
      (
        State("transfer_guard allow", lambda: jax.transfer_guard("allow")),
        State(
          "transfer_guard disallow", lambda: jax.transfer_guard("disallow")
        ),
      ),
    ),
    Dimension(
      "transfer_guard_numpy",
      (
        State("numpy args, allow", prep=_numpy_args),
        State(
          "numpy args, disallow",
          lambda: jax.transfer_guard("disallow"),
          prep=_numpy_args,
        ),
      ),
    ),
    Dimension(
      "default_device",
      (
        State("default_device(0)", _first_device()),
        State("default_device(5)", _nearby_device()),
      ),
    ),
    Dimension(
      "matmul_precision",
      (
        State(
          "precision highest", lambda: jax.default_matmul_precision("highest")
        ),
        State(
          "precision bfloat16", lambda: jax.default_matmul_precision("bfloat16")
        ),
      ),
      frozenset({"matrix", "linalg", "precision"}),
    ),
    Dimension(
      "layout_column_major",
      (
        State("default layout, committed", prep=_row_major),
        State("column-major Format", prep=_column_major),
        State("default layout, uncommitted"),
      ),
      frozenset({"matrix", "sharded"}),
    ),
    Dimension(
      "committed",
      (
        State("uncommitted"),
        State("committed to device 2", prep=_commit(2)),
      ),
    ),
    Dimension(
      "committed_devices",
      (
        State("committed to device 1", prep=_commit(1)),
        State("committed to device 6", prep=_commit(6)),
      ),
    ),
    Dimension(
      "sharded_args",
      (
        State("sharded over all8", prep=_sharded(all8)),
        State("sharded over all8 permuted", prep=_sharded(perm8)),
      ),
    ),
    Dimension(
      "shape_dtype_struct_args",
      (
        State("array args"),
        State("ShapeDtypeStruct args", prep=_sds),
      ),
    ),
    Dimension(
      "closure_variant",
      (
        State("variant 0", variant=0),
        State("variant 1", variant=1),
      ),
      frozenset({"consts", "ref"}),
    ),
    Dimension(
      "user_context",
      (
        State("user_context None"),
        State("user_context 1", lambda: USER(1)),
      ),
    ),
    Dimension(
      "xla_metadata",
      (
        State("no xla metadata"),
        State("xla_metadata(a=1)", lambda: _xla_metadata()),
      ),
    ),
  ]
  for name, alt in trace_context_flags():
    dims.append(
      Dimension(
        f"cfg:{name}",
        (
          State(f"{name} default"),
          State(f"{name}={alt!r}", (lambda n=name, a=alt: _config(n, a))),
        ),
      )
    )
  return {d.name: d for d in dims}


def _xla_metadata():
  from jax.experimental import xla_metadata  # pylint: disable=g-import-not-at-top

  return xla_metadata.set_xla_metadata(a=1)


# ---------------------------------------------------------------- outcomes


def _bits(a: np.ndarray) -> str:
  return np.ascontiguousarray(a).reshape(-1).view(np.uint8).tobytes().hex()


def _leaf_summary(x):
  if isinstance(x, jax.Array):
    dtype = x.dtype
    data = x
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
      data = jax.random.key_data(x)
    host = np.asarray(data)
    shards = tuple((s.device.id, str(s.index)) for s in x.addressable_shards)
    sharding = x.sharding
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    mesh_desc = None
    if mesh is not None:
      mesh_desc = (
        tuple(mesh.axis_names),
        tuple(mesh.devices.shape),
        tuple(d.id for d in mesh.devices.flat),
      )
    try:
      layout = str(x.format.layout)
    except Exception as e:  # pylint: disable=broad-except
      layout = f"<{type(e).__name__}>"
    return (
      "Array",
      str(dtype),
      tuple(x.shape),
      jax.typeof(x).weak_type,
      _bits(host),
      type(sharding).__name__,
      str(spec),
      mesh_desc,
      shards,
      x.committed,
      layout,
    )
  if isinstance(x, np.ndarray):
    return ("ndarray", str(x.dtype), x.shape, _bits(x))
  return ("py", type(x).__name__, repr(x))


def outcome(fn: Callable[[], Any]) -> tuple:
  """Runs ``fn``; its result summarized, or the exception class."""
  corpus.SINK.clear()
  try:
    out = fn()
    jax.block_until_ready(out)
    jax.effects_barrier()
  except Exception as e:  # pylint: disable=broad-except
    try:
      jax.effects_barrier()
    except Exception:  # pylint: disable=broad-except
      pass
    return ("raises", type(e).__module__ + "." + type(e).__qualname__)
  leaves, tree = jax.tree.flatten(out)
  return (
    "ok",
    str(tree),
    tuple(_leaf_summary(l) for l in leaves),
    tuple(corpus.SINK),
  )


def short(o: tuple, limit: int = 300) -> str:
  """One-line rendering of an outcome."""
  if o[0] == "raises":
    return f"raises {o[1]}"
  parts = []
  for leaf in o[2]:
    if leaf[0] == "Array":
      _, dt, shape, weak, hexbits, skind, spec, mesh, shards, comm, lay = leaf
      devs = [d for d, _ in shards]
      parts.append(
        f"{dt}{list(shape)}{' weak' if weak else ''} bits={hexbits[:24]}"
        f" {skind}{spec if spec != 'None' else ''} devs={devs}"
        f"{' mesh=' + str(mesh[2]) if mesh else ''}"
        f" committed={comm} layout={lay}"
      )
    else:
      parts.append(str(leaf))
  text = f"ok {o[1]} [" + "; ".join(parts) + "]"
  if o[3]:
    text += f" callbacks={len(o[3])}"
  return text if len(text) <= limit else text[:limit] + "..."


def diff(a: tuple, b: tuple) -> str:
  """The first field in which two outcomes differ."""
  if a[0] != b[0] or a[0] == "raises":
    return "outcome"
  if a[1] != b[1]:
    return "tree"
  names = (
    "kind",
    "dtype",
    "shape",
    "weak_type",
    "bits",
    "sharding type",
    "spec",
    "mesh devices",
    "shard devices",
    "committed",
    "layout",
  )
  for i, (x, y) in enumerate(zip(a[2], b[2])):
    for name, u, w in zip(names, x, y):
      if u != w:
        return f"leaf {i} {name}"
  return "callbacks"


# ------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Case:
  """A program run under a sequence of states, in one mode."""

  program: str
  dims: tuple  # names of dimensions, joined in each state
  states: tuple  # per step: tuple of State (one per dimension)
  mode: str
  label: str  # e.g. "AB"

  picks: tuple = ()  # per dimension: indices of states A and B

  def key(self) -> str:
    dims = "+".join(
      d if p in ((), (0, 1)) else f"{d}@{p[0]}{p[1]}"
      for d, p in itertools.zip_longest(self.dims, self.picks, fillvalue=())
    )
    return f"{self.program}:{dims}:{self.label}:{self.mode}"


@dataclasses.dataclass
class Mismatch:
  case: Case
  step: int
  stock: tuple
  ours: tuple

  def line(self) -> str:
    state = " & ".join(s.name for s in self.case.states[self.step])
    return (
      f"MISMATCH {self.case.key()} step {self.step} [{state}] "
      f"differs in {diff(self.stock, self.ours)}: stock {short(self.stock)} "
      f"| jaxworks {short(self.ours)}"
    )

  def repro(self) -> str:
    return repro_line(self.case)


def repro_line(case: Case) -> str:
  steps = " -> ".join(
    " & ".join(s.name for s in states) for states in case.states
  )
  return (
    "repro: bazel run //packages/jit_cache:ambient_fuzz -- --case "
    f"'{case.key()}'   # {case.program}, {case.mode} closure(s): {steps}"
  )


def cases_for(
  program: str,
  dims: tuple[str, ...],
  table: dict[str, Dimension] | None = None,
  picks: tuple[tuple[int, int], ...] | None = None,
) -> list[Case]:
  """Both orders x both modes of ``program`` under ``dims`` (states A, B).

  ``picks`` gives, per dimension, the indices of its states A and B
  (default 0 and 1).
  """
  table = table or dimensions()
  picks = picks or tuple((0, 1) for _ in dims)
  a = tuple(table[d].states[i] for d, (i, _) in zip(dims, picks))
  b = tuple(table[d].states[j] for d, (_, j) in zip(dims, picks))
  out = []
  for label, seq in (("AB", (a, b)), ("BA", (b, a))):
    for mode in MODES:
      out.append(Case(program, tuple(dims), seq, mode, label, picks))
  return out


def parse_case(key: str, table: dict[str, Dimension] | None = None) -> Case:
  """Inverse of ``Case.key``."""
  prog = key.split(":")[0]
  # Dimension names may hold ':' (cfg:...): split from the right.
  dims_s, label, mode = key[len(prog) + 1 :].rsplit(":", 2)
  dims, picks = [], []
  for d in dims_s.split("+"):
    name, _, p = d.partition("@")
    dims.append(name)
    picks.append((int(p[0]), int(p[1])) if p else (0, 1))
  for c in cases_for(prog, tuple(dims), table, tuple(picks)):
    if c.label == label and c.mode == mode:
      return c
  raise ValueError(f"no case {key!r}")


@contextlib.contextmanager
def _entered(states) -> Iterator[None]:
  with contextlib.ExitStack() as stack:
    for s in states:
      stack.enter_context(s.enter())
    yield


def _run(case: Case, jit: Callable) -> list[tuple]:
  """The outcome of every step of ``case`` under ``jit``."""
  program = corpus.CORPUS[case.program]
  outcomes = []
  g = None
  for states in case.states:
    variant = sum(s.variant for s in states)

    def step():
      nonlocal g
      inst = program.make(variant)
      if g is None or case.mode == "recreated":
        g = jit(inst.fn, **inst.jit_kwargs)
      args = inst.args()
      for s in states:
        if s.prep is not None:
          args = s.prep(args, inst.jit_kwargs)
      wrap = next((s.wrap for s in states if s.wrap is not None), None)
      if wrap is None:
        return g(*args)
      return wrap(g, args)

    def guarded():
      with _entered(states):
        return outcome(step)

    try:
      outcomes.append(guarded())
    except Exception as e:  # pylint: disable=broad-except
      # Entering the state itself failed: the same for both jits.
      outcomes.append(("raises", "enter:" + type(e).__qualname__))
  return outcomes


def run_case(case: Case, fresh: bool = True) -> list[Mismatch]:
  """Runs ``case`` with stock and jaxworks jit; the steps that differ."""
  if fresh:
    # jaxworks' caches only: stock's are keyed by function object, and the
    # corpus makes new ones.
    jit_cache.clear_caches()
  stock = _run(case, jax.jit)
  ours = _run(case, jit_cache.jit)
  return [
    Mismatch(case, i, s, o)
    for i, (s, o) in enumerate(zip(stock, ours))
    if s != o
  ]


def applicable(program: str, dim: Dimension) -> bool:
  return not dim.tags or bool(dim.tags & corpus.CORPUS[program].tags)


def random_cases(seed: int, n: int, max_dims: int = 3) -> Iterator[Case]:
  """``n`` random cases: a program under 1..max_dims dimensions at once."""
  rng = random.Random(seed)
  table = dimensions()
  names = sorted(table)
  programs = sorted(corpus.CORPUS)
  for _ in range(n):
    prog = rng.choice(programs)
    fits = [d for d in names if applicable(prog, table[d])]
    # One mesh-setting dimension at a time (nested set_mesh conflicts).
    chosen = []
    for d in rng.sample(fits, min(len(fits), rng.randint(1, max_dims))):
      if any(_family(d) == _family(c) for c in chosen):
        continue
      chosen.append(d)
    picks = tuple(
      tuple(rng.sample(range(len(table[d].states)), 2)) for d in chosen
    )
    label = rng.choice(ORDERS)
    mode = rng.choice(MODES)
    for c in cases_for(prog, tuple(chosen), table, picks):
      if c.label == label and c.mode == mode:
        yield c


def _family(dim: str) -> str:
  for fam in (
    "mesh",
    "axis",
    "transfer_guard",
    "committed",
    "sharded",
    "shape_dtype",
    "layout",
    "default_device",
  ):
    if fam in dim:
      return fam
  return dim


def shrink(mismatch: Mismatch) -> Mismatch:
  """The same mismatch with as few dimensions as still show it."""
  case = mismatch.case
  if len(case.dims) == 1:
    return mismatch
  table = dimensions()
  for k in range(1, len(case.dims)):
    for keep in itertools.combinations(range(len(case.dims)), k):
      dims = tuple(case.dims[i] for i in keep)
      picks = tuple(case.picks[i] for i in keep)
      for c in cases_for(case.program, dims, table, picks):
        if c.label != case.label or c.mode != case.mode:
          continue
        found = run_case(c)
        if found:
          return found[0]
  return mismatch
