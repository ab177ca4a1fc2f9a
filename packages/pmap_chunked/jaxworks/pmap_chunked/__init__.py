"""jaxworks.pmap_chunked: pmap as jit(shard_map) with rank-preserving shards.

Public API: :func:`pmap`, :func:`device_put_replicated`,
:func:`device_put_sharded`, and the :class:`Pmapped` / :class:`PmapCacheInfo`
types they return.
"""

from ._src.api import PmapCacheInfo as PmapCacheInfo
from ._src.api import Pmapped as Pmapped
from ._src.api import device_put_replicated as device_put_replicated
from ._src.api import device_put_sharded as device_put_sharded
from ._src.api import pmap as pmap
from .version import __version__ as __version__

__all__ = [
    "PmapCacheInfo",
    "Pmapped",
    "device_put_replicated",
    "device_put_sharded",
    "pmap",
    "__version__",
]
