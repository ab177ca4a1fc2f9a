"""Rules of the checkpoint layer's code, read from its source (ast): whether
a path is local or a bucket's URL is asked only where paths are opened and
stored (destination, storage, stores, gcs, remote): nowhere else a URL
scheme, a test of one, or a class of one kind of place. (The rule of at most
8 parameters covers every package: tests/parameters_test.py.)"""

import ast
import pathlib

# Private imports below: the checkpoint layer's own source is read.
from jaxworks.batched_transfer._src import checkpoint

SRC = pathlib.Path(checkpoint.__file__).parent
MODULES = sorted(SRC.glob("*.py"))

#: Where a path or URL may be read, and one kind of place named.
PLACES = {
  "destination",
  "local",
  "bucket",
  "storage",
  "stores",
  "gcs",
  "remote",
}
#: Names that tell a local path from a URL, or name one kind of place.
KIND_NAMES = {
  "is_url", "is_remote", "SCHEMES", "LocalStorage", "ObstoreStorage",
  "LocalDirectory", "LocalNpz", "BucketPrefix", "BucketNpz", "Location",
  "parse", "open_storage",
}  # fmt: skip


def _kind_tests(tree):
  """Lines that tell a local path from a URL: a ``scheme://`` literal
  compared or searched for, a scheme attribute, a name of one kind."""
  found = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
      if node.value.endswith("://") and " " not in node.value:
        found.append((node.lineno, repr(node.value)))
    elif isinstance(node, ast.Attribute):
      base = node.value.id if isinstance(node.value, ast.Name) else ""
      if node.attr == "parse" and base not in ("storage", "stores"):
        continue  # another parse (steps.StepNames.parse)
      if node.attr in KIND_NAMES | {"remote", "scheme"} and base != "remote":
        found.append((node.lineno, node.attr))
    elif isinstance(node, ast.Name) and node.id in KIND_NAMES:
      found.append((node.lineno, node.id))
    elif isinstance(node, ast.alias) and node.name in KIND_NAMES:
      found.append((getattr(node, "lineno", 0), node.name))
  return found


def test_only_the_place_modules_tell_a_path_from_a_url():
  found = []
  for path in MODULES:
    if path.stem in PLACES:
      continue
    for line, what in _kind_tests(ast.parse(path.read_text())):
      found.append(f"{path.name}:{line} {what}")
  assert not found, f"local-versus-bucket tests outside {PLACES}: {found}"


def test_the_rules_see_what_they_look_for():
  bad = ast.parse(
    "x = path.partition('://')[0] in SCHEMES\n"
    "y = loc.remote or storage.is_url(p)\n"
  )
  assert {w for _, w in _kind_tests(bad)} == {
    "'://'", "SCHEMES", "remote", "is_url",
  }  # fmt: skip
