"""The stages of a jitted function: ``Traced`` (``f.trace(...)``)."""

from __future__ import annotations

from typing import Any

import jax
from jax.extend import core as jex_core

from . import jax_internals as ji

_tree_unflatten = jax.tree_util.tree_unflatten


class Traced:
  """A traced function specialised to argument types (``f.trace(...)``).

  Attributes:
    jaxpr: the ``ClosedJaxpr``. Tracers the function closes over (when traced
      under another transformation) are leading inputs, not constants.
    fun_name: name of the traced function.
    in_avals: abstract values of the dynamic arguments, as the pytree
      ``(args, kwargs)`` (static arguments left out).
    out_info: output ``jax.ShapeDtypeStruct`` pytree.
    args_info: jax's ``ArgInfo`` pytree (aval and donation per argument).
  """

  __slots__ = ("_traced",)

  def __init__(self, traced: Any):
    self._traced = traced

  @property
  def jaxpr(self) -> jex_core.ClosedJaxpr:
    return self._traced.jaxpr

  @property
  def fun_name(self) -> str:
    return self._traced.fun_name

  @property
  def in_avals(self) -> Any:
    params, consts, _, in_tree, _ = ji.traced_parts(self._traced)
    avals = params["jaxpr"].in_avals[len(consts) :]
    return _tree_unflatten(in_tree, avals)

  @property
  def out_info(self) -> Any:
    return self._traced.out_info

  @property
  def args_info(self) -> Any:
    return self._traced.args_info

  @property
  def _consts(self) -> list:
    return ji.traced_parts(self._traced)[1]

  def lower(
    self,
    *,
    lowering_platforms: tuple[str, ...] | None = None,
    _private_parameters: Any = None,
  ) -> jax.stages.Lowered:
    """Lowers to a stock ``jax.stages.Lowered``.

    Args:
      lowering_platforms: platforms to lower for, e.g. ``("tpu",)`` or
        ``("cpu", "cuda")``; default: those of the arguments.
      _private_parameters: a ``jax.interpreters.mlir.LoweringParameters``,
        passed through to ``jax.stages.Traced.lower`` as is (private in jax
        too; ``jaxworks.stages_aot`` lowers with ``jax.export``'s parameters
        through it). Default: jax's default lowering.
    """
    if _private_parameters is None:
      return self._traced.lower(lowering_platforms=lowering_platforms)
    return self._traced.lower(
      lowering_platforms=lowering_platforms,
      _private_parameters=_private_parameters,
    )

  def __repr__(self) -> str:
    return (
      f"Traced({self.fun_name}: {self.jaxpr.in_avals} -> "
      f"{self.jaxpr.out_avals})"
    )
