"""GCS buckets behind ``storage.Storage``, through ``google-cloud-storage``.

Google's client reads ``STORAGE_EMULATOR_HOST`` (an emulator: anonymous
credentials), ``GOOGLE_APPLICATION_CREDENTIALS`` and the application
default credentials itself. Uploads over ``chunk_size`` are resumable
uploads of ``chunk_size`` parts (bounded memory); reads are ranged and run
``concurrency`` at a time. Retries: the client's transient-error policy
(429, 5xx, dropped connections) with exponential backoff, for at most
``retry_timeout_s``; every write here is idempotent (a whole object, or a
conditional one: a create with ``ifGenerationMatch=0``, a ``replace`` with
``ifGenerationMatch=<generation>``, whose retry after a lost answer meets
its own write and says 412: the caller reads the object back), so writes
are retried too. gcp-storage-emulator ignores preconditions: ``create``
and ``replace`` also look at the object first, which makes it refuse a
write another writer made before (not atomically: on GCS the precondition
is).
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable
import importlib
import io
from typing import Any

from . import storage
from .storage import LOG
from .storage import Location
from .storage import Storage

_INSTALL = "pip install 'jaxworks-batched-transfer[cloud]'"


def _modules(api: str) -> tuple[Any, Any, Any, Any]:
  try:
    return (
      importlib.import_module("google.cloud.storage"),
      importlib.import_module("google.api_core.exceptions"),
      importlib.import_module("google.cloud.storage.retry"),
      importlib.import_module("google.auth.credentials"),
    )
  except ImportError as e:
    raise ImportError(
      f"{api}: gs:// URLs need the package {e.name!r}: {_INSTALL}"
    ) from e


class GCSStorage(Storage):
  """A GCS bucket prefix."""

  def __init__(
    self,
    api: str,
    location: Location,
    client: Any,
    tuning: Any,
    fix: str,
    endpoint: str | None,
  ) -> None:
    super().__init__(api, location)
    self._client = client
    self._bucket = client.bucket(location.bucket)
    self._tuning = tuning
    self._fix = fix
    self._endpoint = endpoint
    self.concurrency = tuning.concurrency
    _, self._exc, retry, _ = _modules(api)
    self._retry = retry.DEFAULT_RETRY.with_timeout(tuning.retry_timeout_s)

  def _at(self, location: Location) -> GCSStorage:
    return GCSStorage(
      self.api,
      location,
      self._client,
      self._tuning,
      self._fix,
      self._endpoint,
    )

  def _key(self, key: str) -> str:
    storage.check_key(self.api, key)
    p = self.location.prefix
    return f"{p}/{key}" if p else key

  def _blob(self, key: str) -> Any:
    blob = self._bucket.blob(self._key(key))
    blob.chunk_size = self._tuning.chunk_size // (256 * 1024) * (256 * 1024)
    return blob

  def _error(self, err: Exception, key: str, doing: str) -> OSError:
    exc = self._exc
    if isinstance(err, exc.PreconditionFailed):
      kind = "exists"
    elif isinstance(err, exc.NotFound):
      try:
        kind = "missing" if self._bucket.exists(retry=self._retry) else "bucket"
      except Exception:  # the error of the object says enough
        kind = "missing"
    elif isinstance(err, (exc.Forbidden, exc.Unauthorized)):
      kind = "refused"
    else:
      kind = "failed"
    return storage.request_error(
      self, kind, err, key, doing, self._endpoint, self._fix,
      f"retrying for up to {self._tuning.retry_timeout_s:g} s",
    )  # fmt: skip

  def _call(self, key: str, doing: str, fn: Any, *args: Any, **kw: Any) -> Any:
    try:
      return fn(*args, retry=self._retry, **kw)
    except (self._exc.GoogleAPICallError, self._exc.RetryError) as e:
      raise self._error(e, key, doing) from e
    except OSError as e:  # a connection the client gave up on
      raise self._error(e, key, doing) from e

  def list(self, prefix: str = "") -> dict[str, int]:
    root = self._key(prefix) if prefix else self.location.prefix
    start = len(self.location.prefix) + 1 if self.location.prefix else 0

    def all_blobs(**kw: Any) -> dict[str, int]:
      blobs = self._client.list_blobs(
        self.location.bucket, prefix=root + "/" if root else None, **kw
      )
      return {
        b.name[start:]: int(b.size)
        for b in blobs
        if storage.is_key(b.name[start:])  # not a folder marker
      }

    return dict(sorted(self._call(prefix, "listing", all_blobs).items()))

  def children(self) -> builtins.list[str]:
    root = self.location.prefix

    def prefixes(**kw: Any) -> set[str]:
      it = self._client.list_blobs(
        self.location.bucket,
        prefix=root + "/" if root else None,
        delimiter="/",
        **kw,
      )
      for _ in it:
        pass
      return set(it.prefixes)

    return storage.names_below(root, self._call("", "listing", prefixes))

  def size(self, key: str) -> int:
    blob = self._call(key, "reading", self._bucket.get_blob, self._key(key))
    if blob is None:
      raise FileNotFoundError(f"{self.api}: {self.where(key)!r} does not exist")
    return int(blob.size)

  def mtime_ns(self, key: str) -> int:
    blob = self._call(key, "reading", self._bucket.get_blob, self._key(key))
    if blob is None:
      raise FileNotFoundError(f"{self.api}: {self.where(key)!r} does not exist")
    return int(blob.updated.timestamp() * 1e9)

  def read(self, key: str, start: int = 0, end: int | None = None) -> Any:
    if end is not None and end <= start:
      return b""
    blob = self._blob(key)
    try:
      return self._call(
        key,
        "reading",
        blob.download_as_bytes,
        start=start,
        end=None if end is None else end - 1,
        checksum=None,
        raw_download=True,
      )
    except OSError as e:
      cause = e.__cause__
      status = getattr(cause, "code", None)
      if status == 416:  # the range starts past the end
        return b""
      raise

  def stream_into(self, key: str, start: int, *outs: memoryview) -> None:
    sink = storage.Into(outs)
    if not sink.size:
      return
    end = start + sink.size
    blob = self._blob(key)
    try:
      self._call(
        key,
        "reading",
        blob.download_to_file,
        sink,
        start=start,
        end=end - 1,
        checksum=None,
        raw_download=True,
      )
    except OSError as e:
      if getattr(e.__cause__, "code", None) == 416:  # starts past the end
        raise self.short(key, self.size(key), end) from None
      raise
    if sink.pos != sink.size:
      raise self.short(key, start + sink.pos, end)

  def write(self, key: str, data: Any) -> None:
    view = memoryview(data).cast("B")
    blob = self._blob(key)
    self._call(key, "writing", blob.upload_from_file, io.BytesIO(view))
    LOG.debug("wrote %s", self.where(key))

  def upload(self, key: str, filename: str) -> None:
    blob = self._blob(key)
    self._call(key, "writing", blob.upload_from_filename, filename)
    LOG.debug("uploaded %s to %s", filename, self.where(key))

  def _stream(self, key: str) -> Any:
    # A resumable upload in parts of chunk_size.
    blob = self._blob(key)
    out = self._call(key, "writing", blob.open, "wb", ignore_flush=True)
    return _Stream(self, key, out)

  def copy(self, src: str, dst: str) -> None:
    # Rewrite copies on the server, in as many calls as it takes.
    source, target = self._blob(src), self._blob(dst)

    def rewrite(retry: Any) -> None:
      token = None
      while True:
        token, _, _ = target.rewrite(source, token=token, retry=retry)
        if token is None:
          return

    self._call(dst, "copying to", rewrite)

  def create(self, key: str, data: bytes) -> None:
    # The service refuses a second create (ifGenerationMatch=0); the check
    # before it makes emulators that ignore preconditions refuse too.
    if self.exists(key):
      raise FileExistsError(
        f"{self.api}: {self.where(key)!r} exists already; delete it, or "
        "pass overwrite=True where the API takes it"
      )
    blob = self._blob(key)
    self._call(
      key,
      "writing",
      blob.upload_from_string,
      bytes(data),
      if_generation_match=0,
    )
    LOG.debug("created %s", self.where(key))

  def tag_of(self, key: str) -> str | None:
    blob = self._call(key, "reading", self._bucket.get_blob, self._key(key))
    return None if blob is None else str(blob.generation)

  def read_tagged(self, key: str) -> tuple[bytes, str] | None:
    for _ in range(3):
      blob = self._call(key, "reading", self._bucket.get_blob, self._key(key))
      if blob is None:
        return None
      gen = int(blob.generation)
      try:
        data = self._call(
          key,
          "reading",
          self._blob(key).download_as_bytes,
          if_generation_match=gen,
          checksum=None,
          raw_download=True,
        )
      except FileExistsError:  # replaced between the two: again
        continue
      except FileNotFoundError:
        return None
      return bytes(data), str(gen)
    raise OSError(
      f"{self.api}: {self.where(key)!r} changed at every read; try again"
    )

  def replace(self, key: str, data: bytes, tag: str) -> None:
    # The service refuses the write unless the generation is still ``tag``
    # (ifGenerationMatch). The emulator ignores preconditions: the check
    # before the write makes it refuse a replaced object too (not atomic
    # there; on GCS the precondition is).
    blob = self._call(key, "reading", self._bucket.get_blob, self._key(key))
    if blob is None or str(blob.generation) != tag:
      raise storage.request_error(
        self, "changed", OSError(), key, "writing", self._endpoint, "", ""
      )
    try:
      self._call(
        key,
        "writing",
        self._blob(key).upload_from_string,
        bytes(data),
        if_generation_match=int(tag),
      )
    except (FileExistsError, FileNotFoundError) as e:
      raise storage.request_error(
        self, "changed", e, key, "writing", self._endpoint, "", ""
      ) from e
    LOG.debug("replaced %s", self.where(key))

  def delete(self, keys: Iterable[str]) -> None:
    def one(key: str) -> None:
      try:
        self._call(key, "deleting", self._bucket.delete_blob, self._key(key))
      except FileNotFoundError:
        pass

    storage.run_parallel(one, list(keys), self.concurrency)


class _Stream:
  """A blob writer, its errors as ``GCSStorage``'s."""

  def __init__(self, st: GCSStorage, key: str, out: Any) -> None:
    self.st, self.key, self.out = st, key, out

  def _do(self, fn: Any, *args: Any) -> None:
    exc = self.st._exc
    try:
      fn(*args)
    except (exc.GoogleAPICallError, exc.RetryError, OSError) as e:
      raise self.st._error(e, self.key, "writing") from e

  def write(self, b: Any) -> None:
    self._do(self.out.write, b)

  def close(self) -> None:
    self._do(self.out.close)


def open_gcs(
  api: str, location: Location, opts: dict[str, Any], tuning: Any, fix: str
) -> Storage:
  """The ``GCSStorage`` of ``location``; ``opts`` as ``stores`` documents."""
  gcs, _, _, credentials = _modules(api)
  import os

  endpoint = (
    opts.pop("endpoint", None)
    or opts.pop("endpoint_url", None)
    or os.environ.get("STORAGE_EMULATOR_HOST")
    or None
  )
  project = opts.pop("project", None) or os.environ.get("GOOGLE_CLOUD_PROJECT")
  key_file = opts.pop("credentials", None)
  for k in ("region", "profile"):
    opts.pop(k, None)
  if opts:
    raise ValueError(
      f"{api}: storage_options {sorted(opts)} are not GCS options; gs:// "
      "takes endpoint, project, credentials, max_retries, retry_timeout_s, "
      "concurrency and chunk_size"
    )
  client_options = {"api_endpoint": endpoint} if endpoint else None
  try:
    if key_file:
      client = gcs.Client.from_service_account_json(
        key_file, project=project, client_options=client_options
      )
    elif endpoint and (
      endpoint.startswith("http://") or os.environ.get("STORAGE_EMULATOR_HOST")
    ):
      client = gcs.Client(
        project=project or "emulator",
        credentials=credentials.AnonymousCredentials(),
        client_options=client_options,
      )
    else:
      client = gcs.Client(project=project, client_options=client_options)
  except Exception as e:  # google.auth's DefaultCredentialsError, bad files
    raise PermissionError(
      f"{api}: no credentials for {location.url!r}: {e}; {fix}"
    ) from e
  return GCSStorage(api, location, client, tuning, fix, endpoint)
