"""Runs pytest inside a Bazel py_test (see jaxworks_test in defs.bzl).

Arguments are test files (runfiles paths) and pytest options. Honours XML_OUTPUT_FILE (JUnit XML that Bazel keeps in
bazel-testlogs) and TESTBRIDGE_TEST_ONLY (`bazel test --test_filter=EXPR` becomes `pytest -k EXPR`), and exits with
pytest's status, so a failing test fails the target.
"""

import os
import sys

import pytest


class _JaxworksOptions:
    """Options of tools/build_defs/doctest_test.py, which pytest only accepts from a plugin."""

    @staticmethod
    def pytest_addoption(parser):
        parser.addoption("--jaxworks-package", default=None, help="package whose docstrings run as doctests")
        parser.addoption("--jaxworks-readme", default=None, help="README whose >>> examples run as doctests")


def main():
    args = list(sys.argv[1:])
    args += ["-p", "no:cacheprovider", "-q", "-rfE"]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append(f"--junitxml={xml}")
    only = os.environ.get("TESTBRIDGE_TEST_ONLY")
    if only:
        args += ["-k", only]
    # Hypothesis keeps its example database out of the read-only runfiles tree.
    os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(os.environ.get("TEST_TMPDIR", "/tmp"), ".hypothesis"))
    sys.exit(pytest.main(args, plugins=[_JaxworksOptions()]))


if __name__ == "__main__":
    main()
