"""Implementation of jaxworks.pmap_chunked; import the public API from ``jaxworks.pmap_chunked``.

``deps`` is imported first: it checks every jaxworks package the modules here
import, so a missing or outdated one fails with the ``pip install`` to run.
"""

from . import deps as deps
