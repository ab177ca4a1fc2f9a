"""jaxworks.jit_cache: jit with its own trace cache and executable reuse.

``jit`` has ``jax.jit``'s semantics. Its trace cache is keyed by a C++
argument signature; inner calls that hit it re-emit the cached jaxpr without
running Python; re-created closures reuse compiled executables; caches are
bounded and observable (``cache_info``, ``stats``, ``explain_miss``).

Drop-in adoption: ``install()`` makes ``jax.jit`` be ``jit`` for the whole
program, ``uninstall()`` undoes it, ``installed()`` does both around a block.

Stages: ``jit(f).trace(...)`` gives a :class:`Traced`, its
``lower(lowering_platforms=...)`` a :class:`Lowered` (for any platforms, from
any host) and ``compile()`` a :class:`Compiled`: jaxworks.stages_aot's
subclasses of the ``jax.stages`` classes, the one family every jaxworks
package returns (re-exported here).
"""

import os as _os
from typing import TYPE_CHECKING

from ._src import deps as _deps
from .version import __version__ as __version__

# Checked at import, although the names below are imported lazily: an
# unsupported jax/jaxlib raises ImportError and a missing or too old
# jaxworks.axis_names a RuntimeError naming the pip command, here rather than
# at the first use of a name.
_deps.check_jax()
_deps.check_versions()

if TYPE_CHECKING:
  from ._src.adopt import install as install
  from ._src.adopt import installed as installed
  from ._src.adopt import is_installed as is_installed
  from ._src.adopt import uninstall as uninstall
  from ._src.api import KNOWN_PLATFORMS as KNOWN_PLATFORMS
  from ._src.api import Compiled as Compiled
  from ._src.api import JitFunction as JitFunction
  from ._src.api import Lowered as Lowered
  from ._src.api import Traced as Traced
  from ._src.api import canonical_platforms as canonical_platforms
  from ._src.api import clear_caches as clear_caches
  from ._src.api import eval_shape as eval_shape
  from ._src.api import jit as jit
  from ._src.api import make_jaxpr as make_jaxpr
  from ._src.api import present_platforms as present_platforms
  from ._src.api import reset_stats as reset_stats
  from ._src.api import set_global_maxsize as set_global_maxsize
  from ._src.api import stats as stats
  from ._src.argnums import check_argnums as check_argnums
  from ._src.cache import CacheInfo as CacheInfo
  from ._src.persistent import config as config
  from ._src.persistent import set_cache_dir as set_cache_dir

# Names are imported when first used (PEP 562), so ``import
# jaxworks.jit_cache`` costs little on top of ``import jax``; the first use
# of any name (``jit_cache.jit``) imports the package's modules.
_LAZY = {
  name: "_src." + module
  for module, names in (
    ("adopt", ("install", "installed", "is_installed", "uninstall")),
    ("api", ("JitFunction", "clear_caches", "eval_shape", "jit", "make_jaxpr")),
    ("api", ("reset_stats", "set_global_maxsize", "stats")),
    # The stage family and platform names are jaxworks.stages_aot's.
    ("api", ("Compiled", "Lowered", "Traced", "KNOWN_PLATFORMS")),
    ("api", ("canonical_platforms", "present_platforms")),
    ("argnums", ("check_argnums",)),
    ("cache", ("CacheInfo",)),
    ("persistent", ("config", "set_cache_dir")),
  )
  for name in names
}


def __getattr__(name: str):
  module = _LAZY.get(name)
  if module is None:
    raise AttributeError(
      f"module 'jaxworks.jit_cache' has no attribute {name!r}"
    )
  import importlib  # pylint: disable=g-import-not-at-top

  value = getattr(importlib.import_module("." + module, __name__), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_LAZY))


if _os.environ.get("JAXWORKS_JIT_CACHE_DIR"):
  from ._src import persistent as _persistent  # noqa: F401  (applies it)

__all__ = [
  "CacheInfo",
  "Compiled",
  "JitFunction",
  "KNOWN_PLATFORMS",
  "Lowered",
  "Traced",
  "canonical_platforms",
  "check_argnums",
  "clear_caches",
  "config",
  "eval_shape",
  "install",
  "installed",
  "is_installed",
  "jit",
  "make_jaxpr",
  "present_platforms",
  "reset_stats",
  "set_cache_dir",
  "set_global_maxsize",
  "stats",
  "uninstall",
  "__version__",
]
