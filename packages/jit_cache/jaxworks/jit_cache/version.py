"""Version of jaxworks.jit_cache (the one place it is set)."""

__version__ = "0.6.0"
