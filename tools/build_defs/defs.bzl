"""The jaxworks BUILD vocabulary. A package's BUILD.bazel reads: library, extensions, tests, wheel.

    jaxworks_cc_library(name = "signature_cc", srcs = ["cc/signature.cc"], hdrs = ["cc/signature.h"])
    pybind_extension(name = "jaxworks/jit_cache/_signature", srcs = ["cc/_signature_module.cc"], deps = [":signature_cc"])
    jaxworks_package(name = "jit_cache", deps = ["//packages/axis_names"], pypi = ["jax", "jaxlib", "numpy"],
                     extensions = {":jaxworks/jit_cache/_signature": ["cc/_signature_module.cc", "cc/signature.cc",
                                                                      "cc/signature.h"]})
    jaxworks_test(name = "signature_test", srcs = ["tests/signature_test.py"], deps = [":jit_cache"])
    jaxworks_benchmark(name = "jit_cache_bench", srcs = ["benchmarks/jit_cache_bench.py"], deps = [":jit_cache"])
"""

load("@rules_cc//cc:defs.bzl", "cc_binary", "cc_library")
load("@rules_python//python:defs.bzl", "py_binary", "py_library", "py_test")
load("//tools/build_defs:portable.bzl", "PYTHON_VERSIONS", "cpython_headers", "python_tag", "zig_extension")
load("//tools/build_defs:wheel.bzl", "JaxworksDistInfo", "jaxworks_dist", "jaxworks_sdist", "jaxworks_wheel")

# What the jaxworks wheels require. jax and jaxlib get the range of the package's _src/deps.py (SUPPORTED_JAX, the
# one its import check uses), and each jaxworks dependency the minimum declared there (MINIMUM_VERSIONS).
JAX_REQUIREMENTS = {
    "fastcrc": "fastcrc>=0.5",
    "numpy": "numpy>=1.26",
    "packaging": "packaging>=22",
}

BACKENDS = ["cpu", "gpu", "tpu"]
# The accelerator first (JAX's default backend), then the host CPU, as JAX sets itself up on a GPU or TPU machine
# when JAX_PLATFORMS is unset: host callbacks (jax.debug.print, pure_callback) and jax.devices("cpu") need it.
_JAX_PLATFORMS = {"cpu": "cpu", "gpu": "cuda,cpu", "tpu": "tpu,cpu"}
_COPTS = ["-std=c++17", "-fvisibility=hidden", "-fvisibility-inlines-hidden", "-O2", "-Wall"]

def pypi(name):
    """The label of a runtime PyPI requirement (requirements_runtime.txt): @pypi//<normalized name>."""
    return "@pypi//" + name.lower().replace("-", "_").replace(".", "_")

def pypi_dev(name):
    """The label of a test-, benchmark- or build-only requirement (requirements_lock.txt): @pypi_dev//<name>."""
    return "@pypi_dev//" + name.lower().replace("-", "_").replace(".", "_")

def jaxworks_cc_library(name, srcs = [], hdrs = [], deps = [], **kwargs):
    """The C++ logic of an extension (no PYBIND11_MODULE here), compiled with hidden visibility."""
    cc_library(
        name = name,
        srcs = srcs,
        hdrs = hdrs,
        deps = deps + ["@pybind11"],
        copts = _COPTS,
        **kwargs
    )

def pybind_extension(name, srcs, deps = [], **kwargs):
    """A pybind11 extension `<dir>/<module>.so` importable as `<dir as dotted path>.<module>`.

    `name` is the path of the module inside its import root, e.g. "jaxworks/jit_cache/_signature". The shared object is
    linked statically against its deps with hidden visibility and a version script, so it exports only
    `PyInit_<module>`. A typed stub `<name>.pyi` must be checked in beside it. `:<name>` is a py_library carrying both.
    """
    module = name.split("/")[-1]
    stub = name + ".pyi"
    if not native.glob([stub]):
        fail("pybind_extension {}: the typed stub {} is missing; check one in beside the extension.".format(name, stub))
    version_script = name + ".lds"
    native.genrule(
        name = name + "_version_script",
        outs = [version_script],
        cmd = "echo '{ global: PyInit_%s; local: *; };' > $@" % module,
        visibility = ["//visibility:private"],
    )
    cc_binary(
        name = name + ".so",
        srcs = srcs,
        deps = deps + ["@pybind11"],
        copts = _COPTS,
        linkshared = True,
        linkstatic = True,
        linkopts = ["-Wl,--version-script=$(location :{})".format(version_script)],
        additional_linker_inputs = [":" + version_script],
        visibility = ["//visibility:private"],
        **kwargs
    )
    py_library(
        name = name,
        data = [":" + name + ".so", stub],
        imports = ["."],
    )

def _backend_env(backend, devices):
    env = {"JAX_PLATFORMS": _JAX_PLATFORMS[backend]}
    if backend == "cpu":
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count={}".format(devices)
    return env

def jaxworks_test(name, srcs, deps = [], pypi = [], backends = BACKENDS, devices = 8, one_device = False, args = [], data = [], env = {}, size = "medium", **kwargs):
    """pytest over `srcs`, one target per backend: <name>_cpu / _gpu / _tpu, tagged cpu / gpu / tpu.

    Each sets JAX_PLATFORMS (cpu, cuda, tpu); the cpu target gets `devices` host CPU devices through XLA_FLAGS.
    With `one_device = True` (and "cpu" in `backends`), <name>_cpu_1dev (tagged cpu and one_device) runs the same
    tests on one host CPU device, what a user with one accelerator has: its tests that need more devices skip
    (tests/skip_allowlist.txt lists the target).
    pytest's exit status is the test's, so a failure fails the target.
    """
    main = "//tools/build_defs:pytest_main.py"
    tags = kwargs.pop("tags", [])
    variants = [(backend, "{}_{}".format(name, backend), devices, [backend]) for backend in backends]
    if one_device and "cpu" in backends:
        variants.append(("cpu", "{}_cpu_1dev".format(name), 1, ["cpu", "one_device"]))
    for backend, target, count, backend_tags in variants:
        py_test(
            name = target,
            srcs = srcs + [main],
            main = main,
            args = ["$(rootpath {})".format(src) for src in srcs] + args,
            deps = deps + [_dev_label(p) for p in pypi] + [_dev_label("pytest"), "//tools/build_defs:testing"],
            data = data,
            env = dict(env, **_backend_env(backend, count)),
            tags = tags + backend_tags,
            size = size,
            **kwargs
        )

# The public helpers' names are shadowed by the macros' `pypi` parameters, hence these two.
def _runtime_label(name):
    return pypi(name)

def _dev_label(name):
    return pypi_dev(name)

def jaxworks_benchmark(name, srcs, deps = [], pypi = [], **kwargs):
    """A benchmark: a py_binary printing medians and ratios against stock JAX, plus `<name>_smoke_cpu`, a test that
    runs it with --quick --json (into TEST_TMPDIR) so it cannot rot: its rows must pass the schema (it asserts
    nothing about speed).

    It depends on //benchmarks:support (`import jaxworks_bench`: timing helpers, the JSON rows written with
    --json PATH). List it in benchmarks/BUILD.bazel's _BENCHMARKS so //benchmarks:all runs it."""
    deps = deps + [_dev_label(p) for p in pypi] + ["//benchmarks:support"]
    py_binary(
        name = name,
        srcs = srcs,
        main = srcs[0],
        deps = deps,
        visibility = ["//benchmarks:__pkg__"],  # //benchmarks:all runs every package's benchmark
        **kwargs
    )
    py_test(
        name = name + "_smoke_cpu",
        srcs = srcs,
        main = srcs[0],
        args = ["--quick", "--json", name + "_rows.json"],
        data = kwargs.get("data", []),
        deps = deps,
        env = _backend_env("cpu", 8),
        tags = ["cpu", "benchmark"],
        size = "medium",
    )

def jaxworks_package(name, deps = [], pypi = [], extensions = {}, doctest_backends = ["cpu"], entry_points = [], extras = {}):
    """A jaxworks package: the public py_library `:<name>`, its wheel `:wheel`, its sdist `:sdist`, doctests, and
    per-backend suites.

    `extensions` maps each pybind_extension to its C++ sources and headers (all of them, its deps' included): the
    wheels' copies are built from them by zig, and the sdist ships them for `setup.py`, which builds the same modules.
    The sdist is built from `pyproject.toml` (and that `setup.py` where the package has extensions) beside the BUILD
    file.

    `extras` are optional extras, {"cloud": ["obstore>=0.12"]}: `Provides-Extra` and `Requires-Dist: ...; extra == ...`
    of the wheel and sdist (pyproject.toml's [project.optional-dependencies] must say the same); the package imports
    them lazily, so they are no deps of the py_library (tests name them in `pypi`).

    `entry_points` go into the wheel's entry_points.txt, as "group:name=module:attr"
    (e.g. "console_scripts:jaxworks-aot=jaxworks.stages_aot.__main__:main").

    Sources are `jaxworks/<name>/**/*.py` (each package is a PEP 420 portion of the `jaxworks` namespace, with no
    jaxworks/__init__.py); the version lives in `jaxworks/<name>/version.py` only.
    """
    py_library(
        name = name,
        srcs = native.glob(["jaxworks/{}/**/*.py".format(name)]),
        data = native.glob(["jaxworks/{}/**/*.pyi".format(name)]),
        imports = ["."],
        deps = deps + list(extensions) + [_runtime_label(p) for p in pypi],
        visibility = ["//visibility:public"],
    )
    # Every source file of the package, for repository-wide checks (tests/repo_test.py).
    native.filegroup(
        name = "all_files",
        srcs = native.glob(["**"], exclude = ["**/__pycache__/**", "**/*.so"]),
        visibility = ["//visibility:public"],
    )
    jaxworks_dist(
        name = "dist",
        distribution = "jaxworks-" + name.replace("_", "-"),
        library = ":" + name,
        version_file = "jaxworks/{}/version.py".format(name),
        deps_file = "jaxworks/{}/_src/deps.py".format(name),
        package_root = native.package_name(),
        requires = [JAX_REQUIREMENTS.get(p, p) for p in pypi],
        extras = ["{}={}".format(k, r) for k in sorted(extras) for r in extras[k]],
        deps = [_dist_label(d) for d in deps],
        readme = "README.md" if native.glob(["README.md"]) else None,
        entry_points = entry_points,
        visibility = ["//visibility:public"],
    )
    if not extensions:
        jaxworks_wheel(
            name = "wheel",
            dists = [":dist"],
            visibility = ["//visibility:public"],
        )
    else:
        # One wheel per CPython: `:wheel` (cp311) and `:wheel_cp312`, `:wheel_cp313`, each with the extensions built
        # by zig against that CPython's headers for jaxlib's glibc baseline (tools/build_defs/portable.bzl).
        for version in PYTHON_VERSIONS:
            tag = python_tag(version)
            for ext, ext_srcs in extensions.items():
                zig_extension(
                    name = "{}_{}".format(ext.lstrip(":").replace("/", "_"), tag),
                    module = ext.lstrip(":"),
                    srcs = ext_srcs,
                    python = version,
                    python_headers = cpython_headers(version),
                    visibility = ["//visibility:private"],
                )
            jaxworks_wheel(
                name = "wheel" if version == PYTHON_VERSIONS[0] else "wheel_" + tag,
                dists = [":dist"],
                python_tag = tag,
                extension_files = [":{}_{}".format(ext.lstrip(":").replace("/", "_"), tag) for ext in extensions],
                visibility = ["//visibility:public"],
            )
    jaxworks_sdist(
        name = "sdist",
        dist = ":dist",
        pyproject = "pyproject.toml",
        setup_py = "setup.py" if extensions else None,
        cc_srcs = sorted({f: True for srcs in extensions.values() for f in srcs}),
        visibility = ["//visibility:public"],
    )

    # README examples and every module's docstring examples run as doctests.
    jaxworks_test(
        name = "doctest",
        srcs = ["//tools/build_defs:doctest_test.py"],
        deps = [":" + name],
        args = ["--jaxworks-package=jaxworks." + name] + (
            ["--jaxworks-readme=$(rootpath README.md)"] if native.glob(["README.md"]) else []
        ),
        data = native.glob(["README.md"]),
        backends = doctest_backends,
    )
    for backend in BACKENDS:
        native.test_suite(name = backend + "_tests", tags = [backend], visibility = ["//visibility:public"])

def _dist_label(dep):
    """//packages/axis_names -> //packages/axis_names:dist"""
    if ":" in dep:
        return dep.split(":")[0] + ":dist"
    return dep + ":dist"
