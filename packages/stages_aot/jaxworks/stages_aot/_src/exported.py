"""Exported programs: a ``jax.export.Exported`` plus the VJP order to serialize.

Calling an exported program goes through ``jax.export.Exported.call``, wrapped
so that it also works under ``jax.vmap`` (JAX has no batching rule for a
serialized module: the wrapper runs it once per batch element with
``jax.lax.map``) and stays differentiable under ``jax.vmap`` (a ``custom_vjp``
whose backward pass calls the exported VJP, itself wrapped the same way).
"""

from __future__ import annotations

from collections.abc import Sequence
import hashlib
import threading
from typing import Any
from typing import cast

import jax
import numpy as np

from . import jax_internals
from . import validate
from .lru import LRU
from .specs import format_aval


class Exported:
  """A program exported with ``jax.export``; serializable and callable.

  Get one from :meth:`Lowered.export` or :func:`deserialize`.

  Attributes:
    fun_name: the exported function's name.
    platforms: the platforms the module was lowered for.
    in_avals / out_avals: flat tuples of abstract values (may hold symbolic
      dimensions).
    in_tree / out_tree: the pytree structure of ``(args, kwargs)`` and of
      the result.
    calling_convention_version: the jax.export calling convention version.
    nr_devices: the number of devices the module was lowered for.
    vjp_order: the VJP orders :meth:`serialize` includes (for a deserialized
      program: the orders available).
  """

  __slots__ = (
    "_exp",
    "_vjp_order",
    "_flat_fn",
    "_jitted",
    "_vjp",
    "_origin",
    "_content",
    "_module_sha256",
    "__weakref__",
  )

  def __init__(self, exported: jax.export.Exported, *, vjp_order: int = 0):
    if not isinstance(exported, jax.export.Exported):
      raise TypeError(
        "jaxworks.stages_aot.Exported: expected a jax.export.Exported, got "
        f"{type(exported).__name__}; use Lowered.export() or deserialize(blob)"
      )
    if vjp_order > validate.MAX_VJP_LEVELS:
      raise ValueError(
        f"jaxworks.stages_aot.Exported: vjp_order={vjp_order} is more than "
        f"the {validate.MAX_VJP_LEVELS} VJP orders deserialize and "
        f"load_artifact read back; use vjp_order <= {validate.MAX_VJP_LEVELS}"
      )
    self._exp = exported
    self._vjp_order = vjp_order
    self._flat_fn = None
    self._jitted = None
    self._vjp: Exported | None = None
    # (name of the function this is a VJP of, how many VJPs deep).
    self._origin = (exported.fun_name, 0)
    # (sha256 of the serialized bytes, VJP depth) of a deserialized program:
    # programs read from equal bytes share one callable, and so JAX's caches.
    self._content: tuple[bytes, int] | None = None
    # sha256 (hex) of the serialized StableHLO module, once computed.
    self._module_sha256: str | None = None

  jax_exported = property(
    lambda self: self._exp, doc="The stock ``jax.export.Exported``."
  )
  fun_name = property(lambda self: self._exp.fun_name)
  platforms = property(lambda self: tuple(self._exp.platforms))
  in_avals = property(lambda self: tuple(self._exp.in_avals))
  out_avals = property(lambda self: tuple(self._exp.out_avals))
  in_tree = property(lambda self: self._exp.in_tree)
  out_tree = property(lambda self: self._exp.out_tree)
  calling_convention_version = property(
    lambda self: self._exp.calling_convention_version
  )
  nr_devices = property(lambda self: self._exp.nr_devices)
  vjp_order = property(lambda self: self._vjp_order)

  @property
  def in_shardings(self) -> tuple[jax.sharding.NamedSharding | None, ...]:
    """Input shardings (``NamedSharding`` over an abstract mesh; None: unspecified)."""
    # jax's stubs type the mesh as required; None keeps the abstract mesh.
    shardings = self._exp.in_shardings_jax(None)  # type: ignore[arg-type]
    return tuple(cast(Sequence[jax.sharding.NamedSharding | None], shardings))

  @property
  def out_shardings(self) -> tuple[jax.sharding.NamedSharding | None, ...]:
    """Output shardings (``NamedSharding`` over an abstract mesh; None: unspecified)."""
    shardings = self._exp.out_shardings_jax(None)  # type: ignore[arg-type]
    return tuple(cast(Sequence[jax.sharding.NamedSharding | None], shardings))

  @property
  def uses_shape_polymorphism(self) -> bool:
    """True when some input dimension is symbolic."""
    return any(
      jax.export.is_symbolic_dim(d) for a in self._exp.in_avals for d in a.shape
    )

  def _module_digest(self) -> str:
    """The sha256 (hex) of the serialized StableHLO module (computed once)."""
    if self._module_sha256 is None:
      self._module_sha256 = hashlib.sha256(
        self._exp.mlir_module_serialized
      ).hexdigest()
    return self._module_sha256

  def mlir_text(self) -> str:
    """The serialized module as StableHLO text."""
    return self._exp.mlir_module()

  def serialize(self) -> bytes:
    """Serializes the program with :attr:`vjp_order` orders of VJP.

    >>> import jax.numpy as jnp
    >>> from jaxworks.stages_aot import trace
    >>> exp = trace(jnp.sin, jnp.zeros(3, jnp.float32)).lower().export(vjp_order=1)
    >>> again = deserialize(exp.serialize())
    >>> again.vjp_order, float(jax.grad(lambda x: again(x).sum())(jnp.zeros(3))[0])
    (1, 1.0)
    """
    return bytes(self._exp.serialize(vjp_order=self._vjp_order))

  def has_vjp(self) -> bool:
    """Whether the program can be differentiated (reverse mode)."""
    return self._exp.has_vjp()

  def vjp(self) -> Exported:
    """The exported VJP: flat primal inputs then output cotangents -> input cotangents."""
    if not self._exp.has_vjp():
      raise ValueError(self._no_vjp_message())
    if self._vjp is None:
      vjp = Exported(self._exp.vjp(), vjp_order=max(self._vjp_order - 1, 0))
      vjp._origin = (self._origin[0], self._origin[1] + 1)
      self._vjp = vjp
    return self._vjp

  def _no_vjp_message(self) -> str:
    name, depth = self._origin
    what = (
      f"take derivatives of order {depth + 1} of" if depth else "differentiate"
    )
    return (
      f"jaxworks.stages_aot: cannot {what} the exported function {name!r}: it was "
      f"serialized with vjp_order={depth}; export it with "
      f"Lowered.export(vjp_order={depth + 1}) (CLI: --vjp-order {depth + 1})"
    )

  def _flat(self):
    if self._flat_fn is None:
      self._flat_fn, self._jitted = _callables(self)
    return self._flat_fn

  def call(self, *args, **kwargs):
    """Runs the program; works under ``jax.jit``, ``jax.vmap`` and ``jax.grad``.

    Args:
      *args: arrays with the structure, dtypes and (concrete
        values of the symbolic) shapes the program was exported for.
      **kwargs: keyword arguments, likewise.

    Returns:
      The outputs, with the exported function's output structure.
    """
    flat, tree = jax.tree_util.tree_flatten((args, kwargs))
    if tree != self._exp.in_tree:
      expected = self._exp.in_tree.unflatten(
        [format_aval(a) for a in self._exp.in_avals]
      )
      raise ValueError(
        f"jaxworks.stages_aot.Exported.call: {self.fun_name!r} was exported for "
        f"(args, kwargs) = {expected}, but was called with structure {tree}; "
        "pass arguments with the exported structure"
      )
    if self._jitted is None:
      self._flat()
    return self._exp.out_tree.unflatten(self._jitted(*flat))

  __call__ = call

  def __repr__(self) -> str:
    ins = ", ".join(format_aval(a) for a in self._exp.in_avals)
    outs = ", ".join(format_aval(a) for a in self._exp.out_avals)
    return (
      f"Exported({self.fun_name}({ins}) -> ({outs}), platforms={self.platforms}, "
      f"vjp_order={self._vjp_order})"
    )


#: Callables of deserialized programs, by the content of the bytes they were
#: read from: a program loaded again (a restarted server's reload, a notebook
#: re-running its cell) reuses the callables, so JAX traces and compiles it,
#: its VJP included, once. Bounded: the least recently used are dropped.
_SHARED: LRU[tuple[bytes, int], tuple[Any, Any]] = LRU(32)
_SHARED_LOCK = threading.Lock()


def _callables(exported: Exported) -> tuple[Any, Any]:
  """(flat callable, its stock jit) of ``exported``: shared by programs
  deserialized from equal bytes."""
  key = exported._content  # pylint: disable=protected-access
  if key is not None:
    with _SHARED_LOCK:
      hit = _SHARED.get(key)
    if hit is not None:
      return hit
  flat = _flat_callable(exported)
  made = (flat, jax_internals.stock_jit(flat))
  if key is not None:
    with _SHARED_LOCK:
      hit = _SHARED.get(key)
      if hit is not None:
        return hit
      _SHARED.put(key, made)
  return made


def _flat_callable(exported: Exported):
  """Flat function of the exported program, batchable and differentiable."""
  exp = exported.jax_exported
  n_in = len(exp.in_avals)

  def primal(*flat_args):
    args, kwargs = exp.in_tree.unflatten(flat_args)
    return tuple(exp.out_tree.flatten_up_to(exp.call(*args, **kwargs)))

  # The exported module is a fixed program: under vmap, run it per element.
  batched_primal = jax.custom_batching.sequential_vmap(primal)

  @jax.custom_vjp
  def fn(*flat_args):
    return batched_primal(*flat_args)

  def fwd(*flat_args):
    # Calling `fn` (not `batched_primal`) keeps the forward pass
    # differentiable, for derivatives of order two and more.
    return fn(*flat_args), flat_args

  def bwd(primals, cts):
    if not exp.has_vjp():
      raise ValueError(exported._no_vjp_message())
    vjp = exported.vjp()
    ct_avals = vjp.in_avals[n_in:]
    cts = tuple(
      np.zeros(ct.shape, jax.dtypes.float0)
      if aval.dtype == jax.dtypes.float0
      else ct
      for ct, aval in zip(cts, ct_avals)
    )
    vjp._flat()  # pylint: disable=protected-access
    return tuple(vjp._jitted(*primals, *cts))  # pylint: disable=protected-access

  fn.defvjp(fwd, bwd)
  return fn


@jax_internals.api_boundary
def deserialize(blob: bytes | bytearray) -> Exported:
  """Deserializes what :meth:`Exported.serialize` wrote, and validates it.

  The result's ``vjp_order`` is the number of VJP orders in ``blob``. Every
  order is read now (the flatbuffer reader's own errors, such as
  ``struct.error``, become ``ValueError``), so that damaged bytes fail here,
  not later when the program is called. Per order, the calling-convention
  version, the platforms, the device count, the avals against the pytrees,
  the kept-input indices and the shardings' meshes are checked; each
  StableHLO module is deserialized and verified in a child process (capped
  in memory, with a timeout; answers cached by sha256; the child exits after
  ``module_reader.IDLE_TIMEOUT_S`` seconds without a request), and its
  ``main`` must take and return exactly the platform index, effect tokens,
  kept inputs and outputs the fields describe, partitioned for that many
  devices; each VJP order must fit the order it differentiates. Bytes that
  are consistent but altered (a changed constant) cannot be told from
  another program; artifact directories (:func:`load_artifact`) also check
  the program against their manifest and StableHLO text.

  Raises:
    TypeError: ``blob`` is not bytes.
    ValueError: ``blob`` is not a serialized exported program, or it is
      damaged.
    RuntimeError: the process that reads StableHLO modules cannot be
      started (``sys.executable`` cannot import jaxlib).
  """
  if not isinstance(blob, (bytes, bytearray, memoryview)):
    raise TypeError(
      f"jaxworks.stages_aot.deserialize: expected bytes from Exported.serialize(), "
      f"got {type(blob).__name__}"
    )
  return deserialize_trusting(blob, frozenset(), isolate=True)


def deserialize_trusting(
  blob: bytes | bytearray | memoryview,
  trusted_modules: frozenset[str],
  *,
  isolate: bool,
  verified_modules: frozenset[str] = frozenset(),
  blob_sha256: bytes | None = None,
) -> Exported:
  """:func:`deserialize`, reading the modules in ``trusted_modules`` here.

  ``trusted_modules`` holds sha256 digests of StableHLO modules that may be
  read in this process; every other module (all of them with ``isolate``)
  is read in the module reader's child process. Modules in
  ``verified_modules`` were checked against their program when written and
  are not read at all. ``blob_sha256``: the sha256 of ``blob`` if the
  caller computed it.
  """
  try:
    levels, digests = validate.deserialize_checked(
      bytes(blob),
      trusted_modules=trusted_modules,
      isolate=isolate,
      verified_modules=verified_modules,
    )
  except validate.Invalid as e:
    raise ValueError(
      f"jaxworks.stages_aot.deserialize: {len(blob)} bytes are not a valid serialized "
      f"exported program ({e}); pass the bytes of Exported.serialize() unchanged"
    ) from None
  wrapped = _wrap_levels(levels, blob_sha256 or hashlib.sha256(blob).digest())
  level: Exported | None = wrapped
  for digest in digests:
    assert level is not None
    level._module_sha256 = digest  # pylint: disable=protected-access
    level = level._vjp  # pylint: disable=protected-access
  return wrapped


def _wrap_levels(
  levels: list[jax.export.Exported], digest: bytes | None = None
) -> Exported:
  """An :class:`Exported` whose VJP chain is ``levels[1:]``, read from bytes
  whose sha256 is ``digest`` (None: not shared)."""
  wrappers = [
    Exported(level, vjp_order=len(levels) - 1 - i)
    for i, level in enumerate(levels)
  ]
  if digest is not None:
    for depth, wrapper in enumerate(wrappers):
      wrapper._content = (digest, depth)
  for depth, (outer, inner) in enumerate(zip(wrappers, wrappers[1:]), 1):
    inner._origin = (wrappers[0].fun_name, depth)
    outer._vjp = inner
  return wrappers[0]


def read_own_serialization(blob: bytes, vjp_order: int) -> Exported:
  """Reads back bytes that :meth:`Exported.serialize` just wrote (trusted, so
  not validated), to describe exactly what was written."""
  levels = [jax.export.deserialize(bytearray(blob))]
  for _ in range(vjp_order):
    levels.append(levels[-1].vjp())
  return _wrap_levels(levels)


# Imported from jaxworks.stages_aot (a lazy package): the module tracebacks and repr name;
# doctest finds their examples through __test__.
__test__ = {"Exported": Exported}
Exported.__module__ = "jaxworks.stages_aot"
