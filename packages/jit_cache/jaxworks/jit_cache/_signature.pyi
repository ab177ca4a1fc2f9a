"""Typed stub of the C++ extension jaxworks.jit_cache._signature."""

from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Sequence
from typing import Any

class Signature:
  """Signature of one call's flattened arguments; hash precomputed.

  Built only by :class:`SignatureBuilder`.
  """

  def __hash__(self) -> int: ...
  def __eq__(self, other: object) -> bool: ...
  def __ne__(self, other: object) -> bool: ...
  def __len__(self) -> int: ...
  @property
  def extra(self) -> Any: ...
  @property
  def has_tracer(self) -> bool: ...
  def describe(self) -> list[tuple[str, Any, Any, bool]]:
    """One (kind, first, second, committed) tuple per leaf."""

class SignatureBuilder:
  def __init__(
    self,
    array_types: tuple[type, ...],
    tracer_type: type | None,
    ndarray_type: type | None,
    numpy_generic_type: type | None,
    fallback: Callable[[Any], Hashable] | None,
    array_samples: Callable[[], list[Any]] | None = None,
    flatten: Callable[[Any], tuple[list[Any], Any]] | None = None,
  ) -> None: ...
  def __call__(
    self, leaves: Sequence[Any], extra: Hashable = None
  ) -> Signature: ...
  def classify(self, leaf: Any) -> str: ...
  def reads_array_fields(self) -> bool: ...
  def key(
    self, tree: Any, statics: Hashable, ctx: Hashable
  ) -> tuple[list[Any], Any, Signature]: ...

class ContextKey:
  def __hash__(self) -> int: ...
  def __eq__(self, other: object) -> bool: ...
  @property
  def values(self) -> tuple: ...

class ContextInterner:
  def __init__(self, capacity: int = 8) -> None: ...
  def __call__(self, values: tuple) -> ContextKey: ...
  def __len__(self) -> int: ...

class Forwarder:
  """Base type whose instances forward calls, in C, to their target."""

  def _forward_to(
    self,
    target: Callable[..., Any],
    on_error: Callable[[Any, Exception, tuple, dict], BaseException | None]
    | None,
    traced: Callable[..., Any] | None = None,
    tracer_type: type | None = None,
  ) -> None: ...

def enable_vectorcall(cls: type) -> bool: ...
