"""Offline stand-in for @rules_java//java:defs.bzl: forwards to Bazel 4.2.3's native Java rules.

Bazel's built-in WORKSPACE suffix registers JDK toolchains through these symbols even when no Java is built.
"""

def java_binary(**kwargs):
    native.java_binary(**kwargs)

def java_import(**kwargs):
    native.java_import(**kwargs)

def java_library(**kwargs):
    native.java_library(**kwargs)

def java_runtime(**kwargs):
    native.java_runtime(**kwargs)

def java_toolchain(**kwargs):
    native.java_toolchain(**kwargs)
