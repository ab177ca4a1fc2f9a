"""The only module of jaxworks.stages_aot that imports private ``jax._src`` names.

Each name has one use, and tests/jax_internals_test.py covers each, so that a
JAX upgrade that moves or changes one fails there first:

* ``stock_jit`` (``jax._src.api.jit``): stock ``jax.jit`` from JAX's own
  module, so that a program that swaps in another jit (``jax.jit =
  jaxworks.jit_cache.jit``, before or after importing this package) never
  changes what this package calls.
* ``register_source_exclusion`` and ``backends``: what
  ``jax.extend.source_info_util.register_exclusion`` and
  ``jax.extend.backend.backends`` are, without importing ``jax.extend`` (which
  imports every submodule, Pallas's included, and so would add to the first
  use of every package that returns this package's stages).
* For the stage family (``stages.py``): ``lower_for_export``,
  ``lowering_platforms``, ``lowering_committed``, ``with_committed`` and
  ``one_device_shardings`` (what a stock ``Lowered`` records in its private
  ``_lowering``, and what its compile makes of it), ``export_lowered``
  (``jax.export``'s step after lowering) and ``stage_as``.
* ``MODULE_READER_SOURCE`` (the child process of ``module_reader.py``)
  imports ``jaxlib._jax`` and ``jaxlib.mlir.ir``, the modules behind
  ``jax.extend.mlir``, without the cost of importing jax in the child.
"""

from __future__ import annotations

from . import deps as _deps

_deps.check_jax()  # before any private JAX name is imported

from collections.abc import Callable
import copy as _copy
from typing import Any

import jax
from jax._src import api as _api
from jax._src import config as _config
from jax._src import sharding_impls as _sharding_impls
from jax._src import source_info_util as _source_info_util
from jax._src import stages as _stages
from jax._src import traceback_util as _traceback_util
from jax._src import xla_bridge as _xla_bridge
from jax._src.export import _export as _export_impl
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import pxla as _pxla

__all__ = [
  "MODULE_READER_SOURCE",
  "api_boundary",
  "backends",
  "export_lowered",
  "hide_frames_of",
  "lower_for_export",
  "lowering_committed",
  "lowering_devices",
  "lowering_platforms",
  "one_device_shardings",
  "register_source_exclusion",
  "stage_as",
  "stock_jit",
  "with_committed",
]

#: Stock ``jax.jit`` (the drop-in swap reassigns ``jax.jit``, never this).
stock_jit: Callable[..., Any] = _api.jit

#: jax.extend.source_info_util.register_exclusion
register_source_exclusion = _source_info_util.register_exclusion
#: jax.extend.backend.backends
backends = _xla_bridge.backends


# -- traceback filtering ---------------------------------------------------------

#: ``api_boundary(fun)``: ``fun`` as a JAX API boundary: JAX filters the
#: traceback of an exception raised below it (``jax_traceback_filtering``).
api_boundary = _traceback_util.api_boundary

#: ``hide_frames_of(path)``: frames from files under ``path`` are hidden in
#: JAX's filtered tracebacks, as JAX hides its own.
hide_frames_of = _traceback_util.register_exclusion


# -- the stage family (stages.py) ----------------------------------------------


def lower_for_export(traced: Any, platforms: tuple[str, ...] | None) -> Any:
  """``jax.stages.Traced.lower`` with the (private) lowering parameters of
  ``jax.export.export``, so the result can be exported as is: constants stay
  in the module, and Mosaic/Pallas TPU kernels use their forward-compatible
  form."""
  params = _mlir.LoweringParameters(
    for_export=True,
    hoist_constants_as_args=False,
    export_ignore_forward_compatibility=bool(
      _config.export_ignore_forward_compatibility.value
    ),
  )
  return _stages.Traced.lower(
    traced, lowering_platforms=platforms, _private_parameters=params
  )


def lowering_platforms(lowered: Any) -> tuple[str, ...] | None:
  """The platforms a stock ``jax.stages.Lowered`` was lowered for (None when
  JAX did not record them)."""
  platforms = getattr(lowered._lowering, "_platforms", None)  # pylint: disable=protected-access
  return None if platforms is None else tuple(platforms)


def lowering_committed(lowered: Any) -> bool:
  """Whether the outputs of stock ``lowered``'s executable are committed
  (JAX decides it when lowering, from the jaxpr's shardings)."""
  return bool(lowered._lowering.compile_args["committed"])  # pylint: disable=protected-access


def lowering_devices(lowered: Any) -> tuple[Any, ...] | None:
  """The devices, in order, that stock ``lowered`` was lowered onto (from
  its arguments' or the jit's shardings); None when no sharding fixes them
  (abstract ones, or none given)."""
  args = lowered._lowering.compile_args  # pylint: disable=protected-access
  for s in (*args["in_shardings"], *args["out_shardings"]):
    if isinstance(s, jax.sharding.Sharding):
      try:
        return tuple(s._device_assignment)  # pylint: disable=protected-access
      except (AttributeError, ValueError):
        continue
  return None


def one_device_shardings(
  lowered: Any,
) -> tuple[list[Any], list[Any]] | None:
  """The input and output shardings stock ``lowered``'s executable has when
  it runs on one device, as stock's compile decides them (``pxla``'s
  ``UnloadedMeshExecutable.from_hlo``): where the jit gave none, XLA's
  (replicated, on one device) recovered as the user's
  (``maybe_recover_user_shardings``: a NamedSharding of an input for the
  outputs of its rank, a NamedSharding over its mesh for the others), a
  SingleDeviceSharding where nothing names a mesh. Inputs are listed for
  every argument (None for one the program does not use). None where
  ``lowered`` spans more or no fixed devices."""
  args = lowered._lowering.compile_args  # pylint: disable=protected-access
  devices = lowering_devices(lowered)
  if devices is None or len(devices) != 1 or args["num_devices"] != 1:
    return None
  given = (*args["in_shardings"], *args["out_shardings"])
  if any(
    isinstance(s, jax.sharding.NamedSharding)
    and isinstance(s.mesh, jax.sharding.AbstractMesh)
    for s in given
  ):
    return None
  replicated = _sharding_impls.GSPMDSharding.get_replicated(devices)
  chosen = lambda ss: [  # noqa: E731
    s if isinstance(s, jax.sharding.Sharding) else replicated for s in ss
  ]
  in_avals, out_avals = args["global_in_avals"], args["global_out_avals"]
  ins = _pxla.maybe_recover_user_shardings(
    args["in_shardings"], chosen(args["in_shardings"]), in_avals, in_avals
  )
  outs = _pxla.maybe_recover_user_shardings(
    ins,
    chosen(args["out_shardings"]),
    in_avals,
    out_avals,
    args["intermediate_shardings"],
    args["context_mesh"],
  )
  ins = _pxla.finalize_shardings(ins, devices)
  outs = _pxla.finalize_shardings(outs, devices)
  kept = sorted(args["kept_var_idx"])
  every: list[Any] = [None] * (max(kept, default=-1) + 1)
  for i, s in zip(kept, ins):
    every[i] = s
  return every, list(outs)


def with_committed(lowered: Any, committed: bool) -> Any:
  """A copy of stock ``lowered`` whose executable's outputs are ``committed``.

  The lowering (which JAX may cache and share) is copied, not changed.
  """
  computation = _copy.copy(lowered._lowering)  # pylint: disable=protected-access
  computation.compile_args = {
    **computation.compile_args,
    "committed": committed,
  }
  computation._executable = None  # pylint: disable=protected-access
  out = _copy.copy(lowered)
  out._lowering = computation  # pylint: disable=protected-access
  return out


#: ``jax.export``'s step after lowering: (stock Lowered, jaxpr, function name,
#: disabled checks) -> ``jax.export.Exported``, without lowering again.
export_lowered: Callable[..., Any] = _export_impl._export_lowered  # pylint: disable=protected-access


def stage_as(cls: type, stage: Any) -> Any:
  """A ``cls`` object with the state of stock stage ``stage``.

  ``cls`` subclasses the stock class of ``stage`` (``jax.stages.Traced``,
  ``Lowered`` or ``Compiled``) and adds only methods and ``__dict__``
  entries; the stock state (its ``__slots__`` and ``__dict__``) is shared,
  not copied, so every stock method works on the result as on ``stage``.
  """
  out: Any = object.__new__(cls)
  for klass in type(stage).__mro__:
    slots = getattr(klass, "__slots__", ())
    for name in (slots,) if isinstance(slots, str) else slots:
      if name in ("__dict__", "__weakref__") or not hasattr(stage, name):
        continue
      setattr(out, name, getattr(stage, name))
  out.__dict__.update(getattr(stage, "__dict__", {}))
  return out


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
    # What reading `size` bytes can reasonably need.
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
