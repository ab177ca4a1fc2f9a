"""The jaxworks Python environment for the offline (WORKSPACE) build.

`jaxworks_python_repositories()` makes two external repositories:

* `@pypi`: a virtualenv created from requirements_lock.txt with the `python3` on PATH, exposing
  - `@pypi//:python_toolchain`, a Python toolchain whose interpreter is the virtualenv's python,
  - `@pypi//:python_headers`, the interpreter's C headers (through `@rules_python//python/cc:current_py_cc_headers`),
  - one target per requirement, `@pypi//<name>` (lowercase, `-`/`.` -> `_`), the labels rules_python's
    `pip.parse(hub_name = "pypi")` gives bzlmod users, so BUILD files are the same in both modes.
* `@pypi_dev`: the same requirements under the label bzlmod gives the dev-only hub (`@pypi_dev//pytest`, ...):
  BUILD files name test- and build-only requirements there and runtime ones in `@pypi`, so that a project
  depending on jaxworks under bzlmod only resolves the runtime lock. Here one virtualenv serves both.
* `@pybind11`: `@pybind11//:pybind11`, pybind11's headers from that virtualenv (bzlmod users get pybind11_bazel).

The requirement targets depend on `pip_freeze.txt`, the installed set, so tests re-run when the lock changes.
"""

def _normalize(name):
    return name.lower().replace("-", "_").replace(".", "_")

def _requirement_names(lock_text):
    names = []
    for line in lock_text.splitlines():
        line = line.split("#")[0].strip()
        if not line or line.startswith("-"):
            continue
        for sep in ["==", ">=", "<=", "~=", "[", ";", " "]:
            line = line.split(sep)[0]
        names.append(_normalize(line.strip()))
    return names

def _run(rctx, args, what, timeout = 600):
    result = rctx.execute(args, timeout = timeout, quiet = True)
    if result.return_code != 0:
        fail("jaxworks venv: {} failed (exit {}):\n{}\n{}".format(what, result.return_code, result.stdout, result.stderr))
    return result.stdout.strip()

_BUILD_HEADER = """\
load("@rules_python//python:defs.bzl", "py_runtime", "py_runtime_pair")

package(default_visibility = ["//visibility:public"])

exports_files(["pip_freeze.txt"])

py_runtime(
    name = "py3_runtime",
    interpreter_path = "{python}",
    python_version = "PY3",
    stub_shebang = "#!{python}",
)

py_runtime_pair(
    name = "runtime_pair",
    py3_runtime = ":py3_runtime",
)

toolchain(
    name = "python_toolchain",
    toolchain = ":runtime_pair",
    toolchain_type = "@bazel_tools//tools/python:toolchain_type",
)

cc_library(
    name = "python_headers",
    hdrs = glob(["python_include/**/*.h"]),
    includes = ["python_include"],
)
"""

_REQUIREMENT_BUILD = """\
load("@rules_python//python:defs.bzl", "py_library")

package(default_visibility = ["//visibility:public"])

# Installed in the virtualenv of @pypi (its interpreter finds it); depending on the installed set makes tests re-run
# when the lock changes.
py_library(
    name = "{name}",
    data = ["//:pip_freeze.txt"],
)

alias(
    name = "pkg",
    actual = ":{name}",
)
"""

def _venv_repository_impl(rctx):
    lock = rctx.path(rctx.attr.requirements)
    lock_text = rctx.read(lock)

    # Resolve a pyenv shim (or any wrapper) to the real interpreter.
    python = rctx.which("python3")
    if python == None:
        fail("jaxworks venv: no python3 on PATH; install Python 3.11 (Debian: apt-get install python3 python3-venv).")
    base = _run(rctx, [python, "-c", "import sys; print(sys.executable)"], "locating the Python interpreter")

    _run(rctx, [base, "-m", "venv", "venv"], "python3 -m venv (Debian: apt-get install python3-venv)")
    venv_python = str(rctx.path("venv/bin/python"))
    rctx.report_progress("pip install -r requirements_lock.txt")
    _run(
        rctx,
        [venv_python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "-q", "-r", str(lock)],
        "pip install -r requirements_lock.txt",
        timeout = 3600,
    )
    rctx.file("pip_freeze.txt", _run(rctx, [venv_python, "-m", "pip", "freeze", "--all"], "pip freeze") + "\n")

    include = _run(rctx, [venv_python, "-c", "import sysconfig; print(sysconfig.get_paths()['include'])"], "sysconfig")
    rctx.symlink(include, "python_include")

    rctx.file("BUILD.bazel", _BUILD_HEADER.format(python = venv_python))
    for name in _requirement_names(lock_text):
        rctx.file(name + "/BUILD.bazel", _REQUIREMENT_BUILD.format(name = name))

venv_repository = repository_rule(
    implementation = _venv_repository_impl,
    attrs = {"requirements": attr.label(allow_single_file = True, mandatory = True)},
    # Not `environ = ["PATH"]`: tools that run Bazel through pyenv's shims (or any wrapper that prepends to PATH)
    # would otherwise rebuild the whole virtualenv, and every target, on each switch. The lock file is the key.
    doc = "A virtualenv from a pinned requirements file, with a Python toolchain and per-requirement targets.",
)

def _pybind11_repository_impl(rctx):
    venv_python = str(rctx.path(rctx.attr.venv_marker).dirname) + "/venv/bin/python"
    include = _run(rctx, [venv_python, "-c", "import pybind11; print(pybind11.get_include())"], "locating pybind11")
    rctx.symlink(include, "include")
    rctx.file("BUILD.bazel", """\
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "pybind11",
    hdrs = glob(["include/**/*.h"]),
    includes = ["include"],
    deps = ["@rules_python//python/cc:current_py_cc_headers"],
)
""")

pybind11_repository = repository_rule(
    implementation = _pybind11_repository_impl,
    attrs = {"venv_marker": attr.label(allow_single_file = True, mandatory = True)},
    doc = "pybind11's headers from the @pypi virtualenv, as @pybind11//:pybind11.",
)

def _alias_repository_impl(rctx):
    for name in _requirement_names(rctx.read(rctx.path(rctx.attr.requirements))):
        rctx.file(name + "/BUILD.bazel", """\
package(default_visibility = ["//visibility:public"])

alias(
    name = "{name}",
    actual = "@{hub}//{name}",
)
""".format(name = name, hub = rctx.attr.hub))
    rctx.file("BUILD.bazel", "")

alias_repository = repository_rule(
    implementation = _alias_repository_impl,
    attrs = {
        "requirements": attr.label(allow_single_file = True, mandatory = True),
        "hub": attr.string(mandatory = True),
    },
    doc = "One alias per requirement, `@<name>//<req>` -> `@<hub>//<req>`.",
)

def jaxworks_python_repositories(requirements = "@jaxworks//:requirements_lock.txt"):
    """Defines @pypi (virtualenv, toolchain, requirements), @pypi_dev and @pybind11.

    Register `@pypi//:python_toolchain`.
    """
    venv_repository(name = "pypi", requirements = requirements)
    alias_repository(name = "pypi_dev", requirements = requirements, hub = "pypi")
    pybind11_repository(name = "pybind11", venv_marker = "@pypi//:pip_freeze.txt")

def jaxworks_accelerator_repositories(gpu_requirements, tpu_requirements):
    """@pypi_gpu and @pypi_tpu: the virtualenvs of --config=gpu / --config=tpu.

    Fetched only when a build selects their toolchains (//tools/platforms); register
    `//tools/platforms:python_gpu_toolchain` and `//tools/platforms:python_tpu_toolchain`.
    """
    venv_repository(name = "pypi_gpu", requirements = gpu_requirements)
    venv_repository(name = "pypi_tpu", requirements = tpu_requirements)
