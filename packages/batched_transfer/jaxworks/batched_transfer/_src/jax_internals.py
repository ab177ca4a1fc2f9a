"""Every private JAX name used by jaxworks.batched_transfer, in one place.

A JAX upgrade that moves one of these fails here (and in
tests/jax_internals_test.py, which covers each name), not somewhere deep in the
transfer code. Everything else in the package uses public JAX only.
"""

from __future__ import annotations

from . import deps as _deps

_deps.check_jax()  # before any private JAX name is imported

from collections.abc import Iterator
import contextlib
import functools
from typing import Any

from jax._src import api as _api
from jax._src import array as _array
from jax._src import config as _config
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import distributed as _distributed
from jax._src import layout as _layout
from jax._src import traceback_util as _traceback_util
from jax._src.interpreters import pxla as _pxla
from jax._src.lib import _jax
from jax._src.lib import guard_lib as _guard_lib
from jax._src.lib import xla_client as _xc

# Stock JAX's device_put and jit, taken from where JAX defines them, not from
# the `jax` module's attributes: a program may assign jaxworks' functions (or
# anything else) to `jax.device_put` / `jax.jit`, and the package must never
# end up calling itself through such a swap.
stock_device_put = _api.device_put
stock_jit = _api.jit

# The attribute of a Sharding holding its ordered device list (a hashable
# jaxlib DeviceList); the C++ grouping reads it by this name.
DEVICE_LIST_ATTR = "_internal_device_list"

# The attribute of a Sharding holding its memory kind (what the public
# .memory_kind property returns, without the Python property call).
MEMORY_KIND_ATTR = "_memory_kind"

# Sharding types whose device list is made of the one device an attribute
# holds: two such shardings whose attribute is the same device object have equal
# device lists (the C++ grouping compares device lists by that device alone).
DEVICE_KEYS: dict[type, str] = {_xc.SingleDeviceSharding: "_device"}

# The attribute of a jax.Array holding its sharding (what the public .sharding
# property returns, without the Python property call).
SHARDING_ATTR = "_sharding"

# The attribute of a jax.Array holding its abstract value (what jax.typeof
# returns); its .shape and .dtype are the cheapest way to a byte count.
ABSTRACT_VALUE_ATTR = "aval"

# The concrete type of every committed/uncommitted jax.Array.
ArrayImpl = _array.ArrayImpl

# How a backend copy treats its input (REUSE_INPUT, ALWAYS_COPY, DONATE_INPUT).
ArrayCopySemantics = _xc.ArrayCopySemantics

# One host value (or one device array) to the shards of one sharding:
#   batched_device_put(aval, sharding, per_device_values, devices, committed)
batched_device_put = _xc.batched_device_put

# Many device arrays to new device lists in one backend call:
#   batched_copy(arrays, device_lists, shardings, copy_semantics)
batched_copy = _xc.batched_copy_array_to_devices_with_sharding

# Context manager marking transfers as explicit for jax.transfer_guard.
explicit_device_put_scope = _config.explicit_device_put_scope


def host_to_device_guard() -> Any:
  """The calling thread's own host-to-device transfer guard level (set by a
  ``jax.transfer_guard`` context; None: the process-wide level applies)."""
  return _guard_lib.thread_local_state().host_to_device


@contextlib.contextmanager
def guarded_as(level: Any) -> Iterator[None]:
  """On a worker thread: host-to-device transfers checked at ``level`` (a
  ``host_to_device_guard()`` of the calling thread) and marked explicit, as
  in the call the worker serves."""
  state = _guard_lib.thread_local_state()
  prev = state.host_to_device
  state.host_to_device = level
  try:
    with _config.explicit_device_put_scope():
      yield
  finally:
    state.host_to_device = prev


# The abstract value type of arrays.
ShapedArray = _core.ShapedArray


def device_list(sharding: Any) -> Any:
  """The ordered, hashable device list of a sharding."""
  return getattr(sharding, DEVICE_LIST_ATTR)


def trace_state_clean() -> bool:
  """True when no JAX transformation is tracing (eager execution)."""
  return _core.trace_state_clean()


def enable_x64() -> bool:
  """The current (possibly context-local) value of jax_enable_x64."""
  return bool(_config.enable_x64.value)


def default_device() -> Any:
  """The device a transfer without target goes to (honours jax.default_device)."""
  return _pxla.get_default_device()


def device_put_aval(aval: Any, sharding: Any) -> Any:
  """The abstract value jax.device_put gives a result placed with ``sharding``."""
  return _dispatch.update_dp_aval(aval, sharding)


def committed_array(
  arr: Any, aval: Any, sharding: Any, committed: bool = True
) -> Any:
  """A jax.Array with ``aval`` (committed unless told) that shares the buffers of ``arr``."""
  handler = _xc.array_result_handler(
    aval, sharding, committed=committed, _skip_checks=True
  )
  return handler(arr)


@functools.lru_cache(maxsize=4096)
def default_layout(
  dtype: Any, shard_shape: tuple[int, ...], device: Any
) -> Any:
  """The runtime's default jax.experimental.layout.Layout for one shard."""
  pjrt_layout = device.client.get_default_layout(dtype, shard_shape, device)
  return _layout.Layout.from_pjrt_layout(pjrt_layout)


def release_dropped_host_buffers() -> None:
  """Drops jaxlib's references to the host buffers of arrays already gone.

  On CPU an array placed from numpy memory without a copy keeps that memory;
  when the array is deleted, jaxlib defers releasing it to its next garbage
  collection (a ``gc`` callback). This releases it now.
  """
  _jax.collect_garbage()


def distributed_client() -> Any:
  """jax.distributed's client (key-value store, barriers), or None before
  jax.distributed.initialize(). multihost_utils reads it the same way."""
  return _distributed.global_state.client


# -- traceback filtering ---------------------------------------------------------

#: ``api_boundary(fun)``: ``fun`` as a JAX API boundary: JAX filters the
#: traceback of an exception raised below it (``jax_traceback_filtering``).
api_boundary = _traceback_util.api_boundary

#: ``hide_frames_of(path)``: frames from files under ``path`` are hidden in
#: JAX's filtered tracebacks, as JAX hides its own.
hide_frames_of = _traceback_util.register_exclusion
