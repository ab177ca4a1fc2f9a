"""jaxworks.axis_names: named axes in jaxprs, analysed bottom-up.

Which named axes a function communicates over (``used_axis_names``), the
same function under other axis names (``rename_axes``), unbound or
mismatched names reported at the user's line (``check_axis_names``), and
what each collective costs (``collective_report``).
"""

from ._src.api import AxisNameError as AxisNameError
from ._src.api import CollectiveReport as CollectiveReport
from ._src.api import CollectiveStat as CollectiveStat
from ._src.api import check_axis_names as check_axis_names
from ._src.api import collective_report as collective_report
from ._src.api import diagnose as diagnose
from ._src.api import rename_axes as rename_axes
from ._src.api import used_axis_names as used_axis_names
from .version import __version__ as __version__

__all__ = [
  "AxisNameError",
  "CollectiveReport",
  "CollectiveStat",
  "check_axis_names",
  "collective_report",
  "diagnose",
  "rename_axes",
  "used_axis_names",
  "__version__",
]

# Public classes report the module they are imported from (in tracebacks,
# repr and pickles), not the private one that defines them.
for _value in list(globals().values()):
  if isinstance(_value, type) and _value.__module__.startswith(f"{__name__}._"):
    _value.__module__ = __name__
del _value
