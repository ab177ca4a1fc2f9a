"""The package's error type."""

from __future__ import annotations

from collections.abc import Hashable
from collections.abc import Sequence


class AxisNameError(NameError, AssertionError):
  """An axis name is used where it is not bound, or with the wrong size.

  A subclass of ``NameError`` and ``AssertionError`` because those are what
  JAX raises for an unbound axis name at trace time (``NameError`` outside a
  ``shard_map``, a bare ``AssertionError`` inside one), so ``except`` clauses
  written for stock JAX keep working.

  Attributes:
    primitive: the collective that uses the axis as the user wrote it
      (``"pmean"``, whose equation is a ``psum``), else the primitive's
      name.
    axis_name: the offending axis name.
    bound: the axis names bound where the primitive is used, in order.
    location: ``"file:line (function)"`` of the user's code, or None.
    problems: every problem found, as ``(primitive, axis_name, bound,
      location, detail)`` tuples; the message lists them all.
  """

  def __init__(
    self,
    message: str,
    *,
    primitive: str,
    axis_name: Hashable,
    bound: Sequence[Hashable],
    location: str | None,
    problems: Sequence[tuple] = (),
  ):
    super().__init__(message)
    self.primitive = primitive
    self.axis_name = axis_name
    self.bound = tuple(bound)
    self.location = location
    self.problems = tuple(problems)
