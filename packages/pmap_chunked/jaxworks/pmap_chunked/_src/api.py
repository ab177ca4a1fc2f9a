"""Public API of jaxworks.pmap_chunked: pmap, device_put_replicated/sharded.

Examples below assume 8 host devices, e.g.
``XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu``.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Iterable
from collections.abc import Sequence
import os
from typing import Any

import jax

from . import arguments
from . import axes as axes_lib
from . import jax_internals
from . import placement
from . import pmap as pmap_lib

AxisOutOfRangeError = axes_lib.AxisOutOfRangeError
Pmapped = pmap_lib.Pmapped
CacheInfo = pmap_lib.CacheInfo
stats = pmap_lib.stats
UnhashableStaticError = arguments.UnhashableStaticError

# JAX's filtered tracebacks hide this package's frames as they hide JAX's:
# an error about the user's input ends at the user's call.
jax_internals.hide_frames_of(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)


@jax_internals.api_boundary
def pmap(
  fun: Callable,
  axis_name: Hashable | None = None,
  *,
  in_axes: Any = 0,
  out_axes: Any = 0,
  static_broadcasted_argnums: int | Iterable[int] = (),
  devices: Sequence[jax.Device] | None = None,
  backend: str | None = None,
  axis_size: int | None = None,
  donate_argnums: int | Iterable[int] = (),
  chunked: bool = False,
  maxsize: int = pmap_lib.DEFAULT_MAXSIZE,
) -> Pmapped:
  """Maps ``fun`` over devices, built as ``jit(shard_map(...))``.

  The mapped arguments are split along their ``in_axes`` axis, one slice per
  device, over a 1-D mesh of the devices (Auto axis type) whose axis is
  ``axis_name``. Inputs and outputs are global arrays with a
  ``NamedSharding`` whose shards keep the array's rank: an ``[8, 100]``
  array is held as one ``[1, 100]`` shard per device. So outputs feed
  ``jax.jit``, or this pmap again, without a copy, and inputs that are already
  laid out that way are not moved. The program is traced and cached through
  ``jaxworks.jit_cache.jit``.

  Args:
    fun: Function to map. Its mapped arguments and its outputs are arrays,
      scalars or (nested) tuples/lists/dicts of them. Arguments listed in
      ``static_broadcasted_argnums`` may be any hashable Python values.
    axis_name: Optional hashable name of the mapped axis, used by collectives
      in ``fun`` (``jax.lax.psum(x, axis_name)``, ``pmean``, ``pmax``,
      ``all_gather``, ``ppermute``, ``all_to_all``, ``axis_index``).
    in_axes: Which axis of each positional argument is mapped: an int, None
      (the argument is broadcast to every device), or a tuple with one entry
      per positional argument, whose entries may be pytree prefixes of that
      argument. Negative axes count from the end. Keyword arguments are always
      mapped over axis 0. Default 0.
    out_axes: Where the mapped axis goes in each output: an int (negative
      counts from the end), None (the output is the same on every device and
      is returned once, unmapped), or a pytree prefix of the outputs.
      Default 0.
    static_broadcasted_argnums: An int or collection of ints (anything with
      ``__index__``: ``True`` is 1, NumPy and concrete JAX integers):
      positions of positional arguments that are static (hashable
      compile-time constants, given to every device unchanged); a negative
      position names no argument, as in ``jax.pmap``. A call with a new value
      traces and compiles again; calling with fewer positional arguments is an
      error, so pass static arguments positionally. A static value is matched
      by type and value: ``1``, ``1.0``, ``True`` and ``np.int32(1)`` are four
      programs, floats compare by their bits (``-0.0`` is not ``0.0``, a NaN
      finds its program), tuples and frozensets element by element, other
      objects by type, ``__hash__`` and ``__eq__``. Default ().
    devices: Optional iterable of devices to map over, in order (read as
      ``jax.pmap`` reads it: a numpy array of devices raises
      ``ValueError``; use a list). Its length
      must equal the mapped size (times the sizes of nested pmaps). Default:
      the first devices of ``jax.devices()`` (grouped by process when there
      are several processes).
    backend: Optional platform name (``'cpu'``, ``'gpu'``, ``'tpu'``) whose
      devices to map over when ``devices`` is not given; an unknown one
      raises ``RuntimeError`` as in ``jax.pmap``. Default: the default
      backend.
    axis_size: Optional mapped size (an int, or anything with
      ``__index__``); it must agree with the mapped arguments (at least one
      argument must be mapped, as in ``jax.pmap``). In a multi-process run
      it is the global size.
    donate_argnums: Positions of positional arguments (static ones counted;
      the forms ``static_broadcasted_argnums`` takes) whose buffers XLA may
      reuse for outputs; a donated array whose buffer was reused is deleted.
      As in ``jax.pmap``, an argument that first has to be moved to the
      devices is copied and the copy is donated, keyword arguments are never
      donated, and nothing is donated while ``jax.debug_nans`` is on. A
      donated argument cannot also be static. Default ().
    chunked: If False (default), ``fun`` sees each mapped argument with the
      mapped axis removed and returns per-device values without it (classic
      pmap). If True, ``fun`` sees the device's chunk with the size-1 mapped
      axis kept (rank preserved inside too) and must return outputs that keep
      a size-1 axis at their ``out_axes`` position. The global arrays are the
      same either way. (jaxworks only; not a ``jax.pmap`` parameter.)
    maxsize: Bound on the number of programs (argument structures, sizes,
      static values) this function keeps; the least recently used one is
      dropped first (``cache_info().evictions``). (jaxworks only.)

  Returns:
    A :class:`Pmapped` callable with the same arguments as ``fun``; its outputs
    have the mapped axis (of size = number of devices) at ``out_axes``.

  Raises:
    ValueError: the mapped arguments disagree on the mapped size, the size
      does not match the available or given devices, or in_axes/out_axes do
      not fit the arguments/outputs (:class:`AxisOutOfRangeError` for an axis
      beyond the rank, :class:`UnhashableStaticError` for an unhashable
      static argument).
    jaxworks.axis_names.AxisNameError: ``fun`` uses an axis name that no
      enclosing pmap binds (the message names the primitive, the axis, the
      bound names and the user's file:line).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jaxworks.pmap_chunked import pmap
    >>> x = jnp.arange(8.0)
    >>> y = pmap(lambda v: v / jax.lax.psum(v, "i"), axis_name="i")(x)
    >>> print(y * 28)
    [0. 1. 2. 3. 4. 5. 6. 7.]
    >>> y.sharding.spec, y.addressable_shards[0].data.shape  # rank kept
    (P('i',), (1,))

    With ``chunked=True`` the function sees the size-1 device axis:

    >>> f = pmap(lambda v: v.shape[0] + 0 * v, chunked=True)
    >>> print(f(jnp.zeros((8, 3))).sum())
    24.0

    ``static_broadcasted_argnums`` passes a Python value to every device:

    >>> scale = pmap(lambda v, k: v * k, static_broadcasted_argnums=1)
    >>> print(scale(jnp.ones(8), 3))
    [3. 3. 3. 3. 3. 3. 3. 3.]
  """
  options = pmap_lib.PmapOptions(
    in_axes=in_axes,
    out_axes=out_axes,
    static_broadcasted_argnums=static_broadcasted_argnums,
    devices=devices,
    backend=backend,
    axis_size=axis_size,
    donate_argnums=donate_argnums,
    chunked=chunked,
    maxsize=maxsize,
  )
  return Pmapped(fun, axis_name, options)


@jax_internals.api_boundary
def device_put_replicated(x: Any, devices: Sequence[jax.Device]) -> Any:
  """Copies ``x`` to every device, as one array with a new leading axis.

  The result for each leaf has shape ``(len(devices),) + x.shape`` and equals
  ``jnp.stack([x] * len(devices))`` (what JAX 0.9's helper returned); its
  sharding is a ``NamedSharding`` whose shards keep the rank (each device
  holds a ``[1, ...]`` copy). All leaves go in one batched transfer
  (``jaxworks.batched_transfer.device_put``); the result feeds
  :func:`pmap` without another copy.

  Args:
    x: An array, scalar, or pytree of them.
    devices: A non-empty sequence of distinct devices.

  Returns:
    An array (or pytree of arrays) with leading axis ``len(devices)``.

  Examples:
    >>> import jax, numpy as np
    >>> from jaxworks.pmap_chunked import device_put_replicated
    >>> y = device_put_replicated(np.array([1.0, 2.0]), jax.devices()[:4])
    >>> y.shape, y.addressable_shards[3].data.shape
    ((4, 2), (1, 2))
    >>> print(y[3])
    [1. 2.]
  """
  return placement.device_put_replicated(x, devices)


@jax_internals.api_boundary
def device_put_sharded(
  shards: Sequence[Any], devices: Sequence[jax.Device]
) -> Any:
  """Puts ``shards[i]`` on ``devices[i]``, as one array stacked on axis 0.

  The result for each leaf has shape ``(len(devices),) + shards[0].shape``
  and equals ``jnp.stack(shards)`` (what JAX 0.9's helper returned); device
  ``i`` holds ``shards[i]`` as a ``[1, ...]`` shard of a ``NamedSharding``.
  All pieces go in one batched transfer
  (``jaxworks.batched_transfer.device_put``).

  Args:
    shards: A sequence with one entry per device; entries are arrays, scalars
      or pytrees of them with the same structure, shapes and dtypes.
    devices: A sequence of distinct devices, as long as ``shards``.

  Returns:
    An array (or pytree of arrays) with leading axis ``len(devices)``.

  Examples:
    >>> import jax, numpy as np
    >>> from jaxworks.pmap_chunked import device_put_sharded
    >>> devs = jax.devices()[:4]
    >>> y = device_put_sharded([np.full(2, i) for i in range(4)], devs)
    >>> print(y)
    [[0 0]
     [1 1]
     [2 2]
     [3 3]]
    >>> y.addressable_shards[2].device == devs[2]
    True
  """
  return placement.device_put_sharded(shards, devices)
