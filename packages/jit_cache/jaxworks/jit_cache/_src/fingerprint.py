"""Structural fingerprints of closed jaxprs, for reusing executables.

Two jaxprs get equal fingerprints only when lowering them gives the same
program:

* the same equations in the same order, with variables numbered by first
  appearance and each one's aval (interned by JAX, so compared by identity);
* the same primitive objects and parameters: scalars compared with their type
  (``1``, ``1.0`` and ``True`` differ, floats by ``float.hex`` so ``-0.0`` and
  ``nan`` are exact), containers element-wise, sub-jaxprs recursively,
  ``functools.partial`` by function, arguments and keywords, functions and
  host callbacks by identity, other objects by their own ``==``;
* the same literals and constants: numpy values and small jax Arrays by
  content hash (dtype, shape and a 128-bit BLAKE2b digest; arrays also by
  sharding), larger jax Arrays by identity;
* the same effects.

Parameters that never reach the lowering of the primal program are skipped:
the JVP/VJP rules of ``custom_jvp_call``/``custom_vjp_call`` (fresh closures on
every trace, so keeping them would defeat reuse for ``jax.nn.relu`` and
friends). Anything the fingerprint cannot represent soundly (an unhashable
parameter, a tracer) makes :func:`fingerprint` return ``None``: the program is
then compiled, never shared.

>>> import jax, jax.numpy as jnp
>>> fp = lambda f: fingerprint(jax.make_jaxpr(f)(jnp.ones(3)))
>>> fp(lambda x: x * 2.0) == fp(lambda x: x * 2.0)
True
>>> fp(lambda x: x * 2.0) == fp(lambda x: x * 3.0)
False
"""

from __future__ import annotations

import functools
import hashlib
import threading
import types
import weakref
from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core

#: jax Arrays up to this many bytes are keyed by content, larger by identity.
CONTENT_HASH_MAX_BYTES = 1 << 16

#: Parameters that do not affect the lowering of the primal computation.
_IGNORED_PARAMS = {
    "custom_jvp_call": frozenset({"jvp_jaxpr_fun", "jvp_jaxpr_thunk"}),
    "custom_vjp_call": frozenset({"fwd_jaxpr_thunk", "bwd", "out_trees", "fwd"}),
}


class NotFingerprintable(Exception):
  """Raised internally when a value has no sound structural key."""


class Fingerprint:
  """A structural key with its hash computed once."""

  __slots__ = ("key", "_hash", "__weakref__")

  def __init__(self, key: tuple):
    self.key = key
    self._hash = hash(key)

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other: object) -> bool:
    if self is other:
      return True
    if not isinstance(other, Fingerprint):
      return NotImplemented
    return self._hash == other._hash and self.key == other.key

  def __repr__(self) -> str:
    return f"Fingerprint({self._hash & 0xFFFFFFFF:08x})"


class _Identity:
  """Compares by identity (holds its object strongly: the id stays unique)."""

  __slots__ = ("obj",)

  def __init__(self, obj: Any):
    self.obj = obj

  def __hash__(self) -> int:
    return id(self.obj)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _Identity) and other.obj is self.obj


def _digest(data: np.ndarray) -> bytes:
  return hashlib.blake2b(np.ascontiguousarray(data).view(np.uint8).reshape(-1),
                         digest_size=16).digest()


def value_key(v: Any) -> Any:
  """Hashable structural key of one constant, literal value or parameter."""
  t = type(v)
  if v is None or t is str or t is bytes or t is bool or t is int:
    return (t, v)
  if t is float:
    return (t, v.hex())
  if t is complex:
    return (t, v.real.hex(), v.imag.hex())
  if isinstance(v, jax.core.Tracer):
    raise NotFingerprintable("tracer")
  if isinstance(v, jex_core.ClosedJaxpr):
    return _closed_jaxpr_fingerprint(v)
  if isinstance(v, jex_core.Jaxpr):
    return _open_jaxpr_fingerprint(v)
  if isinstance(v, (np.ndarray, np.generic)):
    a = np.asarray(v)
    if a.dtype == object:
      raise NotFingerprintable("object array")
    return ("np", a.dtype.str, a.shape, _digest(a))
  if isinstance(v, jax.Array):
    sharding = v.sharding
    if (v.nbytes <= CONTENT_HASH_MAX_BYTES and v.is_fully_addressable and
        not jax.dtypes.issubdtype(v.dtype, jax.dtypes.extended)):
      a = np.asarray(v)
      return ("array", a.dtype.str, a.shape, v.weak_type, sharding,
              getattr(v, "_committed", None), _digest(a))
    return ("array-id", _Identity(v))
  if isinstance(v, (tuple, list)):
    return (t, tuple(value_key(x) for x in v))
  if isinstance(v, dict) or (hasattr(v, "items") and hasattr(v, "keys") and
                             not isinstance(v, type)):
    items = [(value_key(k), value_key(x)) for k, x in v.items()]
    try:
      items.sort(key=repr)
    except Exception as e:  # pylint: disable=broad-except
      raise NotFingerprintable(f"mapping keys: {e}") from None
    return (t, tuple(items))
  if isinstance(v, functools.partial):
    return (functools.partial, value_key(v.func), value_key(v.args),
            value_key(v.keywords))
  if isinstance(v, (types.FunctionType, types.BuiltinFunctionType,
                    types.MethodType)):
    return (t, v)  # functions compare by identity
  try:
    hash(v)
  except TypeError:
    raise NotFingerprintable(f"unhashable {t.__name__}") from None
  return (t, v)


def _params_key(primitive: Any, params: dict) -> tuple:
  ignored = _IGNORED_PARAMS.get(primitive.name, frozenset())
  return tuple((name, value_key(params[name]))
               for name in sorted(params) if name not in ignored)


def _effects_key(effects: Any) -> Any:
  try:
    return frozenset(effects)
  except TypeError:
    raise NotFingerprintable("unhashable effect") from None


def _aval_key(aval: Any) -> Any:
  try:
    hash(aval)
  except TypeError:
    raise NotFingerprintable(f"unhashable aval {aval}") from None
  return aval


def _compute_open(jaxpr: Any) -> Fingerprint:
  ids: dict[Any, int] = {}

  def define(v: Any) -> tuple:
    ids[v] = len(ids)
    return (ids[v], _aval_key(v.aval))

  def use(a: Any) -> Any:
    if isinstance(a, jex_core.Literal):
      return ("lit", value_key(a.val), _aval_key(a.aval))
    try:
      return ids[a]
    except KeyError:
      raise NotFingerprintable("unbound variable") from None

  constvars = tuple(define(v) for v in jaxpr.constvars)
  invars = tuple(define(v) for v in jaxpr.invars)
  eqns = []
  for eqn in jaxpr.eqns:
    ins = tuple(use(a) for a in eqn.invars)
    params = _params_key(eqn.primitive, eqn.params)
    outs = tuple(("drop", _aval_key(v.aval)) if isinstance(v, jex_core.DropVar)
                 else define(v) for v in eqn.outvars)
    eqns.append((eqn.primitive, ins, params, outs, _effects_key(eqn.effects)))
  outvars = tuple(use(a) for a in jaxpr.outvars)
  return Fingerprint(("jaxpr", constvars, invars, tuple(eqns), outvars,
                      _effects_key(jaxpr.effects)))


# Sub-jaxprs (for example the body of a cached inner jit, identical in every
# re-created outer function) are fingerprinted once per object.
_MEMO: "weakref.WeakKeyDictionary[Any, Fingerprint | None]" = (
    weakref.WeakKeyDictionary())
_MEMO_LOCK = threading.Lock()


def _memoized(obj: Any, compute) -> Fingerprint:
  with _MEMO_LOCK:
    hit = _MEMO.get(obj, False)
  if hit is None:
    raise NotFingerprintable("memoized failure")
  if hit is not False:
    return hit
  try:
    fp = compute(obj)
  except NotFingerprintable:
    with _MEMO_LOCK:
      _MEMO[obj] = None
    raise
  with _MEMO_LOCK:
    _MEMO[obj] = fp
  return fp


def _open_jaxpr_fingerprint(jaxpr: Any) -> Fingerprint:
  return _memoized(jaxpr, _compute_open)


def _compute_closed(closed: Any) -> Fingerprint:
  return Fingerprint(("closed", _open_jaxpr_fingerprint(closed.jaxpr),
                      tuple(value_key(c) for c in closed.consts)))


def _closed_jaxpr_fingerprint(closed: Any) -> Fingerprint:
  return _memoized(closed, _compute_closed)


def fingerprint(closed_jaxpr: Any) -> Fingerprint | None:
  """Structural fingerprint of a ``ClosedJaxpr``, or None when it has none.

  Args:
    closed_jaxpr: a ``jax.extend.core.ClosedJaxpr``.

  Returns:
    A hashable :class:`Fingerprint`, equal for programs that lower to the same
    executable; ``None`` when some part has no sound key.
  """
  try:
    return _closed_jaxpr_fingerprint(closed_jaxpr)
  except NotFingerprintable:
    return None


def params_key(params: dict, skip: frozenset = frozenset({"jaxpr"})) -> Any:
  """Key of ``jit_p`` parameters other than ``skip`` (None if unkeyable)."""
  try:
    return tuple((name, value_key(params[name]))
                 for name in sorted(params) if name not in skip)
  except NotFingerprintable:
    return None
