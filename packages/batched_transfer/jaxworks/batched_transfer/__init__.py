"""jaxworks.batched_transfer: a pytree onto devices in one batched operation.

Public API: device_put, plan, place_for, save, restore, TransferPlan, PlannedGroup;
install, uninstall, installed, is_installed (swap jax.device_put program-wide).
"""

from jaxworks.batched_transfer._src.adopt import install as install
from jaxworks.batched_transfer._src.adopt import installed as installed
from jaxworks.batched_transfer._src.adopt import is_installed as is_installed
from jaxworks.batched_transfer._src.adopt import uninstall as uninstall
from jaxworks.batched_transfer._src.api import device_put as device_put
from jaxworks.batched_transfer._src.api import place_for as place_for
from jaxworks.batched_transfer._src.api import plan as plan
from jaxworks.batched_transfer._src.checkpoint import restore as restore
from jaxworks.batched_transfer._src.checkpoint import save as save
from jaxworks.batched_transfer._src.plan import PlannedGroup as PlannedGroup
from jaxworks.batched_transfer._src.plan import TransferPlan as TransferPlan
from jaxworks.batched_transfer.version import __version__ as __version__

__all__ = [
  "PlannedGroup",
  "TransferPlan",
  "__version__",
  "device_put",
  "install",
  "installed",
  "is_installed",
  "place_for",
  "plan",
  "restore",
  "save",
  "uninstall",
]
