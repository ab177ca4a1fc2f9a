"""The jaxworks Python environment for the offline (WORKSPACE) build.

Every repository these rules make is named `jaxworks_*`, so a workspace that depends on jaxworks keeps its own
`@pypi`. `jaxworks_python_repositories()` makes:

* `@jaxworks_pypi`: a virtualenv created from a requirements lock (by default `requirements_runtime.txt`, the
  runtime lock: jax, jaxlib, numpy, ml_dtypes and what they need) with the `python3` on PATH, exposing
  - `@jaxworks_pypi//:python_toolchain`, a Python toolchain whose interpreter is the virtualenv's python,
  - `@jaxworks_pypi//:python_headers`, the interpreter's C headers (through
    `@rules_python//python/cc:current_py_cc_headers`),
  - one target per requirement, `@jaxworks_pypi//<name>` (lowercase, `-`/`.` -> `_`).
* `@jaxworks_pypi_dev`: the same requirements under the name bzlmod gives the dev-only hub.
* `@jaxworks_pybind11`: `@jaxworks_pybind11//:pybind11`, the headers of the pybind11 pinned in
  `requirements_lock.txt` (bzlmod users get pybind11_bazel).

jaxworks' BUILD files name these `@pypi`, `@pypi_dev` and `@pybind11`, as under bzlmod (MODULE.bazel's
`use_repo(pip, pypi = "jaxworks_pypi")`): jaxworks' own WORKSPACE defines those three names with
`jaxworks_apparent_names()`, and a consumer maps them with `repo_mapping` on its jaxworks repository
(README.md, "Using one package"; tests/consumer/WORKSPACE).

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

def _pin(lock_text, name):
    for line in lock_text.splitlines():
        line = line.split("#")[0].strip()
        if _normalize(line.split("==")[0].strip()) == name and "==" in line:
            return line
    fail("jaxworks: no {}==VERSION pin in the lock".format(name))

def _pybind11_repository_impl(rctx):
    # pybind11 is a build dependency, not a runtime one: installed here on its own (the pin of the full lock), so
    # the runtime virtualenv a consumer gets stays the runtime lock.
    venv_python = str(rctx.path(rctx.attr.venv_marker).dirname) + "/venv/bin/python"
    pin = _pin(rctx.read(rctx.path(rctx.attr.lock)), "pybind11")
    _run(
        rctx,
        [venv_python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "-q", "--no-deps",
         "--target", str(rctx.path("site")), pin],
        "pip install " + pin,
    )
    include = _run(
        rctx,
        [venv_python, "-c", "import sys; sys.path.insert(0, 'site'); import pybind11; print(pybind11.get_include())"],
        "locating pybind11",
    )
    rctx.symlink(include, "include")
    rctx.file("BUILD.bazel", """\
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "pybind11",
    hdrs = glob(["include/**/*.h"]),
    includes = ["include"],
    deps = ["@rules_python//python/cc:current_py_cc_headers"],
)

filegroup(
    name = "headers",
    srcs = glob(["include/**/*.h"]),
)
""")

pybind11_repository = repository_rule(
    implementation = _pybind11_repository_impl,
    attrs = {
        "venv_marker": attr.label(allow_single_file = True, mandatory = True),
        "lock": attr.label(allow_single_file = True, mandatory = True),
    },
    doc = "The headers of the lock's pybind11, installed with the virtualenv's pip, as `:pybind11`.",
)

def _alias_repository_impl(rctx):
    names = _requirement_names(rctx.read(rctx.path(rctx.attr.requirements))) if rctx.attr.requirements else []
    for name in names:
        rctx.file(name + "/BUILD.bazel", """\
package(default_visibility = ["//visibility:public"])

alias(
    name = "{name}",
    actual = "@{hub}//{name}",
)
""".format(name = name, hub = rctx.attr.hub))
    rctx.file("BUILD.bazel", "package(default_visibility = [\"//visibility:public\"])\n" + "".join([
        "\nalias(\n    name = \"{}\",\n    actual = \"{}\",\n)\n".format(target, actual)
        for target, actual in rctx.attr.root_aliases.items()
    ]))

alias_repository = repository_rule(
    implementation = _alias_repository_impl,
    attrs = {
        "requirements": attr.label(allow_single_file = True),
        "hub": attr.string(mandatory = True),
        "root_aliases": attr.string_dict(doc = "target in //:BUILD -> label it stands for"),
    },
    doc = "One alias per requirement, `@<name>//<req>` -> `@<hub>//<req>`, plus `root_aliases`.",
)

def jaxworks_python_repositories(
        requirements = "@jaxworks//:requirements_runtime.txt",
        pybind11_lock = "@jaxworks//:requirements_lock.txt"):
    """Defines @jaxworks_pypi (virtualenv, toolchain, requirements), @jaxworks_pypi_dev and @jaxworks_pybind11.

    A consumer takes the default `requirements`, the runtime lock, and maps jaxworks' apparent names onto these
    with `repo_mapping` on its jaxworks repository. jaxworks itself passes the full development lock and registers
    `@jaxworks_pypi//:python_toolchain`.
    """
    venv_repository(name = "jaxworks_pypi", requirements = requirements)
    alias_repository(name = "jaxworks_pypi_dev", requirements = requirements, hub = "jaxworks_pypi")
    pybind11_repository(
        name = "jaxworks_pybind11",
        venv_marker = "@jaxworks_pypi//:pip_freeze.txt",
        lock = pybind11_lock,
    )

# What a consumer passes as `repo_mapping` to its jaxworks repository (local_repository, http_archive, ...): the
# apparent names of jaxworks' BUILD files onto the repositories jaxworks_python_repositories() makes.
JAXWORKS_REPO_MAPPING = {
    "@pypi": "@jaxworks_pypi",
    "@pypi_dev": "@jaxworks_pypi_dev",
    "@pybind11": "@jaxworks_pybind11",
}

def jaxworks_apparent_names(requirements = "//:requirements_lock.txt"):
    """jaxworks' own WORKSPACE only: @pypi, @pypi_dev and @pybind11 as aliases of the `jaxworks_*` repositories.

    A consumer never calls this (its `@pypi` is its own); it uses JAXWORKS_REPO_MAPPING instead.
    """
    alias_repository(name = "pypi", requirements = requirements, hub = "jaxworks_pypi")
    alias_repository(name = "pypi_dev", requirements = requirements, hub = "jaxworks_pypi")
    alias_repository(name = "pybind11", hub = "jaxworks_pybind11", root_aliases = {
        "pybind11": "@jaxworks_pybind11//:pybind11",
        "headers": "@jaxworks_pybind11//:headers",
    })

def jaxworks_accelerator_repositories(gpu_requirements, tpu_requirements):
    """@jaxworks_pypi_gpu and @jaxworks_pypi_tpu: the virtualenvs of --config=gpu / --config=tpu.

    Fetched only when a build selects their toolchains (//tools/platforms); register
    `//tools/platforms:python_gpu_toolchain` and `//tools/platforms:python_tpu_toolchain`.
    """
    venv_repository(name = "jaxworks_pypi_gpu", requirements = gpu_requirements)
    venv_repository(name = "jaxworks_pypi_tpu", requirements = tpu_requirements)
