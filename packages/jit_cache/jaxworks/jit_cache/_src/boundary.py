"""Where user calls enter jit_cache: tracebacks and axis-name errors.

``entry_point`` makes a ``JitFunction`` method a JAX API boundary, and the
package's source directory is hidden from JAX's filtered tracebacks, so a
user error shows the user's frames as under ``jax.jit``. An unbound axis
name in a top-level call raises ``jaxworks.axis_names``' diagnostic
instead of stock's bare ``AssertionError`` (inside a ``shard_map``) or
``NameError``; under an outer trace, the error is stock's, for the code
that traces to handle. ``jaxworks.axis_names`` is imported for the first
such error (it is not on the path of a call that works).
"""

from __future__ import annotations

from collections.abc import Callable
import functools
import os
from typing import Any

from . import deps as _deps
from . import jax_internals as ji

API = "jaxworks.jit_cache.jit"

# JAX's filtered tracebacks hide jit_cache's frames as they hide JAX's own.
ji.hide_frames_of(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def entry_point(method: Callable) -> Callable:
  """A JitFunction method as a JAX API boundary (tracebacks filtered as
  stock's), raising axis_names' diagnostic for an unbound axis name: an
  ``AxisNameError`` with file:line, "did you mean", the collective as
  written, and an instance of the ``NameError``/``AssertionError`` stock
  raises."""

  @functools.wraps(method)
  def entry(self, *args, **kwargs):
    try:
      return method(self, *args, **kwargs)
    except (NameError, AssertionError) as e:
      found = axis_name_error(self._fun, e, args, kwargs)  # pylint: disable=protected-access
      if found is None:
        raise
      raise found from e

  return ji.api_boundary(entry)


def axis_name_error(
  fun: Any, error: BaseException, args: tuple, kwargs: dict
) -> BaseException | None:
  """axis_names' diagnostic for JAX's error about an unbound axis name in a
  top-level call of ``fun`` (the user's function); None for any other error,
  and under an outer trace (which handles it: axis_names' own, a user's)."""
  if fun is None or ji.current_trace.value is not ji.eval_trace:
    return None
  return _deps.load_axis_names().diagnose(error, fun, *args, api=API, **kwargs)
