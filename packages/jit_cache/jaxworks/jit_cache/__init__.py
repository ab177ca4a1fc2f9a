"""jaxworks.jit_cache: jit with its own trace cache and executable reuse.

``jit`` has ``jax.jit``'s semantics. Its trace cache is keyed by a C++
argument signature; inner calls that hit it re-emit the cached jaxpr without
running Python; re-created closures reuse compiled executables; caches are
bounded and observable (``cache_info``, ``stats``, ``explain_miss``).

Drop-in adoption: ``install()`` makes ``jax.jit`` be ``jit`` for the whole
program, ``uninstall()`` undoes it, ``installed()`` does both around a block.

Stages: ``jit(f).trace(...)`` gives a :class:`Traced`, its
``lower(lowering_platforms=...)`` a :class:`Lowered` (for any platforms, from
any host) and ``compile()`` a :class:`Compiled`: subclasses of the
``jax.stages`` classes, the one family every jaxworks package returns.
"""

from ._src.adopt import install as install
from ._src.adopt import installed as installed
from ._src.adopt import is_installed as is_installed
from ._src.adopt import uninstall as uninstall
from ._src.api import JitFunction as JitFunction
from ._src.api import clear_caches as clear_caches
from ._src.api import eval_shape as eval_shape
from ._src.api import jit as jit
from ._src.api import make_jaxpr as make_jaxpr
from ._src.api import reset_stats as reset_stats
from ._src.api import set_global_maxsize as set_global_maxsize
from ._src.api import stats as stats
from ._src.argnums import check_argnums as check_argnums
from ._src.cache import CacheInfo as CacheInfo
from ._src.persistent import config as config
from ._src.persistent import set_cache_dir as set_cache_dir
from ._src.platforms import KNOWN_PLATFORMS as KNOWN_PLATFORMS
from ._src.platforms import canonical_platforms as canonical_platforms
from ._src.platforms import present_platforms as present_platforms
from ._src.stages import Compiled as Compiled
from ._src.stages import Lowered as Lowered
from ._src.stages import Traced as Traced
from ._src.stages import register_exporter as register_exporter
from .version import __version__ as __version__

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
  "register_exporter",
  "reset_stats",
  "set_cache_dir",
  "set_global_maxsize",
  "stats",
  "uninstall",
  "__version__",
]
