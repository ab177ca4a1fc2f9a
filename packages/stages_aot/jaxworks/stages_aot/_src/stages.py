"""``trace``: the first stage, and the exporter behind ``Lowered.export``.

The stage family (``Traced`` -> ``Lowered`` -> ``Compiled``) is
``jaxworks.jit_cache``'s: ``trace(f, ...)`` returns a ``jit_cache.Traced``,
whose ``lower(lowering_platforms=...)`` lowers once for any of cpu, cuda,
rocm and tpu with ``jax.export``'s lowering parameters. Importing this module
registers :func:`export_stock` with jit_cache, so ``Lowered.export()`` returns
this package's :class:`Exported` (serializable, with VJPs and validation),
whichever package the ``Lowered`` came from.
"""

from __future__ import annotations

import os

import jax
import jax.extend.source_info_util

from jaxworks.jit_cache import Compiled as Compiled
from jaxworks.jit_cache import Lowered as Lowered
from jaxworks.jit_cache import Traced as Traced
from jaxworks.jit_cache import register_exporter

from . import entry
from .exported import Exported

# Keep this package's frames out of the source locations of lowered modules
# (and out of filtered tracebacks), as JAX does for its own frames.
jax.extend.source_info_util.register_exclusion(
  os.path.dirname(os.path.dirname(__file__))
)


def trace(fun, *args, **kwargs) -> Traced:
  """Traces ``fun`` for the given arguments; the first stage.

  ``fun`` is jitted with ``jaxworks.jit_cache.jit`` unless it is already a
  jitted function (anything with a ``trace`` method, e.g. ``jax.jit(f,
  static_argnums=...)`` or ``jaxworks.jit_cache.jit(f, ...)``), whose options
  are then kept.

  Args:
    fun: the function, or a jitted function.
    *args: arrays, ``jax.ShapeDtypeStruct`` s (with shardings, or with
      symbolic dimensions from :func:`arg_spec`), or static values for static
      arguments of a jitted ``fun``.
    **kwargs: keyword arguments, likewise.

  Returns:
    A ``jaxworks.jit_cache.Traced`` (a ``jax.stages.Traced``).

  >>> import jax.numpy as jnp
  >>> traced = trace(jnp.sin, jax.ShapeDtypeStruct((4,), jnp.float32))
  >>> traced.fun_name, traced.jaxpr.eqns[0].primitive.name
  ('sin', 'sin')
  """
  if not callable(fun):
    raise TypeError(
      f"jaxworks.stages_aot.trace: expected a function to trace, got "
      f"{type(fun).__name__} {fun!r}"
    )
  _check_symbolic_scopes(args, kwargs)
  trace_method = getattr(fun, "trace", None)
  jitted = fun if callable(trace_method) else entry.default_jit()(fun)
  return Traced.from_traced(jitted.trace(*args, **kwargs))


def _check_symbolic_scopes(args, kwargs) -> None:
  """Symbolic dimensions of all arguments must come from one SymbolicScope."""
  first = None
  leaves = jax.tree_util.tree_flatten_with_path((args, kwargs))[0]
  for path, leaf in leaves:
    shape = getattr(leaf, "shape", None)
    if not isinstance(shape, tuple):
      continue
    for d in shape:
      if not jax.export.is_symbolic_dim(d):
        continue
      name = ("args" if path[0].idx == 0 else "kwargs") + jax.tree_util.keystr(
        path[1:]
      )
      if first is None:
        first = (d.scope, name)
      elif d.scope is not first[0]:
        raise ValueError(
          f"jaxworks.stages_aot.trace: the symbolic dimensions of {first[1]} and "
          f"{name} come from different scopes, so equal names would not denote "
          "equal sizes; create the specs together, e.g. arg_specs('f32[b,128]', "
          "'f32[b]'), or pass one jax.export.SymbolicScope to symbolic_shape"
        )


def export_stock(exported: jax.export.Exported, *, vjp_order: int) -> Exported:
  """What ``Lowered.export()`` returns: this package's :class:`Exported` of
  the lowering's stock ``jax.export.Exported`` (registered with jit_cache)."""
  return Exported(exported, vjp_order=vjp_order)


register_exporter(export_stock)

__all__ = ["Compiled", "Lowered", "Traced", "trace"]
