"""Argument specs written as text, e.g. ``'f32[b,128]'``, and avals printed that way.

A spec is ``DTYPE[DIMS]``: DTYPE is a short name (``f32``, ``bf16``, ``i32``,
``bool`` ...) or a NumPy/JAX name (``float32``); DIMS is a comma-separated list
of non-negative integers and symbolic dimension expressions (``b``, ``2*b``),
as accepted by :func:`jax.export.symbolic_shape`. ``f32[]`` is a scalar.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence
import re

import jax
import jax.numpy as jnp
import numpy as np

_SHORT_TO_NAME = {
  "bool": "bool",
  "pred": "bool",
  "i4": "int4",
  "i8": "int8",
  "i16": "int16",
  "i32": "int32",
  "i64": "int64",
  "u4": "uint4",
  "u8": "uint8",
  "u16": "uint16",
  "u32": "uint32",
  "u64": "uint64",
  "bf16": "bfloat16",
  "f16": "float16",
  "f32": "float32",
  "f64": "float64",
  "c64": "complex64",
  "c128": "complex128",
}
_NAME_TO_SHORT: dict[str, str] = {}
for _short, _name in _SHORT_TO_NAME.items():
  _NAME_TO_SHORT.setdefault(_name, _short)

# Extra dtypes accepted by their full name only (the float8 family and friends).
_EXTRA_NAMES = (
  "float8_e4m3fn",
  "float8_e4m3b11fnuz",
  "float8_e4m3fnuz",
  "float8_e5m2",
  "float8_e5m2fnuz",
  "float8_e3m4",
  "float8_e4m3",
  "float8_e8m0fnu",
  "float4_e2m1fn",
  "int2",
  "uint2",
)

_X64_NAMES = ("int64", "uint64", "float64", "complex128")

_SPEC_RE = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_]*)\s*\[(.*)\]\s*$", re.DOTALL)
_INT_RE = re.compile(r"^\s*-?\d+\s*$")


def _dtype_for(name: str, spec: str, api: str) -> np.dtype:
  full = _SHORT_TO_NAME.get(name, name)
  if full in _NAME_TO_SHORT or full in _EXTRA_NAMES:
    try:
      dtype = jnp.dtype(full)
    except TypeError:
      dtype = None
    if dtype is not None:
      # jax.config's options are dynamic attributes, absent from its stubs.
      x64 = jax.config.jax_enable_x64  # type: ignore[attr-defined]
      if full in _X64_NAMES and not x64:
        raise ValueError(
          f"{api}: spec {spec!r} asks for {full}, but 64-bit types are disabled "
          "in this process; set JAX_ENABLE_X64=1 (or jax.config.update("
          "'jax_enable_x64', True)) or use a 32-bit type"
        )
      return dtype
  known = ", ".join(_SHORT_TO_NAME)
  raise ValueError(
    f"{api}: unknown dtype {name!r} in spec {spec!r}; use one of {known} "
    "(or a full name such as float32)"
  )


def parse_arg_specs(
  specs: Iterable[str],
  *,
  scope: jax.export.SymbolicScope | None = None,
  api: str = "jaxworks.stages_aot.arg_specs",
) -> list[jax.ShapeDtypeStruct]:
  """Parses several specs into ``jax.ShapeDtypeStruct`` s sharing one symbolic scope.

  Dimension names that appear in several specs denote the same dimension, as
  ``jax.export`` requires.

  Args:
    specs: strings such as ``'f32[b,128]'``.
    scope: the symbolic scope to use; a new one when None.
    api: the public API name to put in error messages.

  Returns:
    One ``jax.ShapeDtypeStruct`` per spec.

  Raises:
    TypeError: a spec is not a string.
    ValueError: a malformed spec, with the spec and the expected form.

  >>> x, y = parse_arg_specs(["f32[b,128]", "i32[b]"])
  >>> x
  ShapeDtypeStruct(shape=(b, 128), dtype=float32)
  >>> x.shape[0] is y.shape[0] or x.shape[0] == y.shape[0]
  True
  >>> parse_arg_specs(["bf16[]"])
  [ShapeDtypeStruct(shape=(), dtype=bfloat16)]
  """
  if isinstance(specs, str):
    raise TypeError(
      f"{api}: expected a list of specs, got the single string {specs!r}"
    )
  scope = jax.export.SymbolicScope() if scope is None else scope
  return [_parse_one(s, scope, api) for s in specs]


def _parse_one(
  spec: object, scope: jax.export.SymbolicScope, api: str
) -> jax.ShapeDtypeStruct:
  if not isinstance(spec, str):
    raise TypeError(
      f"{api}: an argument spec must be a string such as 'f32[b,128]', got "
      f"{type(spec).__name__} {spec!r}"
    )
  match = _SPEC_RE.match(spec)
  if match is None:
    raise ValueError(
      f"{api}: cannot parse argument spec {spec!r}; expected DTYPE[DIMS], "
      "e.g. 'f32[b,128]', 'i32[8]' or 'f32[]' for a scalar"
    )
  dtype = _dtype_for(match.group(1), spec, api)
  dims = match.group(2)
  if dims.strip() == "":
    return jax.ShapeDtypeStruct((), dtype)
  for i, d in enumerate(dims.split(",")):
    if _INT_RE.match(d) and int(d) < 0:
      raise ValueError(
        f"{api}: dimension {i} of spec {spec!r} is {int(d)}; dimensions must be "
        "non-negative integers or symbolic names such as 'b'"
      )
  try:
    shape = jax.export.symbolic_shape(dims, scope=scope)
  except Exception as e:  # jax raises ValueError or others for bad expressions
    raise ValueError(
      f"{api}: bad dimensions in argument spec {spec!r}: {str(e).rstrip('.')}. "
      "Dimensions are "
      "non-negative integers or expressions of names, e.g. 'f32[b,2*b,128]'"
    ) from None
  return jax.ShapeDtypeStruct(shape, dtype)


def arg_spec(spec: str) -> jax.ShapeDtypeStruct:
  """Parses one argument spec such as ``'f32[b,128]'`` into a ``jax.ShapeDtypeStruct``.

  Use :func:`arg_specs` for several arguments that share dimension names.

  >>> arg_spec("f32[b,128]")
  ShapeDtypeStruct(shape=(b, 128), dtype=float32)
  >>> arg_spec("i8[2,3]")
  ShapeDtypeStruct(shape=(2, 3), dtype=int8)
  >>> arg_spec("f33[4]")
  Traceback (most recent call last):
  ...
  ValueError: jaxworks.stages_aot.arg_spec: unknown dtype 'f33' in spec 'f33[4]'; use one of bool, pred, i4, i8, i16, i32, i64, u4, u8, u16, u32, u64, bf16, f16, f32, f64, c64, c128 (or a full name such as float32)
  """
  return parse_arg_specs([spec], api="jaxworks.stages_aot.arg_spec")[0]


def arg_specs(*specs: str) -> tuple[jax.ShapeDtypeStruct, ...]:
  """Parses argument specs that share dimension names (one symbolic scope).

  >>> x, w = arg_specs("f32[b,128]", "f32[128,16]")
  >>> x.shape, w.shape
  ((b, 128), (128, 16))
  """
  return tuple(parse_arg_specs(specs, api="jaxworks.stages_aot.arg_specs"))


def dtype_short_name(dtype) -> str:
  """Returns the short spec name of a dtype, e.g. ``f32`` for float32.

  >>> dtype_short_name(np.float32), dtype_short_name(jnp.bfloat16)
  ('f32', 'bf16')
  """
  name = dtype_name(dtype)
  return _NAME_TO_SHORT.get(name, name)


def dtype_name(dtype) -> str:
  """numpy's name of a dtype, or JAX's for its extended dtypes (typed PRNG
  keys print as ``key<fry>``), which numpy cannot interpret.

  >>> dtype_name(np.float32), dtype_name(jax.random.key(0).dtype)
  ('float32', 'key<fry>')
  """
  if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
    return str(dtype)
  return np.dtype(dtype).name


def format_aval(aval) -> str:
  """Formats anything with ``shape`` and ``dtype`` as a spec, e.g. ``'f32[b,128]'``.

  >>> format_aval(jax.ShapeDtypeStruct((3, 4), jnp.int32))
  'i32[3,4]'
  >>> format_aval(arg_spec("f32[b, 2*b]"))
  'f32[b,2*b]'
  """
  dims = ",".join(str(d).replace(" ", "") for d in aval.shape)
  return f"{dtype_short_name(aval.dtype)}[{dims}]"


def is_concrete(shape: Sequence) -> bool:
  """True when every dimension is an integer (no symbolic dimensions)."""
  return all(not jax.export.is_symbolic_dim(d) for d in shape)
