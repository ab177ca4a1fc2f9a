"""The one adapter between stages_aot and the traced object it starts from.

``stages_aot.trace(f, ...)`` traces with ``jaxworks.jit_cache.jit``. Any traced
object with ``jaxpr``, ``fun_name``, ``in_avals``, ``args_info``, ``out_info``
and ``lower(lowering_platforms=...)`` can enter the stages: a
``jaxworks.jit_cache.Traced`` or a stock ``jax.stages.Traced``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from . import deps
from . import jax_internals

#: Attributes an object needs to enter the stages (see ``Traced.from_traced``).
TRACED_ATTRIBUTES = (
  "jaxpr",
  "fun_name",
  "in_avals",
  "args_info",
  "out_info",
  "lower",
)


# Checked at import: jaxworks.jit_cache present and recent enough.
_jit_cache = deps.load_jit_cache()


def default_jit():
  """Returns the jit that ``stages_aot.trace`` uses: ``jaxworks.jit_cache.jit``."""
  return _jit_cache.jit


def missing_attributes(obj: Any) -> list[str]:
  """The names in :data:`TRACED_ATTRIBUTES` that ``obj`` lacks."""
  return [name for name in TRACED_ATTRIBUTES if not hasattr(obj, name)]


@functools.lru_cache(maxsize=64)
def _accepts_private_parameters(lower_fn) -> bool:
  try:
    params = inspect.signature(lower_fn).parameters
  except (TypeError, ValueError):
    return False
  return "_private_parameters" in params or any(
    p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()
  )


def lower_traced(traced: Any, platforms: tuple[str, ...]) -> tuple[Any, bool]:
  """Lowers a traced object for ``platforms``, with jax.export's lowering parameters.

  Returns:
    ``(lowered, for_export)``: a ``jax.stages.Lowered`` and whether it was
    lowered with the export parameters (stock ``jax.stages.Traced`` and
    ``jaxworks.jit_cache.Traced`` both accept them). It is False for a traced
    object whose ``lower`` only takes ``lowering_platforms``; the module is then
    jax's default lowering, the same except for the forward-compatibility mode
    of Pallas/Mosaic TPU kernels.
  """
  lower_fn = traced.lower
  underlying = getattr(lower_fn, "__func__", lower_fn)
  if _accepts_private_parameters(underlying):
    params = jax_internals.export_lowering_parameters()
    return lower_fn(
      lowering_platforms=platforms, _private_parameters=params
    ), True
  return lower_fn(lowering_platforms=platforms), False
