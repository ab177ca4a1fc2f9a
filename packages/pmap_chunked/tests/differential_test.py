"""Differential test: pmap_chunked.pmap against stock jax.pmap (the devices
present: 8 host devices on the CPU target).

Hypothesis draws a program shape (positional arguments that are arrays,
tuples, lists or dicts of arrays; per-leaf in_axes incl. None and negative
axes, given as one int per argument or as a matching pytree; static
arguments of mixed types at random positions; out_axes incl. None and
negative axes; donation) and then calls ONE jaxworks pmap several times:
with static values that Python calls equal but that have other types
(``1``/``1.0``/``True``/``np.int32(1)``, ``0.0``/``-0.0``, tuples of those)
and with other dtypes (bfloat16, float16, int8, uint8, bool, complex64, weak
Python scalars). Each call is compared with a stock ``jax.pmap`` of a fresh
function (stock keys its cache by the function and compares statics with
``==``, so a fresh one gives stock's answer for that call alone): same
exception class, or same tree, shapes, dtypes, weak types, bits, per-device
layout and deletion of donated inputs; and ``lower`` gives stock's output
dtypes and shapes. Stock 0.10.2 mis-handles negative in_axes/out_axes, so
stock gets the same axes made non-negative.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from hypothesis import HealthCheck
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from jaxworks.pmap_chunked import pmap

DTYPES = [
  jnp.bfloat16,
  np.float32,
  np.int8,
  np.float16,
  np.int32,
  np.uint8,
  np.bool_,
  np.complex64,
]
# Python scalars (weakly typed) broadcast to every device.
WEAK = [1.5, -2, True, 0.25 + 1j]

# Static values, and values Python calls equal to each of them.
STATICS = [
  (1, 2.0),
  1,
  -0.0,
  1.0,
  True,
  np.int32(1),
  np.float32(1.0),
  0.0,
  2,
  2.0,
  np.int8(2),
  np.float16(2),
  (1.0, 2),
  (True, 2),
  "tag",
  ("tag", 0.5),
  frozenset({2, 0.5}),
  frozenset({2.0, 0.5}),
]


def _variants(value):
  """The static values == `value` (other types or signs; itself too)."""
  return [v for v in STATICS if _equal(v, value)] or [value]


def _equal(a, b):
  try:
    return bool(a == b)
  except (TypeError, ValueError):
    return False


def _numbers(value):
  """The numbers in a static value (tuples and frozensets flattened)."""
  if isinstance(value, (tuple, frozenset)):
    return [n for v in sorted(value, key=repr) for n in _numbers(v)]
  if isinstance(value, (bool, int, float, complex, np.generic)):
    return [value]
  return []


@st.composite
def leaf_kinds(draw, n):
  """(kind, rank, in_axis, shape) of one dynamic leaf."""
  kind = draw(st.sampled_from(["mapped", "weak", "mapped", "broadcast"]))
  if kind == "weak":
    return ("weak", 0, None, ())
  if kind == "broadcast":
    shape = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    return ("broadcast", len(shape), None, shape)
  rank = draw(st.integers(1, 3))
  shape = [draw(st.integers(1, 3)) for _ in range(rank - 1)]
  pos = draw(st.integers(0, rank - 1))
  shape.insert(pos, n)
  axis = draw(st.sampled_from([pos, pos - rank]))
  return ("mapped", rank, axis, tuple(shape))


@st.composite
def programs(draw):
  # Mapped sizes of at most the devices present (8 host devices on the CPU
  # target; one TPU chip).
  n = draw(
    st.sampled_from([k for k in (8, 4, 2, 1) if k <= jax.device_count()])
  )
  nargs = draw(st.integers(1, 3))
  args = []  # per dynamic argument: (container, leaves)
  for _ in range(nargs):
    container = draw(st.sampled_from(["tuple", "leaf", "dict", "list", "leaf"]))
    count = 1 if container == "leaf" else draw(st.integers(1, 2))
    args.append((container, [draw(leaf_kinds(n)) for _ in range(count)]))
  if not any(k == "mapped" for _, leaves in args for k, *_ in leaves):
    args[0] = ("leaf", [("mapped", 1, 0, (n,))])
  # Per argument: one int/None for all its leaves when they agree (and by
  # choice), else a pytree of per-leaf axes shaped like the argument.
  entries = []
  for container, leaves in args:
    axes = [ax for _, _, ax, _ in leaves]
    one = (container == "leaf" or len(set(axes)) == 1) and draw(st.booleans())
    entries.append(("one" if one else "tree", axes))
  nstatic = draw(st.sampled_from([1, 2, 0]))
  positions = sorted(
    draw(
      st.lists(
        st.integers(0, nargs + nstatic - 1),
        min_size=nstatic,
        max_size=nstatic,
        unique=True,
      )
    )
  )
  statics = [draw(st.sampled_from(STATICS)) for _ in positions]
  outs = []
  for kind, rank, _, _ in (l for _, leaves in args for l in leaves):
    per_device_rank = rank - 1 if kind == "mapped" else rank
    choices = list(range(-(per_device_rank + 1), per_device_rank + 1))
    if kind != "mapped":
      choices.append(None)  # the same on every device
    outs.append(draw(st.sampled_from(choices)))
  reduced_axis = draw(st.sampled_from([None, 0, -1]))
  donate = draw(st.sampled_from(list(range(nargs)) + [None]))
  placement = draw(st.sampled_from(["sharded", "numpy", "default"]))
  calls = draw(st.integers(2, 3))
  later = []
  for _ in range(calls - 1):
    later.append(
      (
        [draw(st.sampled_from(_variants(v))) for v in statics],
        draw(st.integers(0, 2**16)),
      )
    )
  return dict(
    n=n,
    args=args,
    entries=entries,
    positions=positions,
    statics=statics,
    outs=outs,
    reduced_axis=reduced_axis,
    donate=donate,
    placement=placement,
    later=later,
    seed=draw(st.integers(0, 2**16)),
    top_int=draw(st.booleans()),
  )


def _value(kind, shape, dtype, rng):
  if kind == "weak":
    return WEAK[rng.randint(len(WEAK))]
  data = np.asarray(rng.randn(*shape) * 3)
  if dtype == np.complex64:
    data = data + 1j * np.asarray(rng.randn(*shape))
  return data.astype(dtype)


def _arguments(prog, seed, statics):
  """Fresh positional arguments (statics at their positions) for one call."""
  rng = np.random.RandomState(seed)
  dyn = []
  for container, leaves in prog["args"]:
    vals = [
      _value(k, shape, DTYPES[rng.randint(len(DTYPES))], rng)
      for k, _, _, shape in leaves
    ]
    vals = [_place(v, k, ax, prog) for v, (k, _, ax, _) in zip(vals, leaves)]
    if container == "leaf":
      dyn.append(vals[0])
    elif container == "tuple":
      dyn.append(tuple(vals))
    elif container == "list":
      dyn.append(list(vals))
    else:
      dyn.append({f"k{i}": v for i, v in enumerate(vals)})
  args, it = [], iter(dyn)
  static_at = dict(zip(prog["positions"], statics))
  for i in range(len(dyn) + len(static_at)):
    args.append(static_at[i] if i in static_at else next(it))
  return args


def _place(value, kind, axis, prog):
  if kind == "weak" or prog["placement"] == "numpy":
    return value
  if prog["placement"] == "default" or kind != "mapped":
    return jnp.asarray(value)
  n = prog["n"]
  mesh = Mesh(np.array(jax.devices()[:n]), ("d",), axis_types=(AxisType.Auto,))
  spec = [None] * value.ndim
  spec[axis % value.ndim] = "d"
  return jax.device_put(value, NamedSharding(mesh, P(*spec)))


def _axes(prog, positive):
  """in_axes (tuple per positional argument, statics included) and
  out_axes; `positive` makes negative axes non-negative (for stock)."""

  def fix(ax, rank):
    return ax % rank if positive and ax is not None and ax < 0 else ax

  per_arg = []
  for (container, leaves), (how, axes) in zip(prog["args"], prog["entries"]):
    axes = [fix(ax, rank) for ax, (_, rank, _, _) in zip(axes, leaves)]
    if how == "one" and len(set(axes)) == 1:
      per_arg.append(axes[0])
    elif container == "leaf":
      per_arg.append(axes[0])
    elif container == "tuple":
      per_arg.append(tuple(axes))
    elif container == "list":
      per_arg.append(list(axes))
    else:
      per_arg.append({f"k{i}": a for i, a in enumerate(axes)})
  in_axes, it = [], iter(per_arg)
  for i in range(len(per_arg) + len(prog["positions"])):
    in_axes.append(None if i in prog["positions"] else next(it))
  in_axes = tuple(in_axes)
  if (
    prog["top_int"]
    and not prog["positions"]
    and len({repr(a) for a in in_axes}) == 1
    and isinstance(in_axes[0], int)
  ):
    in_axes = in_axes[0]
  leaves = [l for _, ls in prog["args"] for l in ls]
  outs = []
  for ax, (kind, rank, _, _) in zip(prog["outs"], leaves):
    out_rank = rank if kind == "mapped" else rank + 1
    outs.append(fix(ax, out_rank))
  return in_axes, (tuple(outs), fix(prog["reduced_axis"], 1))


def _function(prog):
  positions = prog["positions"]

  def fun(*args):
    ks = [k for i in positions for k in _numbers(args[i])]
    dyn = [a for i, a in enumerate(args) if i not in positions]
    leaves = [jnp.asarray(leaf) for leaf in jax.tree_util.tree_leaves(dyn)]
    # Rank-0 leaves (weak Python scalars, 0-d arrays) scale the others, so
    # weak and strong types meet low-precision ones (bf16 * 2.0 is bf16).
    scale = [y for y in leaves if y.ndim == 0]
    outs = []
    for y in leaves:
      for k in ks:
        y = y * k
      if y.ndim:
        for z in scale:
          y = y * z
      outs.append(y)
    total = sum(jnp.real(y).astype(jnp.float32).sum() for y in outs)
    return tuple(outs), jax.lax.psum(total, "i")

  return fun


def _layout(a):
  return sorted(
    (s.device.id, tuple((x.start, x.stop) for x in s.index))
    for s in a.addressable_shards
  )


def _compare(ours, stock):
  assert jax.tree_util.tree_structure(ours) == jax.tree_util.tree_structure(
    stock
  )
  for a, b in zip(
    jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(stock)
  ):
    assert (a.shape, a.dtype, a.weak_type) == (b.shape, b.dtype, b.weak_type)
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert _layout(a) == _layout(b)


def _run(fn, args):
  try:
    return fn(*args), None
  except Exception as e:  # noqa: BLE001  (the class is compared below)
    return None, e


def _deleted(args):
  return [
    x.is_deleted()
    for x in jax.tree_util.tree_leaves(args)
    if isinstance(x, jax.Array)
  ]


# Bounded and derandomized for CI; PMAP_DIFF_EXAMPLES=200 PMAP_DIFF_RANDOM=1
# runs a longer random search locally.
@settings(
  max_examples=int(os.environ.get("PMAP_DIFF_EXAMPLES", "16")),
  derandomize=not os.environ.get("PMAP_DIFF_RANDOM"),
  deadline=None,
  database=None,
  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(programs())
def test_matches_stock_pmap(prog):
  fun = _function(prog)
  kw = dict(
    axis_name="i",
    static_broadcasted_argnums=prog["positions"],
    donate_argnums=() if prog["donate"] is None else _donated(prog),
  )
  in_ours, out_ours = _axes(prog, positive=False)
  in_stock, out_stock = _axes(prog, positive=True)
  ours = pmap(fun, in_axes=in_ours, out_axes=out_ours, **kw)
  calls = [(prog["statics"], prog["seed"])] + prog["later"]
  for statics, seed in calls:
    args_ours = _arguments(prog, seed, statics)
    args_stock = _arguments(prog, seed, statics)
    fresh = lambda *a: fun(*a)  # noqa: E731
    stock_fn = jax.pmap(fresh, in_axes=in_stock, out_axes=out_stock, **kw)
    got, err = _run(ours, args_ours)
    want, stock_err = _run(stock_fn, args_stock)
    if stock_err is not None:
      assert err is not None, f"stock raised {stock_err!r}, jaxworks did not"
      assert isinstance(err, type(stock_err)), (err, stock_err)
      continue
    assert err is None, f"jaxworks raised {err!r}, stock returned"
    _compare(got, want)
    assert _deleted(args_ours) == _deleted(args_stock)
    # The lowered stage has the call's (and stock's) output dtypes.
    lowered = ours.lower(*_arguments(prog, seed, statics)).out_info
    stock_lowered = stock_fn.lower(*_arguments(prog, seed, statics)).out_info
    assert (
      [(o.shape, o.dtype) for o in jax.tree_util.tree_leaves(lowered)]
      == [(o.shape, o.dtype) for o in jax.tree_util.tree_leaves(want)]
      == [(o.shape, o.dtype) for o in jax.tree_util.tree_leaves(stock_lowered)]
    )


def _donated(prog):
  dyn_positions = [
    i
    for i in range(len(prog["args"]) + len(prog["positions"]))
    if i not in prog["positions"]
  ]
  return (dyn_positions[prog["donate"]],)
