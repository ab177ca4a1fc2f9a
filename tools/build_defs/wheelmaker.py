"""Writes a reproducible wheel: fixed timestamps, sorted entries, RECORD with sha256.

Called by the jaxworks_wheel rule (tools/build_defs/wheel.bzl); not meant to be run by hand.

A wheel with a compiled extension gets the manylinux platform tag that
``auditwheel`` (from the lock) finds its shared objects consistent with, the tag
an index accepts; a wheel without one is ``py3-none-any``. Every
``jaxworks/<pkg>/`` directory gets a ``py.typed`` marker (PEP 561).
"""

import argparse
import ast
import base64
import hashlib
import os
import pathlib
import posixpath
import re
import sys
import tarfile
import tempfile
import tomllib
import zipfile

_EPOCH = (1980, 1, 1, 0, 0, 0)
_VERSION_RE = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.M)
_CLASSIFIERS = [
  "Development Status :: 4 - Beta",
  "Intended Audience :: Developers",
  "Intended Audience :: Science/Research",
  "Operating System :: POSIX :: Linux",
  "Programming Language :: Python :: 3",
  "Programming Language :: Python :: 3.11",
  "Programming Language :: Python :: 3.12",
  "Programming Language :: Python :: 3.13",
  "Topic :: Scientific/Engineering :: Artificial Intelligence",
  "Typing :: Typed",
]


def read_version(path):
  with open(path, encoding="utf-8") as f:
    match = _VERSION_RE.search(f.read())
  if not match:
    sys.exit(f'wheelmaker: no `__version__ = "X.Y.Z"` line in {path}')
  return match.group(1)


def read_deps(path):
  """``SUPPORTED_JAX`` and ``MINIMUM_VERSIONS`` of a package's _src/deps.py.

  The one declaration both the import-time check and the wheel's
  Requires-Dist are made from.
  """
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  found = {}
  for node in tree.body:
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      for t in targets:
        if isinstance(t, ast.Name) and t.id in (
          "SUPPORTED_JAX",
          "MINIMUM_VERSIONS",
        ):
          found[t.id] = ast.literal_eval(node.value)
  if set(found) != {"SUPPORTED_JAX", "MINIMUM_VERSIONS"}:
    sys.exit(
      f"wheelmaker: {path} must declare SUPPORTED_JAX (a string) and "
      "MINIMUM_VERSIONS (a dict literal, module name -> version)"
    )
  return found["SUPPORTED_JAX"], found["MINIMUM_VERSIONS"]


_SKIP = re.compile(r"<!-- not-on-pypi -->.*?<!-- /not-on-pypi -->\n?", re.S)
_COMMENT = re.compile(r"<!--.*?-->\n?", re.S)
_LINK = re.compile(r"(\]\()([^)\s]+)(\))")
# A benchmark's repository command, as the figures name it: only its name.
_BENCH_RUN = re.compile(r"`(?:\./tools/)?bazel\s+run\s+//packages/\w+:(\w+)`")


def long_description(text, base_url, readme_dir):
  """The README as an index shows it: no Bazel, absolute links.

  Blocks between ``<!-- not-on-pypi -->`` and ``<!-- /not-on-pypi -->`` (the
  repository's own build commands) and HTML comments are left out, a
  benchmark's command `bazel run //packages/P:NAME` becomes `NAME`; a relative
  link ``](path)`` becomes ``](<base_url>/blob/main/<readme_dir>/path)``.
  Fails if the result still mentions Bazel.
  """
  text = _COMMENT.sub("", _SKIP.sub("", text))
  text = _BENCH_RUN.sub(r"`\1`", text)

  def absolute(m):
    target = m.group(2)
    if re.match(r"^[a-z][a-z0-9+.-]*:|^#", target):
      return m.group(0)
    path = posixpath.normpath(posixpath.join(readme_dir, target))
    if path.startswith("../"):
      sys.exit(f"wheelmaker: link {target!r} leaves the repository")
    return f"{m.group(1)}{base_url}/blob/main/{path}{m.group(3)}"

  text = _LINK.sub(absolute, text)
  text = re.sub(r"\n{3,}", "\n\n", text)
  for n, line in enumerate(text.splitlines(), 1):
    if "bazel" in line.lower():
      sys.exit(
        f"wheelmaker: the long description mentions Bazel (line {n} after "
        f"filtering: {line.strip()!r}); put that part of the README between "
        "<!-- not-on-pypi --> and <!-- /not-on-pypi -->"
      )
  return text


def _record_hash(data):
  digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest())
  return "sha256=" + digest.rstrip(b"=").decode()


def _write(zf, name, data, executable=False):
  info = zipfile.ZipInfo(name, date_time=_EPOCH)
  info.compress_type = zipfile.ZIP_DEFLATED
  info.external_attr = (0o755 if executable else 0o644) << 16
  zf.writestr(info, data)


def _zip(out, files, dist_info, metadata, wheel, entry_points):
  """files: sorted (path in wheel, bytes)."""
  record = []
  with zipfile.ZipFile(out, "w") as zf:
    for dst, data in files:
      _write(zf, dst, data, executable=dst.endswith(".so"))
      record.append(f"{dst},{_record_hash(data)},{len(data)}")
    extra = [("METADATA", metadata), ("WHEEL", wheel)]
    if entry_points:
      extra.append(("entry_points.txt", entry_points))
    for name, text in extra:
      data = text.encode()
      _write(zf, f"{dist_info}/{name}", data)
      record.append(f"{dist_info}/{name},{_record_hash(data)},{len(data)}")
    record.append(f"{dist_info}/RECORD,,")
    _write(zf, f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode())


def package_summary(files):
  """The first line of the package's ``__init__`` docstring, or None."""
  for dst, data in files:
    if re.fullmatch(r"jaxworks/[A-Za-z0-9_]+/__init__\.py", dst):
      doc = ast.get_docstring(ast.parse(data.decode("utf-8")))
      if doc:
        return doc.strip().splitlines()[0]
  return None


def manylinux_tag(wheel_path):
  """The platform tag auditwheel verifies for a linux wheel's extensions."""
  from auditwheel.architecture import Architecture
  from auditwheel.libc import Libc
  from auditwheel.wheel_abi import analyze_wheel_abi

  info = analyze_wheel_abi(
    Libc.GLIBC,
    Architecture.x86_64,
    pathlib.Path(wheel_path),
    frozenset(),
    disable_isa_ext_check=False,
    allow_graft=False,
  )
  policy = info.overall_policy.name
  if not policy.startswith("manylinux_"):
    sys.exit(
      f"wheelmaker: auditwheel finds {wheel_path} consistent with no "
      f"manylinux policy (got {policy!r}); its extensions link "
      "libraries outside the manylinux set"
    )
  return policy


def extras(items):
  """``{extra: sorted requirements}`` of ``--extra-requires`` items."""
  out = {}
  for item in items:
    name, _, req = item.partition("=")
    out.setdefault(name, []).append(req)
  return {k: sorted(v) for k, v in sorted(out.items())}


def check_pyproject(path, distribution, summary, requires, extra=None):
  """Fails unless the checked-in pyproject.toml says what the wheel says."""
  with open(path, "rb") as f:
    project = tomllib.load(f)["project"]
  want = {
    "name": distribution,
    "description": summary,
    "dependencies": sorted(requires),
    "optional-dependencies": extra or {},
  }
  optional = project.get("optional-dependencies", {})
  got = {
    "name": project.get("name"),
    "description": project.get("description"),
    "dependencies": sorted(project.get("dependencies", [])),
    "optional-dependencies": {
      k: sorted(v) for k, v in sorted(optional.items())
    },
  }
  for key, value in want.items():
    if got[key] != value:
      sys.exit(
        f"wheelmaker: {path}: [project] {key} is {got[key]!r}, but the "
        f"wheel has {value!r}; make them agree"
      )


def write_sdist(out, base, members):
  """A reproducible .tar.gz: ``base/`` + sorted members, fixed mtime/owner."""
  import gzip
  import io

  raw = io.BytesIO()
  with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tf:
    for name, data in members:
      info = tarfile.TarInfo(f"{base}/{name}")
      info.size = len(data)
      info.mtime = 315532800  # 1980-01-01, as the wheels
      info.mode = 0o644
      info.uname = info.gname = ""
      tf.addfile(info, io.BytesIO(data))
  with open(out, "wb") as f:
    with gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as gz:
      gz.write(raw.getvalue())


def _entry_points(items):
  """'group:name=module:attr' items -> entry_points.txt text."""
  groups = {}
  for item in items:
    group, _, spec = item.partition(":")
    groups.setdefault(group, []).append(spec.replace("=", " = ", 1))
  return "".join(
    f"[{g}]\n" + "".join(f"{s}\n" for s in sorted(v)) + "\n"
    for g, v in sorted(groups.items())
  )


def _parser():
  p = argparse.ArgumentParser(description=__doc__)
  p.add_argument("--distribution", required=True)
  p.add_argument("--version")
  p.add_argument("--version-file")
  p.add_argument("--summary", default="")
  p.add_argument("--python-tag", default="cp311", help="of a wheel with a .so")
  p.add_argument("--readme", help="Markdown long description")
  p.add_argument("--base-url", default="", help="where relative links point")
  p.add_argument("--readme-dir", default="", help="the README's directory")
  p.add_argument("--deps-file", help="the package's _src/deps.py")
  p.add_argument("--license-file", required=True)
  p.add_argument("--requires", action="append", default=[])
  p.add_argument(
    "--extra-requires",
    action="append",
    default=[],
    help="EXTRA=REQUIREMENT: a requirement of an optional extra",
  )
  p.add_argument(
    "--requires-dist-from",
    action="append",
    default=[],
    help="DIST=VERSION_FILE: requires DIST>=its version",
  )
  p.add_argument(
    "--pins-from",
    action="append",
    default=[],
    help="DIST=VERSION_FILE: requires DIST==its version",
  )
  p.add_argument(
    "--entry-point", action="append", default=[], help="GROUP:NAME=MODULE:ATTR"
  )
  p.add_argument(
    "--project-url", action="append", default=[], help="'LABEL, URL'"
  )
  p.add_argument("--files", required=True, help="lines: SOURCE<TAB>PATH")
  p.add_argument("--out-dir", required=True)
  p.add_argument(
    "--sdist",
    action="store_true",
    help="write the sdist (the --files sources, pyproject.toml, setup.py)",
  )
  p.add_argument("--pyproject", help="the sdist's pyproject.toml")
  p.add_argument("--setup-py", help="the sdist's setup.py (extensions)")
  return p


def _requirements(a):
  """The Requires-Dist lines: --requires, widened by the deps file's jax range, and the jaxworks releases."""
  requires = list(a.requires)
  if a.deps_file:
    supported_jax, minimums = read_deps(a.deps_file)
    # jax and jaxlib: the range the import check accepts.
    requires = [
      r + supported_jax if r in ("jax", "jaxlib") else r for r in requires
    ]
    declared = {
      m.replace(".", "-").replace("_", "-"): v for m, v in minimums.items()
    }
    built = {item.split("=", 1)[0] for item in a.requires_dist_from}
    if set(declared) != built:
      sys.exit(
        f"wheelmaker: {a.deps_file} declares {sorted(declared)} but the "
        f"BUILD deps are {sorted(built)}; make them agree"
      )
    for dist in sorted(declared):
      requires.append(f"{dist}>={declared[dist]}")
  else:
    for item in a.requires_dist_from:
      dist, vfile = item.split("=", 1)
      requires.append(f"{dist}>={read_version(vfile)}")
  for item in a.pins_from:
    dist, vfile = item.split("=", 1)
    requires.append(f"{dist}=={read_version(vfile)}")
  return requires


def _read_files(listing):
  """``(path in the archive, bytes)`` of the listed files, sorted, with a ``py.typed`` per package."""
  files = {}
  with open(listing, encoding="utf-8") as f:
    for line in f:
      if line.strip():
        src, dst = line.rstrip("\n").split("\t")
        with open(src, "rb") as g:
          files[dst] = g.read()
  for dst in list(files):
    parts = dst.split("/")
    if len(parts) > 2 and parts[0] == "jaxworks":
      files.setdefault(f"jaxworks/{parts[1]}/py.typed", b"")
  return sorted(files.items())


def main(argv=None):
  a = _parser().parse_args(argv)
  version = a.version or read_version(a.version_file)
  requires = _requirements(a)
  files = _read_files(a.files)
  dist_name = re.sub(r"[-_.]+", "_", a.distribution).lower()
  dist_info = f"{dist_name}-{version}.dist-info"
  with open(a.license_file, "rb") as f:
    license_data = f.read()
  files.append((f"{dist_info}/licenses/LICENSE", license_data))
  summary = package_summary(files) or a.summary
  metadata = [
    "Metadata-Version: 2.4",
    f"Name: {a.distribution}",
    f"Version: {version}",
    f"Summary: {summary}",
    "License-Expression: Apache-2.0",
    "License-File: LICENSE",
    "Requires-Python: >=3.11",
  ] + [f"Classifier: {c}" for c in _CLASSIFIERS]
  metadata += [f"Project-URL: {u}" for u in a.project_url]
  metadata += [f"Requires-Dist: {r}" for r in requires]
  for name, reqs in extras(a.extra_requires).items():
    metadata.append(f"Provides-Extra: {name}")
    metadata += [f'Requires-Dist: {r}; extra == "{name}"' for r in reqs]
  description = ""
  if a.readme:
    metadata.append("Description-Content-Type: text/markdown")
    with open(a.readme, encoding="utf-8") as f:
      description = long_description(f.read(), a.base_url, a.readme_dir)
  metadata_text = "\n".join(metadata) + "\n\n" + description
  entry_points = _entry_points(a.entry_point)

  if a.sdist:
    check_pyproject(
      a.pyproject, a.distribution, summary, requires, extras(a.extra_requires)
    )
    _sdist(a, f"{dist_name}-{version}", files, metadata_text, description)
  else:
    _wheel(
      a, f"{dist_name}-{version}", files, dist_info, metadata_text, entry_points
    )


def _sdist(a, base, files, metadata_text, description):
  """Writes ``<base>.tar.gz``: the sources (no .so), PKG-INFO, README.md, pyproject.toml and setup.py."""
  extra = [
    ("PKG-INFO", metadata_text.encode()),
    ("README.md", description.encode()),
  ]
  with open(a.pyproject, "rb") as f:
    extra.append(("pyproject.toml", f.read()))
  if a.setup_py:
    with open(a.setup_py, "rb") as f:
      extra.append(("setup.py", f.read()))
  os.makedirs(a.out_dir, exist_ok=True)
  members = [(d, data) for d, data in files if not d.endswith(".so")]
  members = [
    ("LICENSE", data) if d.endswith("/licenses/LICENSE") else (d, data)
    for d, data in members
  ]
  write_sdist(
    os.path.join(a.out_dir, base + ".tar.gz"), base, sorted(members + extra)
  )


def _wheel(a, base, files, dist_info, metadata_text, entry_points):
  """Writes the wheel, tagged manylinux by what its extension needs, or py3-none-any without one."""
  has_extension = any(dst.endswith(".so") for dst, _ in files)

  def wheel_text(tag):
    return (
      "\n".join(
        [
          "Wheel-Version: 1.0",
          "Generator: jaxworks-wheelmaker",
          f"Root-Is-Purelib: {'false' if has_extension else 'true'}",
          f"Tag: {tag}",
        ]
      )
      + "\n"
    )

  os.makedirs(a.out_dir, exist_ok=True)
  if has_extension:
    with tempfile.TemporaryDirectory() as tmp:
      linux_tag = f"{a.python_tag}-{a.python_tag}-linux_x86_64"
      probe = os.path.join(tmp, f"{base}-{linux_tag}.whl")
      _zip(
        probe,
        files,
        dist_info,
        metadata_text,
        wheel_text(linux_tag),
        entry_points,
      )
      platform = manylinux_tag(probe)
    tag = f"{a.python_tag}-{a.python_tag}-{platform}"
  else:
    tag = "py3-none-any"
  out = os.path.join(a.out_dir, f"{base}-{tag}.whl")
  _zip(out, files, dist_info, metadata_text, wheel_text(tag), entry_points)


if __name__ == "__main__":
  main()
