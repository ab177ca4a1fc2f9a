"""Adopting ``batched_transfer.device_put`` across a whole program: ``install()``.

``install()`` assigns :func:`jaxworks.batched_transfer.device_put` to the
attribute ``jax.device_put`` (and nothing else); ``uninstall()`` puts back what
was there before; ``installed()`` does both around a block. The package itself
never looks up ``jax.device_put`` or ``jax.jit`` at call time (it binds stock
JAX's functions at import), so the swap cannot make it call itself.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib

import jax

from . import api as _api
from . import swap as _swap

#: The one name install() replaces (the mechanism: ``_src/swap.py``, shared
#: by every jaxworks package that adopts a JAX entry point).
_SWAP = _swap.Swap(
  "jaxworks.batched_transfer", [(jax, "device_put", _api.device_put)]
)


def is_installed() -> bool:
  """True while ``jax.device_put`` is :func:`jaxworks.batched_transfer.device_put`."""
  return _SWAP.is_installed()


def install() -> None:
  """Makes ``jax.device_put`` be :func:`jaxworks.batched_transfer.device_put`.

  Replaces exactly one name: the attribute ``device_put`` of the ``jax``
  module. Code that looks ``jax.device_put`` up when it runs then gets
  batched_transfer's (same signature, results and exception classes). Names
  bound earlier keep what they were bound to: ``from jax import device_put``
  executed before ``install()``, and JAX's own internal transfers
  (``jnp.asarray``, jit argument handling). Idempotent: a second call changes
  nothing. Undo with :func:`uninstall`.

  >>> import jax
  >>> from jaxworks import batched_transfer
  >>> batched_transfer.install()
  >>> jax.device_put is batched_transfer.device_put
  True
  >>> batched_transfer.uninstall()
  >>> jax.device_put is batched_transfer.device_put
  False
  """
  _SWAP.install()


def uninstall() -> None:
  """Puts back the ``jax.device_put`` that :func:`install` replaced.

  Idempotent: without an earlier ``install()`` (or after ``uninstall()``) it
  changes nothing.

  Raises:
    RuntimeError: ``jax.device_put`` was reassigned by other code after
      ``install()``; it is left as it is (restore that assignment first, or
      assign ``jax.device_put`` yourself).
  """
  _SWAP.uninstall()


@contextlib.contextmanager
def installed() -> Iterator[None]:
  """Context manager: ``jax.device_put`` is batched_transfer's inside the block.

  Replaces the same single name as :func:`install` (``jax.device_put``). On
  exit ``jax.device_put`` is what it was on entry, also when the block raises.

  >>> import jax
  >>> from jaxworks import batched_transfer
  >>> with batched_transfer.installed():
  ...   jax.device_put is batched_transfer.device_put
  True
  >>> jax.device_put is batched_transfer.device_put
  False
  """
  with _SWAP.installed():
    yield
