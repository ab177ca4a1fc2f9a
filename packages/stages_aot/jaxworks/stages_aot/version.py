"""Version of jaxworks.stages_aot (the one place it is defined)."""

__version__ = "0.4.0"
