"""What can be checked offline of the bzlmod build (MODULE.bazel), which no Bazel here can run.

Bazel >= 7 cannot be installed on the project's machines, so MODULE.bazel is read with regular expressions over its
small Starlark subset: every repository name brought in with use_repo is defined, every requirement a BUILD file
names is in the lock of the hub it resolves to, the runtime and development locks agree, and the pins are ones that
support Bazel 7 and 8. Whether Bazel itself accepts the file is not verified here (README.md, "Bazel modes").
"""

import ast
import os
import pathlib
import re

import pytest


def _root():
  srcdir = os.environ.get("TEST_SRCDIR")
  if srcdir:
    root = pathlib.Path(srcdir) / os.environ.get("TEST_WORKSPACE", "jaxworks")
    if (root / "MODULE.bazel").exists():
      return root
  return pathlib.Path(__file__).resolve().parent.parent


ROOT = _root()


def _strip_comments(text):
  return "\n".join(line.split("#")[0] for line in text.splitlines())


def _module():
  text = (ROOT / "MODULE.bazel").read_text()
  return _strip_comments(
    ast.get_docstring(ast.parse(text)) and text.split('"""', 2)[2] or text
  )


def _calls(text, name):
  """Argument strings of each `name(...)` call (no nested parentheses in this file's calls but one level)."""
  return re.findall(
    r"\b" + re.escape(name) + r"\((.*?)\)\s*$", text, re.S | re.M
  )


def _kwargs(args):
  return dict(re.findall(r"(\w+)\s*=\s*(\"[^\"]*\"|True|False)", args))


def _lock(name):
  pins = {}
  for line in (ROOT / name).read_text().splitlines():
    line = line.split("#")[0].strip()
    if line:
      req, _, version = line.partition("==")
      pins[re.sub(r"[-_.]+", "_", req.lower())] = version
  return pins


def _extensions(text):
  """var -> (extension file, extension name, dev_dependency)."""
  out = {}
  pattern = r"^(\w+)\s*=\s*use_extension\(\s*\"([^\"]+)\",\s*\"(\w+)\"(.*?)\)"
  for var, path, ext, rest in re.findall(pattern, text, re.M | re.S):
    out[var] = (path, ext, "dev_dependency = True" in rest)
  return out


def _use_repos(text):
  """(var, apparent name, repository name) for each name a use_repo brings in."""
  out = []
  for var, args in re.findall(r"use_repo\(\s*(\w+)\s*,(.*?)\)", text, re.S):
    for item in [a.strip() for a in args.split(",") if a.strip()]:
      if "=" in item:
        apparent, repo = (x.strip().strip('"') for x in item.split("=", 1))
      else:
        apparent = repo = item.strip('"')
      out.append((var, apparent, repo))
  return out


def _hubs(text):
  """var -> {hub name: requirements lock file} of its `var.parse(...)` tags."""
  hubs = {}
  for var, args in re.findall(r"^(\w+)\.parse\((.*?)\)", text, re.M | re.S):
    kw = _kwargs(args)
    lock = kw["requirements_lock"].strip('"').removeprefix("//:")
    hubs.setdefault(var, {})[kw["hub_name"].strip('"')] = lock
  return hubs


# Repositories that other modules' extensions define (not checkable offline beyond this list).
_KNOWN_EXTENSION_REPOS = {
  (
    "@pybind11_bazel//:internal_configure.bzl",
    "internal_configure_extension",
  ): {"pybind11"}
}


def test_every_use_repo_name_is_defined():
  text = _module()
  extensions, hubs = _extensions(text), _hubs(text)
  repos = _use_repos(text)
  assert repos, (
    "no use_repo found: the reader no longer understands MODULE.bazel"
  )
  for var, apparent, repo in repos:
    assert var in extensions, (
      f"use_repo({var}, ...): {var} is not a use_extension result"
    )
    path, ext, _ = extensions[var]
    if ext == "pip":
      assert repo in hubs.get(var, {}), (
        f"use_repo({var}, {apparent} = {repo!r}): no {var}.parse(hub_name = {repo!r})"
      )
    else:
      assert repo in _KNOWN_EXTENSION_REPOS.get((path, ext), set()), (
        f"{repo} is not defined by {path}%{ext}"
      )


def test_apparent_names_are_the_labels_build_files_use():
  apparent = {a for _, a, _ in _use_repos(_module())}
  assert {"pypi", "pypi_dev", "pybind11"} <= apparent, apparent


def test_hubs_are_namespaced_and_dev_hub_is_a_dev_dependency():
  text = _module()
  extensions, hubs = _extensions(text), _hubs(text)
  by_apparent = {a: (v, r) for v, a, r in _use_repos(text)}
  for var, names in hubs.items():
    for hub in names:
      # A consumer that names its own hub `pypi` must not clash with ours.
      assert hub.startswith("jaxworks_"), hub
  runtime_var, runtime_hub = by_apparent["pypi"]
  dev_var, dev_hub = by_apparent["pypi_dev"]
  assert not extensions[runtime_var][2], (
    "the runtime hub must reach projects that depend on jaxworks"
  )
  assert extensions[dev_var][2], (
    "the test/benchmark hub must be a dev_dependency"
  )
  assert hubs[runtime_var][runtime_hub] == "requirements_runtime.txt"
  assert hubs[dev_var][dev_hub] == "requirements_lock.txt"


def _venv_bzl():
  return (ROOT / "tools" / "build_defs" / "venv.bzl").read_text()


def _function_body(text, name):
  m = re.search(rf"^def {name}\(.*?(?=^\S)", text + "\nEND", re.M | re.S)
  assert m, f"venv.bzl has no {name}()"
  return m.group(0)


def test_workspace_mode_takes_jaxworks_names_and_maps_them_as_bzlmod_does():
  """WORKSPACE mode: the repositories a consumer gets are all jaxworks_*, and
  the repo_mapping it is told to use sends the BUILD files' apparent names
  to the same hubs as MODULE.bazel's use_repo."""
  text = _venv_bzl()
  for fn in (
    "jaxworks_python_repositories",
    "jaxworks_accelerator_repositories",
  ):
    names = re.findall(r'\bname = "([^"]+)"', _function_body(text, fn))
    assert names and all(n.startswith("jaxworks_") for n in names), (fn, names)
  mapping = ast.literal_eval(
    re.search(r"^JAXWORKS_REPO_MAPPING = (\{.*?\})", text, re.M | re.S).group(1)
  )
  by_apparent = {a: r for _, a, r in _use_repos(_module())}
  for apparent in ("pypi", "pypi_dev"):
    assert mapping["@" + apparent] == "@" + by_apparent[apparent], apparent
  assert set(mapping) == {"@pypi", "@pypi_dev", "@pybind11"}, mapping
  assert all(v.startswith("@jaxworks_") for v in mapping.values()), mapping
  # The default lock a consumer gets is the runtime lock.
  default = re.search(
    r'def jaxworks_python_repositories\(\s*requirements = "([^"]+)"', text
  )
  assert default and default.group(1).endswith(":requirements_runtime.txt")


def test_runtime_lock_agrees_with_the_development_lock():
  runtime, full = (
    _lock("requirements_runtime.txt"),
    _lock("requirements_lock.txt"),
  )
  assert runtime, "empty runtime lock"
  for name, version in runtime.items():
    assert full.get(name) == version, (
      f"{name}: runtime pins {version}, development lock {full.get(name)}"
    )
  # The runtime lock holds what the libraries need and not test tools.
  assert {"jax", "jaxlib", "numpy"} <= set(runtime)
  assert not {"pytest", "hypothesis", "matplotlib", "auditwheel"} & set(runtime)


def _build_files():
  return [
    p
    for p in ROOT.rglob("BUILD.bazel")
    if not any(part.startswith("bazel-") for part in p.relative_to(ROOT).parts)
    and "third_party" not in p.relative_to(ROOT).parts
    and "consumer" not in p.relative_to(ROOT).parts
  ]


def _requirements_named_in_builds():
  """{"pypi" | "pypi_dev": {requirement: first BUILD file naming it}}."""
  named = {"pypi": {}, "pypi_dev": {"pytest": "tools/build_defs/defs.bzl"}}
  for path in _build_files():
    text = _strip_comments(path.read_text())
    rel = str(path.relative_to(ROOT))
    for macro, args in re.findall(
      r"^(\w+)\((.*?)^\)", text, re.M | re.S
    ) + re.findall(r"^(jaxworks_\w+)\((.*?)\)$", text, re.M):
      m = re.search(r"\bpypi\s*=\s*\[([^\]]*)\]", args)
      if m:
        hub = "pypi" if macro == "jaxworks_package" else "pypi_dev"
        for req in re.findall(r"\"([^\"]+)\"", m.group(1)):
          named[hub].setdefault(re.sub(r"[-_.]+", "_", req.lower()), rel)
    for hub, req in re.findall(r"(pypi_dev|pypi)\(\"([^\"]+)\"\)", text):
      named[hub].setdefault(re.sub(r"[-_.]+", "_", req.lower()), rel)
    for hub, req in re.findall(r"@(pypi_dev|pypi)//([\w]+)", text):
      named[hub].setdefault(req, rel)
  return named


def test_every_requirement_label_is_in_its_hubs_lock():
  named = _requirements_named_in_builds()
  assert named["pypi"] and len(named["pypi_dev"]) > 1, named
  locks = {
    "pypi": _lock("requirements_runtime.txt"),
    "pypi_dev": _lock("requirements_lock.txt"),
  }
  for hub, reqs in named.items():
    for req, where in reqs.items():
      assert req in locks[hub], (
        f"{where} names @{hub}//{req}, which the {hub} hub's lock does not pin"
      )


def _bazel_deps():
  return {
    m.group(1): m.group(2)
    for m in re.finditer(
      r"bazel_dep\(\s*name\s*=\s*\"([^\"]+)\",\s*version\s*=\s*\"([^\"]+)\"",
      _module(),
    )
  }


def _version(v):
  return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def test_pins_support_bazel_7_and_8():
  deps = _bazel_deps()
  # rules_python < 1.0 and rules_cc < 0.1 predate Bazel 8 support.
  assert _version(deps["rules_python"]) >= (1, 0, 0), deps
  assert _version(deps["rules_cc"]) >= (0, 1, 0), deps
  assert "platforms" in deps


def test_pybind11_agrees_in_both_modes():
  # pybind11_bazel X brings pybind11 X; the WORKSPACE build compiles against the lock's pybind11.
  assert (
    _bazel_deps()["pybind11_bazel"]
    == _lock("requirements_lock.txt")["pybind11"]
  )


def test_workspace_bzlmod_is_empty():
  # Bazel 7 in bzlmod mode still reads WORKSPACE unless WORKSPACE.bzlmod exists.
  text = (ROOT / "WORKSPACE.bzlmod").read_text()
  assert not _strip_comments(text).strip(), (
    "WORKSPACE.bzlmod must hold comments only"
  )


def test_module_version_is_the_combined_wheels():
  module_version = re.search(
    r"module\(\s*name\s*=\s*\"jaxworks\",\s*version\s*=\s*\"([^\"]+)\"",
    _module(),
  ).group(1)
  build = (ROOT / "BUILD.bazel").read_text()
  wheel_version = re.search(
    r"distribution = \"jaxworks\",\s*version = \"([^\"]+)\"", build
  ).group(1)
  assert module_version == wheel_version


@pytest.mark.parametrize(
  "broken, expected",
  [
    ('use_repo(pip, pypi = "nope")', "no pip.parse"),
  ],
)
def test_reader_finds_an_undefined_repository(broken, expected, monkeypatch):
  """The checks can fail: an undefined use_repo name is reported."""
  text = _module() + "\n" + broken + "\n"
  monkeypatch.setattr(__import__(__name__), "_module", lambda: text)
  with pytest.raises(AssertionError, match=expected):
    test_every_use_repo_name_is_defined()
