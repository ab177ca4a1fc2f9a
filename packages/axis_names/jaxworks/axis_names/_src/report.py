"""collective_report: which collectives run over which axes, how often, how much.

``check.walk_nodes`` yields each collective with its axis sizes and static trip
count; ``bytes_moved`` is the per-device estimate (see ``collective_report``).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Mapping
import dataclasses
import math
from typing import Any

from jax.extend.core import ClosedJaxpr
from jax.extend.core import Jaxpr
from jax.extend.core import JaxprEqn

from . import check
from . import tracing
from .errors import AxisNameError

_API = "jaxworks.axis_names.collective_report"

_ALL_REDUCE = frozenset(
  "psum pmax pmin psum_invariant unreduced_psum psum_start"
  " psum_invariant_start unreduced_psum_start".split()
)
_GATHER = frozenset(
  "all_gather all_gather_invariant all_gather_reduced all_gather_start"
  " all_gather_reduced_start".split()
)
_SCATTER = frozenset(
  "reduce_scatter unreduced_reduce_scatter all_to_all ragged_all_to_all"
  " reduce_scatter_start unreduced_reduce_scatter_start all_to_all_start".split()
)
_POINT = frozenset(("pbroadcast", "pbroadcast_start", "psend"))


def _nbytes(avals) -> int:
  total = 0
  for a in avals:
    shape = getattr(a, "shape", None)
    itemsize = getattr(getattr(a, "dtype", None), "itemsize", None)
    if shape is not None and itemsize is not None:
      total += math.prod(shape) * itemsize
  return total


def bytes_moved(eqn: JaxprEqn, n: int) -> float:
  """Estimated bytes one device sends for one execution of ``eqn``.

  ``n`` is the product of the collective's axis sizes; with
  ``axis_index_groups`` the collective runs within groups of their size.
  """
  prim = eqn.primitive.name
  groups = eqn.params.get("axis_index_groups")
  if groups:
    n = len(groups[0])
  # ragged_all_to_all's other operands are the output buffer and offsets.
  operands = eqn.invars[:1] if prim == "ragged_all_to_all" else eqn.invars
  b_in = _nbytes(v.aval for v in operands)
  if n <= 1:
    return 0.0
  if prim in _ALL_REDUCE:
    return 2.0 * (n - 1) / n * b_in
  if prim in _GATHER:
    return float((n - 1) * b_in)
  if prim in _SCATTER:
    return (n - 1) / n * b_in
  if prim in ("ppermute", "ppermute_start"):
    pairs = len(eqn.params.get("perm", ()))
    return b_in * pairs / n
  if prim in _POINT:
    return float(b_in)
  if prim == "precv":
    return float(_nbytes(v.aval for v in eqn.outvars))
  return 0.0


@dataclasses.dataclass(frozen=True)
class CollectiveStat:
  """One (axes, primitive) row of a CollectiveReport.

  Attributes:
    axes: the axis names the collective runs over, in order.
    primitive: the primitive name, e.g. ``"psum"``.
    count: executions per call (static trip counts; see
      ``collective_report``).
    bytes_per_call: estimated bytes sent per device per call, all executions.
    sources: distinct ``file:line`` of the user code, in program order.
  """

  axes: tuple
  primitive: str
  count: int
  bytes_per_call: float
  sources: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class CollectiveReport:
  """Per axis name, the collectives a function runs.

  Attributes:
    rows: one ``CollectiveStat`` per (axes, primitive), sorted.
    axis_sizes: the size used for every axis name that appears.
  """

  rows: tuple[CollectiveStat, ...]
  axis_sizes: Mapping[Hashable, int]

  @property
  def axis_names(self) -> tuple:
    """Every axis name some collective in the report uses."""
    return tuple(dict.fromkeys(a for r in self.rows for a in r.axes))

  def by_axis(self, name: Hashable) -> tuple[CollectiveStat, ...]:
    """Rows whose collective runs over ``name`` (alone or with others)."""
    return tuple(r for r in self.rows if name in r.axes)

  @property
  def total_bytes(self) -> float:
    """Estimated bytes sent per device per call, over all collectives."""
    return sum(r.bytes_per_call for r in self.rows)

  def __str__(self) -> str:
    header = ("axes", "primitive", "count", "bytes/call", "sources")
    body = [
      (
        ",".join(map(str, r.axes)),
        r.primitive,
        str(r.count),
        _fmt_bytes(r.bytes_per_call),
        " ".join(r.sources) or "-",
      )
      for r in self.rows
    ]
    if not body:
      return "no collectives"
    widths = [
      max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(header)
    ]

    def line(cells):
      return "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()

    out = [line(header), line(["-" * w for w in widths])]
    out += [line(row) for row in body]
    return "\n".join(out)


def _fmt_bytes(b: float) -> str:
  return str(int(b)) if b == int(b) else f"{b:.1f}"


def _short(loc: str | None) -> str | None:
  if loc is None:
    return None
  path = loc.split(" (")[0]
  file_name, _, line = path.rpartition(":")
  return f"{file_name.rsplit('/', 1)[-1]}:{line}"


def collective_report(
  fun: Callable | ClosedJaxpr | Jaxpr,
  *args: Any,
  axis_sizes: Mapping[Hashable, int] | None = None,
  **kwargs: Any,
) -> CollectiveReport:
  """Collectives of ``fun`` per axis name: count, bytes per call, sources.

  Counts follow static trip counts: a ``scan`` body counts ``length`` times,
  a ``while`` body once (its trip count is dynamic), every ``cond`` branch
  counts (an upper bound). Collectives under binders count too
  (``jit(shard_map(...))``, ``pmap``), with the binder's sizes. Bytes are
  per device per call, for the usual ring/direct algorithms, with ``n`` the
  product of the collective's axis sizes (the group size with
  ``axis_index_groups``) and ``B`` the per-device operand bytes: all-reduce
  (``psum``, ``pmax``, ``pmin``) ``2(n-1)/n B``, ``all_gather`` ``(n-1) B``,
  reduce-scatter and ``all_to_all`` ``(n-1)/n B``, ``ppermute``
  ``B * pairs / n`` (each sending device sends ``B``, averaged over all
  ``n``), ``pbroadcast``, ``psend``/``precv`` ``B``, ``axis_index``,
  ``pvary`` and casts 0.

  Args:
    fun: a function (traced with ``jax.make_jaxpr``), or a Jaxpr/ClosedJaxpr.
    *args: example arguments (arrays or ``jax.ShapeDtypeStruct``).
    axis_sizes: ``{name: size}`` for every free axis name ``fun`` uses
      (names bound inside ``fun`` by ``shard_map`` take their mesh sizes).
    **kwargs: keyword arguments for ``fun``.

  Returns:
    A ``CollectiveReport``; ``str()`` of it is a readable table.

  Raises:
    AxisNameError: a free axis name has no size in ``axis_sizes``.

  >>> import jax, jax.numpy as jnp
  >>> def step(x):
  ...   x = jax.lax.psum(x, 'i')
  ...   return jax.lax.all_gather(x, 'i')
  >>> r = collective_report(step, jnp.ones(4), axis_sizes={'i': 8})
  >>> [(s.primitive, s.count, s.bytes_per_call) for s in r.by_axis('i')]
  [('all_gather', 1, 112.0), ('psum', 1, 28.0)]
  """
  sizes = tracing.check_axis_sizes(axis_sizes, _API)
  try:
    jaxpr, from_tracing = check.traced_jaxpr(
      fun, args, kwargs, sizes, _API, "pass its size in axis_sizes"
    )
  except AxisNameError:
    raise
  except Exception as e:  # noqa: BLE001 - re-raised unless a name caused it
    check.raise_if_unbound(e, fun, args, kwargs, sizes, _API)
    raise
  nodes = check.walk_nodes(jaxpr, sizes)  # one walk for the check and counts
  problems = [
    p
    for p in check.all_problems(jaxpr, sizes, from_tracing, nodes)
    if p[4].startswith("unbound")
  ]
  if problems:
    raise check.problems_error(problems, _API) from None
  acc: dict[tuple, list] = {}
  used_sizes: dict = {}
  for env, entries, mult in nodes:
    for eqn, _, names, _, _, _ in entries:
      if not names:
        continue
      used_sizes.update((a, env.get(a)) for a in names)
      n = math.prod(env.get(a) or 1 for a in names)
      key = (names, eqn.primitive.name)
      entry = acc.setdefault(key, [0, 0.0, {}])
      entry[0] += mult
      entry[1] += mult * bytes_moved(eqn, n)
      src = _short(check.location(eqn))
      if src is not None:
        entry[2].setdefault(src, None)
  rows = tuple(
    CollectiveStat(axes, prim, count, nbytes, tuple(sources))
    for (axes, prim), (count, nbytes, sources) in sorted(
      acc.items(), key=lambda kv: (repr(kv[0][0]), kv[0][1])
    )
  )
  return CollectiveReport(rows=rows, axis_sizes=used_sizes)
