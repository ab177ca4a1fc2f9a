"""Grouping of leaves into batches, in one C++ pass.

A leaf's group is the tuple (source devices, destination devices, source memory
kind, destination memory kind, kind of leaf). ``group_leaves`` computes all
groups in one C++ pass (see cc/grouping.h); the same algorithm in Python, the
reference the tests compare against and the baseline of the benchmark, lives
with the tests (tests/grouping_twin.py), not in the package.

>>> import numpy as np, jax
>>> from jax.sharding import SingleDeviceSharding
>>> s0, s1 = (SingleDeviceSharding(d) for d in jax.devices()[:2])
>>> leaves = [np.zeros(4, np.float32), np.zeros(2, np.float32), 1.0]
>>> groups = group_leaves(leaves, [s0, s1, s0], default_dst=s0)
>>> [(KIND_NAMES[g.kind], list(g.indices), g.nbytes) for g in groups]
[('numpy', [0], 16), ('numpy', [1], 8), ('scalar', [2], 4)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from .. import _grouping
from . import jax_internals

# Kinds of leaves (the last component of a group key).
HOST_ARRAY = 0  # numpy.ndarray / numpy.memmap
DEVICE_ARRAY = 1  # jax.Array
PY_SCALAR = 2  # bool, int, float, complex
NP_SCALAR = 3  # numpy scalar (numpy.float32(1.0), ...)
OTHER = _grouping.OTHER_KIND  # anything else: handed to jax.device_put as is

KIND_NAMES = {
  HOST_ARRAY: "numpy",
  DEVICE_ARRAY: "jax.Array",
  PY_SCALAR: "scalar",
  NP_SCALAR: "numpy scalar",
  OTHER: "other",
}

# How a kind counts bytes: an int >= 0 (fixed), -1 (leaf.nbytes), or an
# attribute name whose value has .shape and .dtype ("" for the leaf itself).
SizeRule = int | str
# type -> (kind, attribute holding the source sharding or None for host kinds, size rule)
KindsTable = dict[type, tuple[int, str | None, SizeRule]]
_KINDS_CACHE: dict[bool, KindsTable] = {}
# The attributes of a Sharding the grouping reads: device list, memory kind.
ATTRS = (jax_internals.DEVICE_LIST_ATTR, jax_internals.MEMORY_KIND_ATTR)


def kinds_table(x64: bool | None = None) -> KindsTable:
  """The exact-type table given to the C++ pass.

  numpy arrays count ``.nbytes``; jax.Arrays have their source sharding read and
  count prod(shape) * itemsize of their abstract value (cheaper than
  jax.Array.nbytes); Python scalars take the size of the dtype JAX gives them
  (which depends on jax_enable_x64).
  """
  if x64 is None:
    x64 = jax_internals.enable_x64()
  table = _KINDS_CACHE.get(x64)
  if table is None:
    wide = 8 if x64 else 4
    table = {
      np.ndarray: (HOST_ARRAY, None, -1),
      np.memmap: (HOST_ARRAY, None, -1),
      jax_internals.ArrayImpl: (
        DEVICE_ARRAY,
        jax_internals.SHARDING_ATTR,
        jax_internals.ABSTRACT_VALUE_ATTR,
      ),
      bool: (PY_SCALAR, None, 1),
      int: (PY_SCALAR, None, wide),
      float: (PY_SCALAR, None, wide),
      complex: (PY_SCALAR, None, 2 * wide),
    }
    scalar_types = set(np.sctypeDict.values()) | {jnp.bfloat16.dtype.type}
    for t in scalar_types:
      if isinstance(t, type) and issubclass(t, np.generic):
        table[t] = (NP_SCALAR, None, -1)
    _KINDS_CACHE[x64] = table
  return table


def group_leaves(
  leaves: Sequence[Any], dsts: Sequence[Any], default_dst: Any = None
) -> list[Any]:
  """Groups leaf indices in C++; see the module docstring.

  Args:
    leaves: the flat leaves of a pytree.
    dsts: one destination Sharding (or None) per leaf.
    default_dst: the Sharding for host leaves whose destination is None.

  Returns:
    A list of ``_grouping.Group`` (kind, src_devices, dst_devices,
    src_memory_kind, dst_memory_kind, indices, nbytes), by first appearance.
  """
  return _grouping.group_leaves(
    leaves, dsts, kinds_table(), default_dst, *ATTRS, jax_internals.DEVICE_KEYS
  )
