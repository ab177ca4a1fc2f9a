"""Implementation of jaxworks.batched_transfer (private)."""
