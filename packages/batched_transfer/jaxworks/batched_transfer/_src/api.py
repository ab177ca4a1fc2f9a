"""Public API: device_put, plan and place_for.

>>> import jax, numpy as np
>>> from jaxworks import batched_transfer as bt
>>> tree = {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float32)}
>>> out = bt.device_put(tree, jax.devices()[1])
>>> sorted((k, str(v.devices())) for k, v in out.items())
[('b', '{CpuDevice(id=1)}'), ('w', '{CpuDevice(id=1)}')]
"""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from . import grouping
from . import jax_internals
from . import plan as plan_lib
from . import targets
from . import transfer

# Stock JAX callables bound at import (the drop-in contract: never looked up
# on ``jax`` at call time).
_typeof = jax.typeof

_API = "jaxworks.batched_transfer"

# JAX's filtered tracebacks hide this package's frames as they hide JAX's:
# an error about the user's input ends at the user's call.
jax_internals.hide_frames_of(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
_Compiled = jax.stages.Compiled


def _prepare(
  api: str, tree: Any, target: Any, src: Any, donate: Any, may_alias: Any
):
  req = targets.resolve(api, tree, target, src, donate, may_alias)
  groups = grouping.group_leaves(req.leaves, req.dsts, req.default_dst)
  return req, transfer.classify(req, groups)


@jax_internals.api_boundary
def device_put(
  x: Any,
  device: Any = None,
  *,
  src: Any = None,
  donate: Any = False,
  may_alias: Any = None,
) -> Any:
  """Places a pytree on devices with one batched call per group of leaves.

  Same signature and contract as ``jax.device_put``: the tree is flattened
  once, its leaves are grouped in C++ by (source devices, destination devices,
  source memory kind, destination memory kind, kind of leaf), and each group
  moves in one batched call. Results come back in the original structure and
  equal jax.device_put's; bad arguments raise the exception classes
  jax.device_put raises, with messages that name this API and the fix.

  Args:
    x: a pytree of numpy arrays, jax.Arrays and scalars.
    device: None (leave device arrays where they are, send host values to the
      default device, uncommitted), a jax.Device, a jax.sharding.Sharding, a
      jax.experimental.layout.Format (sharding and layout), or a pytree prefix
      of these. PartitionSpec and jax.memory.Space targets are handed to
      stock jax.device_put.
    src: like jax.device_put's ``src``: the placement the leaves come from; only
      used while tracing (then the whole call is stock jax.device_put).
    donate: bool or pytree prefix of bools: inputs may be consumed (read by
      truth value, as in stock).
    may_alias: None, bool or pytree prefix of them: whether a result may share
      its input's buffer (None: True unless donated).

  Returns:
    The tree with every leaf placed.

  Raises:
    ValueError: a ``device`` that is not one of the accepted kinds or not a
      prefix of the tree (followed by jax.device_put's own words), a shape
      the sharding cannot split (jax's IndivisibleError, a ValueError
      subclass, or a plain ValueError where Explicit mesh axes leave it
      indivisible, as in stock; the error names the leaf's tree path), or
      donate together with may_alias.
    TypeError: a leaf JAX cannot hold (a big-endian or non-numeric numpy
      array, float128, complex256, datetime64, a string, an object array),
      as jax.device_put.

  Where a call has several bad inputs, the error is the one jax.device_put
  reports first.

  >>> import jax, numpy as np
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> mesh = jax.make_mesh((8,), ("x",))
  >>> ys = device_put([np.arange(8.0), 3],
  ...                 [NamedSharding(mesh, P("x")), NamedSharding(mesh, P())])
  >>> [y.sharding.spec for y in ys], ys[0].dtype, ys[1].weak_type
  ([P('x',), P()], dtype('float32'), True)
  """
  return place(
    x, device, src=src, donate=donate, may_alias=may_alias, as_stock=True
  )


def place(
  tree: Any,
  target: Any = None,
  *,
  src: Any = None,
  donate: Any = False,
  may_alias: Any = None,
  restored: bool = False,
  api: str = f"{_API}.device_put",
  as_stock: bool = False,
) -> Any:
  """device_put, plus ``restored``: the numpy leaves are restore's reads
  (``transfer.execute``: buffers a device may take over, but never two
  devices one; equal on every process, not compared again).
  ``as_stock``: Format targets under a context mesh are jax.device_put's
  (the public entry point), else placed on the given devices whatever the
  context mesh."""
  stock = jax_internals.stock_device_put
  if not jax_internals.trace_state_clean():
    return stock(tree, target, src=src, donate=donate, may_alias=may_alias)
  req = None
  try:
    try:
      req, batches = _prepare(api, tree, target, src, donate, may_alias)
    except targets.Delegate:
      err = transfer.deleted_to_space_error(api, tree, target)
      if err is not None:
        raise err from None
      return stock(tree, target, src=src, donate=donate, may_alias=may_alias)
    except targets.PlacementError as err:
      _raise_for_a_bad_leaf(api, tree)
      # jax.device_put checks its arguments before it moves anything: its own words (which
      # code may match, e.g. "Mismatch details") follow this package's message.
      try:
        return stock(tree, target, src=src, donate=donate, may_alias=may_alias)
      except ValueError as stock_err:
        raise targets.PlacementError(
          f"{err}. jax.device_put says: {stock_err}"
        ) from None
    if not req.leaves:
      return tree
    if req.deleted:
      _raise_for_a_bad_leaf(api, tree)
      raise transfer.deleted_error(req)
    if as_stock and req.formats and targets.jit_context_mesh():
      # jax.device_put places Format targets through a jit, which checks
      # every device it sees against the context mesh (and raises
      # ValueError where they differ): the whole call is stock's.
      return stock(tree, target, src=src, donate=donate, may_alias=may_alias)
    out = transfer.execute(req, batches, restored=restored)
  except (ValueError, TypeError, AssertionError, jax.errors.JaxRuntimeError):
    # Report what jax.device_put would report first: a bad leaf, then the first leaf (in
    # tree order) its sharding cannot hold. Groups are placed in another order. (A
    # runtime error from a leaf of a type JAX does not hold is its TypeError.)
    _raise_for_a_bad_leaf(api, tree)
    if req is not None:
      transfer.check_placements_in_order(req)
    raise
  return req.treedef.unflatten(out)


def _raise_for_a_bad_leaf(api: str, tree: Any) -> None:
  """Raises what jax.device_put raises for the first leaf JAX cannot hold, if any.

  jax.device_put checks every leaf before its other arguments, so where a call
  has both a bad leaf and a bad target (or flag, or shape), the leaf's error
  (a TypeError) is the one raised. Only run once something failed.
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  for path, leaf in flat:
    where = jax.tree_util.keystr(path) or "<root>"
    if isinstance(leaf, np.ndarray) and not leaf.dtype.isnative:
      raise transfer.byte_order_error(api, where, leaf.dtype)
    try:
      _typeof(leaf)
    except (TypeError, ValueError, OverflowError) as err:
      raise type(err)(f"{api}: the leaf at {where}: {err}") from err


@jax_internals.api_boundary
def plan(
  tree: Any, target: Any = None, *, donate: Any = False, may_alias: Any = None
) -> plan_lib.TransferPlan:
  """What ``device_put(tree, target)`` would do, without moving anything.

  Args:
    tree: the pytree to place.
    target: as for ``device_put``.
    donate: as for ``device_put``.
    may_alias: as for ``device_put``.

  Returns:
    A TransferPlan: the groups in order with their route, source and
    destination devices, memory kinds, bytes, zero-copy and relayout counts,
    and the tree paths of their leaves. str() gives a table.

  >>> import jax, numpy as np
  >>> x = jax.device_put(np.zeros(4, np.float32), jax.devices()[0])
  >>> p = plan({"a": np.ones(4, np.float32), "b": x}, jax.devices()[0])
  >>> print(p)
  TransferPlan: 2 leaves in 2 groups, 32 B; 1 copied, 1 zero-copy
    #  kind       route             leaves  bytes  zero-copy  relayout  from -> to
    0  numpy      host->device           1   16 B          0         0  host -> [0] device
    1  jax.Array  already in place       1   16 B          1         0  [0] device -> [0] device
  """
  try:
    req, batches = _prepare(
      f"{_API}.plan", tree, target, None, donate, may_alias
    )
  except targets.Delegate:
    raise ValueError(
      f"{_API}.plan: PartitionSpec and jax.memory.Space targets depend on the mesh context "
      f"and are placed by jax.device_put; pass a Sharding instead, got {target!r}"
    ) from None
  if req.deleted:  # what device_put raises for it
    raise transfer.deleted_error(req)
  return plan_lib.build_plan(req, batches)


def _leaf_shape_dtype(x: Any) -> tuple[tuple[int, ...], Any]:
  if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)):
    return tuple(x.shape), x.dtype
  return tuple(np.shape(x)), jax.dtypes.canonicalize_dtype(np.result_type(x))


def check_against(api: str, tree: Any, expected: Any, what: str) -> None:
  """Checks tree structure, shapes and dtypes of ``tree`` against ``expected``
  (a tree of objects with .shape and .dtype); errors name the tree path."""
  got_paths = targets.tree_paths(tree)
  want_flat, _ = jax.tree_util.tree_flatten_with_path(expected)
  want_paths = [jax.tree_util.keystr(p) or "<root>" for p, _ in want_flat]
  if got_paths != want_paths:
    missing = [p for p in want_paths if p not in set(got_paths)]
    extra = [p for p in got_paths if p not in set(want_paths)]
    detail = [
      f"{word} {', '.join(items[:5])}" + (" ..." if len(items) > 5 else "")
      for word, items in (("missing", missing), ("unexpected", extra))
      if items
    ] or ["the same paths in a different container structure"]
    raise ValueError(
      f"{api}: the tree does not match {what}: {'; '.join(detail)}. Expected structure "
      f"{jax.tree_util.tree_structure(expected)}, got {jax.tree_util.tree_structure(tree)}"
    )
  for path, x, (_, want) in zip(
    got_paths, jax.tree_util.tree_leaves(tree), want_flat
  ):
    shape, dtype = _leaf_shape_dtype(x)
    if shape != tuple(want.shape) or np.dtype(dtype) != np.dtype(want.dtype):
      raise ValueError(
        f"{api}: the leaf at {path} is {np.dtype(dtype).name}{list(shape)} but {what} "
        f"expects {np.dtype(want.dtype).name}{list(want.shape)}; cast or reshape it before "
        "placing"
      )


@jax_internals.api_boundary
def place_for(
  compiled: Any,
  tree: Any,
  *,
  argnum: int | None = None,
  donate: Any = False,
  may_alias: Any = None,
) -> Any:
  """Places ``tree`` exactly in a compiled function's input formats.

  Every leaf lands with the sharding and layout of ``compiled.input_formats``, so
  calling ``compiled`` on the result passes the buffers through without a copy.

  Args:
    compiled: a ``jax.stages.Compiled``: from ``jax.jit(f).lower(...).compile()``
      or from any jaxworks entry point (``jit_cache.jit(f).lower(...)``,
      ``stages_aot.trace(f, ...).lower(...)``, ``pmap_chunked.pmap(f).lower(...)``,
      then ``.compile()``), whose ``Compiled`` subclasses it.
    tree: the positional arguments of ``compiled`` as a tuple, or, with ``argnum``,
      the one positional argument ``argnum``. For a function with keyword
      arguments pass ``(args, kwargs)``.
    argnum: place only positional argument ``argnum``.
    donate: as for ``device_put``.
    may_alias: as for ``device_put``.

  Returns:
    The placed tree, ready to pass to ``compiled``.

  Raises:
    ValueError: a missing or extra leaf, or a leaf whose shape or dtype differs
      from what ``compiled`` was compiled for (the message names its tree
      path), before anything is placed.

  >>> import jax, numpy as np
  >>> f = jax.jit(lambda w, x: w @ x).lower(np.ones((2, 3), np.float32),
  ...                                       np.ones(3, np.float32)).compile()
  >>> w = place_for(f, np.ones((2, 3), np.float32), argnum=0)
  >>> w.format == f.input_formats[0][0]
  True
  """
  api = f"{_API}.place_for"
  if not isinstance(compiled, _Compiled):
    raise TypeError(
      f"{api}: expected a jax.stages.Compiled, got {type(compiled).__name__}; "
      "compile the function first: jax.jit(f).lower(*args).compile(), or "
      "any jaxworks entry point's .lower(...).compile() (jit_cache, "
      "stages_aot, pmap_chunked)"
    )
  formats, kw_formats = compiled.input_formats
  infos, kw_infos = compiled.args_info
  n = len(formats)
  if argnum is not None:
    if not isinstance(argnum, int) or not -n <= argnum < n:
      raise ValueError(
        f"{api}: argnum {argnum!r} is out of range for a compiled function with "
        f"{n} positional arguments"
      )
    want_formats, want_infos = formats[argnum], infos[argnum]
    what = f"argument {argnum}"
  elif kw_formats:
    want_formats, want_infos = (formats, kw_formats), (infos, kw_infos)
    what = "(args, kwargs)"
  else:
    want_formats, want_infos = tuple(formats), tuple(infos)
    what = "the positional arguments"
    if isinstance(tree, list):
      tree = tuple(tree)
  check_against(api, tree, want_infos, f"the compiled function's {what}")
  try:
    req, batches = _prepare(api, tree, want_formats, None, donate, may_alias)
  except targets.Delegate:  # pragma: no cover - formats are always concrete
    return jax_internals.stock_device_put(
      tree, want_formats, donate=donate, may_alias=may_alias
    )
  if req.deleted:
    raise transfer.deleted_error(req)
  out = transfer.execute(req, batches)
  return req.treedef.unflatten(out)
