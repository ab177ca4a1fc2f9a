"""Implementation of jaxworks.stages_aot; import the public API from ``jaxworks.stages_aot``.

jaxworks.jit_cache is checked first (``deps.load_jit_cache``), so a missing
or outdated one fails with the ``pip install`` to run.
"""

from . import deps as _deps

_deps.load_jit_cache()
