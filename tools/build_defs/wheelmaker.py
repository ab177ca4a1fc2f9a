"""Writes a reproducible wheel (stdlib only): fixed timestamps, sorted entries, RECORD with sha256.

Called by the jaxworks_wheel rule (tools/build_defs/wheel.bzl); not meant to be run by hand.
"""

import argparse
import base64
import hashlib
import os
import re
import sys
import zipfile

_EPOCH = (1980, 1, 1, 0, 0, 0)
_VERSION_RE = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.M)


def read_version(path):
    with open(path, encoding="utf-8") as f:
        match = _VERSION_RE.search(f.read())
    if not match:
        sys.exit(f"wheelmaker: no `__version__ = \"X.Y.Z\"` line in {path}")
    return match.group(1)


def _record_hash(data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _write(zf, name, data, executable=False):
    info = zipfile.ZipInfo(name, date_time=_EPOCH)
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = (0o755 if executable else 0o644) << 16
    zf.writestr(info, data)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--distribution", required=True)
    p.add_argument("--version")
    p.add_argument("--version-file")
    p.add_argument("--summary", default="")
    p.add_argument("--requires", action="append", default=[])
    p.add_argument("--requires-dist-from", action="append", default=[], help="DIST=VERSION_FILE")
    p.add_argument("--files", required=True, help="lines: SOURCE<TAB>PATH_IN_WHEEL")
    p.add_argument("--out-dir", required=True)
    a = p.parse_args(argv)

    version = a.version or read_version(a.version_file)
    requires = list(a.requires)
    for item in a.requires_dist_from:
        dist, vfile = item.split("=", 1)
        requires.append(f"{dist}>={read_version(vfile)}")

    entries = []
    with open(a.files, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                src, dst = line.rstrip("\n").split("\t")
                entries.append((dst, src))
    entries.sort()
    has_extension = any(dst.endswith(".so") for dst, _ in entries)
    tag = "cp311-cp311-linux_x86_64" if has_extension else "py3-none-any"

    dist_name = re.sub(r"[-_.]+", "_", a.distribution).lower()
    dist_info = f"{dist_name}-{version}.dist-info"
    metadata = [
        "Metadata-Version: 2.1",
        f"Name: {a.distribution}",
        f"Version: {version}",
        f"Summary: {a.summary}",
        "Requires-Python: >=3.11" if has_extension else "Requires-Python: >=3.10",
        "License: Apache-2.0",
    ] + [f"Requires-Dist: {r}" for r in requires]
    wheel = [
        "Wheel-Version: 1.0",
        "Generator: jaxworks-wheelmaker",
        f"Root-Is-Purelib: {'false' if has_extension else 'true'}",
        f"Tag: {tag}",
    ]

    os.makedirs(a.out_dir, exist_ok=True)
    out = os.path.join(a.out_dir, f"{dist_name}-{version}-{tag}.whl")
    record = []
    with zipfile.ZipFile(out, "w") as zf:
        for dst, src in entries:
            with open(src, "rb") as f:
                data = f.read()
            _write(zf, dst, data, executable=dst.endswith(".so"))
            record.append(f"{dst},{_record_hash(data)},{len(data)}")
        for name, lines in (("METADATA", metadata), ("WHEEL", wheel)):
            data = ("\n".join(lines) + "\n").encode()
            _write(zf, f"{dist_info}/{name}", data)
            record.append(f"{dist_info}/{name},{_record_hash(data)},{len(data)}")
        record.append(f"{dist_info}/RECORD,,")
        _write(zf, f"{dist_info}/RECORD", ("\n".join(record) + "\n").encode())


if __name__ == "__main__":
    main()
