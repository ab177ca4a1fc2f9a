"""A pmap call's arguments: static values, flat leaves, mapped axes and size.

:class:`Arguments` holds the argument options of one pmapped function (its
in_axes, static and donated positions, devices and axis_size), checked once
when the function is made, and turns each call's arguments into what the
program table is keyed by. Errors name the argument by its path
(``args[1]['w']``) and say the fix.
"""

from __future__ import annotations

from collections.abc import Callable
import operator
import struct
import threading
from typing import Any
from typing import NoReturn

import jax
import numpy as np

from . import axes as axes_lib
from . import lru
from . import mesh as mesh_lib
from .mesh import API as API


class UnhashableStaticError(ValueError, TypeError):
  """A static argument of a pmapped function is not hashable.

  A ``ValueError`` as ``jax.pmap`` raises, and a ``TypeError`` as Python
  raises for ``hash()`` of such a value, so code catching either catches
  it.
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
  if isinstance(value, np.generic) and value.dtype != object:
    # NumPy scalars: by dtype and bytes (np.float32(-0.0) vs np.float32(0.0)).
    return (kind, value.dtype, value.tobytes())
  if isinstance(value, tuple):
    return (kind, tuple(static_key(v) for v in value))
  if isinstance(value, frozenset):
    return (kind, frozenset(static_key(v) for v in value))
  return (kind, value)


def describe(fun: Callable) -> str:
  """How error messages name the pmapped function."""
  return getattr(fun, "__qualname__", None) or repr(fun)


class Arguments:
  """How one pmapped function reads the arguments of a call.

  Args:
    fun: the mapped function (named in errors).
    in_axes: the in_axes spec, already checked by
      ``axes.check_axes_spec``.
    static_broadcasted_argnums, donate_argnums: as ``pmap`` takes them; a
      negative position names no argument, as in ``jax.pmap``.
    devices: the ``devices=`` option, or None.
    axis_size: the ``axis_size=`` option, or None: an integer (anything
      with ``__index__``), compared with the mapped size as ``jax.pmap``
      compares it.
    maxsize: the bound on the table of flat in_axes, one entry per argument
      structure.
  """

  def __init__(
    self,
    fun: Callable,
    in_axes: Any,
    *,
    static_broadcasted_argnums: Any,
    donate_argnums: Any,
    devices: Any,
    axis_size: int | None,
    maxsize: int,
  ):
    statics = _index_tuple(
      "static_broadcasted_argnums", static_broadcasted_argnums
    )
    donate = _index_tuple("donate_argnums", donate_argnums)
    both = set(statics) & set(donate)
    if both:
      raise ValueError(
        f"{API}: argument(s) {sorted(both)} are in both "
        "static_broadcasted_argnums and donate_argnums; a static argument "
        "has no buffer to donate, remove it from one of them."
      )
    self.fun = fun
    self.in_axes = in_axes
    self.negative_in = axes_lib.has_negative(in_axes)
    self.statics = _positions(statics)
    self.donate = _positions(donate)
    self.devices = (
      None if devices is None else mesh_lib.pmap_devices(API, devices)
    )
    self.axis_size = _axis_size(axis_size)
    # (argument structure, positional count) -> flat in_axes.
    self._flat_axes: lru.LRU[Any, tuple] = lru.LRU(maxsize)
    self._lock = threading.Lock()

  def clear(self) -> None:
    with self._lock:
      self._flat_axes.clear()

  def parse(self, args: tuple, kwargs: dict):
    """Static values, flat dynamic leaves, their structure, axes and size."""
    statics = self.statics
    if statics:
      if statics[-1] >= len(args):
        self._raise_too_few(args)
      static_vals = tuple(args[i] for i in statics)
      try:
        hash(static_vals)
      except TypeError:
        self._raise_unhashable(args)
      dyn = tuple(a for i, a in enumerate(args) if i not in statics)
    else:
      static_vals = ()
      dyn = args
    leaves, treedef = jax.tree_util.tree_flatten((dyn, kwargs))
    with self._lock:
      flat = self._flat_axes.get((treedef, len(args)))
    if flat is None:
      flat = self._flat_in_axes(args, dyn, kwargs, len(leaves))
      with self._lock:
        self._flat_axes.put((treedef, len(args)), flat)
    if self.negative_in:
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
    size = self._global_size(size, leaves, flat)
    return static_vals, leaves, treedef, flat, size

  def merge(self, static_vals: tuple, dyn_args: Any, nargs: int) -> list:
    """The positional arguments of the user's function: the static values
    back between the dynamic ones."""
    dyn_iter = iter(dyn_args)
    static_of = dict(zip(self.statics, static_vals))
    return [
      static_of[i] if i in static_of else next(dyn_iter) for i in range(nargs)
    ]

  def donated_leaves(self, treedef, nargs: int) -> tuple[int, ...]:
    """Indices of the flat leaves that belong to donated positional args."""
    dyn_positions = [i for i in range(nargs) if i not in self.statics]
    dyn_args, _ = jax.tree_util.tree_unflatten(
      treedef, range(treedef.num_leaves)
    )
    return tuple(
      i
      for position, arg in zip(dyn_positions, dyn_args)
      if position in self.donate
      for i in jax.tree_util.tree_leaves(arg)
    )

  def raise_deleted(self, i: int, leaves: list, treedef) -> NoReturn:
    """Raises what ``jax.pmap`` raises for a deleted (or donated) array
    argument: ``RuntimeError``, naming the argument."""
    dyn, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
    where = _pretty(axes_lib.leaf_paths((dyn, kwargs))[i])
    x = leaves[i]
    raise RuntimeError(
      f"{API}: argument {where} of {describe(self.fun)} is a deleted "
      f"jax.Array ({x.dtype.name}{list(x.shape)}: deleted, or donated to an "
      "earlier call); jax.pmap raises this RuntimeError too (Array has been "
      "deleted). Pass a live array: keep a copy of what you donate."
    )

  def _raise_too_few(self, args: tuple) -> NoReturn:
    statics = self.statics
    raise ValueError(
      f"{API}: pmapped function has static_broadcasted_argnums="
      f"{statics} but was called with only {len(args)} positional "
      f"argument{'' if len(args) == 1 else 's'}. All static broadcasted "
      f"arguments must be passed positionally. Pass argument "
      f"{statics[-1]} of {describe(self.fun)} (and every one before it) "
      "by position."
    )

  def _raise_unhashable(self, args: tuple) -> NoReturn:
    bad = next(i for i in self.statics if not _hashable(args[i]))
    raise UnhashableStaticError(
      f"{API}: Non-hashable static arguments are not supported: static "
      f"argument {bad} of {describe(self.fun)} "
      f"(static_broadcasted_argnums) must be hashable, got a "
      f"{type(args[bad]).__name__}; pass a hashable value (e.g. a tuple "
      "instead of a list) or make it a mapped argument."
    ) from None

  def _flat_in_axes(self, args, dyn, kwargs, num_leaves) -> tuple:
    in_axes = self.in_axes
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
          f"{describe(self.fun)} was called with {len(args)} positional "
          f"argument(s){keywords}; give one entry per positional argument "
          "(static ones included) or a single int/None for all."
        )
      in_axes = tuple(a for i, a in enumerate(in_axes) if i not in self.statics)
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
      # As jax.pmap, also with axis_size given: the mapped size comes from
      # the arguments only.
      raise ValueError(
        f"{API}: pmap requires at least one argument with a mapped axis. "
        f"No argument leaf of {describe(self.fun)} is mapped (its in_axes "
        "are None, or it has no array arguments); map at least one array "
        "argument (for values that are the same on every device, map "
        "jnp.broadcast_to(x, (n,) + x.shape))."
      )
    if jax.process_count() > 1:
      first = next(x for x, ax in zip(leaves, flat) if ax is not None)
      if not (isinstance(first, jax.Array) and not first.is_fully_addressable):
        # Process-local slices: the global size counts every process's.
        devices = self.devices
        local = (
          sum(d.process_index == jax.process_index() for d in devices)
          if devices
          else jax.local_device_count()
        )
        if size != local:
          raise ValueError(
            f"{API}: {describe(self.fun)} got a process-local mapped size "
            f"of {size} but this process has {local} participating devices; "
            "pass one slice per local device, or a global jax.Array."
          )
        size = len(devices) if devices else (size * jax.process_count())
    if self.axis_size is not None:
      self._check_axis_size(size)
    return size

  def _check_axis_size(self, size: int) -> None:
    """Where jax.pmap checks axis_size (after the arguments): an unhashable
    one is a TypeError (its cache hashes it), one that differs from the
    mapped size a ValueError, one equal to it but no integer a TypeError (it
    slices the device list with it)."""
    if not _hashable(self.axis_size):
      raise TypeError(
        f"{API}: axis_size must be an int or None, got {self.axis_size!r} "
        f"of type {type(self.axis_size).__name__}, which is not hashable "
        f"(jax.pmap raises TypeError too); pass axis_size={size}."
      )
    if self.axis_size != size:
      raise ValueError(
        f"{API}: axis_size={self.axis_size!r} but the mapped arguments of "
        f"{describe(self.fun)} have mapped size {size}; pass "
        f"axis_size={size} or resize the arguments."
      )
    if type(self.axis_size) is not int:
      # Equal but no integer (8.0): jax.pmap slices its device list with
      # it, a TypeError.
      raise TypeError(
        f"{API}: axis_size={self.axis_size!r} must be an integer (or "
        f"have __index__); pass axis_size={size}."
      )

  def _raise_bad_leaf(self, i, ax, leaves, dyn, kwargs):
    where = _pretty(axes_lib.leaf_paths((dyn, kwargs))[i])
    x = leaves[i]
    shape = getattr(x, "shape", None)
    if shape is None and isinstance(x, (bool, int, float, complex)):
      shape = ()  # a Python scalar: a rank-0 value
    if shape is None:
      raise TypeError(
        f"{API}: argument {where} of {describe(self.fun)} is a "
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
      f"{API}: argument {where} of {describe(self.fun)} has shape "
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
      f"{API}: the mapped arguments of {describe(self.fun)} disagree on the "
      f"mapped size ({'; '.join(sizes)}); every mapped argument needs the "
      "same size along its in_axes axis (the number of devices)."
    )


def _index_tuple(what: str, value: Any) -> tuple[int, ...]:
  """An argnums option as ints, accepting what ``jax.pmap`` accepts: an int
  or an iterable of them, where anything with ``__index__`` (a bool, a numpy
  or concrete JAX integer) counts as an int."""
  try:
    return (operator.index(value),)
  except TypeError:
    pass
  try:
    return tuple(map(operator.index, value))
  except TypeError:
    raise TypeError(
      f"{API}: {what} must be an int or a collection of ints, got "
      f"{value!r} of type {type(value).__name__}; pass e.g. {what}=(1,)."
    ) from None


def _axis_size(value: Any) -> Any:
  """axis_size as ``jax.pmap`` uses it: an integer by ``operator.index``
  (``np.int64(8)``, ``True``); any other value is kept and checked at each
  call, where ``jax.pmap`` checks it (``Arguments._check_axis_size``)."""
  if value is None or not _hashable(value):  # np.array(8) has __index__
    return value
  try:
    return operator.index(value)
  except TypeError:
    return value


def _positions(nums: tuple[int, ...]) -> tuple[int, ...]:
  """The argument positions an argnums option names: sorted, distinct,
  negative ones dropped."""
  return tuple(sorted({i for i in nums if i >= 0}))


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
