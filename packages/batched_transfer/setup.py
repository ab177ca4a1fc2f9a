"""The C++ extension of the sdist (the rest is in pyproject.toml).

Built with pybind11's setuptools helpers from the same sources as the Bazel
target //packages/batched_transfer:jaxworks/batched_transfer/_grouping
(hidden visibility, C++17).
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
  ext_modules=[
    Pybind11Extension(
      "jaxworks.batched_transfer._grouping",
      ["cc/_grouping_module.cc", "cc/grouping.cc"],
      include_dirs=[".", "cc"],
      cxx_std=17,
    )
  ]
)
