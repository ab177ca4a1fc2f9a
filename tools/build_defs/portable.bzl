"""Portable extension wheels: one per CPython, linked for an old glibc.

* `jaxworks_cpython_repositories()`: `@jaxworks_cpython_3_11`, `_3_12`, `_3_13`, each a CPython of that version
  found on this machine (`pythonX.Y` on PATH, else pyenv's `$PYENV_ROOT/versions/X.Y.*`), exposing `:headers` (its
  C headers) and `:interpreter.txt` (the path of its python). Fetched only when a target needs it.
* `@jaxworks_zig`: the `ziglang` wheel from the package index (pinned below), as `:zig` (a wrapper that runs
  `python -m ziglang`): a C++ compiler that targets any glibc and links its own libc++ statically.
* `zig_extension`: a pybind11 extension `<module>.so` compiled by zig for `x86_64-linux-gnu.<glibc>` against one
  CPython's headers, exporting only `PyInit_<module>` (the wheels' extensions; the tests in the repository use the
  host compiler's build, `pybind_extension`).
"""

ZIGLANG = "ziglang==0.17.1"
PYTHON_VERSIONS = ["3.11", "3.12", "3.13"]

# jaxlib 0.10.2's own wheels are manylinux_2_27: the extensions target this glibc or an older one.
GLIBC = "2.27"

def _cpython_impl(rctx):
    version = rctx.attr.version
    candidates = []
    found = rctx.which("python" + version)
    if found:
        candidates.append(str(found))
    env = rctx.os.environ
    pyenv_root = env.get("PYENV_ROOT") or (env.get("HOME", "/root") + "/.pyenv")
    listing = rctx.execute(["sh", "-c", "ls -d {}/versions/{}.* 2>/dev/null | sort -V".format(pyenv_root, version)])
    for line in reversed(listing.stdout.strip().splitlines()):
        candidates.append(line + "/bin/python" + version)
    probe = "import sys, sysconfig; assert sys.version.startswith('{}.'); print(sys.executable); print(sysconfig.get_paths()['include'])".format(version)
    for python in candidates:
        result = rctx.execute([python, "-c", probe])
        if result.return_code == 0:
            executable, include = result.stdout.strip().splitlines()
            rctx.symlink(include, "include")
            rctx.file("interpreter.txt", executable + "\n")
            rctx.file("BUILD.bazel", """\
package(default_visibility = ["//visibility:public"])

exports_files(["interpreter.txt"])

filegroup(
    name = "headers",
    srcs = glob(["include/**/*.h"]),
)
""")
            return
    fail(("jaxworks: no CPython {v} found (tried pythonX.Y on PATH and {root}/versions/{v}.*). Install it, e.g. " +
          "`pyenv install {v}` or `uv python install {v}` (then put it on PATH), or Debian's python{v}-dev.").format(
        v = version,
        root = pyenv_root,
    ))

cpython_repository = repository_rule(
    implementation = _cpython_impl,
    attrs = {"version": attr.string(mandatory = True)},
    environ = ["PYENV_ROOT"],
    doc = "A CPython X.Y of this machine: `:headers` and `:interpreter.txt`.",
)

def _zig_impl(rctx):
    python = str(rctx.path(rctx.attr.venv_marker).dirname) + "/venv/bin/python"
    rctx.report_progress("pip install " + ZIGLANG)
    result = rctx.execute(
        [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input", "-q", "--no-deps",
         "--target", str(rctx.path("site")), ZIGLANG],
        timeout = 1800,
        quiet = True,
    )
    if result.return_code != 0:
        fail("jaxworks: pip install {} failed:\n{}{}".format(ZIGLANG, result.stdout, result.stderr))
    rctx.file("zig", """\
#!/bin/sh
# zig from the ziglang wheel. Its cache (the libc++ it builds per target, reused by later builds) lives outside
# Bazel's sandbox so that it is built once per machine; delete it freely.
export ZIG_GLOBAL_CACHE_DIR="${{ZIG_GLOBAL_CACHE_DIR:-${{TMPDIR:-/tmp}}/jaxworks-zig-cache}}"
export ZIG_LOCAL_CACHE_DIR="$ZIG_GLOBAL_CACHE_DIR"
PYTHONPATH="{site}" exec "{python}" -m ziglang "$@"
""".format(site = rctx.path("site"), python = python), executable = True)
    rctx.file("BUILD.bazel", """\
package(default_visibility = ["//visibility:public"])

exports_files(["zig"])
""")

zig_repository = repository_rule(
    implementation = _zig_impl,
    attrs = {"venv_marker": attr.label(allow_single_file = True, mandatory = True)},
    doc = "zig (the ziglang wheel), run with the jaxworks virtualenv's python.",
)

def _repo_name(version):
    return "jaxworks_cpython_" + version.replace(".", "_")

def jaxworks_portable_repositories():
    """@jaxworks_cpython_3_11/_3_12/_3_13 and @jaxworks_zig (each fetched only when a target needs it)."""
    for v in PYTHON_VERSIONS:
        cpython_repository(name = _repo_name(v), version = v)
    zig_repository(name = "jaxworks_zig", venv_marker = "@jaxworks_pypi//:pip_freeze.txt")

def python_tag(version):
    return "cp" + version.replace(".", "")

def cpython_headers(version):
    return "@{}//:headers".format(_repo_name(version))

def cpython_interpreter(version):
    return "@{}//:interpreter.txt".format(_repo_name(version))

def _include_of(ctx, files, suffix):
    """The include directory of `files` that holds `suffix` (Python.h, pybind11/pybind11.h)."""
    for f in files:
        if f.path.endswith("/" + suffix):
            return f.path[:-len(suffix) - 1]
    fail("{}: no {} among the headers given".format(ctx.label, suffix))

def _zig_extension_impl(ctx):
    module = ctx.attr.module
    out = ctx.actions.declare_file("{}/{}.so".format(ctx.label.name, module))
    script = ctx.actions.declare_file(ctx.label.name + ".lds")
    ctx.actions.write(script, "{ global: PyInit_%s; local: *; };\n" % module.split("/")[-1])

    py_include = _include_of(ctx, ctx.files.python_headers, "Python.h")
    pybind_include = _include_of(ctx, ctx.files.pybind11_headers, "pybind11/pybind11.h")
    srcs = [f for f in ctx.files.srcs if f.path.endswith(".cc")]
    hdrs = [f for f in ctx.files.srcs if not f.path.endswith(".cc")]
    includes = {".": True, ctx.bin_dir.path: True}
    for f in srcs:
        includes[f.dirname] = True
    args = ctx.actions.args()
    args.add_all(["c++", "-target", "x86_64-linux-gnu." + ctx.attr.glibc, "-shared", "-fPIC", "-O2", "-std=c++17"])
    args.add_all(["-fvisibility=hidden", "-fvisibility-inlines-hidden", "-s"])
    args.add("-Wl,--version-script=" + script.path)
    for i in includes:
        args.add("-I" + i)
    args.add("-isystem" + py_include)
    args.add("-isystem" + pybind_include)
    args.add_all(srcs)
    args.add("-o", out)
    ctx.actions.run(
        executable = ctx.executable._zig,
        arguments = [args],
        inputs = srcs + hdrs + ctx.files.python_headers + ctx.files.pybind11_headers + [script],
        outputs = [out],
        mnemonic = "ZigExtension",
        progress_message = "zig c++ {} ({}, glibc {})".format(module, ctx.attr.python, ctx.attr.glibc),
        # zig keeps the libc++ it builds for a target in a cache outside the sandbox (see @jaxworks_zig//:zig).
        execution_requirements = {"no-sandbox": "1"},
    )
    return [DefaultInfo(files = depset([out]))]

zig_extension = rule(
    implementation = _zig_extension_impl,
    attrs = {
        "module": attr.string(mandatory = True, doc = "path in the wheel without .so, e.g. jaxworks/jit_cache/_signature"),
        "srcs": attr.label_list(allow_files = True, mandatory = True, doc = ".cc sources and their headers"),
        "python": attr.string(mandatory = True, doc = "the CPython version, for messages"),
        "python_headers": attr.label(mandatory = True),
        "pybind11_headers": attr.label(default = "@pybind11//:headers"),
        "glibc": attr.string(default = GLIBC),
        "_zig": attr.label(default = "@jaxworks_zig//:zig", executable = True, allow_single_file = True, cfg = "exec"),
    },
    doc = "A pybind11 extension built by zig for an old glibc; the output is <name>/<module>.so.",
)
