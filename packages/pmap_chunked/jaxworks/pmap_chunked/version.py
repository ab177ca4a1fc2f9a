"""Version of jaxworks.pmap_chunked (the one place it is defined)."""

__version__ = "0.4.0"
