"""Builds the API reference into a zip (the //docs:api_reference genrule).

    build_docs.py --out api_reference.zip

Runs ``python -m sphinx -W -q -b html`` over this directory, as a user does
from a venv with the wheels and requirements.txt (index.rst), with the
packages this program can import; the HTML is zipped, ``index.html`` at its
top. The exit status is Sphinx's: non-zero on any warning.
"""

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile

DOCS = os.path.dirname(os.path.abspath(__file__))


def build(builder: str, out: str, srcdir: str = DOCS) -> int:
  """``python -m sphinx -W -q -b builder srcdir out``: its exit status.

  In a new process (each build sets the public objects' ``__module__``),
  on the CPU backend, with this process's ``sys.path``.
  """
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
  args = ["-W", "-q", "-b", builder, "-d", os.path.join(out, ".doctrees")]
  command = [sys.executable, "-m", "sphinx", *args, srcdir, out]
  return subprocess.run(command, env=env, check=False).returncode


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="the zip to write")
  out = parser.parse_args().out
  with tempfile.TemporaryDirectory(prefix="jaxworks_docs_") as html:
    status = build("html", html)
    if status:
      return status
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
      for root, dirs, files in os.walk(html):
        dirs[:] = sorted(d for d in dirs if d != ".doctrees")
        for name in sorted(files):
          path = os.path.join(root, name)
          # A fixed date: the same sources give the same zip.
          info = zipfile.ZipInfo(
            os.path.relpath(path, html), (1980, 1, 1, 0, 0, 0)
          )
          info.compress_type = zipfile.ZIP_DEFLATED
          with open(path, "rb") as f:
            zf.writestr(info, f.read())
  return 0


if __name__ == "__main__":
  sys.exit(main())
