"""The jaxworks packages, in dependency order (leaves first); see README.md for the map."""

PACKAGES = [
    "axis_names",
    "batched_transfer",
    "jit_cache",
    "stages_aot",
    "pmap_chunked",
]
