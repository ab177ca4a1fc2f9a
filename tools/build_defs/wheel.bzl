"""Reproducible wheels from jaxworks packages.

`jaxworks_dist` describes one distribution (name, version file, requirements, files, README, entry points);
`jaxworks_wheel` zips it into a wheel. The combined `jaxworks` wheel at //:wheel is a metapackage: no files of its
own, `Requires-Dist: jaxworks-<pkg>==<version>` on each per-package wheel, so installing or removing either kind
leaves one owner per file. The wheel is written into a directory `<name>/` under its correct file name, since the
version is read from version.py at build time.
"""

# Where the project is published, defined here only: each wheel's METADATA lists it (plus its own changelog), and
# the relative links of each long description (its README) are made absolute under it.
PROJECT_URL = "https://github.com/jaxworks/jaxworks"

JaxworksDistInfo = provider(
    doc = "One jaxworks distribution.",
    fields = {
        "distribution": "distribution name, e.g. jaxworks-jit-cache",
        "version_file": "File: the package's version.py",
        "deps_file": "File: the package's _src/deps.py (SUPPORTED_JAX, MINIMUM_VERSIONS)",
        "package_root": "workspace-relative directory whose jaxworks/ tree the wheel holds",
        "files": "depset of Files (sources, stubs, extensions) of the library and its deps",
        "requires": "list of PyPI requirement strings",
        "extras": "list of 'extra=requirement' strings (optional extras)",
        "deps": "list of JaxworksDistInfo of the jaxworks packages it depends on",
        "readme": "File or None: the Markdown long description",
        "entry_points": "list of 'group:name=module:attr'",
    },
)

def _dist_impl(ctx):
    lib = ctx.attr.library
    files = depset(transitive = [lib[DefaultInfo].files, lib[DefaultInfo].default_runfiles.files])
    return [JaxworksDistInfo(
        distribution = ctx.attr.distribution,
        version_file = ctx.file.version_file,
        deps_file = ctx.file.deps_file,
        package_root = ctx.attr.package_root,
        files = files,
        requires = ctx.attr.requires,
        extras = ctx.attr.extras,
        deps = [d[JaxworksDistInfo] for d in ctx.attr.deps],
        readme = ctx.file.readme,
        entry_points = ctx.attr.entry_points,
    )]

jaxworks_dist = rule(
    implementation = _dist_impl,
    attrs = {
        "distribution": attr.string(mandatory = True),
        "library": attr.label(mandatory = True),
        "version_file": attr.label(allow_single_file = [".py"], mandatory = True),
        "deps_file": attr.label(allow_single_file = [".py"], mandatory = True),
        "package_root": attr.string(mandatory = True),
        "requires": attr.string_list(),
        "extras": attr.string_list(),
        "deps": attr.label_list(providers = [JaxworksDistInfo]),
        "readme": attr.label(allow_single_file = [".md"]),
        "entry_points": attr.string_list(),
    },
)

def _wheel_impl(ctx):
    dists = [d[JaxworksDistInfo] for d in ctx.attr.dists]
    meta = ctx.attr.metapackage
    if not meta and len(dists) != 1:
        fail("jaxworks_wheel {}: a wheel with files holds exactly one dist; use metapackage = True".format(ctx.label))
    distribution = ctx.attr.distribution or dists[0].distribution

    args = ctx.actions.args()
    args.add("--distribution", distribution)
    inputs = [ctx.file.license]
    args.add("--license-file", ctx.file.license)
    if ctx.attr.version:
        args.add("--version", ctx.attr.version)
    else:
        args.add("--version-file", dists[0].version_file)
        inputs.append(dists[0].version_file)
    args.add("--summary", ctx.attr.summary)
    args.add("--python-tag", ctx.attr.python_tag)
    readme = ctx.file.readme or (None if meta else dists[0].readme)
    if readme:
        args.add("--readme", readme)
        args.add("--base-url", PROJECT_URL)
        args.add("--readme-dir", readme.owner.package)
        inputs.append(readme)
    args.add("--project-url", "Homepage, " + PROJECT_URL)
    args.add("--project-url", "Source, " + PROJECT_URL)

    manifest = []
    if meta:
        # Exactly the per-package wheels of this release; their own Requires-Dist bring jax and jaxlib.
        for d in dists:
            args.add("--pins-from", "{}={}".format(d.distribution, d.version_file.path))
            inputs.append(d.version_file)
    else:
        d = dists[0]
        if d.package_root:
            args.add("--project-url", "Changelog, {}/blob/main/{}/CHANGELOG.md".format(PROJECT_URL, d.package_root))
        args.add_all(d.requires, before_each = "--requires")
        args.add_all(d.extras, before_each = "--extra-requires")
        args.add("--deps-file", d.deps_file)
        inputs.append(d.deps_file)
        args.add_all(d.entry_points, before_each = "--entry-point")
        for dep in d.deps:
            # Requires-Dist on another jaxworks wheel, with its current version as the minimum.
            args.add("--requires-dist-from", "{}={}".format(dep.distribution, dep.version_file.path))
            inputs.append(dep.version_file)

        # Only files under the dist's own package_root/jaxworks/ go in; external repositories' files never do.
        # Paths are taken relative to the owning repository's root, so this holds when jaxworks is itself an
        # external repository of the workspace building the wheel.
        prefix = d.package_root + "/" if d.package_root else ""
        portable = ctx.files.extension_files
        for f in d.files.to_list():
            if f.owner == None or f.owner.workspace_name != ctx.label.workspace_name:
                continue
            short = f.short_path
            if short.startswith("../"):
                short = short.split("/", 2)[2]
            if not short.startswith(prefix + "jaxworks/"):
                continue
            if not (short.endswith(".py") or short.endswith(".pyi") or short.endswith(".so")):
                continue
            if portable and short.endswith(".so"):
                continue  # the host compiler's build, for the tests in the repository
            manifest.append("{}\t{}".format(f.path, short[len(prefix):]))
            inputs.append(f)
        for f in portable:
            # <package>/<target>/jaxworks/<pkg>/<module>.so -> jaxworks/<pkg>/<module>.so
            manifest.append("{}\t{}".format(f.path, "jaxworks/" + f.short_path.split("/jaxworks/", 1)[1]))
            inputs.append(f)
    manifest_file = ctx.actions.declare_file(ctx.label.name + ".files.txt")
    ctx.actions.write(manifest_file, "\n".join(sorted(manifest)) + "\n")
    inputs.append(manifest_file)
    args.add("--files", manifest_file)

    out = ctx.actions.declare_directory(ctx.label.name)
    args.add("--out-dir", out.path)
    ctx.actions.run(
        executable = ctx.executable._wheelmaker,
        arguments = [args],
        inputs = inputs,
        outputs = [out],
        mnemonic = "JaxworksWheel",
        progress_message = "Building wheel {}".format(distribution),
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

jaxworks_wheel = rule(
    implementation = _wheel_impl,
    attrs = {
        "dists": attr.label_list(providers = [JaxworksDistInfo], mandatory = True),
        "distribution": attr.string(doc = "defaults to the single dist's name"),
        "version": attr.string(doc = "defaults to the (first) dist's version.py"),
        "summary": attr.string(default = "jaxworks: add-ons for JAX's staging and dispatch path"),
        "metapackage": attr.bool(doc = "no files; requires each dist at its exact version"),
        "python_tag": attr.string(default = "cp311", doc = "the CPython of a wheel with extensions"),
        "extension_files": attr.label_list(
            allow_files = [".so"],
            doc = "the extensions to ship (zig_extension outputs) instead of the library's own",
        ),
        "readme": attr.label(allow_single_file = [".md"], doc = "defaults to the dist's README"),
        "license": attr.label(allow_single_file = True, default = "//:LICENSE"),
        "_wheelmaker": attr.label(default = "//tools/build_defs:wheelmaker", executable = True, cfg = "exec"),
    },
    doc = "A reproducible wheel (fixed timestamps, sorted entries, RECORD with sha256) in directory <name>/.",
)

def _sdist_impl(ctx):
    d = ctx.attr.dist[JaxworksDistInfo]
    args = ctx.actions.args()
    args.add("--sdist")
    args.add("--distribution", d.distribution)
    args.add("--version-file", d.version_file)
    args.add("--license-file", ctx.file.license)
    args.add("--pyproject", ctx.file.pyproject)
    inputs = [d.version_file, d.deps_file, ctx.file.license, ctx.file.pyproject]
    if ctx.file.setup_py:
        args.add("--setup-py", ctx.file.setup_py)
        inputs.append(ctx.file.setup_py)
    if d.readme:
        args.add("--readme", d.readme)
        args.add("--base-url", PROJECT_URL)
        args.add("--readme-dir", d.readme.owner.package)
        inputs.append(d.readme)
    args.add_all(d.requires, before_each = "--requires")
    args.add_all(d.extras, before_each = "--extra-requires")
    args.add("--deps-file", d.deps_file)
    for dep in d.deps:
        args.add("--requires-dist-from", "{}={}".format(dep.distribution, dep.version_file.path))
        inputs.append(dep.version_file)
    args.add_all(d.entry_points, before_each = "--entry-point")

    # The Python files exactly as the wheel selects them (no .so), plus the C++ sources of the extensions: those
    # under the package keep their path inside it (cc/...), shared ones their path in the repository (tools/cc/...).
    prefix = d.package_root + "/" if d.package_root else ""
    manifest = []
    for f in d.files.to_list():
        if f.owner == None or f.owner.workspace_name != ctx.label.workspace_name:
            continue
        short = f.short_path
        if short.startswith("../"):
            short = short.split("/", 2)[2]
        if short.startswith(prefix + "jaxworks/") and (short.endswith(".py") or short.endswith(".pyi")):
            manifest.append("{}\t{}".format(f.path, short[len(prefix):]))
            inputs.append(f)
    for f in ctx.files.cc_srcs:
        short = f.short_path
        if short.startswith("../"):
            short = short.split("/", 2)[2]
        manifest.append("{}\t{}".format(f.path, short[len(prefix):] if short.startswith(prefix) else short))
        inputs.append(f)
    manifest_file = ctx.actions.declare_file(ctx.label.name + ".files.txt")
    ctx.actions.write(manifest_file, "\n".join(sorted(manifest)) + "\n")
    inputs.append(manifest_file)
    args.add("--files", manifest_file)

    out = ctx.actions.declare_directory(ctx.label.name)
    args.add("--out-dir", out.path)
    ctx.actions.run(
        executable = ctx.executable._wheelmaker,
        arguments = [args],
        inputs = inputs,
        outputs = [out],
        mnemonic = "JaxworksSdist",
        progress_message = "Building sdist {}".format(d.distribution),
    )
    return [DefaultInfo(files = depset([out]), runfiles = ctx.runfiles(files = [out]))]

jaxworks_sdist = rule(
    implementation = _sdist_impl,
    attrs = {
        "dist": attr.label(providers = [JaxworksDistInfo], mandatory = True),
        "pyproject": attr.label(allow_single_file = [".toml"], mandatory = True),
        "setup_py": attr.label(allow_single_file = [".py"]),
        "cc_srcs": attr.label_list(allow_files = True, doc = "C++ sources and headers of the extensions"),
        "license": attr.label(allow_single_file = True, default = "//:LICENSE"),
        "_wheelmaker": attr.label(default = "//tools/build_defs:wheelmaker", executable = True, cfg = "exec"),
    },
    doc = "The sdist <dist>-<version>.tar.gz (in directory <name>/): the wheel's Python files, the extensions' C++ " +
          "sources, pyproject.toml (setuptools, checked against the wheel's metadata) and setup.py.",
)
