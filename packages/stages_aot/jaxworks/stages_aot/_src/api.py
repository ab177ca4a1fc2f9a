"""The public API of jaxworks.stages_aot, gathered for ``__init__``."""

from jaxworks.jit_cache import KNOWN_PLATFORMS as KNOWN_PLATFORMS
from jaxworks.jit_cache import present_platforms as present_platforms

from .artifact import Artifact as Artifact
from .artifact import ArtifactError as ArtifactError
from .artifact import load_artifact as load_artifact
from .artifact import save_artifact as save_artifact
from .exported import Exported as Exported
from .exported import deserialize as deserialize
from .specs import arg_spec as arg_spec
from .specs import arg_specs as arg_specs
from .specs import format_aval as format_aval
from .stages import Compiled as Compiled
from .stages import Lowered as Lowered
from .stages import Traced as Traced
from .stages import trace as trace
