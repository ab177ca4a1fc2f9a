"""Compiling a lowering for a platform other than the default backend.

A module lowered for several platforms takes a platform index as its first
argument (the ``jax.export`` calling convention); stock ``Lowered.compile``
cannot compile it. :func:`compile_exported` compiles the exported form of the
module with the index fixed to one present platform, placing inputs and
outputs with the exported shardings.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from typing import cast

import jax
import numpy as np

from . import jax_internals as ji

# Stock JAX callables bound at import (never looked up at call time).
_stock_jit = ji.stock_jit
_devices = jax.devices
_default_device = jax.default_device
_default_export_platform = jax.export.default_export_platform
_is_symbolic_dim = jax.export.is_symbolic_dim


def symbolic_inputs(in_avals: Any) -> list[str]:
  """The input avals with symbolic dimensions, as text (for messages)."""
  return [
    a.str_short(short_dtypes=True)
    for a in jax.tree_util.tree_leaves(in_avals)
    if any(_is_symbolic_dim(d) for d in getattr(a, "shape", ()))
  ]


def compile_exported(
  exp: jax.export.Exported,
  target: str,
  in_avals: Any,
  api: str,
  compiler_options: dict[str, Any] | None = None,
  committed: bool | None = None,
  placed_on: Sequence[Any] | None = None,
  one_device: tuple[Sequence[Any], Sequence[Any]] | None = None,
) -> jax.stages.Compiled:
  """Compiles an exported module for ``target``, its platform index fixed.

  ``exp.call`` inlines the module and passes the index of ``target``; inputs
  and outputs are placed with the exported shardings on ``placed_on`` (the
  devices, in order, the arguments were lowered on, as stock's compile places
  them) when those are ``exp.nr_devices`` devices of ``target``, else on a
  mesh of the first ``exp.nr_devices`` devices of ``target``. ``committed``:
  whether outputs are committed (None: as JAX decides for a jit of
  ``exp.call``, which is always committed). ``one_device``: the input and
  output shardings stock's compile gives a lowering over the one device of
  ``placed_on`` (``jax_internals.one_device_shardings``), kept where they
  name a mesh (the exported module over one device records none).
  """
  devices = list(_devices(target))
  placed = bool(
    placed_on
    and len(placed_on) == exp.nr_devices
    and all(platform_name(d) == target for d in placed_on)
  )
  if placed:
    devices = list(cast(Sequence[Any], placed_on))
  in_shardings: Sequence[jax.sharding.Sharding | None]
  out_shardings: Sequence[jax.sharding.Sharding | None]
  in_shardings = (None,) * len(exp.in_avals)
  out_shardings = (None,) * len(exp.out_avals)
  if (
    placed
    and exp.nr_devices == 1
    and one_device is not None
    and len(one_device[0]) <= len(exp.in_avals)
    and len(one_device[1]) == len(exp.out_avals)
    and any(
      isinstance(s, jax.sharding.NamedSharding)
      for s in (*one_device[0], *one_device[1])
    )
  ):
    ins, outs = one_device
    in_shardings = (*ins, *(None,) * (len(exp.in_avals) - len(ins)))
    out_shardings = tuple(outs)
  elif exp.nr_devices > 1:
    # jax's stubs type the mesh as required; None keeps the export's abstract
    # mesh, and the shardings are then NamedShardings (or None).
    abstract_shardings = (
      *exp.in_shardings_jax(None),  # type: ignore[arg-type]
      *exp.out_shardings_jax(None),  # type: ignore[arg-type]
    )
    named = [
      cast(jax.sharding.NamedSharding, s)
      for s in abstract_shardings
      if s is not None
    ]
    if not named or len(devices) < exp.nr_devices:
      raise ValueError(
        f"{api}: cannot place the multi-platform module of {exp.fun_name!r} "
        f"on {exp.nr_devices} {target} devices (this host has "
        f"{len(devices)}, and the module has {len(named)} input/output "
        f"shardings); lower for ({target!r},) alone to compile it"
      )
    abstract = named[0].mesh
    mesh = jax.sharding.Mesh(
      np.array(devices[: exp.nr_devices]).reshape(abstract.axis_sizes),
      abstract.axis_names,
      axis_types=abstract.axis_types,
    )
    in_shardings = exp.in_shardings_jax(mesh)
    out_shardings = exp.out_shardings_jax(mesh)
  flat_avals = jax.tree_util.tree_leaves(in_avals)
  specs = [
    jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    for a, s in zip(flat_avals, in_shardings)
  ]
  # jax's stubs for PyTreeDef lack unflatten.
  args, kwargs = exp.in_tree.unflatten(specs)  # type: ignore[attr-defined]
  out_tree_shardings = exp.out_tree.unflatten(out_shardings)  # type: ignore[attr-defined]
  jitted = _stock_jit(exp.call, out_shardings=out_tree_shardings)
  with _default_device(devices[0]):
    lowered = jitted.trace(*args, **kwargs).lower(lowering_platforms=(target,))
    if committed is not None:
      lowered = ji.with_committed(lowered, committed)
    return lowered.compile(compiler_options)


def platform_name(device: Any) -> str:
  """The platform of ``device`` as lowering names it (``cuda``, not ``gpu``)."""
  platform = device.platform
  return "cuda" if platform == "gpu" else platform


def default_platform() -> str:
  """This process's default platform, as lowering names it."""
  return _default_export_platform()
