"""The programs a pmap runs: a ``jaxworks.jit_cache.jit`` of ``shard_map``.

:class:`Programs` holds what one pmapped function's programs are made of (its
function, axis name, out_axes, devices, chunked) and builds, for one
argument structure/size/static-values combination, the mesh, the per-leaf
shardings and the jitted ``shard_map(body)`` (an :class:`Entry`); ``body`` is
the per-device program around the user's function.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import difflib
import functools
import math
import os
import re
import sys
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
import numpy as np

from . import axes as axes_lib
from . import deps
from . import mesh as mesh_lib
from .arguments import API
from .arguments import Arguments
from .arguments import describe

# Stock JAX callables this module builds on, bound once at import: a program
# that later assigns jaxworks' functions to ``jax.jit``/``jax.pmap``/... (or
# replaces ``jax.shard_map``) cannot make this module call itself.
_shard_map = jax.shard_map
_get_abstract_mesh = jax.sharding.get_abstract_mesh
_typeof = jax.typeof
_device_put = jax.device_put

# Axis name of a pmap given no axis_name: jax.pmap's, so that an output's
# sharding equals the one jax.pmap gives (and one anonymous pmap's outputs
# have exactly the input sharding of another).
ANONYMOUS_AXIS = "_internal_pmap_axis_name"


@dataclasses.dataclass
class Entry:
  """What one argument structure/size/static-values combination runs."""

  mesh: jax.sharding.Mesh
  axis_name: Any
  in_axes: tuple
  in_shardings: tuple
  size: int
  extra_axes: tuple  # ((name, size), ...) added for nested pmaps
  jitted: Any
  donated: frozenset = frozenset()  # indices of donated leaves
  # What a call under a transformation (grad, vmap, an outer jit) runs: as
  # jax.pmap, without output shardings, which would become the input
  # shardings of a transposed program (None: ``jitted``).
  traced: Any = None

  def programs(self) -> list:
    return [self.jitted] + ([] if self.traced is None else [self.traced])


def context_key() -> tuple:
  """What a nested call's program depends on: the enclosing mesh and the
  axis names bound around it."""
  frames = mesh_lib.frames()
  return (frames[-1].mesh, tuple(f.axis_name for f in frames))


class Programs:
  """Builds the programs of one pmapped function (``axis_name`` None becomes
  ``ANONYMOUS_AXIS``; ``out_axes`` is already checked)."""

  def __init__(
    self,
    fun: Callable,
    axis_name: Any,
    *,
    out_axes: Any,
    arguments: Arguments,
    backend: str | None,
    chunked: bool,
  ):
    self.fun = fun
    self.anonymous = axis_name is None
    self.axis_name = ANONYMOUS_AXIS if axis_name is None else axis_name
    self.out_axes = out_axes
    self.negative_out = axes_lib.has_negative(out_axes)
    self.arguments = arguments
    self.backend = backend
    self.chunked = chunked

  def more_axes(
    self, entry: Entry, need: mesh_lib.NeedsAxis, demanded: dict
  ) -> tuple:
    """The nested axes for the next attempt, adding or resizing ``need``'s."""
    name, size = need.axis_name, need.size
    if name == entry.axis_name or demanded.get(name, size) != size:
      raise ValueError(
        f"{API}: nested pmaps inside {describe(self.fun)} map axis "
        f"{name!r} with sizes {demanded.get(name, entry.size)} and {size} in "
        "one call; a nested axis needs one size per call and a name distinct "
        "from the enclosing pmaps'."
      )
    demanded[name] = size
    others = tuple((n, s) for n, s in entry.extra_axes if n != name)
    if len(others) == len(entry.extra_axes):
      return entry.extra_axes + ((name, size),)
    # The argument shapes changed since this entry was built: resize the axis.
    return tuple((n, size if n == name else s) for n, s in entry.extra_axes)

  def build(
    self,
    static_vals,
    treedef,
    in_axes,
    size,
    nargs,
    *,
    extra_axes: tuple,
    nested: bool,
    donating: bool = True,
  ) -> Entry:
    """The program of one argument structure, size and static values.

    ``extra_axes`` are the axes of nested pmaps the mesh adds after this
    pmap's own; ``nested`` says this pmap is called inside another one's
    body (it then maps over an axis of the enclosing mesh).
    """
    spmd_mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh
    if nested:
      mesh, axis_name = self._nested_mesh(size)
      spmd_mesh = _get_abstract_mesh()
    else:
      axis_name = self.axis_name
      mesh = spmd_mesh = self._mesh(size, extra_axes)
    in_specs = tuple(axes_lib.spec_for_axis(axis_name, ax) for ax in in_axes)
    in_shardings = tuple(NamedSharding(mesh, s) for s in in_specs)
    negative_moves: list = []
    frame = mesh_lib.Frame(axis_name, size, mesh)
    body = functools.partial(
      self.body, frame, static_vals, treedef, in_axes, nargs, negative_moves
    )
    mapped = _shard_map(
      body,
      mesh=spmd_mesh,
      in_specs=in_specs,
      out_specs=axes_lib.out_specs_for(axis_name, self.out_axes),
      axis_names={axis_name},
      check_vma=False,
    )

    def program(*flat_args):  # flat_args: as jax.pmap's, in JAX's errors
      out = mapped(*flat_args)
      if not negative_moves:
        return out
      # Negative out_axes: moved into place now that the global rank is known.
      out_leaves, out_tree = jax.tree_util.tree_flatten(out)
      for i, dest in negative_moves:
        out_leaves[i] = jnp.moveaxis(out_leaves[i], 0, dest)
      return jax.tree_util.tree_unflatten(out_tree, out_leaves)

    # The user's name for jaxprs and errors, but not their signature (jit
    # checks donate_argnums against it).
    functools.update_wrapper(program, self.fun, updated=())
    delattr(program, "__wrapped__")
    donate_argnums = (
      self.arguments.donated_leaves(treedef, nargs) if donating else ()
    )
    # Inner axes of a nested pmap may shard the inputs too; let jit take
    # each input's own layout instead of pinning the outer axis only.
    pinned = {}
    if not (nested or extra_axes):
      # The outputs' shardings too, as jax.pmap gives them: left to the
      # compiler, a program over one device takes its first input's
      # sharding for every output of that rank (P('i') for out_axes=1)
      # and P() for the others.
      pinned = {
        "in_shardings": in_shardings,
        "out_shardings": axes_lib.out_shardings_for(
          mesh, axis_name, self.out_axes
        ),
      }
    jitted = deps.jit(program, donate_argnums=donate_argnums, **pinned)
    traced = None
    if "out_shardings" in pinned:
      traced = deps.jit(
        program, donate_argnums=donate_argnums, in_shardings=in_shardings
      )
    return Entry(
      mesh=mesh,
      axis_name=axis_name,
      in_axes=in_axes,
      in_shardings=in_shardings,
      size=size,
      extra_axes=extra_axes,
      jitted=jitted,
      donated=frozenset(donate_argnums),
      traced=traced,
    )

  def place_negative(self, entry: Entry, out: Any) -> Any:
    """``out`` (a call's outputs) with each output of a negative out_axes
    on the sharding of its axis counted from the front: a program over one
    device leaves them on another spec of the same single shard (its jit
    cannot be told their rank before tracing), which this re-labels without
    a copy."""
    if not self.negative_out or entry.extra_axes:
      return out
    leaves, tree = jax.tree_util.tree_flatten(out)
    axes = axes_lib.broadcast_axes(API, "out_axes", self.out_axes, out)
    for i, (y, ax) in enumerate(zip(leaves, axes)):
      if ax is None or ax >= 0 or not isinstance(y, jax.Array):
        continue
      spec = axes_lib.global_spec(entry.axis_name, ax, y.ndim)
      want = NamedSharding(entry.mesh, spec)
      if y.sharding != want:
        leaves[i] = _device_put(y, want)
    return jax.tree_util.tree_unflatten(tree, leaves)

  def _mesh(self, size: int, extra_axes: tuple) -> jax.sharding.Mesh:
    """A top-level call's mesh: this pmap's axis, then the nested ones."""
    sizes = (size,) + tuple(s for _, s in extra_axes)
    devices = mesh_lib.select_devices(
      self.arguments.devices, math.prod(sizes), self.backend
    )
    return mesh_lib.make_mesh(
      devices, sizes, (self.axis_name,) + tuple(n for n, _ in extra_axes)
    )

  def _nested_mesh(self, size: int):
    """The enclosing mesh and this pmap's axis name in it (nested calls)."""
    frames = mesh_lib.frames()
    axis_name = self.axis_name
    bound = [f.axis_name for f in frames]
    if axis_name in bound:
      if not self.anonymous:
        raise ValueError(
          f"{API}: nested pmap reuses axis name {axis_name!r}, already "
          f"bound by an enclosing pmap (bound: {bound}); give the inner "
          "pmap its own axis_name."
        )
      axis_name = f"{axis_name}_{len(frames)}"  # nobody can refer to it
    if self.arguments.devices is not None:
      raise ValueError(
        f"{API}: a nested pmap cannot take devices= (got "
        f"{list(self.arguments.devices)}); pass devices to the outermost "
        "pmap only, listing the devices of all nested axes."
      )
    mesh = frames[-1].mesh
    if mesh.shape.get(axis_name) != size:
      raise mesh_lib.NeedsAxis(axis_name, size)
    return mesh, axis_name

  def body(
    self, frame, static_vals, treedef, in_axes, nargs, negative_moves, *local
  ):
    """Per-device program: the user function between squeeze/expand_dims."""
    if not self.chunked:
      local = [
        x if ax is None else lax.squeeze(x, (ax,))
        for x, ax in zip(local, in_axes)
      ]
    dyn_args, kwargs = jax.tree_util.tree_unflatten(treedef, local)
    args = self.arguments.merge(static_vals, dyn_args, nargs)
    frames = mesh_lib.frames()
    frames.append(frame)
    try:
      out = self.fun(*args, **kwargs)
    except NameError as err:
      # Reported from this trace, as jax.pmap reports it (the function runs
      # once), through jaxworks.axis_names' error type.
      found = self._unbound_error(err, [f.axis_name for f in frames])
      if found is None:
        raise
      raise found from None
    finally:
      frames.pop()
    return self._outputs(out, negative_moves)

  def _unbound_error(self, err: NameError, bound: list) -> Any:
    """The ``AxisNameError`` for JAX's unbound-axis ``NameError`` ``err``
    raised by the user's function, or None for another ``NameError``."""
    if isinstance(err, deps.AxisNameError):
      return None
    m = _UNBOUND_RE.search(str(err))
    if m is None:
      return None
    name = m.group(1)
    location, called = _user_call(err.__traceback__)
    primitive = called or "a collective"
    strs = [b for b in bound if isinstance(b, str)]
    close = difflib.get_close_matches(name, strs, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    where = f"{location}: " if location else ""
    message = (
      f"{API}: {describe(self.fun)} (axis_name={bound[-1]!r}) uses an "
      f"unbound axis name: {name}. {where}{primitive} uses axis {name!r}, "
      f"unbound{hint}; bound here: {tuple(bound)}. Fix: use one of the "
      "bound names, or call it under a pmap, shard_map or vmap that binds "
      f"{name!r}."
    )
    return deps.AxisNameError(
      message,
      primitive=primitive,
      axis_name=name,
      bound=tuple(bound),
      location=location,
      problems=((primitive, name, tuple(bound), location, "unbound"),),
    )

  def _outputs(self, out: Any, negative_moves: list) -> Any:
    """The per-device outputs with their mapped axis at ``out_axes`` (kept
    there when chunked, inserted otherwise). A negative out_axes is put on
    axis 0 here and recorded in ``negative_moves`` as (leaf, destination),
    for the program to move once the global rank is known."""
    out_leaves, out_tree = jax.tree_util.tree_flatten(out)
    out_axes = axes_lib.broadcast_axes(API, "out_axes", self.out_axes, out)
    negative_moves.clear()
    result = []
    for i, (y, ax) in enumerate(zip(out_leaves, out_axes)):
      y = jnp.asarray(y)
      if ax is None:
        result.append(y)
        continue
      rank = y.ndim if self.chunked else y.ndim + 1
      dest = ax % rank if -rank <= ax < rank else None
      if dest is None or (self.chunked and y.shape[dest] != 1):
        where = f"output result{axes_lib.leaf_paths(out)[i]}"
        axes_lib.normalize_axis(API, "out_axes", ax, rank, where)
        raise ValueError(
          f"{API}(chunked=True): {where} of {describe(self.fun)} has "
          f"per-device shape {y.shape}, but with chunked=True an output "
          f"mapped along out_axes={ax} must keep its size-1 device chunk on "
          "that axis; return x[None] or x.reshape(1, ...), or use "
          "chunked=False."
        )
      if not self.chunked:
        y = lax.expand_dims(y, (0 if ax < 0 else dest,))
      elif ax < 0:
        y = jnp.moveaxis(y, dest, 0)
      if ax < 0:
        negative_moves.append((i, dest))
      result.append(y)
    return jax.tree_util.tree_unflatten(out_tree, result)

  def diagnose(self, err, static_vals, treedef, nargs, leaves, entry):
    """Re-reports an unbound axis name through jaxworks.axis_names."""
    local = []
    for x, ax in zip(leaves, entry.in_axes):
      shape = list(jnp.shape(x))
      if ax is not None:
        shape[ax] = 1
      local.append(jax.ShapeDtypeStruct(tuple(shape), jnp.result_type(x)))
    bound = {f.axis_name: f.size for f in mesh_lib.frames()}
    bound[entry.axis_name] = entry.size
    bound.update(entry.extra_axes)
    frame = mesh_lib.Frame(entry.axis_name, entry.size, entry.mesh)
    body = functools.partial(
      self.body, frame, static_vals, treedef, entry.in_axes, nargs, []
    )
    functools.update_wrapper(body, self.fun, updated=())
    try:
      deps.check_axis_names(body, *local, axis_sizes=bound)
    except deps.AxisNameError as found:
      found.args = (
        f"{API}: {describe(self.fun)} (axis_name="
        f"{entry.axis_name!r}) uses an unbound axis name: "
        f"{found.axis_name}. {found}",
      ) + found.args[1:]
      raise found from None
    raise err


# JAX's NameError for an axis name no enclosing transformation binds.
_UNBOUND_RE = re.compile(r"unbound axis name: (.+?)\. ")


def _library_dirs() -> tuple[str, ...]:
  """The directories of JAX and of the jaxworks packages imported (frames
  there are not the user's code)."""
  files = [jax.__file__] + [
    m.__file__
    for name, m in list(sys.modules.items())
    if name.count(".") == 1 and name.startswith("jaxworks.")
  ]
  return tuple(
    {
      f(os.path.dirname(path)) + os.sep
      for path in files
      if isinstance(path, str)
      for f in (os.path.abspath, os.path.realpath)
    }
  )


def _is_library(filename: str, dirs: tuple[str, ...]) -> bool:
  return any(
    f(filename).startswith(dirs) for f in (os.path.abspath, os.path.realpath)
  )


def _user_call(tb: Any) -> tuple[str | None, str | None]:
  """``("file:line (function)", called)`` of the innermost frame of user
  code in traceback ``tb`` and the name of the function it called there
  (``psum``), or Nones."""
  location = called = None
  after_user = False
  dirs = _library_dirs()
  while tb is not None:
    code = tb.tb_frame.f_code
    if not _is_library(code.co_filename, dirs):
      location = f"{code.co_filename}:{tb.tb_lineno} ({code.co_name})"
      after_user = True
    elif after_user:
      called, after_user = code.co_name, False
    tb = tb.tb_next
  return location, called


def abstract(x: Any, sharding: Any) -> jax.ShapeDtypeStruct:
  """The ShapeDtypeStruct ``lower``/``trace`` stage for one argument leaf,
  with its weak type (a Python scalar stays weak, as in a call)."""
  if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
    return x
  # A ShapeDtypeStruct without a sharding, or an abstract value such as
  # jax.core.ShapedArray (jax.pmap accepts those), is used as it is.
  if isinstance(x, (jax.Array, np.ndarray, np.generic)) or not (
    hasattr(x, "shape") and hasattr(x, "dtype")
  ):
    x = _typeof(x)
  return jax.ShapeDtypeStruct(
    x.shape,
    x.dtype,
    sharding=sharding,
    weak_type=getattr(x, "weak_type", False),
  )
