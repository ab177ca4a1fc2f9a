"""Adopting ``batched_transfer.device_put`` across a whole program: ``install()``.

``install()`` assigns :func:`jaxworks.batched_transfer.device_put` to the
attribute ``jax.device_put`` (and nothing else); ``uninstall()`` puts back what
was there before; ``installed()`` does both around a block. The package itself
never looks up ``jax.device_put`` or ``jax.jit`` at call time (it binds stock
JAX's functions at import), so the swap cannot make it call itself. The
mechanism is ``_src/swap.py``, shared by every jaxworks package that adopts a
JAX entry point.

>>> import jax
>>> from jaxworks import batched_transfer
>>> with batched_transfer.installed():
...   jax.device_put is batched_transfer.device_put
True
"""

import jax

from . import api as _api
from . import swap as _swap

is_installed, install, uninstall, installed = _swap.adoption(
  "jaxworks.batched_transfer",
  jax,
  "device_put",
  _api.device_put,
  defined_in=__name__,
  note="It has the same signature, results and exception classes.",
  keeps="``from jax import device_put`` executed before ``install()``, and "
  "JAX's own internal transfers (``jnp.asarray``, jit argument handling)",
)
