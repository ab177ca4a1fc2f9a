"""What the kernel says about this process's memory maps (/proc/self/smaps)."""


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
