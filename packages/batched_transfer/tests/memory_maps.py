"""Where restore's host memory is: this process's memory maps
(/proc/self/smaps) and the device buffers restore reads into."""

from jaxworks.batched_transfer._src.checkpoint import reader


def vm_flags(address: int) -> set[str]:
  """The VmFlags of the memory map holding ``address``: "hg" marks one
  advised to use transparent huge pages (MADV_HUGEPAGE)."""
  with open("/proc/self/smaps") as f:
    inside = False
    for line in f:
      head = line.split()[0]
      if "-" in head and ":" not in head:
        lo, hi = (int(x, 16) for x in head.split("-"))
        inside = lo <= address < hi
      elif inside and head == "VmFlags:":
        return set(line.split()[1:])
  raise AssertionError(f"no map holds {address:#x}")


def record_pieces(monkeypatch) -> list[int]:
  """The addresses of the buffers restore reads device parts into
  (``reader.Pieces``) from now on, as they are made."""
  made: list[int] = []
  init = reader.Pieces.__init__

  def recording(self, *args, **kwargs):
    init(self, *args, **kwargs)
    made.extend(b.ctypes.data for b in self.buffers)

  monkeypatch.setattr(reader.Pieces, "__init__", recording)
  return made
