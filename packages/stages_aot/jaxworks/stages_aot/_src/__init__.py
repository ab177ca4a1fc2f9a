"""Implementation of jaxworks.stages_aot; import the public API from ``jaxworks.stages_aot``."""
