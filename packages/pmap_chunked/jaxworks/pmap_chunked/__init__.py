"""jaxworks.pmap_chunked: pmap as jit(shard_map) with rank-preserving shards.

Public API: :func:`pmap`, :func:`device_put_replicated`,
:func:`device_put_sharded`, the :class:`Pmapped` type ``pmap`` returns,
``CacheInfo`` (``jaxworks.jit_cache.CacheInfo``, what ``cache_info()`` and
:func:`stats` return), and the adoption API :func:`install` /
:func:`uninstall` / :func:`installed` (``jax.pmap = pmap_chunked.pmap``,
reversibly). ``Pmapped.trace``/``lower`` return the stage family of
``jaxworks.stages_aot`` (re-exported by ``jaxworks.jit_cache``).
"""

from ._src.adopt import install as install
from ._src.adopt import installed as installed
from ._src.adopt import is_installed as is_installed
from ._src.adopt import uninstall as uninstall
from ._src.api import AxisOutOfRangeError as AxisOutOfRangeError
from ._src.api import CacheInfo as CacheInfo
from ._src.api import Pmapped as Pmapped
from ._src.api import UnhashableStaticError as UnhashableStaticError
from ._src.api import device_put_replicated as device_put_replicated
from ._src.api import device_put_sharded as device_put_sharded
from ._src.api import pmap as pmap
from ._src.api import stats as stats
from .version import __version__ as __version__

__all__ = [
  "AxisOutOfRangeError",
  "CacheInfo",
  "Pmapped",
  "UnhashableStaticError",
  "device_put_replicated",
  "device_put_sharded",
  "install",
  "installed",
  "is_installed",
  "pmap",
  "stats",
  "uninstall",
  "__version__",
]

# Public classes report the module they are imported from (in tracebacks,
# repr and pickles), not the private one that defines them.
for _value in list(globals().values()):
  if isinstance(_value, type) and _value.__module__.startswith(f"{__name__}._"):
    _value.__module__ = __name__
del _value
