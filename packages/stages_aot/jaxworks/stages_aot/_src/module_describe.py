"""What the module checks need from a serialized StableHLO module.

Imports nothing but the standard library, so that the module reader's child
process (``module_reader.py``) can load this file by path without importing
jax; the reader (``deserialize``: ``jax.extend.mlir``'s
``deserialize_portable_artifact``) and the MLIR bindings (``ir``) are passed
in, so the same code runs in-process and in the child.
"""

from __future__ import annotations

from typing import Any


def _text(obj: Any) -> str:
  try:
    return str(obj)
  except Exception:  # a damaged name need not be UTF-8
    return "(not UTF-8)"


def _describe_type(ir: Any, t: Any) -> dict[str, Any]:
  try:
    tensor = ir.RankedTensorType(t)
  except Exception:  # not a ranked tensor (a token, say)
    return {"text": _text(t)}
  return {
    "text": _text(t),
    "shape": list(tensor.shape),
    "element": _text(tensor.element_type),
  }


def describe(
  blob: bytes, deserialize: Any, ir: Any, context: Any = None
) -> dict[str, Any]:
  """Reads and verifies one serialized module; says what ``main`` takes.

  ``context`` is the ``ir.Context`` to read it in (a fresh one if None).

  Returns:
    ``{"error": text}`` when the module does not deserialize, does not verify
    or has no ``main``; else ``{"attributes": {name: int}, "inputs": [type],
    "results": [type], "dynamic": int}``, where a type is ``{"text", "shape",
    "element"}`` (``shape`` and ``element`` for ranked tensors; ``dynamic``
    marks an unknown dimension in ``shape``).
  """
  diagnostics: list[str] = []

  def on_diagnostic(d: Any) -> bool:
    diagnostics.append(_text(d.message))
    return True

  with context or ir.Context() as ctx:
    ctx.allow_unregistered_dialects = True
    handler = ctx.attach_diagnostic_handler(on_diagnostic)
    try:
      try:
        module = deserialize(blob)
      except Exception as e:  # the reader raises whatever damage causes
        return {"error": "; ".join(diagnostics) or _text(e)}
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
        if (
          "sym_name" in op_attrs
          and "function_type" in op_attrs
          and ir.StringAttr(op_attrs["sym_name"]).value == "main"
        ):
          main = ir.FunctionType(ir.TypeAttr(op_attrs["function_type"]).value)
      if main is None:
        return {"error": "no main function"}
      return {
        "attributes": ints,
        "inputs": [_describe_type(ir, t) for t in main.inputs],
        "results": [_describe_type(ir, t) for t in main.results],
        "dynamic": ir.ShapedType.get_dynamic_size(),
      }
    finally:
      handler.detach()


def describe_safely(
  blob: bytes, deserialize: Any, ir: Any, context: Any = None
) -> dict[str, Any]:
  """:func:`describe`, with any exception it raises as an ``error`` answer."""
  try:
    return describe(blob, deserialize, ir, context)
  except Exception as e:
    return {"error": type(e).__name__ + ": " + _text(e)}
