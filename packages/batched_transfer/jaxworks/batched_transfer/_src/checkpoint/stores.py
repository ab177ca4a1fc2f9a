"""Object stores behind ``storage.Storage``, configured as users have them.

``open_storage(api, path, storage_options)`` is the one entry: a local path
gives a ``storage.LocalStorage``; ``s3://`` and ``az://`` URLs an
``ObstoreStorage`` (obstore, the Python binding of the Rust
``object_store`` crate); ``gs://`` URLs a ``GCSStorage`` (Google's
``google-cloud-storage`` client). The client libraries are imported on the
first URL only (``pip install 'jaxworks-batched-transfer[cloud]'``).

Configuration, in order of precedence: ``storage_options``, then each
cloud's standard environment:

- S3: ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
  ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION`` /
  ``AWS_DEFAULT_REGION``; without keys in the environment, boto3's chain
  (``AWS_PROFILE``, ``~/.aws/credentials`` and ``config``, SSO) where boto3
  is installed, else the instance's or container's role.
- GCS: ``STORAGE_EMULATOR_HOST`` (an emulator, no credentials),
  ``GOOGLE_APPLICATION_CREDENTIALS`` and application default credentials,
  ``GOOGLE_CLOUD_PROJECT``.
- Azure: ``AZURE_STORAGE_CONNECTION_STRING`` (``AccountName``,
  ``AccountKey``, ``SharedAccessSignature``, ``BlobEndpoint``,
  ``UseDevelopmentStorage``), else obstore's ``AZURE_STORAGE_*`` variables.

An ``http://`` endpoint (an emulator, a local server) works as it is.
``storage_options`` keys read here: ``endpoint`` (or ``endpoint_url``),
``region``, ``profile`` (S3), ``project`` and ``credentials`` (a key file,
GCS), ``max_retries`` (default 5), ``retry_timeout_s`` (default 60),
``concurrency`` (parallel requests per object, default 8), ``chunk_size``
(bytes per part of a multipart upload or ranged read, default 8 MiB); the
other keys go to the store's own configuration (obstore's
``S3Config``/``AzureConfig`` names, such as ``access_key_id``).

Throttling (429/503) and other 5xx answers, dropped connections and
timeouts are retried (by the client; a bulk delete, S3's DeleteObjects
POST, which it does not retry, here) with exponential backoff and jitter, at most
``max_retries`` times within ``retry_timeout_s``; then the error names the
URL, the key and what to check.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable
from collections.abc import Iterator
import datetime
import os
import pathlib
import random
import time
from typing import Any

from . import storage
from .storage import LOG
from .storage import Location
from .storage import Storage

#: The least bytes a streamed GET hands over at once (``open_stream``):
#: a header's first chunk, and the most held of an object not yet taken.
STREAM_CHUNK = 64 * 2**10
_INSTALL = "pip install 'jaxworks-batched-transfer[cloud]'"
_OWN_KEYS = (
  "endpoint",
  "endpoint_url",
  "region",
  "profile",
  "project",
  "credentials",
  "max_retries",
  "retry_timeout_s",
  "concurrency",
  "chunk_size",
)
_FIX = {
  "s3": (
    "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or "
    "pass storage_options={'access_key_id': ..., 'secret_access_key': ...}"
  ),
  "gs": (
    "set GOOGLE_APPLICATION_CREDENTIALS to a service account key file, run "
    "'gcloud auth application-default login', or pass "
    "storage_options={'credentials': KEY_FILE}"
  ),
  "az": (
    "set AZURE_STORAGE_CONNECTION_STRING, or pass "
    "storage_options={'account_name': ..., 'account_key': ...}"
  ),
}


#: What S3 and Azure answer to credentials they refuse.
_REFUSED = (
  "403 Forbidden",
  "401 Unauthorized",
  "AccessDenied",
  "InvalidAccessKeyId",
  "SignatureDoesNotMatch",
  "AuthenticationFailed",
)


def _import(api: str, scheme: str, module: str) -> Any:
  import importlib

  try:
    return importlib.import_module(module)
  except ImportError as e:
    raise ImportError(
      f"{api}: {scheme}:// URLs need the package {e.name!r}: {_INSTALL}"
    ) from e


def _positive(api: str, opts: dict[str, Any], key: str, default: Any) -> Any:
  v = opts.pop(key, default)
  if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
    raise ValueError(
      f"{api}: storage_options[{key!r}] must be a non-negative number, "
      f"got {v!r}"
    )
  return v


class _Tuning:
  """The options every object store takes (popped from ``opts``)."""

  def __init__(self, api: str, opts: dict[str, Any]) -> None:
    self.max_retries = int(_positive(api, opts, "max_retries", 5))
    self.retry_timeout_s = float(_positive(api, opts, "retry_timeout_s", 60))
    self.concurrency = max(
      1, int(_positive(api, opts, "concurrency", storage.DEFAULT_CONCURRENCY))
    )
    self.chunk_size = max(
      5 * 2**20, int(_positive(api, opts, "chunk_size", storage.CHUNK))
    )


def _endpoint(opts: dict[str, Any], *env: str) -> str | None:
  v = opts.pop("endpoint", None) or opts.pop("endpoint_url", None)
  for name in env:
    v = v or os.environ.get(name) or None
  return v


class ObstoreStorage(Storage):
  """An S3 bucket or Azure container prefix through obstore."""

  def __init__(
    self,
    api: str,
    location: Location,
    store: Any,
    tuning: _Tuning,
    endpoint: str | None,
  ) -> None:
    super().__init__(api, location)
    self._store = store
    self._tuning = tuning
    self._endpoint = endpoint
    self.concurrency = tuning.concurrency
    self._obs = _import(api, location.scheme, "obstore")
    self._exc = _import(api, location.scheme, "obstore.exceptions")

  def _at(self, location: Location) -> ObstoreStorage:
    return ObstoreStorage(
      self.api, location, self._store, self._tuning, self._endpoint
    )

  def _key(self, key: str) -> str:
    storage.check_key(self.api, key)
    p = self.location.prefix
    return f"{p}/{key}" if p else key

  def _error(self, err: Exception, key: str, doing: str) -> OSError:
    t = self._tuning
    return storage.request_error(
      self, self._kind(err), err, key, doing, self._endpoint,
      _FIX[self.location.scheme],
      f"up to {t.max_retries} retries within {t.retry_timeout_s:g} s",
    )  # fmt: skip

  def _kind(self, err: Exception) -> str:
    """What ``err`` is (``storage.request_error``'s kinds)."""
    exc, text = self._exc, str(err)
    if isinstance(err, exc.InvalidPathError):
      kind = "stray"
    elif isinstance(
      err, (exc.NotSupportedError, exc.UnknownConfigurationKeyError)
    ):
      kind = "rejected"
    elif isinstance(
      err, (exc.AlreadyExistsError, exc.PreconditionError, FileExistsError)
    ):
      kind = "exists"
    elif "NoSuchBucket" in text or "ContainerNotFound" in text:
      kind = "bucket"
    elif isinstance(err, (exc.NotFoundError, FileNotFoundError)):
      kind = "missing"
    elif any(m in text for m in _REFUSED) or isinstance(
      err,
      (exc.PermissionDeniedError, exc.UnauthenticatedError, PermissionError),
    ):
      kind = "refused"
    else:
      kind = "failed"
    return kind

  def _call(self, key: str, doing: str, fn: Any, *args: Any, **kw: Any) -> Any:
    try:
      return fn(self._store, *args, **kw)
    except (self._exc.BaseError, OSError) as e:
      raise self._error(e, key, doing) from e

  def list(self, prefix: str = "") -> dict[str, int]:
    root = self._key(prefix) if prefix else self.location.prefix
    start = len(self.location.prefix) + 1 if self.location.prefix else 0
    out = {}
    try:
      for batch in self._obs.list(
        self._store, prefix=root + "/" if root else None
      ):
        for meta in batch:
          key = meta["path"][start:]
          if storage.is_key(key):  # not a folder marker
            out[key] = int(meta["size"])
    except (self._exc.BaseError, OSError) as e:
      raise self._error(e, prefix, "listing") from e
    return dict(sorted(out.items()))

  def children(self) -> builtins.list[str]:
    root = self.location.prefix
    try:
      result = self._obs.list_with_delimiter(
        self._store, root + "/" if root else None
      )
    except (self._exc.BaseError, OSError) as e:
      raise self._error(e, "", "listing") from e
    return storage.names_below(root, result["common_prefixes"])

  def size(self, key: str) -> int:
    return int(
      self._call(key, "reading", self._obs.head, self._key(key))["size"]
    )

  def mtime_ns(self, key: str) -> int:
    meta = self._call(key, "reading", self._obs.head, self._key(key))
    return int(meta["last_modified"].timestamp() * 1e9)

  def read(self, key: str, start: int = 0, end: int | None = None) -> Any:
    if end is not None and end <= start:
      return b""
    try:
      if end is None:
        # To the end in one GET: a HEAD for the size and then a ranged GET
        # would cut an object rewritten in between to the old length.
        options = {"range": {"offset": start}} if start else {}
        return self._obs.get(
          self._store, self._key(key), options=options
        ).bytes()
      return self._obs.get_range(
        self._store, self._key(key), start=start, end=end
      )
    except (self._exc.BaseError, OSError) as e:
      if "range" in str(e).lower() and self.size(key) <= start:
        return b""  # past the end: nothing there, as a file read says
      raise self._error(e, key, "reading") from e

  def stream_into(self, key: str, start: int, *outs: memoryview) -> None:
    into = storage.Into(outs)
    if not into.size:
      return
    end = start + into.size
    try:
      result = self._obs.get(
        self._store, self._key(key), options={"range": (start, end)}
      )
      for part in result.stream(min_chunk_size=2**20):
        into.write(part)
    except (self._exc.BaseError, OSError) as e:
      if "range" in str(e).lower() and self.size(key) <= start:
        raise self.short(key, self.size(key), end) from None
      raise self._error(e, key, "reading") from e
    if into.pos != into.size:
      raise self.short(key, start + into.pos, end)

  def open_stream(self, key: str) -> storage.ByteStream:
    # A GET without a range: the object whole, pulled as it is taken.
    result = self._call(key, "reading", self._obs.get, self._key(key))

    def chunks() -> Iterator[Any]:
      try:
        yield from result.stream(min_chunk_size=STREAM_CHUNK)
      except (self._exc.BaseError, OSError) as e:
        raise self._error(e, key, "reading") from e

    return storage.ByteStream(self, key, chunks())

  def read_ranges(self, key: str, ranges: Any) -> builtins.list[Any]:
    ranges = [(a, b) for a, b in ranges]
    if not ranges or any(b <= a for a, b in ranges):
      return super().read_ranges(key, ranges)
    return self._call(
      key,
      "reading",
      self._obs.get_ranges,
      self._key(key),
      starts=[a for a, _ in ranges],
      ends=[b for _, b in ranges],
    )

  def _put(self, key: str, data: Any, **kw: Any) -> None:
    self._call(
      key,
      "writing",
      self._obs.put,
      self._key(key),
      data,
      chunk_size=self._tuning.chunk_size,
      max_concurrency=self._tuning.concurrency,
      **kw,
    )

  def write(self, key: str, data: Any) -> None:
    self._put(key, memoryview(data).cast("B"))
    LOG.debug("wrote %s", self.where(key))

  def upload(self, key: str, filename: str) -> None:
    # Up to storage.WHOLE bytes in one request; larger files in parts of
    # chunk_size, concurrency at a time, read from the file as they go.
    whole = os.path.getsize(filename) <= storage.WHOLE
    self._put(key, pathlib.Path(filename), use_multipart=not whole)
    LOG.debug("uploaded %s to %s", filename, self.where(key))

  def _stream(self, key: str) -> Any:
    try:
      out = self._obs.open_writer(
        self._store,
        self._key(key),
        buffer_size=self._tuning.chunk_size,
        max_concurrency=self._tuning.concurrency,
      )
    except (self._exc.BaseError, OSError) as e:
      raise self._error(e, key, "writing") from e
    return _Stream(self, key, out)

  def copy(self, src: str, dst: str) -> None:
    # One request on the server (CopyObject) up to its limit of 5 GiB;
    # larger objects are read and streamed back in parts.
    try:
      self._obs.copy(self._store, self._key(src), self._key(dst))
      return
    except (self._exc.BaseError, OSError) as e:
      if self.size(src) <= _COPY_MAX:
        raise self._error(e, dst, "copying to") from e
    out = self.open_write(dst, self.size(src))
    for a, b in storage.chunks(self.size(src)):
      out.write(self.read(src, a, b))
    out.close()

  def create(self, key: str, data: bytes) -> None:
    self._put(key, bytes(data), mode="create", use_multipart=False)
    LOG.debug("created %s", self.where(key))

  def tag_of(self, key: str) -> str | None:
    try:
      return str(self._obs.head(self._store, self._key(key))["e_tag"])
    except (self._exc.NotFoundError, FileNotFoundError):
      return None
    except (self._exc.BaseError, OSError) as e:
      raise self._error(e, key, "reading") from e

  def read_tagged(self, key: str) -> tuple[bytes, str] | None:
    try:
      result = self._obs.get(self._store, self._key(key))
      return bytes(result.bytes()), str(result.meta["e_tag"])
    except (self._exc.NotFoundError, FileNotFoundError):
      return None
    except (self._exc.BaseError, OSError) as e:
      raise self._error(e, key, "reading") from e

  def replace(self, key: str, data: bytes, tag: str) -> None:
    try:
      self._obs.put(
        self._store,
        self._key(key),
        bytes(data),
        mode={"e_tag": tag},
        use_multipart=False,
      )
    except (
      self._exc.PreconditionError,
      self._exc.AlreadyExistsError,
      self._exc.NotFoundError,
      FileNotFoundError,
      FileExistsError,
    ) as e:  # another version now, or none: If-Match failed
      raise storage.request_error(
        self, "changed", e, key, "writing", self._endpoint, "", ""
      ) from e
    except (self._exc.BaseError, OSError) as e:
      raise self._error(e, key, "writing") from e
    LOG.debug("replaced %s", self.where(key))

  def delete(self, keys: Iterable[str]) -> None:
    keys = list(keys)
    paths = [self._key(k) for k in keys]
    if not paths:
      return
    # S3's DeleteObjects is a POST, which the client does not retry after
    # a dropped connection: deleting is idempotent, so it is retried here.
    t = self._tuning
    give_up = time.monotonic() + t.retry_timeout_s
    for attempt in range(t.max_retries + 1):
      try:
        self._obs.delete(self._store, paths)
        return
      except (self._exc.NotFoundError, FileNotFoundError):
        return
      except (self._exc.BaseError, OSError) as e:
        err = self._error(e, keys[0], "deleting")
        if self._kind(e) != "failed" or attempt == t.max_retries:
          raise err from e
        pause = min(5.0, 0.1 * 2**attempt) * (0.5 + random.random() / 2)
        if time.monotonic() + pause > give_up:
          raise err from e
        LOG.debug("%s; retrying", err)
        time.sleep(pause)


#: The largest object S3's CopyObject copies in one request.
_COPY_MAX = 5 * 2**30


class _Stream:
  """obstore's multipart writer, its errors as ``ObstoreStorage``'s."""

  def __init__(self, st: ObstoreStorage, key: str, out: Any) -> None:
    self.st, self.key, self.out = st, key, out

  def write(self, b: Any) -> None:
    try:
      self.out.write(b)
    except (self.st._exc.BaseError, OSError) as e:
      raise self.st._error(e, self.key, "writing") from e

  def close(self) -> None:
    try:
      self.out.close()
    except (self.st._exc.BaseError, OSError) as e:
      raise self.st._error(e, self.key, "writing") from e


def _retry_config(t: _Tuning) -> dict[str, Any]:
  return {
    "max_retries": t.max_retries,
    "retry_timeout": datetime.timedelta(seconds=t.retry_timeout_s),
    "backoff": {
      "init_backoff": datetime.timedelta(milliseconds=100),
      "max_backoff": datetime.timedelta(seconds=5),
      "base": 2,
    },
  }


def _s3(api: str, location: Location, opts: dict[str, Any]) -> Storage:
  stores = _import(api, "s3", "obstore.store")
  tuning = _Tuning(api, opts)
  endpoint = _endpoint(opts, "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
  region = (
    opts.pop("region", None)
    or os.environ.get("AWS_REGION")
    or os.environ.get("AWS_DEFAULT_REGION")
  )
  profile = opts.pop("profile", None) or os.environ.get("AWS_PROFILE")
  config: dict[str, Any] = dict(opts)
  for k in _OWN_KEYS:
    config.pop(k, None)
  if endpoint:
    config["endpoint"] = endpoint
  keys_given = "access_key_id" in config or (
    os.environ.get("AWS_ACCESS_KEY_ID") and not profile
  )
  provider = None
  if not keys_given and not config.get("skip_signature"):
    provider, region = _boto3_credentials(profile, region)
  if region:
    config["region"] = region
  client = {"allow_http": bool(endpoint and endpoint.startswith("http://"))}
  try:
    store = stores.S3Store(
      location.bucket,
      config=config,
      client_options=client,
      retry_config=_retry_config(tuning),
      credential_provider=provider,
    )
  except Exception as e:  # obstore's configuration errors
    raise ValueError(
      f"{api}: cannot configure S3 for {location.url!r}: {e}; see "
      "storage_options and the AWS_* environment variables"
    ) from e
  return ObstoreStorage(api, location, store, tuning, endpoint)


def _boto3_credentials(
  profile: str | None, region: str | None
) -> tuple[Any, str | None]:
  """boto3's credential chain (profiles, config files, SSO), if installed."""
  try:
    import boto3
    from obstore.auth.boto3 import Boto3CredentialProvider
  except ImportError:
    return None, region
  session = boto3.Session(profile_name=profile)
  if session.get_credentials() is None:
    return None, region
  return Boto3CredentialProvider(session), region or session.region_name


def _connection_string(text: str) -> dict[str, Any]:
  parts = dict(
    p.split("=", 1) for p in text.split(";") if "=" in p and p.strip()
  )
  config: dict[str, Any] = {}
  if parts.get("UseDevelopmentStorage", "").lower() == "true":
    config["use_emulator"] = True
  names = {
    "AccountName": "account_name",
    "AccountKey": "account_key",
    "SharedAccessSignature": "sas_key",
    "BlobEndpoint": "endpoint",
  }
  for k, v in parts.items():
    if k in names:
      config[names[k]] = v
  return config


def _azure(api: str, location: Location, opts: dict[str, Any]) -> Storage:
  stores = _import(api, "az", "obstore.store")
  tuning = _Tuning(api, opts)
  config = _connection_string(
    os.environ.get("AZURE_STORAGE_CONNECTION_STRING", "")
  )
  endpoint = _endpoint(opts) or config.get("endpoint")
  config.update((k, v) for k, v in opts.items() if k not in _OWN_KEYS)
  if endpoint:
    config["endpoint"] = endpoint
  client = {"allow_http": bool(endpoint and endpoint.startswith("http://"))}
  try:
    store = stores.AzureStore(
      location.bucket,
      config=config,
      client_options=client,
      retry_config=_retry_config(tuning),
    )
  except Exception as e:
    raise ValueError(
      f"{api}: cannot configure Azure for {location.url!r}: {e}; {_FIX['az']}"
    ) from e
  return ObstoreStorage(api, location, store, tuning, endpoint)


def open_storage(
  api: str, path: Any, storage_options: dict[str, Any] | None = None
) -> Storage:
  """The ``Storage`` of ``path``: a local path, or an object-store URL.

  Args:
    api: the API name for messages.
    path: a local path, or an ``s3://``, ``gs://`` or ``az://`` URL (a
      ``file://`` URL is refused, naming the local path to use).
    storage_options: for a URL, settings over the cloud's standard
      environment (see the module docstring); none for a local path.

  Raises:
    ImportError: a URL's client library is not installed (the message says
      what to install).
    ValueError: a bad path, URL or option.
  """
  location = storage.parse(api, path)
  opts = dict(storage_options or {})
  if not location.remote:
    if opts:
      raise ValueError(
        f"{api}: storage_options {sorted(opts)} are for s3://, gs:// and "
        f"az:// URLs; {location.url!r} is a local path"
      )
    return storage.LocalStorage(api, location)
  if location.scheme == "s3":
    return _s3(api, location, opts)
  if location.scheme == "az":
    return _azure(api, location, opts)
  from . import gcs

  tuning = _Tuning(api, opts)
  return gcs.open_gcs(api, location, opts, tuning, _FIX["gs"])
