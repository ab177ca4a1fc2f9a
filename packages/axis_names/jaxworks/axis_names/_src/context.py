"""The caller's tracing context with axis names renamed back to the old ones.

``rename_axes(f, {'i': 'k'})`` is called where ``'k'`` is bound (inside a
``shard_map`` over ``'k'``, a ``vmap(axis_name='k')``, ...). To trace ``f``,
which speaks of ``'i'``, we present it the same context under the old names:

* the axis environment binds ``'i'`` with the size ``'k'`` has here;
* the abstract mesh (inside ``shard_map``) has its ``'k'`` axis renamed ``'i'``;
* each argument's abstract value has ``'k'`` renamed ``'i'`` in its varying
  manual axes and in its sharding.

The resulting jaxpr is then renamed forward (``rename.rename_jaxpr``) and
evaluated in the real context. Only public JAX is used here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Mapping

import jax
from jax.sharding import NamedSharding

from . import deep


def renamed_context(leaves, mapping: Mapping[Hashable, Hashable],
                    inverse: Mapping[Hashable, Hashable], api: str):
  """``(avals, axis_env, mesh_context)`` for tracing under the old names."""
  env: dict[Hashable, int] = {}
  for old, new in mapping.items():
    try:
      env[old] = jax.lax.axis_size(new)
    except NameError:
      pass  # ``new`` is not bound here; tracing binds ``old`` if needed
  cur = jax.sharding.get_abstract_mesh()
  mesh = deep.rename(cur, inverse)
  mesh_ctx = (jax.sharding.use_abstract_mesh(mesh) if mesh is not cur
              else contextlib.nullcontext())
  avals = []
  memo: dict = {}
  for i, leaf in enumerate(leaves):
    try:
      aval = deep.rename(jax.typeof(leaf), inverse, memo)
    except TypeError as e:
      raise TypeError(
          f"{api}: argument leaf {i} ({leaf!r:.60}) is not an array or scalar;"
          " a renamed function takes only array arguments (bind static values "
          "with functools.partial before renaming)") from e
    sharding = getattr(aval, "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
      sharding = None
    mat = getattr(aval, "mat", None)
    avals.append(jax.ShapeDtypeStruct(
        aval.shape, aval.dtype, sharding=sharding, weak_type=aval.weak_type,
        manual_axis_type=mat))
  return avals, env, mesh_ctx
