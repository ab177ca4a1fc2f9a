"""Where a checkpoint lives: ``open`` reads a path or a URL, once, into
the ``Destination`` of its kind (place tells what a destination does and
how a save goes through it).

A local path gives a ``local.LocalDirectory`` or a ``local.LocalNpz``, an
``s3://``, ``gs://`` or ``az://`` URL a ``bucket.BucketPrefix`` or a
``bucket.BucketNpz`` (a path ending in ``.npz`` is one archive:
``format.is_npz``); any other URL, ``file://`` included, is refused
(naming the local path to write instead), by every API alike. Every save,
restore and CheckpointManager goes through it.
"""

from __future__ import annotations

import os
import re
from typing import Any

from . import format
from . import storage
from . import stores
from .bucket import BucketNpz as BucketNpz
from .bucket import BucketPrefix as BucketPrefix
from .local import DirectorySave as DirectorySave
from .local import LocalDirectory as LocalDirectory
from .local import LocalNpz as LocalNpz
from .place import Destination as Destination
from .place import Opened as Opened
from .place import Save as Save

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def open(  # noqa: A001 (the module's verb: destination.open)
  api: str,
  path: Any,
  storage_options: dict[str, Any] | None = None,
  overwrite: bool = False,
  lease: bool = True,
) -> Destination:
  """The destination of ``path``, a local path or an object-store URL.

  Args:
    api: the API named in errors.
    path: a str or os.PathLike: ``<name>.npz`` for one archive, anything
      else for a directory (a prefix in a bucket).
    storage_options: for a URL, settings over the cloud's environment
      (stores); none for a local path.
    overwrite: a save may replace the checkpoint there.
    lease: a save to a bucket takes the path's writer lease (False: the
      caller holds one above it, a CheckpointManager's).

  Raises:
    ValueError: a URL of another scheme (``file://`` too: write the local
      path), storage_options for a local path, a bad URL.
    TypeError: ``path`` is not a path.
  """
  text = storage.path_text(api, path)
  if not text:
    raise ValueError(
      f"{api}: the path is empty; pass the checkpoint's path (e.g. "
      "'ckpt', '/data/run/ckpt' or 'ckpt.npz') or an s3://, gs:// or az:// "
      "URL"
    )
  url = _SCHEME.match(text)
  if url is None:
    if storage_options:
      raise ValueError(
        f"{api}: storage_options are for s3://, gs:// and az:// URLs; "
        f"{text!r} is a local path"
      )
    # Absolute now, in the call: a later os.chdir (or a background save's
    # thread) never moves it.
    local = os.path.abspath(text)
    kind = LocalNpz if format.is_npz(local) else LocalDirectory
    return kind(api, local, overwrite)
  if url.group(1).lower() not in storage.SCHEMES:
    raise ValueError(storage.unknown_url(api, text, url.group(1)))
  st = stores.open_storage(api, text, storage_options)
  bucket = BucketNpz if format.is_npz(text) else BucketPrefix
  return bucket(api, text, st, overwrite, lease)


def open_directory(
  api: str, path: Any, storage_options: dict[str, Any] | None = None
) -> Destination:
  """The destination of a CheckpointManager's ``directory`` (its steps are
  its ``child``ren): a local one as an absolute path, a URL without its
  trailing ``/``. Its saves take no writer lease (the manager holds the
  directory's) and replace nothing."""
  at = open(api, path, storage_options, overwrite=False, lease=False)
  return at.child("")


def check_name(api: str, path: Any) -> None:
  """Refuses, before anything is written, a local path that names no
  place of its own for a checkpoint: ``/``, or a path whose last component
  is ``.`` or ``..`` (a directory that holds the working directory or the
  path's own parent: replacing it fails, or takes what the user did not
  name)."""
  text = storage.path_text(api, path)
  if _SCHEME.match(text):
    return
  parts = [p for p in text.split(os.sep) if p]
  if os.path.abspath(text) == os.path.abspath(os.sep) or (
    parts and parts[-1] in (".", "..")
  ):
    raise ValueError(
      f"{api}: {text!r} names the directory "
      f"{os.path.abspath(text)!r} itself, not a checkpoint inside it; "
      "nothing was written. Name the checkpoint, e.g. "
      f"{os.path.join(text, 'ckpt')!r}"
    )
