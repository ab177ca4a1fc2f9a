"""Public functions of jaxworks.axis_names (re-exported by ``__init__``)."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Mapping
import os
from typing import Any
from typing import cast

from jax.extend.core import ClosedJaxpr
from jax.extend.core import Jaxpr

from . import analysis
from . import check as _check
from . import jax_internals
from . import rename as _rename
from . import report as _report
from . import tracing
from .check import diagnose as diagnose
from .errors import AxisNameError as AxisNameError
from .report import CollectiveReport as CollectiveReport
from .report import CollectiveStat as CollectiveStat

_API = "jaxworks.axis_names.used_axis_names"

# JAX's filtered tracebacks hide this package's frames as they hide JAX's:
# an error about the user's program ends at the user's call.
jax_internals.hide_frames_of(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
check_axis_names = jax_internals.api_boundary(_check.check_axis_names)
rename_axes = jax_internals.api_boundary(_rename.rename_axes)
collective_report = jax_internals.api_boundary(_report.collective_report)


@jax_internals.api_boundary
def used_axis_names(
  x: Callable | ClosedJaxpr | Jaxpr,
  *args: Any,
  axis_sizes: Mapping[Hashable, int] | None = None,
  **kwargs: Any,
) -> frozenset[Hashable]:
  """The free axis names a jaxpr or function uses.

  A name is used when a collective (``psum``, ``all_gather``, ``ppermute``,
  ...) or an axis query (``axis_index``) mentions it, directly or in any
  sub-jaxpr (``jit``, ``cond``, ``while``, ``scan``, ``remat``,
  ``custom_jvp``/``custom_vjp``, ``shard_map``, ...), and no binder around it
  (a ``shard_map`` over that mesh axis, ``pmap``'s ``axis_name``) binds it.
  Such a name is reported also where JAX 0.10.2 leaves it out of
  ``jaxpr.effects`` (``ppermute``, ``custom_linear_solve``'s ``matvec``, a
  nested ``shard_map``, a ``pallas_call`` kernel).

  For a ``Jaxpr`` or ``ClosedJaxpr`` the result is computed bottom-up once
  per jaxpr object (every sub-jaxpr memoized too, weakly held), so repeated
  queries are a dictionary lookup. A callable is traced with
  ``jax.make_jaxpr`` first; free names it uses need not be bound (they are
  bound with a placeholder size while tracing).

  Args:
    x: a ``Jaxpr``, a ``ClosedJaxpr``, a ``Traced`` (from ``jax.jit``,
      ``jaxworks.jit_cache.jit``, ``stages_aot.trace`` or
      ``pmap_chunked.pmap``), jaxworks' ``Lowered``, or a callable.
    *args: example arguments when ``x`` is a callable.
    axis_sizes: optional ``{name: size}`` to trace ``x`` with, when its
      output shapes depend on axis sizes.
    **kwargs: keyword arguments for a callable ``x``.

  Returns:
    A frozenset of axis names (usually strings).

  >>> import jax, jax.numpy as jnp
  >>> def f(x):
  ...   y = jax.lax.psum(x, 'i')
  ...   return jax.lax.cond(y[0] > 0, lambda v: v * jax.lax.axis_index('j'),
  ...                       lambda v: v, y)
  >>> sorted(used_axis_names(f, jnp.ones(2)))
  ['i', 'j']
  >>> jaxpr = jax.make_jaxpr(f, axis_env=[('i', 2), ('j', 4)])(jnp.ones(2))
  >>> sorted(used_axis_names(jaxpr))
  ['i', 'j']
  """
  names = analysis.closed_or_open_names(x, _API)
  if names is not None:
    if args or kwargs or axis_sizes is not None:
      raise TypeError(
        f"{_API}: got a {type(x).__name__} plus example arguments or "
        "axis_sizes; those are only for a callable. Pass the jaxpr alone."
      )
    return names
  sizes = tracing.check_axis_sizes(axis_sizes, _API)
  # Not a jaxpr (returned above); tracing rejects a non-callable.
  closed, _ = tracing.trace(cast(Callable, x), args, kwargs, sizes, _API)
  return analysis.jaxpr_axis_names(closed.jaxpr)
