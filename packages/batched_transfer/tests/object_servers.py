"""Real object-store servers on 127.0.0.1 for the tests, started in-process.

``s3_server()``: moto's ``ThreadedMotoServer`` (S3's REST API, signatures,
multipart uploads and ``If-None-Match`` puts); ``gcs_server()``:
gcp-storage-emulator (GCS's JSON API and resumable uploads; it ignores
``ifGenerationMatch``). ``failing_server(status)``: an HTTP server that
answers every request with ``status`` and counts them (throttling and 5xx
answers). Every server listens on 127.0.0.1 on a free port, runs in daemon
threads of the test process and stops when its ``with`` block ends (or the
process does). The client libraries are the real ones, never a mock.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import http.server
import logging
import socket
import threading

import pytest

S3_ENV = {
  "AWS_ACCESS_KEY_ID": "testing",
  "AWS_SECRET_ACCESS_KEY": "testing",
  "AWS_REGION": "us-east-1",
}


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
  """moto's S3 server; yields its endpoint, ``http://127.0.0.1:PORT``."""
  from moto.server import ThreadedMotoServer

  logging.getLogger("werkzeug").setLevel(logging.ERROR)
  server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
  server.start()
  host, port = server.get_host_and_port()
  try:
    yield f"http://{host}:{port}"
  finally:
    server.stop()


def s3_bucket(endpoint: str, name: str) -> None:
  """Creates the bucket ``name`` on the S3 server at ``endpoint``."""
  import boto3

  client = boto3.client(
    "s3",
    endpoint_url=endpoint,
    aws_access_key_id="testing",
    aws_secret_access_key="testing",
    region_name="us-east-1",
  )
  client.create_bucket(Bucket=name)


@contextlib.contextmanager
def gcs_server() -> Iterator[str]:
  """gcp-storage-emulator in memory; yields ``http://127.0.0.1:PORT``."""
  from gcp_storage_emulator.server import create_server

  logging.getLogger("gcp_storage_emulator").setLevel(logging.ERROR)
  port = free_port()
  server = create_server("127.0.0.1", port, in_memory=True)
  server.start()
  try:
    yield f"http://127.0.0.1:{port}"
  finally:
    server.stop()


def gcs_bucket(endpoint: str, name: str) -> None:
  """Creates the bucket ``name`` on the GCS emulator at ``endpoint``."""
  from google.auth.credentials import AnonymousCredentials
  from google.cloud import storage

  client = storage.Client(
    project="test",
    credentials=AnonymousCredentials(),
    client_options={"api_endpoint": endpoint},
  )
  client.create_bucket(name)


class _Failing(http.server.BaseHTTPRequestHandler):
  status = 503
  count = 0
  lock = threading.Lock()

  def _answer(self) -> None:
    with self.lock:
      type(self).count += 1
    length = int(self.headers.get("Content-Length") or 0)
    if length:
      self.rfile.read(length)
    code = b"AccessDenied" if self.status == 403 else b"SlowDown"
    body = b"<Error><Code>" + code + b"</Code><Message>no</Message></Error>"
    self.send_response(self.status)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    if self.command != "HEAD":
      self.wfile.write(body)

  do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer

  def log_message(self, *args: object) -> None:
    pass


@contextlib.contextmanager
def failing_server(status: int = 503) -> Iterator[tuple[str, type]]:
  """A server answering ``status`` to everything; yields (endpoint, counter).

  ``counter.count`` is the number of requests it answered.
  """
  handler = type("Handler", (_Failing,), {"status": status, "count": 0})
  server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
  server.daemon_threads = True
  thread = threading.Thread(target=server.serve_forever, daemon=True)
  thread.start()
  try:
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
  finally:
    server.shutdown()
    server.server_close()


# The module-scoped fixtures of the tests that use these servers (a test
# module makes them its own by assigning them to its names).
@pytest.fixture(scope="module")
def s3_endpoint():
  """A moto S3 server on 127.0.0.1 with a bucket "ckpt"; its endpoint."""
  with s3_server() as endpoint:
    s3_bucket(endpoint, "ckpt")
    yield endpoint


@pytest.fixture(scope="module")
def gcs_endpoint():
  """A gcp-storage-emulator on 127.0.0.1 with a bucket "ckpt"; its endpoint."""
  with gcs_server() as endpoint:
    gcs_bucket(endpoint, "ckpt")
    yield endpoint
