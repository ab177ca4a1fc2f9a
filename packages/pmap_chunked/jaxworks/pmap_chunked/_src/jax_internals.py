"""The ONLY module of jaxworks.pmap_chunked that imports private JAX names.

Each name is exercised by tests/jax_internals_test.py, so a JAX upgrade that
moves one of them fails there, in one obvious place.

- ``jax._src.core.ShapedArray`` and ``jax._src.array.ArrayImpl``: wrapping
  per-device buffers as one global array that keeps a weak type (public
  ``jax.make_array_from_single_device_arrays`` always makes a strong type, while
  JAX 0.9's device_put_replicated/sharded kept the weak type of Python scalars).
- ``jax._src.core.shaped_abstractify``: ``Pmapped.lower`` describes the
  arguments of its flat-argument program with the user's argument structure and
  the arguments' own avals (as ``jax.pmap``'s own ``lower`` does), so
  ``args_info`` and ``.compile()(...)`` take the arguments as the user passes
  them.
- ``jax._src.array.ArrayImpl`` again: ``uncommitted_view`` re-wraps a
  committed array's buffers as an uncommitted array (no copy), so that
  ``jit`` moves it to the program's devices itself, as an implicit transfer
  that ``jax.transfer_guard`` checks (the public ``device_put`` is an
  explicit one, which ``"disallow"`` lets through).
"""

from __future__ import annotations

from . import deps as _deps

_deps.check_jax()  # before any private JAX name is imported

from collections.abc import Sequence
from typing import Any

import jax
from jax._src import array as _array
from jax._src import core as _core
from jax._src import traceback_util as _traceback_util


def weak_array_from_shards(
  shape: tuple, dtype: Any, sharding: Any, pieces: Sequence[Any]
) -> Any:
  """A committed, weakly typed global array made of ``pieces`` (no copy)."""
  aval = _core.ShapedArray(tuple(shape), dtype, weak_type=True)
  return _array.ArrayImpl(aval, sharding, list(pieces), committed=True)


def arg_info(x: Any, donated: bool) -> Any:
  """The ``jax.stages.ArgInfo`` of argument leaf ``x``, with its own aval (not
  the one the program was lowered with, which carries the mesh sharding)."""
  return jax.stages.ArgInfo(_core.shaped_abstractify(x), donated)


def uncommitted_view(x: Any) -> Any:
  """``x``'s buffers as an uncommitted array with its aval and sharding."""
  return _array.ArrayImpl(
    x.aval, x.sharding, [s.data for s in x.addressable_shards], committed=False
  )


# -- traceback filtering ---------------------------------------------------------

#: ``api_boundary(fun)``: ``fun`` as a JAX API boundary: JAX filters the
#: traceback of an exception raised below it (``jax_traceback_filtering``).
api_boundary = _traceback_util.api_boundary

#: ``hide_frames_of(path)``: frames from files under ``path`` are hidden in
#: JAX's filtered tracebacks, as JAX hides its own.
hide_frames_of = _traceback_util.register_exclusion
