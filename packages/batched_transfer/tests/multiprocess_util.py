"""Shared by the tests that start jax.distributed processes on 127.0.0.1."""

import json
import os
import socket

import ml_dtypes  # noqa: F401  (np.dtype of ml_dtypes names needs it imported)
import numpy as np


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def numpy_read(path: str) -> dict:
  """Every array of a multi-process checkpoint, with numpy and json alone:
  what the README's manifest schema promises a reader needs."""
  with open(os.path.join(path, "jaxworks_manifest.json")) as f:
    manifest = json.load(f)
  out = {}
  for key, entry in manifest["arrays"].items():
    dtype = np.dtype(entry["dtype"])
    a = np.empty(entry["shape"], dtype)
    for shard in entry["shards"]:
      data = np.load(os.path.join(path, shard["file"]))
      where = tuple(
        slice(s, s + n) for s, n in zip(shard["start"], shard["shape"])
      )
      a[where] = data.view(dtype) if data.dtype.kind == "V" else data
    out[key] = a
  return out
