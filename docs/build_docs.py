"""Builds the jaxworks API reference with Sphinx (the //docs:build_docs binary).

    build_docs.py --out api_reference.zip       # the HTML, zipped
    build_docs.py --packages mod1,mod2 --out x.zip  # other packages' pages
    build_docs.py --allow-warnings --out x.zip  # warnings printed, not fatal

The Sphinx project is staged in a temporary directory: index.rst from here
and one page per package (``.. public-api:: PACKAGE``; see public_api.py),
by default for every jaxworks package importable here, with conf.py from
here as its configuration. Sphinx runs in this process on the CPU backend,
with warnings as errors (a public name without a docstring is one) unless
``--allow-warnings``; the HTML is written as one zip to ``--out``,
``index.html`` at its top. The exit status is non-zero when Sphinx fails.
"""

import argparse
import os
import shutil
import sys
import tempfile
import zipfile

import public_api

_DOCS = os.path.dirname(os.path.abspath(__file__))


def _page(package: str) -> str:
  """The reference page of ``package``: its title, guide and API."""
  lines = [package, "=" * len(package), ""]
  if package.startswith("jaxworks."):
    short = package.removeprefix("jaxworks.")
    lines += [f"The guide is ``packages/{short}/README.md``.", ""]
  lines += [f".. public-api:: {package}", ""]
  return "\n".join(lines)


def stage(srcdir: str, packages: list[str]) -> None:
  """Writes the Sphinx sources into ``srcdir``: index.rst and api/*.rst."""
  os.makedirs(os.path.join(srcdir, "api"))
  shutil.copyfile(
    os.path.join(_DOCS, "index.rst"), os.path.join(srcdir, "index.rst")
  )
  for package in packages:
    page = os.path.join(srcdir, "api", package.removeprefix("jaxworks."))
    with open(page + ".rst", "w", encoding="utf-8") as f:
      f.write(_page(package))


def _zip_tree(root: str, out: str) -> None:
  """Writes every file under ``root`` into the zip ``out``, paths relative."""
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
    for dirpath, dirnames, filenames in os.walk(root):
      dirnames.sort()
      for name in sorted(filenames):
        path = os.path.join(dirpath, name)
        # A fixed date, so the same sources give the same zip.
        info = zipfile.ZipInfo(
          os.path.relpath(path, root), (1980, 1, 1, 0, 0, 0)
        )
        info.compress_type = zipfile.ZIP_DEFLATED
        with open(path, "rb") as f:
          zf.writestr(info, f.read())


def build(packages: list[str], out: str, strict: bool = True) -> int:
  """Builds the HTML reference of ``packages`` into the zip ``out``.

  Returns Sphinx's exit status: with ``strict``, non-zero on any warning
  (and no zip written); else only on an error.
  """
  # Before Sphinx imports jax (the directive imports the packages).
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from sphinx.cmd.build import build_main  # pylint: disable=g-import-not-at-top

  with tempfile.TemporaryDirectory(prefix="jaxworks_docs_") as tmp:
    srcdir, outdir = os.path.join(tmp, "src"), os.path.join(tmp, "html")
    stage(srcdir, packages)
    status = build_main(
      [
        "-b",
        "html",
        *(["-W"] if strict else []),
        "-q",
        "-c",
        _DOCS,
        "-D",
        "public_api_packages=" + ",".join(packages),
        "-d",
        os.path.join(tmp, "doctrees"),
        srcdir,
        outdir,
      ]
    )
    if status == 0:
      _zip_tree(outdir, out)
  return status


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", required=True, help="the zip to write")
  parser.add_argument(
    "--packages",
    help="comma-separated modules to document (default: every jaxworks "
    "package importable here)",
  )
  parser.add_argument(
    "--allow-warnings",
    action="store_true",
    help="write the zip even when Sphinx warns (the //docs:api_reference "
    "genrule: a docstring problem fails //docs:api_reference_test, not the "
    "build of //...)",
  )
  args = parser.parse_args(argv)
  packages = (
    args.packages.split(",") if args.packages else public_api.packages()
  )
  status = build(packages, args.out, strict=not args.allow_warnings)
  if status != 0:
    print(
      f"build_docs: Sphinx failed (status {status}); the warnings above say "
      "what to fix",
      file=sys.stderr,
    )
  return status


if __name__ == "__main__":
  sys.exit(main())
