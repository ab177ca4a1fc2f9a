"""Argument signatures: the C++ extension, configured.

``signature(leaves, extra)`` returns a hashable ``Signature`` whose hash was
computed once, in C++. Per leaf it records the kind and the abstract
properties, never the value:

* jax Array: its aval (shape, dtype, weak_type; interned by JAX), its sharding
  and whether it is committed;
* tracer: its aval, the abstract value (two tracers of different values get
  equal signatures);
* numpy array: dtype and shape; numpy scalar: its type; Python
  ``bool``/``int``/``float``/``complex``: the type (weakly typed in JAX);
* anything else goes to :func:`fallback_key`: PRNG key arrays,
  ``jax.ShapeDtypeStruct``, objects with ``__jax_array__``; other objects get a
  ``TypeError``.

Its pure-Python twin, the tests' reference and the benchmark's baseline,
lives with the tests (tests/signature_twin.py), not in the package.

>>> import numpy as np
>>> s1 = signature([np.zeros(3, np.float32), 1.0], extra="ctx")
>>> s2 = signature([np.ones(3, np.float32), 2.0], extra="ctx")
>>> s1 == s2, hash(s1) == hash(s2), len(s1)
(True, True, 2)
>>> signature([np.zeros(4, np.float32), 1.0], extra="ctx") == s1
False
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .. import _signature as _ext
from . import jax_internals as ji


def fallback_key(leaf: Any) -> tuple:
  """Signature key of a leaf the extension does not classify itself.

  Args:
    leaf: any object.

  Returns:
    ``(type, aval, sharding, committed)``, hashable.

  Raises:
    TypeError: ``leaf`` is not a valid JAX argument.
  """
  try:
    aval = ji.shaped_abstractify(leaf)
  except TypeError as e:
    raise TypeError(
      f"value of type {type(leaf).__name__} is not a valid JAX type ({e})"
    ) from None
  sharding = getattr(leaf, "sharding", None)
  committed = getattr(leaf, "_committed", None)
  key = (type(leaf), aval, sharding, committed)
  try:
    hash(key)
  except TypeError:
    key = (type(leaf), aval, None, committed)
  return key


_BUILDER = _ext.SignatureBuilder(
  array_types=(ji.ArrayImpl,),
  tracer_type=jax.core.Tracer,
  ndarray_type=np.ndarray,
  numpy_generic_type=np.generic,
  fallback=fallback_key,
  array_samples=ji.array_samples,
  flatten=ji.tracing_registry.flatten,
)

#: signature(leaves: list | tuple, extra: Hashable = None) -> Signature
signature = _BUILDER

#: key(tree, statics, ctx) -> (leaves, treedef, Signature): the leaves and
#: treedef of ``tracing_registry.flatten(tree)`` and
#: ``signature(leaves, (treedef, statics, ctx))``, in one C++ pass (a tree
#: structure of tuples, lists, str-keyed dicts and None seen before is not
#: flattened again).
key = _BUILDER.key
Signature = _ext.Signature


def leaf_properties(desc: tuple) -> dict[str, Any]:
  """Readable properties of one ``Signature.describe()`` entry.

  Returns a dict with ``kind``, ``shape``, ``dtype``, ``weak_type``,
  ``sharding`` and ``committed`` (``None`` where it does not apply).
  """
  kind, first, second, committed = desc
  props: dict[str, Any] = {
    "kind": kind,
    "shape": None,
    "dtype": None,
    "weak_type": None,
    "sharding": None,
    "committed": None,
  }
  aval = None
  if kind == "jax_array":
    aval = first
    props["sharding"] = second
    props["committed"] = committed
  elif kind == "tracer":
    aval = first
  elif kind == "ndarray":
    props.update(shape=tuple(second), dtype=np.dtype(first), weak_type=False)
  elif kind == "numpy_scalar":
    props.update(shape=(), dtype=np.dtype(first), weak_type=False)
  elif kind in ("bool", "int", "float", "complex"):
    props.update(shape=(), dtype=f"python {kind}", weak_type=True)
  elif kind == "other" and isinstance(first, tuple) and len(first) == 4:
    typ, aval, sharding, committed = first
    props["kind"] = getattr(typ, "__name__", str(typ))
    props["sharding"] = sharding
    props["committed"] = committed
  if aval is not None:
    props["shape"] = getattr(aval, "shape", None)
    props["dtype"] = getattr(aval, "dtype", None)
    props["weak_type"] = getattr(aval, "weak_type", None)
  return props
