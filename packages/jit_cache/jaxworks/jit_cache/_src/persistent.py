"""Across processes: JAX's persistent compilation cache, switched on.

``set_cache_dir(path)`` (or the environment variable
``JAXWORKS_JIT_CACHE_DIR``) turns on JAX's persistent compilation cache for
the whole process, with the settings of ``config`` (``cache_dir.py``). Every
compile of the process goes through it: ``jit_cache.jit``'s, ``jax.jit``'s,
eager operations' and library jits'. Its entries are JAX's own: XLA
executables, never pickles. jit_cache adds one subdirectory, ``jaxworks-hints/``
(``hints.py``): small JSON files naming the entries a call site or a process
read last time, which the next process deserializes ahead of JAX's read
(``prefetch.py``). What the cache did is counted in ``monitoring.py``.

This module is the front door. It applies ``JAXWORKS_JIT_CACHE_DIR`` when it
is imported: by ``import jaxworks.jit_cache`` when the variable is set then,
otherwise at the first use of ``jit``, ``config`` or ``set_cache_dir``.
"""

from __future__ import annotations

import os

from . import cache_dir as _cache_dir
from . import prefetch as _prefetch
from .cache_dir import ENV_VAR as ENV_VAR
from .cache_dir import config as config


def set_cache_dir(
  path: str | os.PathLike | None, max_bytes: int | None = None
) -> None:
  """Turns JAX's persistent compilation cache on (a directory) or off (None).

  For the whole process: every compile (``jit_cache.jit``, ``jax.jit``,
  eager operations) looks up and writes entries there. Takes effect at the
  next compile, also when the process compiled before. In the background it
  deserializes the entries that the last run of the same command line read
  first, until JAX asks for them (``prefetch.py``; ``config.prefetch``); the
  list of those entries is kept in the directory's ``jaxworks-hints/``.

  A missing directory is created with mode 0700 (its missing parents too).
  An existing one that another user owns, or that group or others may write
  to, gets a warning: whoever can write there can make this process run
  their code (entries are executables).

  Args:
    path: the directory, or None to turn the cache off.
    max_bytes: sets ``config.max_bytes`` (JAX's bound on the directory).

  Raises:
    TypeError: ``path`` is not a path or None, or ``max_bytes`` not an int.
    ValueError: ``max_bytes`` is 0 or below -1.
    NotADirectoryError: ``path`` exists and is not a directory.
  """
  if path is not None and not isinstance(path, (str, os.PathLike)):
    raise TypeError(
      "jaxworks.jit_cache.set_cache_dir: path must be a str, an "
      f"os.PathLike or None, got {type(path).__name__} {path!r:.80}"
    )
  if max_bytes is not None:
    _cache_dir.set_max_bytes(max_bytes)
  _cache_dir.use(path)
  _prefetch.start_process()


if os.environ.get(ENV_VAR):
  set_cache_dir(os.environ[ENV_VAR])
