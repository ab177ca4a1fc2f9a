"""Real object-store servers on 127.0.0.1 for the tests, started in-process.

``s3_server()``: moto's ``ThreadedMotoServer`` (S3's REST API, signatures,
multipart uploads and ``If-None-Match`` puts); ``gcs_server()``:
gcp-storage-emulator (GCS's JSON API and resumable uploads; it ignores
``ifGenerationMatch``); ``azure_server()``: Azurite, Microsoft's Azure
Storage emulator (npm package ``azurite``, a node process; containers are
created with the Azure SDK for JavaScript, ``@azure/storage-blob``, which
.ci/run installs beside it). ``failing_server(status)``: an HTTP server that
answers every request with ``status`` and counts them (throttling and 5xx
answers). Every server listens on 127.0.0.1 on a free port, runs in daemon
threads of the test process and stops when its ``with`` block ends (or the
process does); ``s3_server_process()`` runs moto in a child process, for
benchmarks. The client libraries are the real ones, never a mock.
"""

from __future__ import annotations

from collections.abc import Iterator
import contextlib
import http.server
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
import uuid

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


_S3_CHILD = """
import logging, sys
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # until the parent closes it (or exits)
server.stop()
"""


@contextlib.contextmanager
def s3_server_process(no_auth_actions: int | None = None) -> Iterator[str]:
  """moto's S3 server in a process of its own (as a real server is, it
  does not share the client's interpreter lock); yields its endpoint.

  ``no_auth_actions``: moto checks every request's credentials against its
  IAM users (signature, known access key, policy) after the first this
  many (moto's INITIAL_NO_AUTH_ACTION_COUNT); None: it accepts any.
  """
  import sys

  env = dict(os.environ)
  if no_auth_actions is not None:
    env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(no_auth_actions)
  proc = subprocess.Popen(
    [sys.executable, "-c", _S3_CHILD],
    stdin=subprocess.PIPE,
    stdout=subprocess.PIPE,
    text=True,
    env=env,
  )
  try:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.strip().isdigit():
      raise RuntimeError(f"moto's S3 server did not start: {line!r}")
    yield f"http://127.0.0.1:{int(line)}"
  finally:
    proc.kill()
    proc.wait()


def s3_user(endpoint: str, bucket: str) -> dict[str, str]:
  """On a server of ``s3_server_process(no_auth_actions=4)``: an IAM user
  allowed everything and its access key (the 3 unauthenticated actions
  then left make it), and ``bucket`` created with that key; the key as
  ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY``."""
  import json

  import boto3

  iam = boto3.client(
    "iam",
    endpoint_url=endpoint,
    aws_access_key_id="nobody",
    aws_secret_access_key="nothing",
    region_name="us-east-1",
  )
  iam.create_user(UserName="saver")
  policy = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
  }
  iam.put_user_policy(
    UserName="saver", PolicyName="all", PolicyDocument=json.dumps(policy)
  )
  key = iam.create_access_key(UserName="saver")["AccessKey"]
  env = {
    "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
    "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"],
  }
  boto3.client(
    "s3",
    endpoint_url=endpoint,
    region_name="us-east-1",
    aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
    aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
  ).create_bucket(Bucket=bucket)
  return env


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


#: Azurite's well-known development account and key (public, in its docs).
AZURE_ACCOUNT = "devstoreaccount1"
AZURE_KEY = (
  "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
  "KBHBeksoGMGw=="
)
#: What .ci/run installs (npm): the emulator and the SDK that makes containers.
AZURE_NPM = "azurite@3.37.0 @azure/storage-blob@12.34.0"
_AZURE_INSTALL = f"npm install -g {AZURE_NPM} (as .ci/run does)"


def _node_module(name: str) -> str:
  """The directory of the globally installed npm package ``name``."""
  root = subprocess.run(
    ["npm", "root", "-g"], capture_output=True, text=True, check=True
  ).stdout.strip()
  path = os.path.join(root, *name.split("/"))
  if not os.path.isdir(path):
    raise RuntimeError(
      f"the npm package {name} is not installed: {_AZURE_INSTALL}"
    )
  return path


@contextlib.contextmanager
def azure_server() -> Iterator[str]:
  """Azurite's blob service in memory on 127.0.0.1; yields the connection
  string of its development account (``AZURE_STORAGE_CONNECTION_STRING``)."""
  exe = shutil.which("azurite-blob")
  if exe is None:
    raise RuntimeError(f"azurite-blob is not on PATH: {_AZURE_INSTALL}")
  port = free_port()
  with tempfile.TemporaryDirectory() as workspace:
    proc = subprocess.Popen(
      [
        exe, "--blobHost", "127.0.0.1", "--blobPort", str(port),
        "--inMemoryPersistence", "--disableTelemetry", "--silent",
        # the SDK may speak a newer API version than this Azurite knows
        "--skipApiVersionCheck",
      ],
      cwd=workspace,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )  # fmt: skip
    try:
      deadline = time.monotonic() + 60
      while True:
        with (
          contextlib.suppress(OSError),
          socket.create_connection(("127.0.0.1", port), timeout=1),
        ):
          break
        if proc.poll() is not None or time.monotonic() > deadline:
          proc.kill()
          raise RuntimeError(
            f"Azurite did not start on port {port}: "
            f"{proc.communicate()[0][-2000:]}"
          )
        time.sleep(0.1)
      yield (
        f"DefaultEndpointsProtocol=http;AccountName={AZURE_ACCOUNT};"
        f"AccountKey={AZURE_KEY};"
        f"BlobEndpoint=http://127.0.0.1:{port}/{AZURE_ACCOUNT};"
      )
    finally:
      proc.terminate()
      try:
        proc.wait(10)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


_CREATE_CONTAINER = """
const {BlobServiceClient} = require(process.argv[1]);
BlobServiceClient.fromConnectionString(process.argv[2])
  .createContainer(process.argv[3])
  .then(() => process.exit(0), (e) => { console.error(e.message); process.exit(1); });
"""


def azure_container(connection_string: str, name: str) -> None:
  """Creates the container ``name`` (with the Azure SDK for JavaScript:
  obstore, like the service's data plane, cannot create containers)."""
  out = subprocess.run(
    [
      "node", "-e", _CREATE_CONTAINER,
      _node_module("@azure/storage-blob"), connection_string, name,
    ],
    capture_output=True, text=True, timeout=60,
  )  # fmt: skip
  if out.returncode:
    raise RuntimeError(
      f"creating the container {name!r} on Azurite failed: {out.stderr[-2000:]}"
    )


#: A checkpoint's head in a bucket, and the prefix of its versions.
HEAD = "jaxworks_head.json"
VERSIONS = ".jaxworks-v"


def version_of(st):
  """The storage (``storage.Storage``) of the version that the head of the
  checkpoint at ``st`` names: where its objects are, named as on disk."""
  head = json.loads(bytes(st.read(HEAD)))
  return st.child(f"{VERSIONS}/{head['save']}")


def to_legacy(st):
  """Rewrites the checkpoint at ``st`` as 0.6.x wrote it: the objects of
  its version at the path itself, no head."""
  ver = version_of(st)
  for key in ver.list():
    st.write(key, ver.read(key))
  st.delete([HEAD])
  ver.delete_prefix()


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


class Proxy:
  """A TCP proxy on 127.0.0.1 in front of a server: ``endpoint`` is its
  address; ``stop()`` closes its port and every connection through it at
  once (what a client sees of a server killed mid-request), ``start()``
  opens the same port again (the server back, with its objects)."""

  def __init__(self, target: str) -> None:
    host, _, port = target.rpartition("//")[2].partition(":")
    self._target = (host, int(port))
    self.port = free_port()
    self.endpoint = f"http://127.0.0.1:{self.port}"
    self._lock = threading.Lock()
    self._open: list[socket.socket] = []
    self._listener: socket.socket | None = None
    #: Answers to drop: the next ``lose`` answers of the server are not
    #: passed on, their connections closed (the request was applied).
    self.lose = 0
    self.start()

  def start(self) -> None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", self.port))
    s.listen(64)
    self._listener = s
    threading.Thread(target=self._accept, args=(s,), daemon=True).start()

  def stop(self) -> None:
    with self._lock:
      listener, self._listener = self._listener, None
      conns, self._open = self._open, []
    for c in [listener, *conns]:
      if c is not None:
        with contextlib.suppress(OSError):
          c.shutdown(socket.SHUT_RDWR)
        c.close()

  def _accept(self, listener: socket.socket) -> None:
    while True:
      try:
        client, _ = listener.accept()
      except OSError:
        return
      try:
        server = socket.create_connection(self._target)
      except OSError:
        client.close()
        continue
      with self._lock:
        if self._listener is not listener:
          client.close()
          server.close()
          return
        self._open += [client, server]
      for a, b in ((client, server), (server, client)):
        threading.Thread(
          target=self._pump, args=(a, b, a is server), daemon=True
        ).start()

  def _pump(self, a: socket.socket, b: socket.socket, answers: bool) -> None:
    try:
      while data := a.recv(1 << 16):
        if answers:
          with self._lock:
            drop = self.lose > 0
            self.lose -= drop
          if drop:  # applied, and its answer lost: the connection cut
            for c in (a, b):
              with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            return
        b.sendall(data)
    except OSError:
      pass
    finally:
      with contextlib.suppress(OSError):
        b.shutdown(socket.SHUT_WR)


# The module-scoped fixtures of the tests that use these servers (a test
# module makes them its own by assigning them to its names).
@pytest.fixture(scope="module")
def s3_endpoint():
  """A moto S3 server on 127.0.0.1 with a bucket "ckpt"; its endpoint."""
  with s3_server() as endpoint:
    s3_bucket(endpoint, "ckpt")
    yield endpoint


@pytest.fixture(scope="module")
def azure_connection():
  """Azurite on 127.0.0.1 with a container "ckpt"; its connection string."""
  with azure_server() as connection_string:
    azure_container(connection_string, "ckpt")
    yield connection_string


@pytest.fixture(scope="module")
def gcs_endpoint():
  """A gcp-storage-emulator on 127.0.0.1 with a bucket "ckpt"; its endpoint."""
  with gcs_server() as endpoint:
    gcs_bucket(endpoint, "ckpt")
    yield endpoint


@pytest.fixture(params=["s3", "gs"], name="url")
def bucket_url(request, monkeypatch):
  """A new checkpoint URL (``s3://`` on moto, ``gs://`` on the GCS
  emulator: a test using it runs on both), its client configured by the
  environment as users configure it."""
  if request.param == "s3":
    for k, v in S3_ENV.items():
      monkeypatch.setenv(k, v)
    monkeypatch.setenv(
      "AWS_ENDPOINT_URL", request.getfixturevalue("s3_endpoint")
    )
  else:
    endpoint = request.getfixturevalue("gcs_endpoint")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
  return f"{request.param}://ckpt/run-{uuid.uuid4().hex}/ckpt"
