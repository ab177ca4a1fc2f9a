"""dep_check's version comparison against ``packaging``, the oracle.

``contains`` compares plain release numbers itself (so that importing a
jaxworks package need not import ``packaging``) and hands everything else
to ``packaging``: on generated versions and specifiers both must agree.
"""

import itertools
import random
import subprocess
import sys

import dep_check
from packaging.specifiers import SpecifierSet
import pytest

_RNG = random.Random(20261202)


def _release() -> str:
  return ".".join(
    str(_RNG.choice([0, 0, 1, 2, 9, 10, 11])) for _ in range(_RNG.randint(1, 4))
  )


def _version() -> str:
  """Mostly releases, some with PEP 440's other parts (and a few invalid)."""
  v = _release()
  extra = _RNG.choice(
    ["", "", "", "rc1", "a0", ".post1", ".dev3", "+local", "-x"]
  )
  return v + extra


def _spec() -> str:
  clauses = []
  for _ in range(_RNG.randint(1, 3)):
    op = _RNG.choice([">=", "<=", "==", "!=", "<", ">", "~="])
    tail = (
      _RNG.choice(["", "", "", "", ".*", "rc1"]) if op in ("==", "!=") else ""
    )
    clauses.append(
      f"{op}{_release()}{tail}" if tail != ".*" else f"{op}{_release()}.*"
    )
  return _RNG.choice([",", ", "]).join(clauses)


@pytest.mark.parametrize("seed", range(4))
def test_contains_agrees_with_packaging(seed):
  del seed  # four batches of the one generator
  checked = fast = 0
  for version, spec in itertools.product(
    [_version() for _ in range(60)], [_spec() for _ in range(40)]
  ):
    try:
      want = version in SpecifierSet(spec, prereleases=True)
    except Exception as e:  # pylint: disable=broad-except
      with pytest.raises(type(e)):
        dep_check.contains(spec, version)
      continue
    assert dep_check.contains(spec, version) == want, (spec, version)
    checked += 1
    fast += bool(dep_check._RELEASE.fullmatch(version)) and all(  # pylint: disable=protected-access
      dep_check._CLAUSE.fullmatch(c)
      for c in spec.split(",")  # pylint: disable=protected-access
    )
  assert checked > 1500 and fast > 300  # both paths are exercised


def test_the_supported_range_by_hand():
  spec = ">=0.10.2,<0.11"
  assert dep_check.contains(spec, "0.10.2") and dep_check.contains(
    spec, "0.10.10"
  )
  assert not dep_check.contains(spec, "0.11") and not dep_check.contains(
    spec, "0.11.0"
  )
  assert not dep_check.contains(spec, "0.10.1") and not dep_check.contains(
    spec, "0.9.9"
  )
  assert dep_check.contains(spec, "0.10.3.dev20261201")  # a nightly: packaging
  assert not dep_check.contains(spec, "0.11.0rc1")
  assert dep_check.contains("==0.10", "0.10.0") and not dep_check.contains(
    "!=0.10", "0.10.0.0"
  )


def test_a_plain_check_does_not_import_packaging():
  code = (
    "import sys, dep_check\n"
    "dep_check.check_version('a', 'b', '0.10.2', '0.10.0')\n"
    "assert not dep_check.contains('>=0.10.2,<0.11', '0.11.1')\n"
    "print('packaging' in sys.modules)\n"
  )
  out = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    check=True,
    env={"PYTHONPATH": ":".join(sys.path)},
  )
  assert out.stdout.strip() == "False"
