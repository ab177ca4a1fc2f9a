"""Adopting ``pmap_chunked.pmap`` across a whole program: ``install()``.

``install()`` assigns :func:`jaxworks.pmap_chunked.pmap` to the attribute
``jax.pmap`` and to nothing else; ``uninstall()`` puts back what was there
before; ``installed()`` does both around a block. The mechanism is
``_src/swap.py``, shared by every jaxworks package that adopts a JAX entry
point.

``jax.device_put_replicated`` and ``jax.device_put_sharded`` are not
installed. JAX 0.10 removed them from the public API (touching them raises an
``AttributeError`` that points at the migration guide), and libraries test
for them to pick a code path; bringing them back under those names would send
such code down the path written for JAX 0.9 and its ``PmapSharding``. Call
:func:`jaxworks.pmap_chunked.device_put_replicated` / ``device_put_sharded``
by name instead.

pmap_chunked binds every stock JAX callable it builds on when it is imported
(``jax.shard_map`` and the others) and calls ``jaxworks.jit_cache.jit`` and
``jaxworks.batched_transfer.device_put`` by name, so the swap (also together
with ``jax.jit = jit_cache.jit`` and ``jax.device_put =
batched_transfer.device_put``) cannot make it call itself.

>>> import jax
>>> from jaxworks import pmap_chunked
>>> with pmap_chunked.installed():
...   jax.pmap is pmap_chunked.pmap
True
"""

import jax

from . import api as _api
from . import swap as _swap

is_installed, install, uninstall, installed = _swap.adoption(
  "jaxworks.pmap_chunked",
  jax,
  "pmap",
  _api.pmap,
  defined_in=__name__,
  note="Not ``jax.device_put_replicated``/``jax.device_put_sharded``, which "
  "JAX 0.10 removed: call pmap_chunked's functions of those names.",
  keeps="``from jax import pmap`` executed before ``install()``, and "
  "functions already wrapped",
)
