"""Version of jaxworks.axis_names (the one place it is set)."""

__version__ = "0.3.2"
