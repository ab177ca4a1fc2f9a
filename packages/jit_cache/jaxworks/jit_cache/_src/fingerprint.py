"""Structural fingerprints of closed jaxprs, for reusing executables.

Two jaxprs get equal fingerprints only when lowering them gives the same
program. Anything that can change the compiled program is in the key, and
compared in a way user code cannot fool:

* the same equations in the same order, with variables numbered by first
  appearance and each one's aval (interned by JAX, so compared by identity);
* each equation's context (``eqn.ctx``: ``threefry_partitionable``, compute
  type, XLA metadata, abstract mesh, ...), by identity: JAX interns it, so
  equal contexts are one object;
* the same primitive objects and parameters: scalars compared with their type
  (``1``, ``1.0`` and ``True`` differ, floats by their IEEE bit pattern, so
  ``-0.0``, ``nan``, ``-nan`` and every NaN payload are told apart), tuples,
  lists, dicts, JAX's named tuples and JAX's dataclasses (such as the wrapper
  of a host callback) field by field, sub-jaxprs recursively, JAX's own value
  types (dtypes, shardings, meshes, avals, tree definitions, effects) by
  value; every other object (functions, host callbacks, user dataclasses,
  anything with its own ``__eq__``) by identity;
* what a host callback carries (a ``functools.partial``'s function, arguments
  and keywords, recursively): the executable calls back into those very
  objects, so only immutable values (scalars, strings, tuples of them, JAX's
  value types) are compared by content; lists, dicts, arrays, bound methods,
  callable objects and closures by identity, kept alive by the key;
* the same literals and constants: numpy values and small jax Arrays by
  content hash (dtype, shape and a 128-bit BLAKE2b digest; arrays also by
  sharding), larger jax Arrays by identity (a key holding one that was
  deleted or donated since is never used). A numpy array is mutable, so its
  content is hashed again on every fingerprint (nothing that holds one is
  memoized);
* the same effects.

Parameters that never reach the lowering of the primal program are skipped:
the JVP/VJP rules of ``custom_jvp_call``/``custom_vjp_call`` (fresh closures on
every trace, so keeping them would defeat reuse for ``jax.nn.relu`` and
friends). Anything the fingerprint cannot represent soundly (an unhashable
parameter, a tracer, an object array) makes :func:`fingerprint` return
``None``: the program is then compiled, never shared.

>>> import jax, jax.numpy as jnp
>>> fp = lambda f: fingerprint(jax.make_jaxpr(f)(jnp.ones(3)))
>>> fp(lambda x: x * 2.0) == fp(lambda x: x * 2.0)
True
>>> fp(lambda x: x * 2.0) == fp(lambda x: x * 3.0)
False
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import functools
import hashlib
import struct
import threading
from typing import Any
import weakref

import jax
import numpy as np

from . import jax_internals as ji

#: jax Arrays up to this many bytes are keyed by content, larger by identity.
CONTENT_HASH_MAX_BYTES = 1 << 16

#: Parameters that do not affect the lowering of the primal computation.
_IGNORED_PARAMS = {
  "custom_jvp_call": frozenset({"jvp_jaxpr_fun", "jvp_jaxpr_thunk"}),
  "custom_vjp_call": frozenset({"fwd_jaxpr_thunk", "bwd", "out_trees", "fwd"}),
}

#: Top-level modules whose types we trust to compare by value.
_TRUSTED_MODULES = frozenset({"jax", "jaxlib", "numpy", "ml_dtypes"})

#: JAX's immutable value types, compared with their own ``==``.
_VALUE_TYPES = (
  np.dtype,
  jax.sharding.Sharding,
  jax.sharding.PartitionSpec,
  ji.Mesh,
  ji.AbstractMesh,
  ji.PyTreeDef,
  ji.AbstractValue,
  ji.Effect,
  ji.UnspecifiedValue,
  ji.Layout,
  ji.Format,
)


class NotFingerprintable(Exception):
  """Raised internally when a value has no sound structural key."""


class Fingerprint:
  """A structural key with its hash computed once.

  Attributes:
    key: the hashable structural key.
    pins: the key holds user objects by identity (functions, host callbacks,
      large arrays, unknown objects): an executable of this program may keep
      them alive, so it is only shared while a function using it lives.
    nbytes: bytes of constants and literals keyed by content (baked into the
      executable).
    arrays: the constant jax Arrays keyed by identity, checked for deletion
      (:meth:`deleted`) whenever the key is used.
  """

  __slots__ = ("key", "_hash", "pins", "nbytes", "arrays", "__weakref__")

  def __init__(
    self,
    key: tuple,
    pins: bool = False,
    nbytes: int = 0,
    arrays: tuple = (),
  ):
    self.key = key
    self._hash = hash(key)
    self.pins = pins
    self.nbytes = nbytes
    self.arrays = arrays

  def deleted(self) -> bool:
    """Whether a jax Array this key holds by identity was deleted (donated)
    since: its program must not be reused, as lowering it anew raises."""
    return any(a.is_deleted() for a in self.arrays)

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


_DOUBLE = struct.Struct("<d")
_NO_EFFECTS: frozenset = frozenset()


def float_bits(v: float) -> bytes:
  """The IEEE 754 bit pattern of ``v``: keeps the sign of zero and of NaN and
  the NaN payload, which ``float.hex``, ``==`` and ``hash`` all lose."""
  return _DOUBLE.pack(v)


#: Arrays of at most this many bytes are keyed by their bytes themselves
#: (cheaper than a digest; the dtype and shape in the key fix which form a
#: given array gets).
_RAW_MAX_BYTES = 64

#: numpy array types whose content is keyed (filled as they are first met).
_ARRAY_TYPES: set[type] = set()


def _digest(data: np.ndarray) -> bytes:
  if data.nbytes <= _RAW_MAX_BYTES:
    return data.tobytes()  # C order, as the digest below
  return hashlib.blake2b(
    # numpy's stubs declare the buffer protocol only for Python >= 3.12.
    np.ascontiguousarray(data).view(np.uint8).reshape(-1),  # type: ignore[arg-type]
    digest_size=16,
  ).digest()


def _trusted(t: type) -> bool:
  return getattr(t, "__module__", "").split(".")[0] in _TRUSTED_MODULES


# Jaxprs (for example the body of a cached inner jit, identical in every
# re-created outer function) whose fingerprints hold no mutable content are
# fingerprinted once per object. A fingerprint that hashed a numpy array is
# never memoized: the array may be written to later.
_MEMO: weakref.WeakKeyDictionary[Any, Fingerprint] = weakref.WeakKeyDictionary()
_MEMO_LOCK = threading.Lock()


class _ValueKeys(abc.ABC):
  """Keys of constants, literal values and parameters, and what a key holds.

  ``pins``, ``nbytes``, ``volatile`` and ``arrays`` say what the keys made
  so far hold. Values may hold jaxprs, which the subclass keys
  (:meth:`jaxpr`).
  """

  def __init__(self):
    self.pins = False  # a user object is held by identity
    self.nbytes = 0  # bytes keyed by content
    self.volatile = False  # content of a mutable (numpy) array was hashed
    self.arrays: list = []  # jax Arrays keyed by identity
    # Containers keyed in this computation, by id (the jaxpr holds them, so
    # an id names one object): the same parameters of many equations are
    # keyed once.
    self.seen: dict[Any, tuple] = {}

  def identity(self, v: Any) -> Any:
    self.pins = True
    return _Identity(v)

  @abc.abstractmethod
  def jaxpr(self, obj: Any) -> Fingerprint:
    """The key of a jaxpr held by a value (the jaxpr walker's)."""

  def apart(self, compute: Any, *args: Any) -> tuple[Any, tuple]:
    """``compute(*args)`` with what its key holds counted on its own, then
    added to the walker's: (key, (pins, nbytes, volatile, arrays) of that
    key)."""
    outer = (self.pins, self.nbytes, self.volatile, self.arrays)
    self.pins, self.nbytes, self.volatile, self.arrays = False, 0, False, []
    try:
      key = compute(*args)
    finally:
      mine = (self.pins, self.nbytes, self.volatile, tuple(self.arrays))
      self.pins = outer[0] or mine[0]
      self.nbytes = outer[1] + mine[1]
      self.volatile = outer[2] or mine[2]
      self.arrays = outer[3]
      self.arrays.extend(mine[3])
    return key, mine

  def reuse(self, hit: tuple) -> Any:
    """The key of a ``seen`` record ``(obj, key, pins, nbytes, volatile,
    arrays, ...)``, counting what it holds."""
    self.pins |= hit[2]
    self.nbytes += hit[3]
    self.volatile |= hit[4]
    self.arrays.extend(hit[5])
    return hit[1]

  def value(self, v: Any) -> Any:
    """Hashable structural key of one constant, literal value or parameter."""
    t = type(v)
    if v is None or t is str or t is bytes or t is bool or t is int:
      return (t, v)
    if t is float:
      return (t, float_bits(v))
    if t is complex:
      return (t, float_bits(v.real), float_bits(v.imag))
    if t is tuple or t is dict or t is list or t is ji.FrozenDict:
      hit = self.seen.get(id(v))
      if hit is not None and hit[0] is v:
        return self.reuse(hit)
      key, mine = self.apart(self._container, v, t)
      self.seen[id(v)] = (v, key, *mine)
      return key
    if t in _ARRAY_TYPES:  # literals: the most common value after scalars
      return self.ndarray(v, t)
    return self._object(v, t)

  def _container(self, v: Any, t: type) -> Any:
    if t is dict or t is ji.FrozenDict:
      items = [(self.value(k), self.value(x)) for k, x in v.items()]
      items.sort(key=repr)
      return (t, tuple(items))
    return (t, tuple(self.value(x) for x in v))

  def _object(self, v: Any, t: type) -> Any:
    """Key of a value that is neither a builtin scalar nor a plain tuple,
    list or dict (the order of the tests matters: numpy's scalars are
    floats and ints too)."""
    if isinstance(v, jax.core.Tracer):
      raise NotFingerprintable("tracer")
    if isinstance(v, (ji.ClosedJaxpr, ji.Jaxpr)):
      return self.jaxpr(v)
    if isinstance(v, (int, float, complex)) and _trusted(t):
      # JAX's typed literals (TypedFloat, ...): the value, its type, dtype.
      base: type = (
        complex
        if isinstance(v, complex)
        else (float if isinstance(v, float) else int)
      )
      return (t, self.value(base(v)), self.value(getattr(v, "dtype", None)))
    if isinstance(v, np.ndarray):
      if t is not np.ndarray and not t.__module__.startswith("jax"):
        raise NotFingerprintable(f"ndarray subclass {t.__name__}")
      _ARRAY_TYPES.add(t)
      return self.ndarray(v, t)
    if isinstance(v, np.generic):
      a = np.asarray(v)
      if a.dtype == object:
        raise NotFingerprintable("object scalar")
      return ("np-scalar", t, a.dtype.str, _digest(a))
    if isinstance(v, jax.Array):
      return self.array(v)
    if isinstance(v, (enum.Enum, type)):
      # Singletons: compared by identity, never by a user-defined __eq__.
      owner = t if isinstance(v, enum.Enum) else v
      return (t, _Identity(v) if _trusted(owner) else self.identity(v))
    if isinstance(v, tuple) and _trusted(t) and hasattr(v, "_fields"):
      return (t, tuple(self.value(x) for x in v))  # JAX's named tuples
    if t is frozenset:
      return (t, frozenset(self.value(x) for x in v))
    if t is slice:
      return (t, self.value(v.start), self.value(v.stop), self.value(v.step))
    if t is functools.partial:
      # An executable calls a host callback back with everything it
      # carries: what the partial holds is keyed as held state.
      return self.partial(v)
    if dataclasses.is_dataclass(v) and _trusted(t):
      return (
        t,
        tuple(
          (f.name, self.value(getattr(v, f.name)))
          for f in dataclasses.fields(v)
        ),
      )
    if isinstance(v, _VALUE_TYPES) and _trusted(t):
      try:
        hash(v)
      except TypeError:
        raise NotFingerprintable(f"unhashable {t.__name__}") from None
      return (t, v)
    # Functions, host callbacks, user objects with their own __eq__, anything
    # else: the same object or not at all.
    return (t, self.identity(v))

  def ndarray(self, v: np.ndarray, t: type) -> Any:
    """Key of a numpy array (or JAX's numpy-backed literal) by content."""
    if v.dtype.hasobject:
      raise NotFingerprintable("object array")
    self.volatile = True
    self.nbytes += v.nbytes
    return (
      "np",
      t,
      v.dtype.str,
      v.shape,
      bool(getattr(v, "weak_type", False)),
      _digest(v),
    )

  def array(self, v: Any) -> Any:
    if (
      v.nbytes <= CONTENT_HASH_MAX_BYTES
      and v.is_fully_addressable
      and not jax.dtypes.issubdtype(v.dtype, jax.dtypes.extended)
    ):
      try:
        a = np.asarray(v)
      except RuntimeError as e:  # deleted (donated) array
        raise NotFingerprintable(f"array: {e}") from None
      self.nbytes += a.nbytes
      return (
        "array",
        a.dtype.str,
        a.shape,
        v.weak_type,
        self.value(v.sharding),
        getattr(v, "_committed", None),
        _digest(a),
      )
    if v.is_deleted():  # lowering it anew raises: never reuse
      raise NotFingerprintable("deleted array")
    self.arrays.append(v)
    return ("array-id", self.identity(v))

  def partial(self, v: functools.partial) -> Any:
    # The keywords dict is the partial's own copy: keyed by its items.
    keywords = tuple((k, self.held(x)) for k, x in sorted(v.keywords.items()))
    return (type(v), self.held(v.func), self.held(v.args), keywords)

  def held(self, v: Any) -> Any:
    """Key of a value that a host callback carries (a ``functools.partial``'s
    function, arguments and keywords): the executable calls back into this
    very object, so anything that is not an immutable value (lists, dicts,
    sets, arrays, functions, bound methods, callable objects, anything of
    the user's) is keyed by identity and kept alive by the key, never by
    content; tuples and frozensets are keyed element by element."""
    t = type(v)
    if v is None or t in (str, bytes, bool, int, float, complex):
      return self.value(v)
    if t is tuple:
      return (t, tuple(self.held(x) for x in v))
    if t is frozenset:
      return (t, frozenset(self.held(x) for x in v))
    if t is functools.partial:
      return self.partial(v)
    if isinstance(v, (np.generic, enum.Enum)) or (
      isinstance(v, _VALUE_TYPES) and _trusted(t)
    ):
      return self.value(v)
    return (t, self.identity(v))

  def params(self, params: dict, skip: frozenset) -> tuple:
    """Key of a parameter dict, without the names in ``skip``."""
    return tuple(
      (name, self.value(params[name]))
      for name in sorted(params)
      if name not in skip
    )


class _Walker(_ValueKeys):
  """One fingerprint computation: keys jaxprs (variables, equations,
  effects) and the values they hold, and records what the key holds."""

  def __init__(self):
    super().__init__()
    self.local: dict[int, tuple[Any, Fingerprint]] = {}
    self.avals: dict[int, Any] = {}  # hashable avals met, by id
    self.idents: dict[int, _Identity] = {}  # primitives and contexts, by id

  def effects(self, effects: Any) -> Any:
    if not effects:
      return _NO_EFFECTS
    out = []
    for e in effects:
      if isinstance(e, ji.Effect) and _trusted(type(e)):
        try:
          hash(e)
        except TypeError:
          raise NotFingerprintable("unhashable effect") from None
        out.append(e)
      else:
        out.append(self.identity(e))
    return frozenset(out)

  def aval(self, aval: Any) -> Any:
    if id(aval) in self.avals:  # JAX interns avals: most are met again
      return aval
    try:
      hash(aval)
    except TypeError:
      raise NotFingerprintable(f"unhashable aval {aval}") from None
    self.avals[id(aval)] = aval  # held: the id names this object meanwhile
    return aval

  def eqn_params(self, primitive: Any, params: dict) -> tuple:
    # Equations of one primitive whose parameters are the same objects
    # share one key (ids are stable: the jaxpr holds the values).
    memo = (id(primitive), *params, *map(id, params.values()))
    hit = self.seen.get(memo)
    if hit is not None and hit[0] is primitive:
      return self.reuse(hit)
    ignored = _IGNORED_PARAMS.get(primitive.name, frozenset())
    key, mine = self.apart(self.params, params, ignored)
    # The entry holds the values, so their ids cannot be reused meanwhile.
    self.seen[memo] = (primitive, key, *mine, tuple(params.values()))
    return key

  def jaxpr(self, obj: Any) -> Fingerprint:
    """Fingerprint of a (Closed)Jaxpr, memoized when it holds no numpy data."""
    seen = self.local.get(id(obj))
    hit: Fingerprint | None
    if seen is not None and seen[0] is obj:
      hit = seen[1]  # holds numpy data: valid for this computation only
      self.volatile = True
    else:
      with _MEMO_LOCK:
        hit = _MEMO.get(obj)
    if hit is not None:
      self.pins |= hit.pins
      self.nbytes += hit.nbytes
      self.arrays.extend(hit.arrays)
      return hit
    key, (pins, nbytes, volatile, arrays) = self.apart(self._jaxpr_key, obj)
    fp = Fingerprint(key, pins, nbytes, arrays)
    if volatile:
      self.local[id(obj)] = (obj, fp)
    else:
      with _MEMO_LOCK:
        _MEMO[obj] = fp
    return fp

  def _jaxpr_key(self, obj: Any) -> tuple:
    if isinstance(obj, ji.ClosedJaxpr):
      return (
        "closed",
        self.jaxpr(obj.jaxpr),
        tuple(self.value(c) for c in obj.consts),
      )
    return self.open_jaxpr(obj)

  def open_jaxpr(self, jaxpr: Any) -> tuple:
    ids: dict[Any, int] = {}
    aval, value, idents = self.aval, self.value, self.idents
    literal, drop = ji.Literal, ji.DropVar

    def define(v: Any) -> tuple:
      n = ids[v] = len(ids)
      return (n, aval(v.aval))

    def use(a: Any) -> Any:
      if isinstance(a, literal):
        return ("lit", value(a.val), aval(a.aval))
      n = ids.get(a)
      if n is None:
        raise NotFingerprintable("unbound variable")
      return n

    def ident(obj: Any) -> _Identity:
      # An id names one object while the jaxpr holding it lives.
      got = idents.get(id(obj))
      if got is None:
        got = idents[id(obj)] = _Identity(obj)
      return got

    constvars = tuple([define(v) for v in jaxpr.constvars])
    invars = tuple([define(v) for v in jaxpr.invars])
    eqns = []
    for eqn in jaxpr.eqns:
      ins = tuple([use(a) for a in eqn.invars])
      params = self.eqn_params(eqn.primitive, eqn.params)
      outs = tuple(
        [
          ("drop", aval(v.aval)) if isinstance(v, drop) else define(v)
          for v in eqn.outvars
        ]
      )
      eqns.append(
        (
          ident(eqn.primitive),
          ins,
          params,
          outs,
          self.effects(eqn.effects),
          ident(eqn.ctx),
        )
      )
    outvars = tuple([use(a) for a in jaxpr.outvars])
    return (
      "jaxpr",
      constvars,
      invars,
      tuple(eqns),
      outvars,
      self.effects(jaxpr.effects),
    )


def value_key(v: Any) -> Any:
  """Hashable structural key of one constant, literal value or parameter.

  Raises:
    NotFingerprintable: ``v`` has no sound key.
  """
  return _Walker().value(v)


def fingerprint(closed_jaxpr: Any) -> Fingerprint | None:
  """Structural fingerprint of a ``ClosedJaxpr``, or None when it has none.

  Args:
    closed_jaxpr: a ``jax.extend.core.ClosedJaxpr``.

  Returns:
    A hashable :class:`Fingerprint`, equal for programs that lower to the same
    executable; ``None`` when some part has no sound key, or holds a jax
    Array that was deleted (donated) since (compiling anew then raises as
    stock does).
  """
  try:
    fp = _Walker().jaxpr(closed_jaxpr)
  except NotFingerprintable:
    return None
  return None if fp.deleted() else fp


def params_key(
  params: dict, skip: frozenset = frozenset({"jaxpr"})
) -> Fingerprint | None:
  """Key of ``jit_p`` parameters other than ``skip`` (None if unkeyable)."""
  walker = _Walker()
  try:
    key = walker.params(params, skip)
  except NotFingerprintable:
    return None
  fp = Fingerprint(key, walker.pins, walker.nbytes, tuple(walker.arrays))
  return None if fp.deleted() else fp


def clear_memo() -> None:
  """Forgets every memoized jaxpr fingerprint."""
  with _MEMO_LOCK:
    _MEMO.clear()


def plain(values: Any) -> bool:
  """True when ``values`` (a trace context) holds nothing of the user's:
  only scalars, strings, enums and JAX's or numpy's own objects. A user
  context holding another object keeps its executables out of the shared
  cache's strong tier (they live only as long as their functions)."""
  t = type(values)
  if values is None or t in (bool, int, float, complex, str, bytes):
    return True
  if t is tuple or t is frozenset:
    return all(plain(v) for v in values)
  return isinstance(values, enum.Enum) or _trusted(t)
