"""Tracing a user function to a ClosedJaxpr while some axis names are free.

``jax.make_jaxpr(f)(x)`` raises ``NameError`` as soon as ``f`` uses an axis
name that nothing binds. To analyse such a function we bind the names the
caller gave sizes for (``axis_sizes``) and, for any other name JAX reports
as unbound, bind it with a placeholder size of 1 and trace again. The
caller learns which names were placeholders.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Mapping
import os
import sysconfig
import traceback as _traceback
from typing import Any

import jax
from jax.extend.core import ClosedJaxpr
from jax.extend.core import Jaxpr
import jaxlib

from . import analysis
from . import jax_internals
from .errors import AxisNameError

# Stock JAX, bound at import (a swapped-in ``jax.make_jaxpr`` is not used).
_make_jaxpr = jax.make_jaxpr

PLACEHOLDER_SIZE = 1
_MAX_RETRIES = 256


def check_axis_sizes(axis_sizes: Any, api: str) -> dict[Hashable, int]:
  """Validates ``axis_sizes`` and returns it as a dict."""
  if axis_sizes is None:
    return {}
  if not isinstance(axis_sizes, Mapping):
    raise TypeError(
      f"{api}: axis_sizes must be a mapping from axis name to size, got "
      f"{axis_sizes!r} of type {type(axis_sizes).__name__}; pass e.g. "
      "axis_sizes={'i': 8}"
    )
  for name, size in axis_sizes.items():
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
      raise ValueError(
        f"{api}: axis_sizes[{name!r}] = {size!r} is not a positive int; "
        "give each axis name its number of devices (or shards), e.g. "
        f"axis_sizes={{{name!r}: 8}}"
      )
  return dict(axis_sizes)


def trace(
  fun: Callable,
  args: tuple,
  kwargs: dict,
  axis_sizes: Mapping[Hashable, int],
  api: str,
  use_placeholders: bool = True,
  placeholders: dict[Hashable, NameError] | None = None,
) -> tuple[ClosedJaxpr, dict[Hashable, NameError]]:
  """Traces ``fun(*args, **kwargs)``, binding free axis names as needed.

  With ``use_placeholders`` False no name is bound with a placeholder:
  JAX's ``NameError`` propagates. ``placeholders``, when given, is the dict
  filled (and returned): the caller sees the names bound so far also when
  a later retry fails.

  Returns:
    The ClosedJaxpr and ``{name: NameError}`` for each name that had to be
    bound with ``PLACEHOLDER_SIZE`` (the error JAX raised for it).

  Raises:
    TypeError: ``fun`` is not callable.
    NameError: JAX reported an unbound name that cannot be recovered from
      its message (a non-string name); the caller turns it into an
      ``AxisNameError``.
  """
  if not callable(fun):
    raise TypeError(
      f"{api}: expected a Jaxpr, a ClosedJaxpr or a callable with example "
      f"arguments, got {fun!r} of type {type(fun).__name__}"
    )
  env = dict(axis_sizes)
  if placeholders is None:
    placeholders = {}
  for _ in range(_MAX_RETRIES):
    try:
      closed = _make_jaxpr(fun, axis_env=list(env.items()))(*args, **kwargs)
      return closed, placeholders
    except NameError as e:
      name = jax_internals.unbound_axis_name(e)
      if not use_placeholders or name is None or name in env:
        raise
      env[name] = PLACEHOLDER_SIZE
      placeholders[name] = e
  raise RuntimeError(
    f"{api}: gave up after binding {_MAX_RETRIES} free axis names of "
    f"{getattr(fun, '__name__', fun)!r}"
  )


def jaxpr_of(
  fun: Any,
  args: tuple,
  kwargs: dict,
  axis_sizes: Mapping[Hashable, int],
  api: str,
  fix: str,
  placeholders: dict[Hashable, NameError] | None = None,
) -> Jaxpr:
  """The Jaxpr of a Jaxpr, a ClosedJaxpr, a stage (``Traced``, jaxworks'
  ``Lowered``), or a callable traced on its args.

  An unbound name that tracing cannot recover from becomes an
  ``AxisNameError`` naming ``api``, the user's line and ``fix``. Names bound
  with a placeholder size go into ``placeholders`` (see ``trace``).
  """
  fun = analysis.stage_jaxpr(fun, api)
  if isinstance(fun, (ClosedJaxpr, Jaxpr)):
    if args or kwargs:
      raise TypeError(
        f"{api}: got a {type(fun).__name__} plus example arguments; those "
        "are only for a callable. Pass the jaxpr alone."
      )
    return fun.jaxpr if isinstance(fun, ClosedJaxpr) else fun
  try:
    closed, _ = trace(
      fun, args, kwargs, axis_sizes, api, placeholders=placeholders
    )
  except NameError as e:
    if isinstance(e, AxisNameError):
      raise
    loc = user_location_of_exception(e)
    raise AxisNameError(
      f"{api}: {e} (at {loc or 'an unknown location'}); {fix}",
      primitive="unknown",
      axis_name=None,
      bound=tuple(axis_sizes),
      location=loc,
    ) from e
  return closed.jaxpr


def _dir_of(module) -> str:
  return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


# Frames in these directories are not the user's: JAX, jaxlib and this
# package; nor is the standard library, except packages installed inside
# its tree (``.../lib/python3.X/site-packages`` of a system Python).
_NOT_USER = (
  _dir_of(jax),
  _dir_of(jaxlib),
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
)
_STDLIB = sysconfig.get_path("stdlib") + os.sep
_INSTALLED = (
  os.sep + "site-packages" + os.sep,
  os.sep + "dist-packages" + os.sep,
)


def _is_user_file(filename: str) -> bool:
  path = os.path.abspath(filename)
  if path.startswith(_NOT_USER):
    return False
  return not path.startswith(_STDLIB) or any(p in path for p in _INSTALLED)


def _user_call(tb) -> tuple[str | None, str | None]:
  frames = _traceback.extract_tb(tb)
  for i in range(len(frames) - 1, -1, -1):
    fr = frames[i]
    if _is_user_file(fr.filename):
      called = frames[i + 1].name if i + 1 < len(frames) else None
      return f"{fr.filename}:{fr.lineno} ({fr.name})", called
  return None, None


def user_location_of_exception(err: BaseException) -> str | None:
  """``file:line (function)`` of the innermost user frame in a traceback."""
  return _user_call(err.__traceback__)[0]


def user_call_of_exception(err: BaseException) -> tuple[str | None, str | None]:
  """``(file:line (function), name)`` of the innermost user frame in a
  traceback (JAX's frames kept) and of the function it called there
  (``pmean``), or Nones."""
  return _user_call(jax_internals.unfiltered_traceback(err))
