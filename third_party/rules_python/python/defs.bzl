"""Offline stand-in for @rules_python//python:defs.bzl: forwards to Bazel 4.2.3's native Python rules.

BUILD files load these names from @rules_python so that the same files work with the real rules_python under bzlmod.
"""

load("@bazel_tools//tools/python:toolchain.bzl", _py_runtime_pair = "py_runtime_pair")

def py_binary(**kwargs):
    native.py_binary(**kwargs)

def py_library(**kwargs):
    native.py_library(**kwargs)

def py_test(**kwargs):
    native.py_test(**kwargs)

def py_runtime(**kwargs):
    native.py_runtime(**kwargs)

def py_runtime_pair(**kwargs):
    _py_runtime_pair(**kwargs)
