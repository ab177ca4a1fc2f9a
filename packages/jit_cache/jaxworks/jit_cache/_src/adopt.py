"""Adopting ``jit_cache.jit`` across a whole program: ``install()``.

``install()`` assigns :func:`jaxworks.jit_cache.jit` to the attribute
``jax.jit`` (and nothing else); ``uninstall()`` puts back what was there
before; ``installed()`` does both around a block. jit_cache itself never looks
up ``jax.jit`` at call time (it binds stock JAX's ``jit`` at import), so the
swap cannot make it call itself.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib

import jax

from . import api as _api
from . import swap as _swap

#: The one name install() replaces (the mechanism: ``_src/swap.py``, shared
#: by every jaxworks package that adopts a JAX entry point).
_SWAP = _swap.Swap("jaxworks.jit_cache", [(jax, "jit", _api.jit)])


def is_installed() -> bool:
  """True while ``jax.jit`` is :func:`jaxworks.jit_cache.jit`."""
  return _SWAP.is_installed()


def install() -> None:
  """Makes ``jax.jit`` be :func:`jaxworks.jit_cache.jit` for the process.

  Replaces exactly one name: the attribute ``jit`` of the ``jax`` module.
  Code that looks ``jax.jit`` up when it runs (``jax.jit(f)``, ``@jax.jit``
  in a module imported afterwards) then gets jit_cache. Names bound earlier
  keep what they were bound to: ``from jax import jit`` executed before
  ``install()``, JAX's own internal uses of jit (``jax.numpy``, ``lax``),
  ``jax.experimental.pjit.pjit`` and functions already wrapped with
  ``jax.jit``. Idempotent: a second call changes nothing. Undo with
  :func:`uninstall`.

  >>> import jax
  >>> from jaxworks import jit_cache
  >>> jit_cache.install()
  >>> jax.jit is jit_cache.jit
  True
  >>> jit_cache.uninstall()
  >>> jax.jit is jit_cache.jit
  False
  """
  _SWAP.install()


def uninstall() -> None:
  """Puts back the ``jax.jit`` that :func:`install` replaced.

  Idempotent: without an earlier ``install()`` (or after ``uninstall()``) it
  changes nothing. When ``install()`` found ``jax.jit`` already replaced by
  something else, that object is what comes back.

  Raises:
    RuntimeError: ``jax.jit`` was reassigned by other code after
      ``install()``; it is left as it is (assign it yourself, or call
      ``uninstall()`` after restoring it).
  """
  _SWAP.uninstall()


@contextlib.contextmanager
def installed() -> Iterator[None]:
  """Context manager: ``jax.jit`` is jit_cache's inside the block.

  On exit ``jax.jit`` is what it was on entry (still jit_cache's when it
  was installed before the block), also when the block raises. Replaces the
  same single name as :func:`install`.

  >>> import jax
  >>> from jaxworks import jit_cache
  >>> with jit_cache.installed():
  ...   jax.jit is jit_cache.jit
  True
  >>> jax.jit is jit_cache.jit
  False
  """
  with _SWAP.installed():
    yield
