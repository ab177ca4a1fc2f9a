"""The public API of jaxworks.stages_aot, gathered for ``__init__``."""

from .artifact import Artifact, ArtifactError, load_artifact, save_artifact
from .exported import Exported, deserialize
from .platforms import KNOWN_PLATFORMS, present_platforms
from .specs import arg_spec, arg_specs, format_aval
from .stages import Compiled, Lowered, Traced, trace

