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
import threading
from typing import Any

import jax

from . import api as _api

_LOCK = threading.Lock()
# What jax.pmap was before each install() that replaced it (a stack).
_saved: list[Any] = []


def is_installed() -> bool:
  """True while ``jax.pmap`` is :func:`jaxworks.pmap_chunked.pmap`."""
  return jax.pmap is _api.pmap


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
  with _LOCK:
    if jax.pmap is _api.pmap:
      return
    _saved.append(jax.pmap)
    jax.pmap = _api.pmap


def uninstall() -> None:
  """Puts back the ``jax.pmap`` that :func:`install` replaced.

  Idempotent: without an earlier ``install()`` (or after ``uninstall()``) it
  changes nothing.

  Raises:
    RuntimeError: ``jax.pmap`` was reassigned by other code after
      ``install()``; it is left as it is (restore that assignment first, or
      set ``jax.pmap`` yourself).
  """
  with _LOCK:
    if not _saved:
      return
    if jax.pmap is not _api.pmap:
      raise RuntimeError(
        "jaxworks.pmap_chunked.uninstall: jax.pmap was reassigned after "
        f"install() (it is now {jax.pmap!r:.80}); not overwriting it. "
        "Restore that assignment first, or set jax.pmap yourself."
      )
    jax.pmap = _saved.pop()


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
  with _LOCK:
    before = jax.pmap
    jax.pmap = _api.pmap
  try:
    yield
  finally:
    with _LOCK:
      jax.pmap = before
