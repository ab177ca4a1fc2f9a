"""A pmap call's arguments: static values, flat leaves, mapped axes and size.

``Pmapped`` inherits :class:`Arguments`; its methods read the options the
constructor checked (``_statics``, ``_in_axes``, ``_axis_size``, ...). Errors
name the argument by its path (``args[1]['w']``) and say the fix.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
import struct
from typing import Any

import jax
import numpy as np

from . import axes as axes_lib

API = "jaxworks.pmap_chunked.pmap"


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


class PmapState:
  """What ``Pmapped``'s constructor checked and keeps, read by its mixins."""

  _fun: Callable
  _axis_name: Any
  _anonymous: bool
  _in_axes: Any
  _out_axes: Any
  _negative_in: bool
  _negative_out: bool
  _statics: tuple[int, ...]
  _donate: tuple[int, ...]
  _devices: Any
  _backend: str | None
  _axis_size: int | None
  _chunked: bool
  _flat_axes: collections.OrderedDict
  _lookup: Callable[..., Any]
  _store: Callable[..., None]
  _name: Callable[[], str]


class Arguments(PmapState):
  """Argument parsing of :class:`~.pmap.Pmapped` (a mixin)."""

  def _parse(self, args: tuple, kwargs: dict):
    """Static values, flat dynamic leaves, their structure, axes and size."""
    statics = self._statics
    if statics:
      if statics[-1] >= len(args):
        raise ValueError(
          f"{API}: pmapped function has static_broadcasted_argnums="
          f"{statics} but was called with only {len(args)} positional "
          f"argument{'' if len(args) == 1 else 's'}. All static broadcasted "
          f"arguments must be passed positionally. Pass argument "
          f"{statics[-1]} of {self._name()} (and every one before it) by "
          "position."
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
          f"{API}: pmap requires at least one argument with a mapped axis. "
          f"No argument leaf of {self._name()} is mapped (its in_axes are "
          "None, or it has no array leaves), so the mapped size is unknown; "
          "pass axis_size=<number of devices> to pmap or map at least one "
          "array argument."
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


def merge_statics(statics, static_vals, dyn_args, nargs) -> list:
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
