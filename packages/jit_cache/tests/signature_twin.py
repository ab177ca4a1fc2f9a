"""The pure-Python twin of jit_cache's C++ argument signature
(``signature.signature``): the same equality in plain Python, the reference
the signature tests compare against and the baseline of jit_cache_bench's
signature rows. It lives here, not in the package: it ships in no wheel.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxworks.jit_cache._src import jax_internals as ji
from jaxworks.jit_cache._src.signature import fallback_key


class PySignature:
  """Pure-Python equivalent of ``Signature`` (same equality), for comparison."""

  __slots__ = ("_leaves", "_extra", "_hash")

  def __init__(self, leaves: tuple, extra: Any):
    self._leaves = leaves
    self._extra = extra
    self._hash = hash((leaves, extra))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, PySignature):
      return NotImplemented
    return (
      self._hash == other._hash
      and self._leaves == other._leaves
      and self._extra == other._extra
    )

  def __len__(self) -> int:
    return len(self._leaves)


def _py_leaf(x: Any) -> tuple:
  t = type(x)
  if t is ji.ArrayImpl:
    return ("jax_array", x.aval, x._sharding, x._committed)  # pylint: disable=protected-access
  if t is float or t is int or t is bool or t is complex:
    return (t.__name__,)
  if isinstance(x, jax.core.Tracer):
    return ("tracer", x.aval)
  if t is np.ndarray:
    return ("ndarray", x.dtype, x.shape)
  if isinstance(x, np.generic):
    return ("numpy_scalar", t)
  return ("other", fallback_key(x))


def py_signature(leaves: Sequence[Any], extra: Any = None) -> PySignature:
  """``signature`` written in plain Python (reference and benchmark twin)."""
  if not isinstance(leaves, (list, tuple)):
    raise TypeError(
      "jaxworks.jit_cache signature: leaves must be a list or tuple, got "
      f"{type(leaves).__name__}"
    )
  return PySignature(tuple([_py_leaf(x) for x in leaves]), extra)
