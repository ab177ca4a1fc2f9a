"""Adopting ``jit_cache.jit`` across a whole program: ``install()``.

``install()`` assigns :func:`jaxworks.jit_cache.jit` to the attribute
``jax.jit`` (and nothing else); ``uninstall()`` puts back what was there
before; ``installed()`` does both around a block. jit_cache itself never looks
up ``jax.jit`` at call time (it binds stock JAX's ``jit`` at import), so the
swap cannot make it call itself. The mechanism is ``_src/swap.py``, shared by
every jaxworks package that adopts a JAX entry point.

>>> import jax
>>> from jaxworks import jit_cache
>>> with jit_cache.installed():
...   jax.jit is jit_cache.jit
True
"""

import jax

from . import api as _api
from . import swap as _swap

is_installed, install, uninstall, installed = _swap.adoption(
  "jaxworks.jit_cache",
  jax,
  "jit",
  _api.jit,
  defined_in=__name__,
  keeps="``from jax import jit`` executed before ``install()``, JAX's own "
  "internal uses of jit (``jax.numpy``, ``lax``), "
  "``jax.experimental.pjit.pjit`` and functions already wrapped with "
  "``jax.jit``",
)
