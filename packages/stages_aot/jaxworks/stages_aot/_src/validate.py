"""Load-time validation of a deserialized ``jax.export.Exported``.

``jax.export.deserialize`` reads the flatbuffer lazily (the VJP of a program
is deserialized only when asked for) and parses the StableHLO module only when
the program is first called. A damaged or hostile blob can then fail anywhere:
with a raw ``struct.error`` while counting VJP orders, or at call time, in
XLA. :func:`deserialize_checked` reads every level eagerly and checks, for
each one, everything a later call relies on:

* the fields are consistent: as many avals as tree leaves, kept-input indices
  sorted, distinct and in range, known and distinct platforms, a supported
  calling-convention version, shardings on meshes of ``nr_devices`` devices;
* the module bytes deserialize (with the same StableHLO reader the compiler
  uses, run in a child process: see ``module_reader.py``) and the module
  verifies;
* the module's ``main`` takes and returns exactly what the fields say (platform
  index, effect tokens, the kept inputs with their shapes and element types)
  and the module is partitioned for ``nr_devices`` devices;
* each VJP level agrees with the level it differentiates (its inputs are the
  primal inputs plus one cotangent per output; its outputs one cotangent per
  input).

Any failure is a ``ValueError`` saying what is inconsistent.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import hashlib
from typing import Any

import jax
import numpy as np

from . import module_reader
from . import platforms as _platforms
from .specs import format_aval

# Bound at import: a program that swaps jax's entry points keeps this one.
_deserialize = jax.export.deserialize

#: At most this many VJP levels are read (jax.export writes one per order).
MAX_VJP_LEVELS = 16

# MLIR element type of each dtype name; dtypes not listed (extended dtypes such
# as PRNG keys) are checked by count only.
_ELEMENT_TYPES = {
  "bool": "i1",
  "float0": "i1",
  "int2": "i2",
  "int4": "i4",
  "int8": "i8",
  "int16": "i16",
  "int32": "i32",
  "int64": "i64",
  "uint2": "ui2",
  "uint4": "ui4",
  "uint8": "ui8",
  "uint16": "ui16",
  "uint32": "ui32",
  "uint64": "ui64",
  "float16": "f16",
  "bfloat16": "bf16",
  "float32": "f32",
  "float64": "f64",
  "complex64": "complex<f32>",
  "complex128": "complex<f64>",
  "float8_e4m3fn": "f8E4M3FN",
  "float8_e4m3b11fnuz": "f8E4M3B11FNUZ",
  "float8_e4m3fnuz": "f8E4M3FNUZ",
  "float8_e5m2": "f8E5M2",
  "float8_e5m2fnuz": "f8E5M2FNUZ",
  "float8_e3m4": "f8E3M4",
  "float8_e4m3": "f8E4M3",
  "float8_e8m0fnu": "f8E8M0FNU",
  "float4_e2m1fn": "f4E2M1FN",
}


class Invalid(ValueError):
  """The deserialized program is inconsistent (the message says how)."""


def deserialize_checked(
  blob: bytes,
  *,
  trusted_modules: frozenset[str] = frozenset(),
  isolate: bool = False,
  verified_modules: frozenset[str] = frozenset(),
) -> tuple[list[jax.export.Exported], list[str | None]]:
  """Deserializes ``blob`` and every VJP level in it, and validates each.

  Args:
    blob: what ``jax.export.Exported.serialize`` wrote.
    trusted_modules: sha256 digests of modules that may be read in this
      process (see ``module_reader.describe_modules``); others are read in
      the child process.
    isolate: read every module in the child process.
    verified_modules: sha256 digests of modules already checked against
      the program they belong to (an artifact's manifest records them when
      ``save_artifact`` writes a checked program): those are not read again.

  Returns:
    The levels, primal first; the ``vjp()`` of each returns the next one
    (the very object validated here, not a fresh deserialization); and the
    sha256 (hex) of each level's module where it was computed (with
    ``verified_modules``), else None.

  Raises:
    Invalid: the blob does not parse, or a level is inconsistent.
  """
  try:
    levels = [_deserialize(bytearray(blob))]
    while levels[-1].has_vjp():
      if len(levels) > MAX_VJP_LEVELS:
        raise Invalid(f"more than {MAX_VJP_LEVELS} VJP levels")
      levels.append(levels[-1].vjp())
  except Invalid:
    raise
  except Exception as e:  # the flatbuffer reader raises whatever damage causes
    raise Invalid(f"{type(e).__name__}: {_shorten(e)}") from None
  for depth, level in enumerate(levels):
    _check_at(depth, _check_level, level)
    if depth:
      _check_at(depth, _check_vjp_of, levels[depth - 1], level)
  digests: list[str | None] = [
    hashlib.sha256(lvl.mlir_module_serialized).hexdigest()
    if verified_modules
    else None
    for lvl in levels
  ]
  unchecked = [
    (depth, lvl)
    for depth, lvl in enumerate(levels)
    if digests[depth] not in verified_modules
  ]
  try:
    infos = module_reader.describe_modules(
      [lvl.mlir_module_serialized for _, lvl in unchecked],
      trusted=trusted_modules,
      isolate=isolate,
    )
  except module_reader.ReaderUnavailable as e:
    raise RuntimeError(
      f"jaxworks.stages_aot: cannot validate the StableHLO modules: {e}"
    ) from None
  for (depth, level), info in zip(unchecked, infos):
    _check_at(depth, _check_module, level, info)
  # Chain the validated levels, so that vjp() never deserializes again.
  chained = [levels[-1]]
  for level in reversed(levels[:-1]):
    nxt = chained[-1]

    def get_vjp(_: Any, nxt: jax.export.Exported = nxt) -> jax.export.Exported:
      return nxt

    chained.append(dataclasses.replace(level, _get_vjp=get_vjp))
  return chained[::-1], digests


def _shorten(text: object, limit: int = 300) -> str:
  text = " ".join(str(text).split())
  return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_at(depth: int, check: Callable[..., None], *args: Any) -> None:
  """``check(*args)`` on level ``depth``; a failure is an Invalid naming it."""
  where = "the program" if depth == 0 else f"its VJP of order {depth}"
  try:
    check(*args)
  except Invalid as e:
    raise Invalid(f"{where}: {e}") from None
  except Exception as e:
    raise Invalid(f"{where}: {type(e).__name__}: {_shorten(e)}") from None


def _check_level(exp: jax.export.Exported) -> None:
  lo = jax.export.minimum_supported_calling_convention_version
  hi = jax.export.maximum_supported_calling_convention_version
  if not lo <= exp.calling_convention_version <= hi:
    raise Invalid(
      f"calling convention version {exp.calling_convention_version} is not "
      f"in {lo}..{hi}"
    )
  platforms = tuple(exp.platforms)
  if (
    not platforms
    or len(set(platforms)) != len(platforms)
    or any(p not in _platforms.KNOWN_PLATFORMS for p in platforms)
  ):
    raise Invalid(
      f"platforms {platforms!r} are not distinct names from {_platforms.KNOWN_PLATFORMS}"
    )
  if not isinstance(exp.nr_devices, int) or exp.nr_devices < 1:
    raise Invalid(f"nr_devices {exp.nr_devices!r} is not a positive int")
  if not isinstance(exp.fun_name, str):
    raise Invalid(f"function name {exp.fun_name!r} is not a string")
  # jax's stubs for PyTreeDef lack num_leaves and unflatten.
  in_tree: Any = exp.in_tree
  out_tree: Any = exp.out_tree
  if in_tree.num_leaves != len(exp.in_avals) or out_tree.num_leaves != len(
    exp.out_avals
  ):
    raise Invalid(
      f"{len(exp.in_avals)} input and {len(exp.out_avals)} output avals for trees "
      f"with {in_tree.num_leaves} and {out_tree.num_leaves} leaves"
    )
  # The input tree is (args tuple, kwargs dict).
  placeholder = in_tree.unflatten([0] * in_tree.num_leaves)
  if not (
    isinstance(placeholder, tuple)
    and len(placeholder) == 2
    and isinstance(placeholder[0], tuple)
    and isinstance(placeholder[1], dict)
  ):
    raise Invalid(f"input tree {in_tree} is not (args, kwargs)")
  kept = tuple(exp.module_kept_var_idx)
  if list(kept) != sorted(set(kept)) or any(
    not 0 <= i < len(exp.in_avals) for i in kept
  ):
    raise Invalid(
      f"kept input indices {kept} are not sorted, distinct indices below "
      f"{len(exp.in_avals)}"
    )
  # jax's stubs type the mesh as required; None keeps the export's abstract
  # mesh, and the shardings are then NamedShardings (or None).
  in_shardings: Any = exp.in_shardings_jax(None)  # type: ignore[arg-type]
  out_shardings: Any = exp.out_shardings_jax(None)  # type: ignore[arg-type]
  if len(in_shardings) != len(exp.in_avals) or len(out_shardings) != len(
    exp.out_avals
  ):
    raise Invalid("the number of shardings differs from the number of avals")
  for s in (*in_shardings, *out_shardings):
    if s is not None and s.mesh.size != exp.nr_devices:
      raise Invalid(
        f"a sharding's mesh has {s.mesh.size} devices, the program {exp.nr_devices}"
      )


def _check_module(exp: jax.export.Exported, info: dict[str, Any]) -> None:
  kept = tuple(exp.module_kept_var_idx)
  if "error" in info:
    raise Invalid(
      f"its StableHLO module is unreadable ({_shorten(info['error'])})"
    )
  attrs = info["attributes"]
  devices = attrs.get("mhlo.num_partitions", 1) * attrs.get(
    "mhlo.num_replicas", 1
  )
  if devices != exp.nr_devices:
    raise Invalid(
      f"the module is partitioned for {devices} devices, the program says "
      f"{exp.nr_devices}"
    )
  inputs, results = info["inputs"], info["results"]
  n_tokens = len(exp.ordered_effects)
  n_index = 1 if len(exp.platforms) > 1 else 0
  expected_inputs = n_index + n_tokens + len(kept)
  if len(inputs) != expected_inputs or len(results) != n_tokens + len(
    exp.out_avals
  ):
    raise Invalid(
      f"its module's main takes {len(inputs)} inputs and returns {len(results)} "
      f"results; the program needs {expected_inputs} inputs ({n_index} platform "
      f"index, {n_tokens} tokens, {len(kept)} kept arguments) and "
      f"{n_tokens + len(exp.out_avals)} results"
    )
  dynamic = info["dynamic"]
  for i, t in zip(kept, inputs[n_index + n_tokens :]):
    _check_type(t, exp.in_avals[i], f"input {i}", dynamic)
  for i, (t, aval) in enumerate(zip(results[n_tokens:], exp.out_avals)):
    _check_type(t, aval, f"output {i}", dynamic)


def _check_type(
  mlir_type: dict[str, Any], aval, what: str, dynamic: int
) -> None:
  name = np.dtype(aval.dtype).name if _is_numpy_dtype(aval.dtype) else None
  expected_element = _ELEMENT_TYPES.get(name) if name else None
  if expected_element is None:
    return  # an extended dtype: its physical layout is jax's business
  dims = mlir_type.get("shape")
  same = (
    dims is not None
    and len(dims) == len(aval.shape)
    and all(
      (m == d) if isinstance(d, (int, np.integer)) else (m == dynamic)
      for m, d in zip(dims, aval.shape)
    )
  )
  if not same or mlir_type.get("element") != expected_element:
    raise Invalid(
      f"{what} is {_shorten(mlir_type['text'])} in the module, the program says "
      f"{format_aval(aval)}"
    )


def _is_numpy_dtype(dtype) -> bool:
  try:
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
  except TypeError:
    return False


def _cotangent_dtype(dtype):
  if _is_numpy_dtype(dtype) and jax.dtypes.issubdtype(dtype, np.inexact):
    return dtype
  return jax.dtypes.float0


def _check_vjp_of(
  primal: jax.export.Exported, vjp: jax.export.Exported
) -> None:
  n_in, n_out = len(primal.in_avals), len(primal.out_avals)
  if len(vjp.in_avals) != n_in + n_out or len(vjp.out_avals) != n_in:
    raise Invalid(
      f"takes {len(vjp.in_avals)} inputs and returns {len(vjp.out_avals)}; a VJP of "
      f"a program with {n_in} inputs and {n_out} outputs takes {n_in + n_out} and "
      f"returns {n_in}"
    )
  if (
    tuple(vjp.platforms) != tuple(primal.platforms)
    or vjp.nr_devices != primal.nr_devices
  ):
    raise Invalid("its platforms or device count differ from the program's")
  expected = [(a.shape, a.dtype) for a in primal.in_avals] + [
    (a.shape, _cotangent_dtype(a.dtype)) for a in primal.out_avals
  ]
  expected += [(a.shape, _cotangent_dtype(a.dtype)) for a in primal.in_avals]
  observed = [(a.shape, a.dtype) for a in (*vjp.in_avals, *vjp.out_avals)]
  for (shape, dtype), (o_shape, o_dtype) in zip(expected, observed):
    if [str(d) for d in shape] != [str(d) for d in o_shape] or dtype != o_dtype:
      raise Invalid(
        f"its avals {[format_aval(a) for a in vjp.in_avals]} -> "
        f"{[format_aval(a) for a in vjp.out_avals]} do not match the program's"
      )
