"""The C++ extensions of the sdist (the rest is in pyproject.toml).

Built with pybind11's setuptools helpers from the same sources as the Bazel
targets //packages/batched_transfer:jaxworks/batched_transfer/_grouping and
:jaxworks/batched_transfer/_checked_read (hidden visibility, C++17).
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
    ),
    Pybind11Extension(
      "jaxworks.batched_transfer._checked_read",
      ["cc/_checked_read_module.cc", "cc/crc32c.cc"],
      include_dirs=["cc"],
      cxx_std=17,
    ),
  ]
)
