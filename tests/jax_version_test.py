"""Importing a jaxworks package under a JAX release it does not support fails at once, naming the range.

Every package imports private ``jax._src`` internals of jax 0.10 (through its ``_src/jax_internals.py``), so each
checks the installed jax and jaxlib against the range its wheels require (``jax>=0.10.2,<0.11``) before touching them.
"""

import ast
import re
import subprocess
import sys

import pytest

# The package list Bazel uses (packages.bzl), so a new package is checked too.
with open("packages.bzl", encoding="utf-8") as _f:
  PACKAGES = ast.literal_eval(
    re.search(r"^PACKAGES = (\[.*?\])", _f.read(), re.M | re.S).group(1)
  )

_PROBE = r"""
import importlib.metadata, sys
real = importlib.metadata.version
fake = dict(arg.split("=") for arg in sys.argv[2:])
importlib.metadata.version = lambda name: fake.get(name, real(name))
try:
  __import__("jaxworks." + sys.argv[1])
except ImportError as e:
  print("ImportError:", e)
else:
  print("imported")
"""


def _import_with(package, **versions):
  args = [f"{k}={v}" for k, v in versions.items()]
  out = subprocess.run(
    [sys.executable, "-c", _PROBE, package, *args],
    capture_output=True,
    text=True,
    check=True,
  )
  return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize(
  "versions",
  [
    {"jax": "0.11.0"},
    {"jaxlib": "0.10.1"},
    {"jax": "0.9.2", "jaxlib": "0.9.2"},
  ],
)
def test_unsupported_jax_fails_at_import_naming_the_range(package, versions):
  line = _import_with(package, **versions)
  assert line.startswith("ImportError:"), line
  # The package itself or the first jaxworks dependency it imports says so.
  assert "supports jax and jaxlib >=0.10.2,<0.11" in line, line
  assert any(f"jaxworks.{p} supports" in line for p in PACKAGES), line
  for name, version in versions.items():
    assert f"'{name}': '{version}'" in line, line


@pytest.mark.parametrize("package", PACKAGES)
def test_supported_jax_imports(package):
  assert _import_with(package) == "imported"
