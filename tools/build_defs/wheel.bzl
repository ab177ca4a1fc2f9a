"""Reproducible wheels from jaxworks packages.

`jaxworks_dist` describes one distribution (name, version file, requirements, files); `jaxworks_wheel` zips one or
more of them into a wheel (a per-package wheel, or the combined `jaxworks` wheel at //:wheel). The wheel is written
into a directory `<name>/` under its correct file name, since the version is read from version.py at build time.
"""

JaxworksDistInfo = provider(
    doc = "One jaxworks distribution.",
    fields = {
        "distribution": "distribution name, e.g. jaxworks-jit-cache",
        "version_file": "File: the package's version.py",
        "package_root": "workspace-relative directory whose jaxworks/ tree the wheel holds",
        "files": "depset of Files (sources, stubs, extensions) of the library and its deps",
        "requires": "list of PyPI requirement strings",
        "deps": "list of JaxworksDistInfo of the jaxworks packages it depends on",
    },
)

def _dist_impl(ctx):
    lib = ctx.attr.library
    files = depset(transitive = [lib[DefaultInfo].files, lib[DefaultInfo].default_runfiles.files])
    return [JaxworksDistInfo(
        distribution = ctx.attr.distribution,
        version_file = ctx.file.version_file,
        package_root = ctx.attr.package_root,
        files = files,
        requires = ctx.attr.requires,
        deps = [d[JaxworksDistInfo] for d in ctx.attr.deps],
    )]

jaxworks_dist = rule(
    implementation = _dist_impl,
    attrs = {
        "distribution": attr.string(mandatory = True),
        "library": attr.label(mandatory = True),
        "version_file": attr.label(allow_single_file = [".py"], mandatory = True),
        "package_root": attr.string(mandatory = True),
        "requires": attr.string_list(),
        "deps": attr.label_list(providers = [JaxworksDistInfo]),
    },
)

def _wheel_impl(ctx):
    dists = [d[JaxworksDistInfo] for d in ctx.attr.dists]
    if ctx.attr.distribution:
        distribution = ctx.attr.distribution
    elif len(dists) == 1:
        distribution = dists[0].distribution
    else:
        fail("jaxworks_wheel {}: several dists need an explicit distribution name".format(ctx.label))

    args = ctx.actions.args()
    args.add("--distribution", distribution)
    inputs = []
    if ctx.attr.version:
        args.add("--version", ctx.attr.version)
    else:
        args.add("--version-file", dists[0].version_file)
        inputs.append(dists[0].version_file)
    args.add("--summary", ctx.attr.summary)

    inside = {d.distribution: True for d in dists}
    requires = []
    for d in dists:
        for r in d.requires:
            if r not in requires:
                requires.append(r)
        for dep in d.deps:
            if dep.distribution not in inside:
                # Requires-Dist on another jaxworks wheel, with its current version as the minimum.
                args.add("--requires-dist-from", "{}={}".format(dep.distribution, dep.version_file.path))
                inputs.append(dep.version_file)
    args.add_all(requires, before_each = "--requires")

    # Only files under each dist's own package_root/jaxworks/ go in; external repositories' files never do.
    manifest = []
    for d in dists:
        prefix = d.package_root + "/" if d.package_root else ""
        for f in d.files.to_list():
            if f.owner == None or f.owner.workspace_name != ctx.label.workspace_name:
                continue
            short = f.short_path
            if not short.startswith(prefix + "jaxworks/"):
                continue
            if not (short.endswith(".py") or short.endswith(".pyi") or short.endswith(".so")):
                continue
            manifest.append("{}\t{}".format(f.path, short[len(prefix):]))
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
        "_wheelmaker": attr.label(default = "//tools/build_defs:wheelmaker", executable = True, cfg = "exec"),
    },
    doc = "A reproducible wheel (fixed timestamps, sorted entries, RECORD with sha256) in directory <name>/.",
)
