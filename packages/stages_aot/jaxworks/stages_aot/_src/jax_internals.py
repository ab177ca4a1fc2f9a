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


#: The child process of ``module_reader``: says ``ready`` once its imports are
#: done, then reads requests from stdin (a count,
#: then length-prefixed serialized StableHLO modules, little-endian uint64s)
#: and answers each with one JSON line: per module, an error or the module's
#: verification result, its integer attributes and the types of ``main``. Its
#: address space is capped per module, so that a damaged length cannot make
#: it take the machine's memory.
MODULE_READER_SOURCE = r"""
import json, struct, sys
from jaxlib import _jax
from jaxlib.mlir import ir
try:
    import resource
except ImportError:
    resource = None

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

def text(obj):
    try:
        return str(obj)
    except Exception:
        return "(not UTF-8)"

def describe_type(t):
    try:
        tensor = ir.RankedTensorType(t)
    except Exception:
        return {"text": text(t)}
    return {"text": text(t), "shape": list(tensor.shape),
            "element": text(tensor.element_type)}

def describe(blob):
    diagnostics = []
    def on_diagnostic(d):
        diagnostics.append(text(d.message))
        return True
    with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = True
        handler = ctx.attach_diagnostic_handler(on_diagnostic)
        try:
            try:
                module = _jax.mlir.deserialize_portable_artifact(blob)
            except Exception as e:
                return {"error": "; ".join(diagnostics) or text(e)}
            if not module.operation.verify():
                return {"error": "does not verify: " + "; ".join(diagnostics)}
            attrs = module.operation.attributes
            ints = {}
            for name in ("mhlo.num_partitions", "mhlo.num_replicas"):
                if name in attrs:
                    ints[name] = ir.IntegerAttr(attrs[name]).value
            main = None
            for op in module.body.operations:
                op_attrs = op.operation.attributes
                if ("sym_name" in op_attrs and "function_type" in op_attrs
                        and ir.StringAttr(op_attrs["sym_name"]).value == "main"):
                    main = ir.FunctionType(ir.TypeAttr(op_attrs["function_type"]).value)
            if main is None:
                return {"error": "no main function"}
            return {"attributes": ints,
                    "inputs": [describe_type(t) for t in main.inputs],
                    "results": [describe_type(t) for t in main.results],
                    "dynamic": ir.ShapedType.get_dynamic_size()}
        finally:
            handler.detach()

sys.stdout.write("ready\n")
sys.stdout.flush()
while True:
    (count,) = struct.unpack("<Q", read(8))
    answers = []
    for _ in range(count):
        (size,) = struct.unpack("<Q", read(8))
        blob = read(size)
        limit_memory(size)
        try:
            answers.append(describe(blob))
        except Exception as e:
            answers.append({"error": type(e).__name__ + ": " + text(e)})
    sys.stdout.write(json.dumps(answers) + "\n")
    sys.stdout.flush()
"""
