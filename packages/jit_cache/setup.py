"""The C++ extension of the sdist (the rest is in pyproject.toml).

Built with pybind11's setuptools helpers from the same sources as the Bazel
target //packages/jit_cache:jaxworks/jit_cache/_signature (hidden visibility,
C++17).
"""

from pybind11.setup_helpers import Pybind11Extension
from setuptools import setup

setup(
  ext_modules=[
    Pybind11Extension(
      "jaxworks.jit_cache._signature",
      ["cc/_signature_module.cc", "cc/signature.cc"],
      include_dirs=[".", "cc"],
      cxx_std=17,
    )
  ]
)
