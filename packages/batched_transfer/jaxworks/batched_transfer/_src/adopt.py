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
import threading
from typing import Any

import jax

from . import api as _api

_LOCK = threading.Lock()
# What jax.device_put was before each install() that replaced it.
_saved: list[Any] = []


def is_installed() -> bool:
  """True while ``jax.device_put`` is :func:`jaxworks.batched_transfer.device_put`."""
  return jax.device_put is _api.device_put


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
  with _LOCK:
    if jax.device_put is _api.device_put:
      return
    _saved.append(jax.device_put)
    jax.device_put = _api.device_put


def uninstall() -> None:
  """Puts back the ``jax.device_put`` that :func:`install` replaced.

  Idempotent: without an earlier ``install()`` (or after ``uninstall()``) it
  changes nothing.

  Raises:
    RuntimeError: ``jax.device_put`` was reassigned by other code after
      ``install()``; it is left as it is (restore that assignment first, or
      assign ``jax.device_put`` yourself).
  """
  with _LOCK:
    if not _saved:
      return
    if jax.device_put is not _api.device_put:
      raise RuntimeError(
        "jaxworks.batched_transfer.uninstall: jax.device_put was reassigned after install() "
        f"(it is now {jax.device_put!r:.80}); not overwriting it. Restore that assignment "
        "first, or set jax.device_put yourself"
      )
    jax.device_put = _saved.pop()


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
  with _LOCK:
    before = jax.device_put
    jax.device_put = _api.device_put
  try:
    yield
  finally:
    with _LOCK:
      jax.device_put = before
