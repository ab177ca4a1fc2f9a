"""Argument numbers and names: ``static_argnums``/``argnames`` and
``donate_argnums``/``argnames`` checked and completed from the function's
signature, as ``jax.jit`` documents (an argnum names its parameter and the
reverse), with errors that name the bad value and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import inspect
import operator
from typing import Any

import jax

_tree_flatten_with_path = jax.tree_util.tree_flatten_with_path
_keystr = jax.tree_util.keystr


def check_argnums(
  value: Any,
  what: str,
  *,
  api: str = "jaxworks.jit_cache.jit",
  nonnegative: bool = False,
) -> tuple[int, ...]:
  """An argnums option as a tuple of ints (public as ``check_argnums``).

  Args:
    value: None, an int or an iterable of ints, normalized as ``jax.jit``
      does: anything with ``__index__`` (numpy integers, ``True``) is one
      position, anything else is iterated (tuples, lists, numpy arrays,
      generators).
    what: the option's name for messages, e.g. ``"static_argnums"``.
    api: the public API name messages start with.
    nonnegative: reject negative positions (as ``pmap`` does).

  Returns:
    The positions as Python ints, in the order given (``()`` for None).

  Raises:
    TypeError: anything else, naming the option, the value and the fix.

  >>> check_argnums(1, "static_argnums")
  (1,)
  >>> check_argnums([2, 0], "donate_argnums")
  (2, 0)
  >>> import numpy as np
  >>> check_argnums(np.array([1, 3]), "static_argnums")
  (1, 3)
  """
  if value is None:
    return ()
  try:
    out: tuple[int, ...] | None = (operator.index(value),)
  except TypeError:
    try:
      out = tuple(map(operator.index, value))
    except TypeError:
      out = None
  if out is None:
    raise TypeError(
      f"{api}: {what} must be an int or a sequence of ints, got "
      f"{value!r}; pass e.g. {what}=(1,)"
    )
  if nonnegative and any(i < 0 for i in out):
    raise TypeError(
      f"{api}: {what} must hold non-negative ints (positions of positional "
      f"arguments), got {value!r}; pass e.g. {what}=(1,)"
    )
  return out


def name_tuple(value: Any, what: str) -> tuple[str, ...]:
  if value is None:
    return ()
  items = (value,) if isinstance(value, str) else value
  try:
    out = tuple(items)
  except TypeError:
    out = None
  if out is None or not all(isinstance(n, str) for n in out):
    raise TypeError(
      f"jaxworks.jit_cache.jit: {what} must be a str or a sequence of "
      f"str, got {value!r}"
    )
  return out


def parse_argnums(specs: tuple, whats: tuple) -> tuple:
  """Each of ``specs`` (argnums, argnames, ...) normalized, None kept, in
  ``jax.jit``'s order: a bad type in any of them is reported (TypeError)
  before a value that does not fit the function (ValueError)."""
  return tuple(
    None
    if v is None
    else (
      check_argnums(v, what) if what.endswith("nums") else name_tuple(v, what)
    )
    for v, what in zip(specs, whats)
  )


def resolve_argnums(
  fun: Callable,
  name: str,
  sig: inspect.Signature | None,
  argnums: Any,
  argnames: Any,
  what: str,
) -> tuple[tuple[int, ...], tuple[str, ...]]:
  """Completes argnums from argnames or the reverse, as jax.jit documents.

  ``argnums`` and ``argnames`` are the user's values, or what
  :func:`parse_argnums` made of them."""
  if argnums is None and argnames is None:
    return (), ()
  nums = check_argnums(argnums, f"{what}_argnums")
  names = name_tuple(argnames, f"{what}_argnames")
  if sig is None:
    return nums, names
  params = list(sig.parameters.values())
  kinds = inspect.Parameter
  positional = [
    p
    for p in params
    if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)
  ]
  if not any(p.kind is kinds.VAR_POSITIONAL for p in params):
    n = len(positional)
    for i in nums:
      if not -n <= i < n:
        raise ValueError(
          f"jaxworks.jit_cache.jit: {what}_argnums {i} out of range for "
          f"{name} with {n} positional args; use an index in [{-n}, {n}) "
          f"or {what}_argnames"
        )
  positional_only = {p.name for p in params if p.kind is kinds.POSITIONAL_ONLY}
  if bad := sorted(set(names) & positional_only):
    raise ValueError(
      f"jaxworks.jit_cache.jit: {what}_argnames {bad} of {name} are "
      f"positional-only parameters; use {what}_argnums instead"
    )
  if not any(p.kind is kinds.VAR_KEYWORD for p in params):
    valid = {
      p.name
      for p in params
      if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)
    }
    if bad := sorted(set(names) - valid):
      raise ValueError(
        f"jaxworks.jit_cache.jit: {what}_argnames {bad} are not parameters "
        f"of {name} (it takes {sorted(valid)}); fix the names"
      )
  if argnums is not None and argnames is None:
    names = tuple(
      p.name
      for i, p in enumerate(params)
      if p.kind is kinds.POSITIONAL_OR_KEYWORD and i in nums
    )
  elif argnames is not None and argnums is None:
    nums = tuple(
      i
      for i, p in enumerate(params)
      if p.kind is kinds.POSITIONAL_OR_KEYWORD and p.name in names
    )
  return nums, names


def fun_name(fun: Callable) -> str:
  name = getattr(fun, "__name__", None)
  if name is None and isinstance(fun, functools.partial):
    return fun_name(fun.func)
  return name if isinstance(name, str) else type(fun).__name__


def signature_of(fun: Callable) -> inspect.Signature | None:
  try:
    return inspect.signature(fun)
  except (TypeError, ValueError):
    return None


def split_statics(
  args: tuple,
  kwargs: dict,
  static_argnums: tuple[int, ...],
  static_argnames: frozenset[str],
  name: str,
) -> tuple[tuple, dict, tuple]:
  """(dynamic args, dynamic kwargs, hashable statics key) of a call.

  Raises:
    ValueError: a static argument is not hashable (naming it and the fix).
  """
  statics: list[Any] = []
  if static_argnums:
    n = len(args)
    idx = {i + n if i < 0 else i for i in static_argnums}
    idx = {i for i in idx if 0 <= i < n}
    statics.extend((i, args[i]) for i in sorted(idx))
    dyn_args = tuple(a for i, a in enumerate(args) if i not in idx)
  else:
    dyn_args = args
  if kwargs and static_argnames:
    statics.extend(
      (k, kwargs[k]) for k in sorted(kwargs) if k in static_argnames
    )
    dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_argnames}
  else:
    dyn_kwargs = kwargs
  key = tuple((where, type(v), v) for where, v in statics)
  try:
    hash(key)
  except TypeError:
    for where, v in statics:
      try:
        hash(v)
      except TypeError as e:
        label = (
          f"argument {where}"
          if isinstance(where, int)
          else f"argument {where!r}"
        )
        raise ValueError(
          "jaxworks.jit_cache.jit: Non-hashable static arguments are "
          f"not supported: static {label} of {name} is "
          f"not hashable: {type(v).__name__} {v!r:.80} ({e}); pass a "
          "hashable value (for example a tuple instead of a list) or "
          "make the argument dynamic"
        ) from None
    raise
  return dyn_args, dyn_kwargs, key


def leaf_paths(
  args: tuple,
  kwargs: dict,
  static_argnums: tuple[int, ...],
  static_argnames: frozenset[str],
  param_names: list[str] | None,
) -> list[str]:
  """Readable path of each dynamic leaf, e.g. ``x['w']`` or ``args[2][0]``."""
  n = len(args)
  static_idx = {i + n if i < 0 else i for i in static_argnums}
  dyn_positions = [i for i in range(n) if i not in static_idx]
  dyn_args = tuple(args[i] for i in dyn_positions)
  dyn_kwargs = {k: v for k, v in kwargs.items() if k not in static_argnames}
  flat, _ = _tree_flatten_with_path((dyn_args, dyn_kwargs))
  out = []
  for path, _ in flat:
    if not path:
      out.append("?")
      continue
    head = path[0].idx if hasattr(path[0], "idx") else 0
    if head == 0 and len(path) > 1 and hasattr(path[1], "idx"):
      pos = dyn_positions[path[1].idx]
      names = param_names or []
      base = names[pos] if pos < len(names) else f"args[{pos}]"
    elif head == 1 and len(path) > 1 and hasattr(path[1], "key"):
      base = str(path[1].key)
    else:
      out.append(_keystr(path))
      continue
    out.append(base + _keystr(tuple(path[2:])))
  return out
