"""The directory and settings of JAX's persistent compilation cache.

``config`` (``jit_cache.config``) holds the settings jit_cache applies while
the cache is on: ``jax_persistent_cache_min_compile_time_secs`` and
``jax_persistent_cache_min_entry_size_bytes`` at 0, so that small programs
are cached too, and no bound on the directory's size. ``use`` switches JAX to
a directory (or off) with them; ``persistent.set_cache_dir`` is the public
entry point.

JAX decides once per process, at its first compile, whether the cache is
used; ``use`` resets that decision, so it takes effect when called after a
compile too.
"""

from __future__ import annotations

import os
import stat
from typing import Any
import warnings

import jax

from . import jax_internals as ji

_config_update = jax.config.update

#: Environment variable naming the cache directory (applied when
#: ``persistent.py`` is imported).
ENV_VAR = "JAXWORKS_JIT_CACHE_DIR"


def _setting(name: str) -> property:
  """A checked setting of ``_Config``, applied at once while the cache is on."""
  return property(
    lambda self: self._values[name], lambda self, v: self._set(name, v)
  )


class _Config:
  """Settings of the persistent cache (``jit_cache.config``).

  Attributes:
    cache_dir: the directory in use, or None (off); see ``set_cache_dir``.
    min_compile_time_secs: ``jax_persistent_cache_min_compile_time_secs``
      while the cache is on (default 0: every program is written).
    min_entry_size_bytes: ``jax_persistent_cache_min_entry_size_bytes``
      while the cache is on (default 0).
    max_bytes: ``jax_compilation_cache_max_size`` (default -1: no bound; a
      bound needs the ``filelock`` package, which JAX's eviction uses).
    prefetch: whether a function's first call in a process deserializes its
      executable from the cache while it traces (default True; see
      ``prefetch.py``).
  """

  _JAX_NAMES = {
    "min_compile_time_secs": "jax_persistent_cache_min_compile_time_secs",
    "min_entry_size_bytes": "jax_persistent_cache_min_entry_size_bytes",
    "max_bytes": "jax_compilation_cache_max_size",
  }

  def __init__(self):
    self._dir: str | None = None
    self._values: dict[str, Any] = {
      "min_compile_time_secs": 0.0,
      "min_entry_size_bytes": 0,
      "max_bytes": -1,
    }
    self._prefetch = True

  @property
  def cache_dir(self) -> str | None:
    """The directory in use, or None (off)."""
    return self._dir

  def _set(self, name: str, value: Any) -> None:
    _check_setting(name, value)
    self._values[name] = value
    if self._dir is not None:
      _config_update(self._JAX_NAMES[name], value)
      ji.reset_persistent_cache()

  @property
  def prefetch(self) -> bool:
    return self._prefetch

  @prefetch.setter
  def prefetch(self, value: bool) -> None:
    if not isinstance(value, bool):
      raise TypeError(
        "jaxworks.jit_cache.config.prefetch must be True or False, got "
        f"{type(value).__name__} {value!r:.80}"
      )
    self._prefetch = value

  min_compile_time_secs = _setting("min_compile_time_secs")
  min_entry_size_bytes = _setting("min_entry_size_bytes")
  max_bytes = _setting("max_bytes")

  def __repr__(self) -> str:
    return (
      f"jit_cache.config(cache_dir={self.cache_dir!r}, "
      + ", ".join(f"{k}={v!r}" for k, v in self._values.items())
      + f", prefetch={self.prefetch!r})"
    )


def _check_setting(name: str, value: Any) -> None:
  where = f"jaxworks.jit_cache.config.{name}"
  if name == "min_compile_time_secs":
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise TypeError(
        f"{where} must be a number of seconds, got "
        f"{type(value).__name__} {value!r:.80}"
      )
    if value < 0:
      raise ValueError(f"{where} must be >= 0, got {value}")
    return
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(
      f"{where} must be an int, got {type(value).__name__} {value!r:.80}"
    )
  if name == "min_entry_size_bytes" and value < 0:
    raise ValueError(f"{where} must be >= 0, got {value}")
  if name == "max_bytes":
    if value == 0 or value < -1:
      raise ValueError(
        f"{where} must be positive, or -1 for no bound, got {value}; "
        "jit_cache.set_cache_dir(None) turns the cache off"
      )
    if value != -1:
      try:
        import filelock  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
      except ImportError as e:
        raise ImportError(
          f"{where}={value}: JAX bounds its persistent cache only with the "
          "'filelock' package installed (its eviction locks the directory); "
          "install filelock, or keep the default -1 (no bound)"
        ) from e


config = _Config()


def set_max_bytes(max_bytes: int) -> None:
  """Sets ``config.max_bytes`` for the next ``use``."""
  _check_setting("max_bytes", max_bytes)
  config._values["max_bytes"] = max_bytes  # pylint: disable=protected-access


def use(path: str | os.PathLike | None) -> None:
  """Points JAX's persistent cache at ``path`` (prepared as ``prepare``
  does) with ``config``'s settings, or turns it off (None)."""
  if path is None:
    config._dir = None  # pylint: disable=protected-access
    _config_update("jax_compilation_cache_dir", None)
    ji.reset_persistent_cache()
    return
  directory = os.path.abspath(os.fspath(path))
  prepare(directory)
  config._dir = directory  # pylint: disable=protected-access
  for name, jax_name in _Config._JAX_NAMES.items():  # pylint: disable=protected-access
    _config_update(jax_name, config._values[name])  # pylint: disable=protected-access
  _config_update("jax_compilation_cache_dir", directory)
  ji.reset_persistent_cache()


def prepare(directory: str) -> None:
  """Creates ``directory`` (0700) or warns when others may write to it."""
  missing = []
  head = directory
  while not os.path.lexists(head):
    missing.append(head)
    head = os.path.dirname(head)
  for d in reversed(missing):
    try:
      os.mkdir(d, 0o700)
    except FileExistsError:
      pass  # made meanwhile by someone else: checked below
  if not os.path.isdir(directory):
    raise NotADirectoryError(
      f"jaxworks.jit_cache.set_cache_dir: {directory!r} exists and is not "
      "a directory; pass a directory (it is created when missing)"
    )
  problem = unsafe_reason(directory)
  if problem:
    warnings.warn(
      f"jaxworks.jit_cache.set_cache_dir: {directory!r} {problem}; its "
      "entries are executables that this process runs, so whoever can "
      "write there can run code as you. Use a directory of your own with "
      f"mode 0700 (chmod 700 {directory}), e.g. under your home directory",
      UserWarning,
      stacklevel=4,
    )


def unsafe_reason(directory: str) -> str:
  """Why users other than the caller may write to ``directory`` ("" if
  none of them may)."""
  st = os.stat(directory)
  reasons = []
  getuid = getattr(os, "getuid", None)
  if getuid is not None and st.st_uid != getuid():
    reasons.append(f"is owned by uid {st.st_uid}, not by you (uid {getuid()})")
  writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
  if writable:
    who = " and ".join(
      w
      for bit, w in ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "others"))
      if writable & bit
    )
    reasons.append(
      f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    )
  return " and ".join(reasons)
