"""jaxworks.stages_aot: trace -> lower(lowering_platforms) -> compile / export, and AOT artifacts.

>>> import jax, jax.numpy as jnp
>>> from jaxworks import stages_aot
>>> lowered = stages_aot.trace(jnp.sin, jax.ShapeDtypeStruct((4,), jnp.float32)).lower(
...     lowering_platforms=("cpu", "tpu"))
>>> lowered.fun_name, lowered.platforms
('sin', ('cpu', 'tpu'))
"""

from typing import TYPE_CHECKING

from ._src import deps as _deps
from .version import __version__ as __version__

# Checked at import: an unsupported jax/jaxlib raises ImportError here rather
# than at the first use.
_deps.check_jax()

if TYPE_CHECKING:
  from ._src.artifact import Artifact as Artifact
  from ._src.artifact import ArtifactError as ArtifactError
  from ._src.artifact import load_artifact as load_artifact
  from ._src.artifact import save_artifact as save_artifact
  from ._src.exported import Exported as Exported
  from ._src.exported import deserialize as deserialize
  from ._src.platforms import KNOWN_PLATFORMS as KNOWN_PLATFORMS
  from ._src.platforms import canonical_platforms as canonical_platforms
  from ._src.platforms import present_platforms as present_platforms
  from ._src.specs import arg_spec as arg_spec
  from ._src.specs import arg_specs as arg_specs
  from ._src.specs import format_aval as format_aval
  from ._src.stages import Compiled as Compiled
  from ._src.stages import Lowered as Lowered
  from ._src.stages import Traced as Traced
  from ._src.stages import trace as trace

# Names are imported when first used (PEP 562): the stage family
# (``from jaxworks.stages_aot import Lowered``, as jaxworks.jit_cache does)
# imports neither the exported program, its validation nor artifacts (whose
# module reader imports ``jax.extend``).
_LAZY = {
  "Artifact": "_src.artifact",
  "ArtifactError": "_src.artifact",
  "load_artifact": "_src.artifact",
  "save_artifact": "_src.artifact",
  "Exported": "_src.exported",
  "deserialize": "_src.exported",
  "KNOWN_PLATFORMS": "_src.platforms",
  "canonical_platforms": "_src.platforms",
  "present_platforms": "_src.platforms",
  "arg_spec": "_src.specs",
  "arg_specs": "_src.specs",
  "format_aval": "_src.specs",
  "Compiled": "_src.stages",
  "Lowered": "_src.stages",
  "Traced": "_src.stages",
  "trace": "_src.stages",
}


def __getattr__(name: str):
  module = _LAZY.get(name)
  if module is None:
    raise AttributeError(
      f"module 'jaxworks.stages_aot' has no attribute {name!r}"
    )
  import importlib  # pylint: disable=g-import-not-at-top

  value = getattr(importlib.import_module("." + module, __name__), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted(set(globals()) | set(_LAZY))


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
  "canonical_platforms",
  "deserialize",
  "format_aval",
  "load_artifact",
  "present_platforms",
  "save_artifact",
  "trace",
]
