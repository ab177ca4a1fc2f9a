"""Which equation params name axes, and which equations bind axis names.

Two small tables drive the whole package:

* ``AXIS_PARAMS``: for each collective or axis query, the param holding the
  axis name(s) it uses (``psum[axes=('i', 0)]``, ``ppermute[axis_name=('i',)]``).
  Integers in these params are positional axes, not names.
* ``BINDERS``: for each higher-order primitive that binds axis names, a
  function from its params to ``{name: size}`` of the names it binds (size
  None when not static). Names used inside its sub-jaxprs stop at the
  binder.

* ``CALLABLE_PARAMS``: for each primitive whose params hold Python callables
  that trace user code later (a ``custom_vjp``'s forward and backward rules,
  a ``custom_jvp`` rule), which params those are and how they are called.
  The names such code uses are invisible until it runs, so a rename wraps
  them (``rename.py``).

Sub-jaxprs themselves are not listed anywhere: they are found by scanning
every param value (and tuples/lists of them) for ``Jaxpr``/``ClosedJaxpr``.
A primitive in neither table with no sub-jaxprs falls back to the
``NamedAxisEffect`` objects JAX attached to its equation.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Mapping
from typing import Any

# Primitive name -> the param holding the axis name(s). Asynchronous
# ``*_start`` variants take the same params as their synchronous primitive.
AXIS_PARAMS: dict[str, str] = {
  # reductions / invariant casts: ``axes`` mixes names and positional ints
  **dict.fromkeys(
    "psum pmax pmin psum_invariant unreduced_psum pvary preduced"
    " vary_unreduced_cast_p reduced_vary_cast_p psum_start"
    " psum_invariant_start unreduced_psum_start".split(),
    "axes",
  ),
  # data movement and axis queries: ``axis_name``
  **dict.fromkeys(
    "axis_index ppermute pbroadcast psend precv all_to_all ragged_all_to_all"
    " all_gather all_gather_invariant all_gather_reduced reduce_scatter"
    " unreduced_reduce_scatter all_gather_start all_gather_reduced_start"
    " reduce_scatter_start unreduced_reduce_scatter_start all_to_all_start"
    " pbroadcast_start ppermute_start".split(),
    "axis_name",
  ),
}


def names_in_param(value: Any) -> tuple[Hashable, ...]:
  """The axis names in an ``axes``/``axis_name`` param value, in order."""
  items = value if isinstance(value, (tuple, list)) else (value,)
  return tuple(a for a in items if a is not None and not isinstance(a, int))


def rename_in_param(value: Any, mapping: Mapping[Hashable, Hashable]) -> Any:
  """``value`` with every axis name replaced through ``mapping``."""
  if isinstance(value, (tuple, list)):
    return type(value)(
      a if a is None or isinstance(a, int) else mapping.get(a, a) for a in value
    )
  if value is None or isinstance(value, int):
    return value
  return mapping.get(value, value)


def _shard_map_binds(params: Mapping[str, Any]) -> dict:
  # shard_map makes ``newly_manual_axes`` manual; axes that were already
  # manual are bound by an enclosing shard_map. (JAX's own effect filter
  # drops all of ``mesh.axis_names``; that differs only for a nested
  # shard_map that uses an outer manual axis, where this is the exact set.)
  shape = params["mesh"].shape
  return {n: shape.get(n) for n in params["newly_manual_axes"]}


def _pmap_binds(params: Mapping[str, Any]) -> dict:
  # The pre-0.10 ``xla_pmap`` primitive (JAX 0.10 builds pmap from jit and
  # shard_map); kept so jaxprs from other JAX versions analyse correctly.
  size = params.get("axis_size")
  return {n: size for n in names_in_param(params["axis_name"])}


def _pallas_call_binds(params: Mapping[str, Any]) -> dict:
  # A Pallas kernel's named grid axes (``grid=(("g", 2),)``): inside the
  # kernel ``lax.axis_index("g")`` is the grid index. Dynamic grid bounds
  # have no static size.
  grid_mapping = params["grid_mapping"]
  names = grid_mapping.grid_names or ()
  return {
    n: s if isinstance(s, int) else None
    for n, s in zip(names, grid_mapping.grid)
  }


def _mesh_shape_binds(*meshes) -> dict:
  return {n: s for mesh in meshes for n, s in mesh.shape.items()}


BINDERS: dict[str, Callable[[Mapping[str, Any]], dict]] = {
  "shard_map": _shard_map_binds,
  "xla_pmap": _pmap_binds,
  "pallas_call": _pallas_call_binds,
  # Pallas ``core_map`` binds its core mesh's axes; ``mpmd_map`` the axes
  # of all its meshes (JAX traces each body with all of them bound).
  "core_map": lambda params: _mesh_shape_binds(params["mesh"]),
  "mpmd_map": lambda params: _mesh_shape_binds(*params["meshes"]),
}


# How a rule callable is called:
# JAXPR_THUNK: ``thunk(*flags)`` traces the rule and returns a tuple holding
#   its jaxpr (``(jaxpr, consts)`` or ``(jaxpr, consts, out_zeros)``).
# RULE: called with values (tracers, arrays, symbolic zeros, static Python
#   values), it runs the user's rule and returns values.
JAXPR_THUNK = "jaxpr_thunk"
RULE = "rule"

CALLABLE_PARAMS: dict[str, dict[str, str]] = {
  "custom_vjp_call": {"fwd_jaxpr_thunk": JAXPR_THUNK, "bwd": RULE},
  "custom_jvp_call": {"jvp_jaxpr_fun": JAXPR_THUNK},
  # ``custom_lin`` carries a custom_vjp's backward rule in jaxprs traced
  # under ``jvp``/``linearize``; ``custom_vmap_call`` its batching rule.
  "custom_lin": {"bwd": RULE},
  "custom_vmap_call": {"rule": RULE},
}
