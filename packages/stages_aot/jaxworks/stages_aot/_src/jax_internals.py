"""The only module of jaxworks.stages_aot that imports private ``jax._src`` names.

Each name is used for one reason, and tests/jax_internals_test.py covers every
one, so that a JAX upgrade that moves or changes one fails there first:

* ``stock_jit`` (``jax._src.api.jit``): stock ``jax.jit``, bound from JAX's own
  module, so that a program that swaps in another jit (``jax.jit =
  jaxworks.jit_cache.jit``, before or after importing this package) never
  changes what this package calls.
* ``MODULE_READER_SOURCE`` (a script run in a child process, see
  ``module_reader.py``) imports ``jaxlib._jax`` and ``jaxlib.mlir.ir``: the
  modules behind ``jax.extend.mlir.deserialize_portable_artifact`` and
  ``jax.extend.mlir.ir``, without the cost of importing jax in the child.
"""

from __future__ import annotations

from . import deps as _deps

_deps.check_jax()  # before any private JAX name is imported

from jax._src import api as _api

__all__ = [
  "MODULE_READER_SOURCE",
  "stock_jit",
]

#: Stock ``jax.jit`` (the drop-in swap reassigns ``jax.jit``, never this).
stock_jit = _api.jit


#: The child process of ``module_reader``, run as
#: ``python -P -c MODULE_READER_SOURCE PATH`` where PATH is
#: ``module_describe.py`` (loaded by path: the child never imports jax). It says
#: ``ready`` once its imports are done, then reads requests from stdin (a
#: count, then length-prefixed serialized StableHLO modules, little-endian
#: uint64s) and answers each with one JSON line: per module,
#: ``module_describe.describe_safely``'s answer. Its address space is capped
#: per module, so that a damaged length cannot make it take the machine's
#: memory. It exits when stdin closes (the parent closes it when idle).
MODULE_READER_SOURCE = r"""
import importlib.util, json, struct, sys
from jaxlib import _jax
from jaxlib.mlir import ir
try:
    import resource
except ImportError:
    resource = None

spec = importlib.util.spec_from_file_location("module_describe", sys.argv[1])
module_describe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module_describe)

def limit_memory(size):
    # A damaged length can make the reader allocate without end: cap the
    # address space at what reading `size` bytes can reasonably need.
    if resource is None:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = 2 * 1024 ** 3 + 32 * size
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    try:
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (ValueError, OSError):
        pass

def read(n):
    data = sys.stdin.buffer.read(n)
    if len(data) != n:
        sys.exit(0)
    return data

sys.stdout.write("ready\n")
sys.stdout.flush()
while True:
    (count,) = struct.unpack("<Q", read(8))
    answers = []
    for _ in range(count):
        (size,) = struct.unpack("<Q", read(8))
        blob = read(size)
        limit_memory(size)
        answers.append(module_describe.describe_safely(
            blob, _jax.mlir.deserialize_portable_artifact, ir))
    sys.stdout.write(json.dumps(answers) + "\n")
    sys.stdout.flush()
"""
