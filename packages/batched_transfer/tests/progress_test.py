"""The progress bar: drawn on a terminal only, bytes and rate, finishes with a newline."""

import io

# Private imports below: Progress has no public constructor.
from jaxworks.batched_transfer._src.checkpoint.progress import Progress


class Tty(io.StringIO):
  def isatty(self):
    return True


def test_draws_on_a_terminal():
  out = Tty()
  bar = Progress("restore", 2 * 2**30, stream=out, width=10)
  assert bar.enabled
  bar.update(2**30)
  bar.update(2**30)
  bar.close()
  text = out.getvalue()
  assert "restore [#####.....]  50% 1.00/2.00 GiB" in text
  assert "restore [##########] 100% 2.00/2.00 GiB" in text
  assert text.endswith("\n")


def test_silent_when_not_a_terminal_or_disabled():
  for stream, enabled in (
    (io.StringIO(), None),
    (Tty(), False),
    (object(), None),
  ):
    bar = Progress("x", 10, enabled=enabled, stream=stream)
    bar.update(10)
    bar.close()
    assert not bar.enabled
    if isinstance(stream, io.StringIO):
      assert stream.getvalue() == ""


def test_zero_total():
  out = Tty()
  bar = Progress("x", 0, stream=out)
  bar.close()
  assert "100%" in out.getvalue()
