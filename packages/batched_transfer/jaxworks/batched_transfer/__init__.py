"""jaxworks.batched_transfer: a pytree onto devices in one batched operation.

Public API: device_put, plan, place_for, save, restore, metadata,
custom_metadata, SaveHandle,
CheckpointManager, CheckpointManagerOptions, WriterConflictError, StrayKeyError,
CheckpointReplacedError,
TransferPlan, PlannedGroup, PlacementError, SpecRankError;
install, uninstall, installed, is_installed (swap jax.device_put program-wide).
"""

from ._src.adopt import install as install
from ._src.adopt import installed as installed
from ._src.adopt import is_installed as is_installed
from ._src.adopt import uninstall as uninstall
from ._src.api import device_put as device_put
from ._src.api import place_for as place_for
from ._src.api import plan as plan
from ._src.checkpoint.api import SaveHandle as SaveHandle
from ._src.checkpoint.api import custom_metadata as custom_metadata
from ._src.checkpoint.api import metadata as metadata
from ._src.checkpoint.api import restore as restore
from ._src.checkpoint.api import save as save
from ._src.checkpoint.lease import WriterConflictError as WriterConflictError
from ._src.checkpoint.manager import CheckpointManager as CheckpointManager
from ._src.checkpoint.manager import (
  CheckpointManagerOptions as CheckpointManagerOptions,
)
from ._src.checkpoint.reader import (
  CheckpointReplacedError as CheckpointReplacedError,
)
from ._src.checkpoint.storage import StrayKeyError as StrayKeyError
from ._src.plan import PlannedGroup as PlannedGroup
from ._src.plan import TransferPlan as TransferPlan
from ._src.targets import PlacementError as PlacementError
from ._src.transfer import SpecRankError as SpecRankError
from .version import __version__ as __version__

__all__ = [
  "CheckpointManager",
  "CheckpointManagerOptions",
  "CheckpointReplacedError",
  "PlacementError",
  "PlannedGroup",
  "SaveHandle",
  "SpecRankError",
  "StrayKeyError",
  "TransferPlan",
  "WriterConflictError",
  "__version__",
  "custom_metadata",
  "device_put",
  "install",
  "installed",
  "is_installed",
  "metadata",
  "place_for",
  "plan",
  "restore",
  "save",
  "uninstall",
]

# Public classes report the module they are imported from (in tracebacks,
# repr and pickles), not the private one that defines them.
for _value in list(globals().values()):
  if isinstance(_value, type) and _value.__module__.startswith(f"{__name__}._"):
    _value.__module__ = __name__
del _value
