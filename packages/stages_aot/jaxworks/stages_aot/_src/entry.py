"""The one place stages_aot reaches jaxworks.jit_cache, which owns the stages.

``stages_aot.trace(f, ...)`` traces with ``jaxworks.jit_cache.jit``; the stage
classes (``Traced``, ``Lowered``, ``Compiled``) and cross-platform lowering
are jit_cache's, so stages_aot never inspects a ``lower`` signature nor
passes a private JAX parameter.
"""

from __future__ import annotations

from . import deps

# Checked at import: jaxworks.jit_cache present and recent enough.
jit_cache = deps.load_jit_cache()


def default_jit():
  """Returns the jit that ``stages_aot.trace`` uses: ``jaxworks.jit_cache.jit``."""
  return jit_cache.jit
