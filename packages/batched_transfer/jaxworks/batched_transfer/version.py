"""The version of jaxworks.batched_transfer (the one place it lives)."""

__version__ = "0.6.0"
