"""jaxworks.stages_aot: trace -> lower(lowering_platforms) -> compile / export, and AOT artifacts.

>>> import jax, jax.numpy as jnp
>>> from jaxworks import stages_aot
>>> lowered = stages_aot.trace(jnp.sin, jax.ShapeDtypeStruct((4,), jnp.float32)).lower(
...     lowering_platforms=("cpu", "tpu"))
>>> lowered.fun_name, lowered.platforms
('sin', ('cpu', 'tpu'))
"""

from ._src.api import KNOWN_PLATFORMS as KNOWN_PLATFORMS
from ._src.api import Artifact as Artifact
from ._src.api import ArtifactError as ArtifactError
from ._src.api import Compiled as Compiled
from ._src.api import Exported as Exported
from ._src.api import Lowered as Lowered
from ._src.api import Traced as Traced
from ._src.api import arg_spec as arg_spec
from ._src.api import arg_specs as arg_specs
from ._src.api import deserialize as deserialize
from ._src.api import format_aval as format_aval
from ._src.api import load_artifact as load_artifact
from ._src.api import present_platforms as present_platforms
from ._src.api import save_artifact as save_artifact
from ._src.api import trace as trace
from .version import __version__ as __version__

__all__ = [
  "Artifact",
  "ArtifactError",
  "Compiled",
  "Exported",
  "KNOWN_PLATFORMS",
  "Lowered",
  "Traced",
  "__version__",
  "arg_spec",
  "arg_specs",
  "deserialize",
  "format_aval",
  "load_artifact",
  "present_platforms",
  "save_artifact",
  "trace",
]
