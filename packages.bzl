"""The jaxworks packages, in dependency order (leaves first); see README.md for the map."""

PACKAGES = [
    "axis_names",
    "batched_transfer",
    "stages_aot",
    "jit_cache",
    "pmap_chunked",
]
