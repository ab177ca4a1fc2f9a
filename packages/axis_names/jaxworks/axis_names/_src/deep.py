"""Axis names carried by values other than collective params.

Inside a ``shard_map`` an axis name is not only in collectives: abstract
values record the manual axes they vary over (``f32[2]{V:i}``) and their
sharding's mesh, equations record the abstract mesh they were traced under,
and params such as ``jit``'s ``ctx_mesh`` or a ``sharding=`` hold meshes and
``PartitionSpec`` objects. ``names_of`` lists the manual axis names such a value
mentions and ``rename`` rebuilds it under a mapping, returning the same
object when nothing changes (so untouched structure stays shared). Only
manual mesh axes are renamed: those are the names collectives use. The one
exception is a ``HiddenName``: while a function is traced under its old
names, a mesh axis that still carries an old name is hidden under a
``HiddenName`` (see ``context.py``), whatever its axis type, and renamed
back afterwards.
"""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import AbstractMesh
from jax.sharding import ManualAxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

_EMPTY: frozenset = frozenset()
_AbstractValue = jax.core.AbstractValue


class HiddenName(str):
  """A temporary mesh axis name standing for a user axis that is hidden.

  ``rename_axes(f, {'i': 'k'})`` inside a ``shard_map`` whose mesh has both
  ``'i'`` and ``'k'`` traces ``f`` with the mesh axis ``'k'`` called ``'i'``;
  the mesh's own ``'i'`` axis is meanwhile called ``hidden('i')``. The name
  is deterministic (the same axis gets the same name in every trace, so
  avals recorded in one trace match the next) and a ``str`` subclass, so JAX
  accepts it wherever it accepts a mesh axis name.
  """

  __slots__ = ()


def hidden(name: Hashable) -> HiddenName:
  """The ``HiddenName`` standing for mesh axis ``name`` while it is hidden."""
  return HiddenName(f"{name}(hidden by jaxworks.axis_names.rename_axes)")


def _hidden_axes(mesh, mapping: Mapping | None = None) -> frozenset:
  """Non-manual axes of ``mesh`` that a hiding entry of ``mapping`` renames.

  With no mapping: the axes already named by a ``HiddenName``.
  """
  return frozenset(
    n
    for n in mesh.axis_names
    if isinstance(n, HiddenName)
    or (mapping is not None and isinstance(mapping.get(n), HiddenName))
  )


def _spec_names(spec: PartitionSpec) -> frozenset:
  out: set = set()
  for entry in spec:
    if isinstance(entry, tuple):
      out.update(entry)
    elif entry is not None and entry is not PartitionSpec.UNCONSTRAINED:
      out.add(entry)
  out.update(getattr(spec, "unreduced", ()) or ())
  out.update(getattr(spec, "reduced", ()) or ())
  return frozenset(out)


def _manual(mesh) -> frozenset:
  """Manual axes of a mesh (the ones a collective can name), plus hidden."""
  if mesh.empty:
    return _EMPTY
  return frozenset(getattr(mesh, "manual_axes", ()) or ()) | _hidden_axes(mesh)


def _renamable(mesh, mapping: Mapping) -> frozenset:
  """Axes of ``mesh`` that ``mapping`` may rename."""
  return _manual(mesh) | _hidden_axes(mesh, mapping)


def names_of(v: Any) -> frozenset:
  """Manual axis names a mesh, sharding, spec, aval (or tuple) mentions.

  Only manual mesh axes count: an ``Auto``/``Explicit`` mesh axis is not an
  axis a collective can use, so a mesh or sharding outside any
  ``shard_map`` mentions nothing. A bare ``PartitionSpec`` (``shard_map``'s
  in/out specs) names the axes its binder makes manual.
  """
  if isinstance(v, _AbstractValue):
    mat = getattr(v, "mat", None)
    sharding = getattr(v, "sharding", None)
    names = _EMPTY
    if mat is not None and (mat.varying or mat.unreduced or mat.reduced):
      names = mat.varying | mat.unreduced | mat.reduced
    if isinstance(sharding, NamedSharding):
      manual = _manual(sharding.mesh)
      if manual:
        names = names | manual
    return names
  if isinstance(v, (AbstractMesh, Mesh)):
    return _manual(v)
  if isinstance(v, NamedSharding):
    return _manual(v.mesh)
  if isinstance(v, PartitionSpec):
    return _spec_names(v)
  if isinstance(v, ManualAxisType):
    return v.varying | v.unreduced | v.reduced
  if isinstance(v, (tuple, list)):
    return _EMPTY.union(*map(names_of, v))
  return _EMPTY


def _rename_set(names: frozenset, mapping: Mapping) -> frozenset:
  if names.isdisjoint(mapping):
    return names
  return frozenset(mapping.get(n, n) for n in names)


def _rename_spec(spec: PartitionSpec, mapping: Mapping) -> PartitionSpec:
  if _spec_names(spec).isdisjoint(mapping):
    return spec

  def one(entry):
    if isinstance(entry, tuple):
      return tuple(mapping.get(n, n) for n in entry)
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
      return entry
    return mapping.get(entry, entry)

  kwargs = {}
  for attr in ("unreduced", "reduced"):
    value = getattr(spec, attr, None)
    if value:
      kwargs[attr] = _rename_set(frozenset(value), mapping)
  return PartitionSpec(*(one(e) for e in spec), **kwargs)


def _only(mapping: Mapping, names: frozenset) -> dict:
  return {o: n for o, n in mapping.items() if o in names}


def _rename_axis_names(names: tuple, mapping: Mapping, what: Any) -> tuple:
  new = tuple(mapping.get(n, n) for n in names)
  if len(set(new)) != len(new):
    raise ValueError(
      f"jaxworks.axis_names: renaming {dict(mapping)!r} would give {what} "
      f"the duplicate axis names {new}; pick names the mesh does not "
      "already have"
    )
  return new


def rename(
  v: Any, mapping: Mapping[Hashable, Hashable], memo: dict | None = None
) -> Any:
  """``v`` with axis names renamed; the same object when nothing changes."""
  if not mapping:
    return v
  if memo is not None:
    hit = memo.get(id(v))
    if hit is not None and hit[0] is v:
      return hit[1]
  out = _rename(v, mapping, memo)
  if memo is not None and out is not v:
    memo[id(v)] = (v, out)
  return out


def _rename(v: Any, mapping: Mapping, memo) -> Any:
  if isinstance(v, _AbstractValue):
    names = names_of(v)
    sharding = getattr(v, "sharding", None)
    if isinstance(sharding, NamedSharding):
      names = names | _renamable(sharding.mesh, mapping)
    if names.isdisjoint(mapping):
      return v
    kwargs = {}
    mat = getattr(v, "mat", None)
    if mat is not None:
      new_mat = rename(mat, mapping, memo)
      if new_mat is not mat:
        kwargs["manual_axis_type"] = new_mat
    if isinstance(sharding, NamedSharding):
      new_sh = rename(sharding, mapping, memo)
      if new_sh is not sharding:
        kwargs["sharding"] = new_sh
    return v.update(**kwargs) if kwargs else v
  if isinstance(v, (AbstractMesh, Mesh)):
    manual = _renamable(v, mapping)
    if manual.isdisjoint(mapping):
      return v
    new_names = _rename_axis_names(v.axis_names, _only(mapping, manual), v)
    if isinstance(v, AbstractMesh):
      return v.update(axis_names=new_names)
    return Mesh(v.devices, new_names, axis_types=v.axis_types)
  if isinstance(v, NamedSharding):
    manual = _renamable(v.mesh, mapping)
    if manual.isdisjoint(mapping):
      return v
    mesh = rename(v.mesh, mapping, memo)
    spec = _rename_spec(v.spec, _only(mapping, manual))
    if mesh is v.mesh and spec is v.spec:
      return v
    return NamedSharding(mesh, spec, memory_kind=v.memory_kind)
  if isinstance(v, PartitionSpec):
    return _rename_spec(v, mapping)
  if isinstance(v, ManualAxisType):
    sets = {k: getattr(v, k) for k in ("varying", "unreduced", "reduced")}
    new = {k: _rename_set(names, mapping) for k, names in sets.items()}
    if all(new[k] is sets[k] for k in sets):
      return v
    return ManualAxisType(**new)
  if isinstance(v, (tuple, list)) and type(v) in (tuple, list):
    items = [rename(x, mapping, memo) for x in v]
    if all(a is b for a, b in zip(items, v)):
      return v
    return type(v)(items)
  return v
