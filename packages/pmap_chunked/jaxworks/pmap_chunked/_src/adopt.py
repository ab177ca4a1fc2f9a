"""Adopting ``pmap_chunked.pmap`` across a whole program: ``install()``.

``install()`` assigns :func:`jaxworks.pmap_chunked.pmap` to the attribute
``jax.pmap`` and to nothing else; ``uninstall()`` puts back what was there
before; ``installed()`` does both around a block.

``jax.device_put_replicated`` and ``jax.device_put_sharded`` are not
installed. JAX 0.10 removed them from the public API (touching them raises an
``AttributeError`` that points at the migration guide), and libraries test
for them to pick a code path; bringing them back under those names would send
such code down the path written for JAX 0.9 and its ``PmapSharding``s. Call
:func:`jaxworks.pmap_chunked.device_put_replicated` / ``device_put_sharded``
by name instead.

pmap_chunked binds every stock JAX callable it builds on when it is imported
(``jax.shard_map`` and the others) and calls ``jaxworks.jit_cache.jit`` and
``jaxworks.batched_transfer.device_put`` by name, so the swap (also together
with ``jax.jit = jit_cache.jit`` and ``jax.device_put =
batched_transfer.device_put``) cannot make it call itself.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib

import jax

from . import api as _api
from . import swap as _swap

#: The one name install() replaces (the mechanism: ``_src/swap.py``, shared
#: by every jaxworks package that adopts a JAX entry point).
_SWAP = _swap.Swap("jaxworks.pmap_chunked", [(jax, "pmap", _api.pmap)])


def is_installed() -> bool:
  """True while ``jax.pmap`` is :func:`jaxworks.pmap_chunked.pmap`."""
  return _SWAP.is_installed()


def install() -> None:
  """Makes ``jax.pmap`` be :func:`jaxworks.pmap_chunked.pmap` for the process.

  Replaces exactly one name: the attribute ``pmap`` of the ``jax`` module
  (not ``jax.device_put_replicated``/``jax.device_put_sharded``, which JAX
  0.10 removed: see the module docstring). Code that looks ``jax.pmap`` up
  when it runs then gets pmap_chunked; names bound earlier (``from jax
  import pmap`` executed before ``install()``, functions already wrapped)
  keep what they were bound to. Idempotent: a second call changes nothing.
  Undo with :func:`uninstall`.

  >>> import jax
  >>> from jaxworks import pmap_chunked
  >>> pmap_chunked.install()
  >>> jax.pmap is pmap_chunked.pmap
  True
  >>> pmap_chunked.uninstall()
  >>> jax.pmap is pmap_chunked.pmap
  False
  """
  _SWAP.install()


def uninstall() -> None:
  """Puts back the ``jax.pmap`` that :func:`install` replaced.

  Idempotent: without an earlier ``install()`` (or after ``uninstall()``) it
  changes nothing.

  Raises:
    RuntimeError: ``jax.pmap`` was reassigned by other code after
      ``install()``; it is left as it is (restore that assignment first, or
      set ``jax.pmap`` yourself).
  """
  _SWAP.uninstall()


@contextlib.contextmanager
def installed() -> Iterator[None]:
  """Context manager: ``jax.pmap`` is pmap_chunked's inside the block.

  Replaces the same single name as :func:`install`. On exit ``jax.pmap`` is
  what it was on entry, also when the block raises.

  >>> import jax
  >>> from jaxworks import pmap_chunked
  >>> with pmap_chunked.installed():
  ...   jax.pmap is pmap_chunked.pmap
  True
  >>> jax.pmap is pmap_chunked.pmap
  False
  """
  with _SWAP.installed():
    yield
