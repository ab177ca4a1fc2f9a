"""A one-line progress bar for long transfers, drawn only on a terminal."""

from __future__ import annotations

import sys
import time
from typing import Any
from typing import TextIO


def _gib(n: float) -> str:
  return f"{n / 2**30:.2f}"


class Progress:
  """Draws ``label [#####.....] 50% 0.50/1.00 GiB 1.2 GB/s`` on ``stream``.

  Args:
    label: text in front of the bar.
    total: the number of bytes that make 100%.
    enabled: True to draw, False to stay silent, None to draw only when
      ``stream`` is a terminal (its isatty() is True).
    stream: where to draw (default sys.stderr, looked up at construction).

  >>> import io
  >>> p = Progress("restore", 100, enabled=None, stream=io.StringIO())
  >>> p.enabled   # a StringIO is not a terminal
  False
  """

  def __init__(
    self,
    label: str,
    total: int,
    enabled: bool | None = None,
    stream: TextIO | None = None,
    width: int = 30,
  ):
    self.stream: Any = sys.stderr if stream is None else stream
    if enabled is None:
      isatty = getattr(self.stream, "isatty", None)
      enabled = bool(isatty()) if callable(isatty) else False
    self.enabled = enabled
    self.label, self.total, self.width = label, max(int(total), 0), width
    self.done = 0
    self._start = time.perf_counter()
    self._last_draw = 0.0

  def update(self, nbytes: int) -> None:
    self.done += int(nbytes)
    now = time.perf_counter()
    if self.enabled and (
      now - self._last_draw > 0.1 or self.done >= self.total
    ):
      self._last_draw = now
      self._draw(now)

  def _draw(self, now: float) -> None:
    frac = 1.0 if self.total == 0 else min(self.done / self.total, 1.0)
    filled = int(frac * self.width)
    rate = self.done / max(now - self._start, 1e-9) / 1e9
    self.stream.write(
      f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] "
      f"{frac * 100:3.0f}% {_gib(self.done)}/{_gib(self.total)} GiB "
      f"{rate:.2f} GB/s"
    )
    self.stream.flush()

  def close(self) -> None:
    if self.enabled:
      self._draw(time.perf_counter())
      self.stream.write("\n")
      self.stream.flush()
