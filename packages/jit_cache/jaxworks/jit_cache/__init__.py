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
  "install": "_src.adopt",
  "installed": "_src.adopt",
  "is_installed": "_src.adopt",
  "uninstall": "_src.adopt",
  "JitFunction": "_src.api",
  "clear_caches": "_src.api",
  "eval_shape": "_src.api",
  "jit": "_src.api",
  "make_jaxpr": "_src.api",
  "reset_stats": "_src.api",
  "set_global_maxsize": "_src.api",
  "stats": "_src.api",
  "check_argnums": "_src.argnums",
  "CacheInfo": "_src.cache",
  "config": "_src.persistent",
  "set_cache_dir": "_src.persistent",
  # The stage family and platform names are jaxworks.stages_aot's.
  "KNOWN_PLATFORMS": "_src.api",
  "canonical_platforms": "_src.api",
  "present_platforms": "_src.api",
  "Compiled": "_src.api",
  "Lowered": "_src.api",
  "Traced": "_src.api",
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
