"""pmap built as jit(shard_map(body)) over a mesh of the devices.

The mechanism, in one place:

1. A call flattens its arguments, finds each leaf's mapped axis (in_axes) and
   the mapped size n, and picks n devices.
2. A cache entry per (argument structure, axes, n, static arguments) holds a
   Mesh with Auto axes, one NamedSharding per leaf (the mapped dimension split
   over the pmap axis, so every device holds a [.., 1, ..] chunk: shards keep
   their rank) and a ``jaxworks.jit_cache.jit`` of ``shard_map(body)``.
3. ``body`` runs per device. With chunked=False it squeezes the size-1 mapped
   axis before calling the user function and re-inserts it at out_axes
   afterwards (classic pmap semantics); with chunked=True the user function
   sees and returns the size-1 axis itself.
4. Inputs already laid out as the entry expects are passed as they are (no
   copy); the others move in one batched transfer. Outputs are global arrays
   with NamedShardings, so they feed jax.jit or this pmap again without a copy.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
import dataclasses
import functools
import inspect
import math
import struct
import threading
import types
from typing import Any
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding
import numpy as np

from . import axes as axes_lib
from . import deps
from . import jax_internals
from . import mesh as mesh_lib
from . import placement

API = "jaxworks.pmap_chunked.pmap"

# Axis name of a pmap given no axis_name (as in jax.pmap, one shared name, so
# outputs of one anonymous pmap have exactly the input sharding of another).
ANONYMOUS_AXIS = "_pmap_axis"

# Default bound on one pmapped function's program table (LRU), as for
# jaxworks.jit_cache.jit's per-function trace entries.
DEFAULT_MAXSIZE = 256

# Stock JAX callables this module builds on, bound once at import: a program
# that later assigns jaxworks' functions to ``jax.jit``/``jax.pmap``/... (or
# replaces ``jax.shard_map``) cannot make this module call itself.
_shard_map = jax.shard_map
_get_abstract_mesh = jax.sharding.get_abstract_mesh
_typeof = jax.typeof


class PmapCacheInfo(NamedTuple):
  """Counters of one pmapped function's cache.

  Attributes:
    hits: calls that found their compiled program in the cache.
    misses: calls that had to build a new program (trace and compile).
    entries: distinct programs held (argument structures, sizes, statics).
    evictions: programs dropped because the table was full (LRU order).
    maxsize: the bound on ``entries`` (``pmap(..., maxsize=...)``).
  """

  hits: int
  misses: int
  entries: int
  evictions: int = 0
  maxsize: int = DEFAULT_MAXSIZE


class UnhashableStaticError(ValueError, TypeError):
  """A static argument of a pmapped function is not hashable.

  A ``ValueError`` as ``jax.pmap`` raises, and a ``TypeError`` as Python
  raises for ``hash()`` of such a value (and as earlier jaxworks versions
  raised), so code catching either keeps working.
  """


def static_key(value: Any) -> Any:
  """The cache key of one static argument: its type and its value.

  Python's ``==`` says ``1 == 1.0 == True`` and ``0.0 == -0.0``, but each of
  those traces to a different program (dtype, sign), so the type of the value
  (and of every element of a tuple or frozenset) is part of the key and floats
  are compared by their bits (``-0.0`` is not ``0.0``; a NaN equals a NaN with
  the same bits). Other values are compared as JAX compares static
  arguments: by type, ``__hash__`` and ``__eq__``.
  """
  kind = type(value)
  if kind is float:
    return (kind, struct.pack("<d", value))
  if kind is complex:
    return (kind, struct.pack("<dd", value.real, value.imag))
  if isinstance(value, np.generic):
    # NumPy scalars: by dtype and bytes (np.float32(-0.0) vs np.float32(0.0)).
    if value.dtype != object:
      return (kind, value.dtype, value.tobytes())
    return (kind, value)
  if isinstance(value, tuple):
    return (kind, tuple(static_key(v) for v in value))
  if isinstance(value, frozenset):
    return (kind, frozenset(static_key(v) for v in value))
  return (kind, value)


@dataclasses.dataclass
class _Entry:
  """What one argument structure/size/static-values combination runs."""

  mesh: jax.sharding.Mesh
  axis_name: Any
  in_axes: tuple
  in_shardings: tuple
  size: int
  extra_axes: tuple  # ((name, size), ...) added for nested pmaps
  jitted: Any
  donated: frozenset = frozenset()  # indices of donated leaves


def _index_tuple(what: str, value: Any) -> tuple[int, ...]:
  if value is None:
    return ()
  items = (value,) if isinstance(value, int) else value
  try:
    items = tuple(items)
  except TypeError:
    raise TypeError(
      f"{API}: {what} must be an int or a sequence of ints, got "
      f"{value!r}; pass e.g. {what}=(1,)."
    ) from None
  for i in items:
    if type(i) is not int or i < 0:
      raise TypeError(
        f"{API}: {what} must hold non-negative ints (positions "
        f"of positional arguments), got {value!r}; pass e.g. "
        f"{what}=(1,)."
      )
  return tuple(sorted(set(items)))


_Tracer = jax.core.Tracer


def _is_tracer(x: Any) -> bool:
  return isinstance(x, _Tracer)


class Pmapped:
  """A function mapped over devices by :func:`jaxworks.pmap_chunked.pmap`.

  Calling it runs the mapped function; ``lower`` and ``trace`` give the
  ``jaxworks.jit_cache`` stages of the program a call would run, and
  ``cache_info()`` reports this function's cache counters.
  """

  def __init__(
    self,
    fun: Callable,
    axis_name: Any,
    *,
    in_axes: Any,
    out_axes: Any,
    static_broadcasted_argnums: Any,
    devices: Any,
    backend: str | None,
    axis_size: int | None,
    donate_argnums: Any,
    chunked: bool,
    maxsize: int = DEFAULT_MAXSIZE,
  ):
    if isinstance(fun, staticmethod):
      raise TypeError(
        f"{API}: got the staticmethod object {fun!r}; as "
        "jax.pmap, pmap takes the function itself: apply "
        "@staticmethod outside (above) @pmap."
      )
    if not callable(fun):
      raise TypeError(
        f"{API}: fun must be callable, got {fun!r} of type "
        f"{type(fun).__name__}; pass the function to map."
      )
    if inspect.isgeneratorfunction(fun):
      raise TypeError(
        f"{API}: fun must return its outputs, but {fun!r} is a "
        "generator function (it yields); return a value or a "
        "tuple of values instead."
      )
    self._anonymous = axis_name is None
    if axis_name is None:
      axis_name = ANONYMOUS_AXIS
    try:
      hash(axis_name)
    except TypeError:
      raise TypeError(
        f"{API}: axis_name must be hashable, got {axis_name!r}; "
        "use a string such as axis_name='i'."
      ) from None
    if axis_size is not None and (type(axis_size) is not int or axis_size < 1):
      raise TypeError(
        f"{API}: axis_size must be a positive int or None, got {axis_size!r}."
      )
    if not isinstance(chunked, bool):
      raise TypeError(f"{API}: chunked must be True or False, got {chunked!r}.")
    if type(maxsize) is not int or maxsize < 1:
      raise TypeError(
        f"{API}: maxsize must be an int >= 1, got {maxsize!r}; "
        f"pass e.g. maxsize={DEFAULT_MAXSIZE}."
      )
    if backend is not None and not isinstance(backend, str):
      raise TypeError(
        f"{API}: backend must be a platform name such as "
        f"'cpu' or None, got {backend!r}."
      )
    self._fun = fun
    self._axis_name = axis_name
    self._in_axes = axes_lib.check_axes_spec(API, "in_axes", in_axes)
    self._out_axes = axes_lib.check_axes_spec(API, "out_axes", out_axes)
    self._negative_in = axes_lib.has_negative(self._in_axes)
    self._negative_out = axes_lib.has_negative(self._out_axes)
    self._statics = _index_tuple(
      "static_broadcasted_argnums", static_broadcasted_argnums
    )
    self._donate = _index_tuple("donate_argnums", donate_argnums)
    both = set(self._statics) & set(self._donate)
    if both:
      raise ValueError(
        f"{API}: argument(s) {sorted(both)} are in both "
        "static_broadcasted_argnums and donate_argnums; a static argument "
        "has no buffer to donate, remove it from one of them."
      )
    self._devices = (
      None if devices is None else mesh_lib.check_devices(API, devices)
    )
    self._backend = backend
    self._axis_size = axis_size
    self._chunked = chunked
    self._maxsize = maxsize
    # Program table (LRU): key -> _Entry; and the flat in_axes of each
    # argument structure (bounded the same way).
    self._entries: collections.OrderedDict = collections.OrderedDict()
    self._flat_axes: collections.OrderedDict = collections.OrderedDict()
    self._lock = threading.Lock()
    self._hits = 0
    self._misses = 0
    self._evictions = 0
    functools.update_wrapper(self, fun, updated=())

  # ----------------------------------------------------------------- calling

  def __call__(self, *args, **kwargs):
    return self._run("call", args, kwargs)

  def __get__(self, instance, owner=None):
    """As a method (``@pmap`` on a ``def`` in a class), binds ``self``."""
    if instance is None:
      return self
    return types.MethodType(self, instance)

  def lower(self, *args, **kwargs):
    """Lowers the program a call with these arguments would run.

    Returns the ``Lowered`` stage of the underlying ``jaxworks.jit_cache.jit``
    (arguments may be arrays or ``jax.ShapeDtypeStruct``s).
    """
    return self._run("lower", args, kwargs)

  def trace(self, *args, **kwargs):
    """Traces the program a call with these arguments would run."""
    return self._run("trace", args, kwargs)

  def cache_info(self) -> PmapCacheInfo:
    """Hits, misses, entries, evictions and maxsize of this function's
    program table."""
    return PmapCacheInfo(
      self._hits,
      self._misses,
      len(self._entries),
      self._evictions,
      self._maxsize,
    )

  def clear_cache(self) -> None:
    """Drops every program this function holds (the next call rebuilds)."""
    with self._lock:
      self._entries.clear()
      self._flat_axes.clear()

  def _lookup(self, table: collections.OrderedDict, key: Any) -> Any:
    with self._lock:
      found = table.get(key)
      if found is not None:
        table.move_to_end(key)
      return found

  def _store(
    self, table: collections.OrderedDict, key: Any, value: Any, count: bool
  ) -> None:
    with self._lock:
      table[key] = value
      table.move_to_end(key)
      while len(table) > self._maxsize:
        table.popitem(last=False)
        if count:
          self._evictions += 1

  def _run(self, how: str, args: tuple, kwargs: dict):
    static_vals, leaves, treedef, in_axes, size = self._parse(args, kwargs)
    nested = bool(mesh_lib.frames())
    tracing = nested or any(map(_is_tracer, leaves))
    key = (
      treedef,
      in_axes,
      size,
      static_key(static_vals),
      len(args),
      self._context_key() if nested else None,
    )
    entry = self._lookup(self._entries, key)
    built = entry is None
    if built:
      entry = self._build(
        static_vals,
        treedef,
        in_axes,
        size,
        len(args),
        extra_axes=(),
        nested=nested,
      )
    demanded: dict = {}
    while True:
      try:
        out = self._run_entry(how, entry, leaves, treedef, tracing)
      except mesh_lib.NeedsAxis as need:
        if nested:
          raise
        entry = self._build(
          static_vals,
          treedef,
          in_axes,
          size,
          len(args),
          nested=False,
          extra_axes=self._more_axes(entry, need, demanded),
        )
        built = True
        continue
      except deps.AxisNameError:
        raise
      except NameError as err:
        self._diagnose(
          err, static_vals, treedef, in_axes, size, len(args), leaves, entry
        )
      # Only a call that succeeded changes the cache: a failed one leaves
      # nothing half-built behind.
      if built:
        self._misses += 1
        self._store(self._entries, key, entry, count=True)
      else:
        self._hits += 1
      return out

  def _run_entry(
    self, how: str, entry: _Entry, leaves: list, treedef, tracing: bool
  ):
    if how != "call":
      stage = getattr(entry.jitted, how)(
        *[self._abstract(x, s) for x, s in zip(leaves, entry.in_shardings)]
      )
      if how == "lower":
        # The program takes flat leaves; describe its arguments as the user
        # passed them ((positional, keyword) without the static ones, as
        # jax.pmap's lower does), so .compile() takes the user's arguments.
        donated = [
          a.donated for a in jax.tree_util.tree_leaves(stage.args_info)
        ]
        stage = jax_internals.lowered_with_args_info(
          stage,
          jax.tree_util.tree_unflatten(
            treedef,
            [jax_internals.arg_info(x, d) for x, d in zip(leaves, donated)],
          ),
        )
      return stage
    if tracing:
      return entry.jitted(*leaves)
    return entry.jitted(
      *placement.place_inputs(
        leaves,
        entry.in_shardings,
        entry.axis_name,
        entry.in_axes,
        entry.donated,
      )
    )

  # ------------------------------------------------------------ arguments

  def _parse(self, args: tuple, kwargs: dict):
    """Static values, flat dynamic leaves, their structure, axes and size."""
    statics = self._statics
    if statics:
      if statics[-1] >= len(args):
        raise ValueError(
          f"{API}: {self._name()} has static_broadcasted_argnums="
          f"{statics} but was called with {len(args)} positional "
          f"argument(s); pass every static argument positionally."
        )
      static_vals = tuple(args[i] for i in statics)
      try:
        hash(static_vals)
      except TypeError:
        bad = next(i for i in statics if not _hashable(args[i]))
        raise UnhashableStaticError(
          f"{API}: Non-hashable static arguments are not supported: static "
          f"argument {bad} of {self._name()} (static_broadcasted_argnums) "
          f"must be hashable, got a {type(args[bad]).__name__}; pass a "
          "hashable value (e.g. a tuple instead of a list) or make it a "
          "mapped argument."
        ) from None
      dyn = tuple(a for i, a in enumerate(args) if i not in statics)
    else:
      static_vals = ()
      dyn = args
    leaves, treedef = jax.tree_util.tree_flatten((dyn, kwargs))
    flat = self._lookup(self._flat_axes, (treedef, len(args)))
    if flat is None:
      flat = self._flat_in_axes(args, dyn, kwargs, len(leaves))
      self._store(self._flat_axes, (treedef, len(args)), flat, count=False)
    if self._negative_in:
      flat = tuple(self._normalize_in(flat, leaves, dyn, kwargs))
    size = None
    for i, ax in enumerate(flat):
      if ax is None:
        continue
      try:
        n = leaves[i].shape[ax]
      except (AttributeError, IndexError, TypeError):
        self._raise_bad_leaf(i, ax, leaves, dyn, kwargs)
      if size is None:
        size = n
      elif n != size:
        self._raise_sizes(flat, leaves, dyn, kwargs)
    return (
      static_vals,
      leaves,
      treedef,
      flat,
      self._global_size(size, leaves, flat),
    )

  def _flat_in_axes(self, args, dyn, kwargs, num_leaves) -> tuple:
    in_axes = self._in_axes
    if isinstance(in_axes, tuple):
      if len(in_axes) != len(args):
        keywords = (
          f" (and {len(kwargs)} keyword argument(s): each argument passed "
          "by keyword is mapped over its axis 0 and has no in_axes entry; "
          "pass them positionally to give them one)"
          if kwargs
          else ""
        )
        raise ValueError(
          f"{API}: in_axes={in_axes!r} has {len(in_axes)} entries but "
          f"{self._name()} was called with {len(args)} positional "
          f"argument(s){keywords}; give one entry per positional argument "
          "(static ones included) or a single int/None for all."
        )
      in_axes = tuple(
        a for i, a in enumerate(in_axes) if i not in self._statics
      )
    elif in_axes is not None and type(in_axes) is not int:
      raise ValueError(
        f"{API}: in_axes={in_axes!r} must be an int, None or a tuple with "
        "one entry per positional argument; wrap it as in_axes=(spec,) for "
        "a single argument."
      )
    flat = axes_lib.broadcast_axes(API, "in_axes", in_axes, dyn)
    flat += [0] * (num_leaves - len(flat))  # keyword arguments: axis 0
    return tuple(flat)

  def _normalize_in(self, flat, leaves, dyn, kwargs):
    for i, (ax, x) in enumerate(zip(flat, leaves)):
      if ax is not None and ax < 0:
        ndim = len(getattr(x, "shape", ()))
        if ax < -ndim:
          where = _pretty(axes_lib.leaf_paths((dyn, kwargs))[i])
          axes_lib.normalize_axis(API, "in_axes", ax, ndim, f"argument {where}")
        yield ax + ndim
      else:
        yield ax

  def _global_size(self, size, leaves, flat) -> int:
    if size is None:
      if self._axis_size is None:
        raise ValueError(
          f"{API}: {self._name()} has no mapped argument (every in_axes is "
          "None), so the mapped size is unknown; pass axis_size=<number of "
          "devices> to pmap or map at least one argument."
        )
      return self._axis_size
    if jax.process_count() > 1:
      first = next(x for x, ax in zip(leaves, flat) if ax is not None)
      if not (isinstance(first, jax.Array) and not first.is_fully_addressable):
        local = (
          sum(d.process_index == jax.process_index() for d in self._devices)
          if self._devices
          else jax.local_device_count()
        )
        if size != local:
          raise ValueError(
            f"{API}: {self._name()} got a process-local mapped size of "
            f"{size} but this process has {local} participating devices; "
            "pass one slice per local device, or a global jax.Array."
          )
        size = (
          len(self._devices) if self._devices else (size * jax.process_count())
        )
    if self._axis_size is not None and self._axis_size != size:
      raise ValueError(
        f"{API}: axis_size={self._axis_size} but the mapped arguments of "
        f"{self._name()} have mapped size {size}; pass axis_size={size} or "
        "resize the arguments."
      )
    return size

  def _raise_bad_leaf(self, i, ax, leaves, dyn, kwargs):
    where = _pretty(axes_lib.leaf_paths((dyn, kwargs))[i])
    x = leaves[i]
    shape = getattr(x, "shape", None)
    if shape is None and isinstance(x, (bool, int, float, complex)):
      shape = ()  # a Python scalar: a rank-0 value
    if shape is None:
      raise TypeError(
        f"{API}: argument {where} of {self._name()} is a "
        f"{type(x).__name__}, which cannot be mapped over (in_axes={ax}); "
        "pass an array, give it in_axes=None to broadcast it, or list its "
        "position in static_broadcasted_argnums."
      )
    fix = (
      f"use an axis below {len(shape)} or"
      if shape
      else "a scalar has no axis to map:"
    )
    raise axes_lib.AxisOutOfRangeError(
      f"{API}: argument {where} of {self._name()} has shape "
      f"{tuple(shape)} (rank {len(shape)}) and cannot be mapped over axis "
      f"{ax}; {fix} give it in_axes=None to broadcast it."
    )

  def _raise_sizes(self, flat, leaves, dyn, kwargs):
    paths = axes_lib.leaf_paths((dyn, kwargs))
    sizes = [
      f"{_pretty(p)}: size {x.shape[ax]} along axis {ax}"
      for p, x, ax in zip(paths, leaves, flat)
      if ax is not None
    ]
    raise ValueError(
      f"{API}: the mapped arguments of {self._name()} disagree on the "
      f"mapped size ({'; '.join(sizes)}); every mapped argument needs the "
      "same size along its in_axes axis (the number of devices)."
    )

  # ------------------------------------------------------------- programs

  def _context_key(self):
    frames = mesh_lib.frames()
    return (frames[-1].mesh, tuple(f.axis_name for f in frames))

  def _more_axes(
    self, entry: _Entry, need: mesh_lib.NeedsAxis, demanded: dict
  ) -> tuple:
    """The nested axes for the next attempt, adding or resizing ``need``'s."""
    name, size = need.axis_name, need.size
    if name == entry.axis_name or demanded.get(name, size) != size:
      raise ValueError(
        f"{API}: nested pmaps inside {self._name()} map axis {name!r} with "
        f"sizes {demanded.get(name, entry.size)} and {size} in one call; a "
        "nested axis needs one size per call and a name distinct from the "
        "enclosing pmaps'."
      )
    demanded[name] = size
    others = tuple((n, s) for n, s in entry.extra_axes if n != name)
    if len(others) == len(entry.extra_axes):
      return entry.extra_axes + ((name, size),)
    # The argument shapes changed since this entry was built: resize the axis.
    return tuple((n, size if n == name else s) for n, s in entry.extra_axes)

  def _build(
    self,
    static_vals,
    treedef,
    in_axes,
    size,
    nargs,
    *,
    extra_axes: tuple,
    nested: bool,
  ) -> _Entry:
    axis_name = self._axis_name
    spmd_mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh
    if nested:
      mesh, axis_name = self._nested_mesh(size)
      spmd_mesh = _get_abstract_mesh()
    else:
      sizes = (size,) + tuple(s for _, s in extra_axes)
      devices = mesh_lib.select_devices(
        self._devices, math.prod(sizes), self._backend
      )
      mesh = mesh_lib.make_mesh(
        devices, sizes, (axis_name,) + tuple(n for n, _ in extra_axes)
      )
      spmd_mesh = mesh
    in_specs = tuple(axes_lib.spec_for_axis(axis_name, ax) for ax in in_axes)
    in_shardings = tuple(NamedSharding(mesh, s) for s in in_specs)

    negative_moves: list = []
    body = functools.partial(
      self._body,
      axis_name,
      static_vals,
      treedef,
      in_axes,
      size,
      mesh,
      nargs,
      negative_moves,
    )
    mapped = _shard_map(
      body,
      mesh=spmd_mesh,
      in_specs=in_specs,
      out_specs=axes_lib.out_specs_for(axis_name, self._out_axes),
      axis_names={axis_name},
      check_vma=False,
    )
    # The program takes the flat argument leaves (named flat_args in JAX's
    # argument-mismatch errors, as for jax.pmap).
    if self._negative_out:

      def program(*flat_args):
        out_leaves, out_tree = jax.tree_util.tree_flatten(mapped(*flat_args))
        for i, dest in negative_moves:
          out_leaves[i] = jnp.moveaxis(out_leaves[i], 0, dest)
        return jax.tree_util.tree_unflatten(out_tree, out_leaves)
    else:

      def program(*flat_args):
        return mapped(*flat_args)

    # Keep the user's name for jaxprs and errors, but not their signature
    # (jit checks donate_argnums against it).
    functools.update_wrapper(program, self._fun, updated=())
    delattr(program, "__wrapped__")
    donate_argnums = self._donated_leaves(treedef, nargs)
    if nested or extra_axes:
      # Inner axes of a nested pmap may shard the inputs too; let jit take
      # each input's own layout instead of pinning the outer axis only.
      jitted = deps.jit(program, donate_argnums=donate_argnums)
    else:
      jitted = deps.jit(
        program, donate_argnums=donate_argnums, in_shardings=in_shardings
      )
    return _Entry(
      mesh=mesh,
      axis_name=axis_name,
      in_axes=in_axes,
      in_shardings=in_shardings,
      size=size,
      extra_axes=extra_axes,
      jitted=jitted,
      donated=frozenset(donate_argnums),
    )

  def _nested_mesh(self, size: int):
    """The enclosing mesh and this pmap's axis name in it (nested calls)."""
    frames = mesh_lib.frames()
    axis_name = self._axis_name
    bound = [f.axis_name for f in frames]
    if axis_name in bound:
      if not self._anonymous:
        raise ValueError(
          f"{API}: nested pmap reuses axis name {axis_name!r}, already "
          f"bound by an enclosing pmap (bound: {bound}); give the inner "
          "pmap its own axis_name."
        )
      axis_name = f"{axis_name}_{len(frames)}"  # nobody can refer to it
    if self._devices is not None:
      raise ValueError(
        f"{API}: a nested pmap cannot take devices= (got "
        f"{list(self._devices)}); pass devices to the outermost pmap only, "
        "listing the devices of all nested axes."
      )
    mesh = frames[-1].mesh
    if mesh.shape.get(axis_name) != size:
      raise mesh_lib.NeedsAxis(axis_name, size)
    return mesh, axis_name

  def _donated_leaves(self, treedef, nargs) -> tuple[int, ...]:
    """Indices of the flat leaves that belong to donated positional args."""
    dyn_positions = [i for i in range(nargs) if i not in self._statics]
    dyn_args, _ = jax.tree_util.tree_unflatten(
      treedef, [0] * treedef.num_leaves
    )
    donated: list[int] = []
    start = 0
    for position, arg in zip(dyn_positions, dyn_args):
      n = len(jax.tree_util.tree_leaves(arg))
      if position in self._donate:
        donated.extend(range(start, start + n))
      start += n
    return tuple(donated)

  def _body(
    self,
    axis_name,
    static_vals,
    treedef,
    in_axes,
    size,
    mesh,
    nargs,
    negative_moves,
    *local,
  ):
    """Per-device program: the user function between squeeze/expand_dims."""
    if not self._chunked:
      local = [
        x if ax is None else lax.squeeze(x, (ax,))
        for x, ax in zip(local, in_axes)
      ]
    dyn_args, kwargs = jax.tree_util.tree_unflatten(treedef, local)
    args = _merge_statics(self._statics, static_vals, dyn_args, nargs)
    frames = mesh_lib.frames()
    frames.append(mesh_lib.Frame(axis_name, size, mesh))
    try:
      out = self._fun(*args, **kwargs)
    finally:
      frames.pop()
    out_leaves, out_tree = jax.tree_util.tree_flatten(out)
    out_axes = axes_lib.broadcast_axes(API, "out_axes", self._out_axes, out)
    paths = None
    negative_moves.clear()
    result = []
    for i, (y, ax) in enumerate(zip(out_leaves, out_axes)):
      y = jnp.asarray(y)
      if ax is None:
        result.append(y)
        continue
      rank = y.ndim if self._chunked else y.ndim + 1
      if not -rank <= ax < rank:
        paths = paths or axes_lib.leaf_paths(out)
        axes_lib.normalize_axis(
          API, "out_axes", ax, rank, f"output result{paths[i]}"
        )
      dest = ax % rank
      if self._chunked:
        if y.shape[dest] != 1:
          paths = paths or axes_lib.leaf_paths(out)
          raise ValueError(
            f"{API}(chunked=True): output result{paths[i]} of "
            f"{self._name()} has per-device shape {y.shape}, but with "
            f"chunked=True an output mapped along out_axes={ax} must keep "
            "its size-1 device chunk on that axis; return x[None] or "
            "x.reshape(1, ...), or use chunked=False."
          )
        if ax < 0:
          y = jnp.moveaxis(y, dest, 0)
      else:
        y = lax.expand_dims(y, (0 if ax < 0 else dest,))
      if ax < 0:
        negative_moves.append((i, dest))
      result.append(y)
    return jax.tree_util.tree_unflatten(out_tree, result)

  # ------------------------------------------------------------ helpers

  def _abstract(self, x, sharding):
    """The ShapeDtypeStruct ``lower``/``trace`` stage for one argument leaf,
    with its weak type (a Python scalar stays weak, as in a call)."""
    if isinstance(x, jax.ShapeDtypeStruct):
      if x.sharding is not None:
        return x
      return jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type
      )
    if (
      not isinstance(x, (jax.Array, np.ndarray, np.generic))
      and hasattr(x, "shape")
      and hasattr(x, "dtype")
    ):
      # An abstract value (e.g. jax.core.ShapedArray), as jax.pmap accepts.
      return jax.ShapeDtypeStruct(
        x.shape,
        x.dtype,
        sharding=sharding,
        weak_type=getattr(x, "weak_type", False),
      )
    aval = _typeof(x)
    return jax.ShapeDtypeStruct(
      aval.shape, aval.dtype, sharding=sharding, weak_type=aval.weak_type
    )

  def _diagnose(
    self, err, static_vals, treedef, in_axes, size, nargs, leaves, entry
  ):
    """Re-reports an unbound axis name through jaxworks.axis_names."""
    local = []
    for x, ax in zip(leaves, in_axes):
      shape = list(jnp.shape(x))
      if ax is not None:
        shape[ax] = 1
      local.append(jax.ShapeDtypeStruct(tuple(shape), jnp.result_type(x)))
    bound = mesh_lib.bound_axis_sizes()
    bound[entry.axis_name] = size
    bound.update(dict(entry.extra_axes))
    body = functools.partial(
      self._body,
      entry.axis_name,
      static_vals,
      treedef,
      in_axes,
      size,
      entry.mesh,
      nargs,
      [],
    )
    functools.update_wrapper(body, self._fun, updated=())
    try:
      deps.check_axis_names(body, *local, axis_sizes=bound)
    except deps.AxisNameError as found:
      found.args = (
        f"{API}: {self._name()} (axis_name="
        f"{entry.axis_name!r}) uses an unbound axis name: "
        f"{found.axis_name}. {found}",
      ) + found.args[1:]
      raise found from None
    raise err

  def _name(self) -> str:
    return getattr(self._fun, "__qualname__", None) or repr(self._fun)

  def __repr__(self):
    return (
      f"<jaxworks.pmap_chunked.pmap of {self._name()} over axis "
      f"{self._axis_name!r}, chunked={self._chunked}>"
    )


def _merge_statics(statics, static_vals, dyn_args, nargs) -> list:
  if not statics:
    return list(dyn_args)
  dyn_iter = iter(dyn_args)
  static_of = dict(zip(statics, static_vals))
  return [
    static_of[i] if i in static_of else next(dyn_iter) for i in range(nargs)
  ]


def _hashable(x) -> bool:
  try:
    hash(x)
  except TypeError:
    return False
  return True


def _pretty(path: str) -> str:
  """'[0][1]' (positional) / '[1]['k']' (keyword) -> args[1] / kwargs['k']."""
  if path.startswith("[0]"):
    return "args" + path[3:]
  if path.startswith("[1]"):
    return "kwargs" + path[3:]
  return path
