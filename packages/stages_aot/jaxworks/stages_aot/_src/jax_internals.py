"""The only module of jaxworks.stages_aot that imports private ``jax._src`` names.

Each name is used for one reason, and tests/jax_internals_test.py covers every
one, so that a JAX upgrade that moves or changes one fails there first:

* ``LoweringParameters`` (``jax._src.interpreters.mlir``): the lowering options
  that ``jax.export`` uses (``for_export=True``, constants kept inside the
  module). ``jax.stages.Traced.lower`` accepts them as ``_private_parameters``;
  lowering once with them lets ``Lowered.export()`` reuse that very lowering
  instead of lowering a second time.
* ``export_lowered`` (``jax._src.export._export._export_lowered``): turns a
  ``jax.stages.Lowered`` plus its jaxpr and function name into a
  ``jax.export.Exported``. It is the part of ``jax.export.export`` that runs
  after lowering; the jaxpr is what makes the exported program differentiable.
"""

from __future__ import annotations

import jax
from jax._src.export._export import _export_lowered as export_lowered
from jax._src.interpreters.mlir import LoweringParameters

__all__ = ["LoweringParameters", "export_lowered", "export_lowering_parameters"]


def export_lowering_parameters() -> LoweringParameters:
    """Returns lowering parameters equal to the ones ``jax.export.export`` uses."""
    return LoweringParameters(
        for_export=True,
        hoist_constants_as_args=False,
        export_ignore_forward_compatibility=bool(
            jax.config.jax_export_ignore_forward_compatibility
        ),
    )
