"""Adds up the test cases that one ``bazel test`` invocation ran.

Usage::

  python3 tools/test_summary.py --allowlist tests/skip_allowlist.txt BEP.json...

Each ``BEP.json`` is the ``--build_event_json_file`` of one ``bazel test``
invocation. Only the test targets that invocation reported are counted (never
leftovers of deleted targets or older runs still lying in ``bazel-testlogs``),
from the JUnit file each one wrote. Prints one closing line::

  tests: N passed, N failed, N skipped

and exits 1 when a test case failed, a test target failed without a JUnit file
saying why, no test ran at all, or a test case was skipped without an entry in
the allowlist. The allowlist holds one skipped test case per line,
``<target label> <test case id> # reason``; ``*`` as the test case id allows any
case of that target (for GPU/TPU-only targets, for example).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import urllib.parse
import xml.etree.ElementTree as ET


@dataclasses.dataclass
class Summary:
  passed: int = 0
  failed: int = 0
  skipped: int = 0
  problems: list[str] = dataclasses.field(default_factory=list)

  def line(self) -> str:
    return (
      f"tests: {self.passed} passed, {self.failed} failed, "
      f"{self.skipped} skipped"
    )


def read_allowlist(path: str | None) -> dict[str, set[str]]:
  """Maps target label -> allowed skipped case ids (``*`` for any)."""
  allowed: dict[str, set[str]] = {}
  if not path:
    return allowed
  with open(path, encoding="utf-8") as f:
    for number, raw in enumerate(f, 1):
      line = raw.strip()
      if not line or line.startswith("#"):
        continue
      entry, _, reason = line.partition("#")
      fields = entry.split()
      if len(fields) != 2 or not reason.strip():
        raise ValueError(
          f"{path}:{number}: expected '<target label> <test case id> "
          f"# reason', got {raw.rstrip()!r}"
        )
      allowed.setdefault(fields[0], set()).add(fields[1])
  return allowed


def test_results(bep_path: str) -> list[tuple[str, str, str | None]]:
  """(label, status, path of test.xml or None) per test run in a BEP file."""
  results = []
  with open(bep_path, encoding="utf-8") as f:
    for raw in f:
      if not raw.strip():
        continue
      event = json.loads(raw)
      ident = event.get("id", {}).get("testResult")
      if ident is None:
        continue
      result = event.get("testResult", {})
      xml = None
      for output in result.get("testActionOutput", []):
        if output.get("name") == "test.xml":
          uri = output.get("uri", "")
          xml = urllib.parse.unquote(urllib.parse.urlparse(uri).path)
      results.append((ident["label"], result.get("status", "NO_STATUS"), xml))
  return results


def _case_id(case: ET.Element) -> str:
  classname = case.get("classname", "")
  name = case.get("name", "")
  return f"{classname}::{name}" if classname else name


def summarize(bep_paths: list[str], allowed: dict[str, set[str]]) -> Summary:
  summary = Summary()
  targets = 0
  for bep in bep_paths:
    for label, status, xml in test_results(bep):
      targets += 1
      counted_failures = 0
      if xml is not None:
        try:
          tree = ET.parse(xml)
        except (OSError, ET.ParseError) as e:
          summary.problems.append(f"{label}: unreadable JUnit file {xml}: {e}")
          tree = None
        if tree is not None:
          for case in tree.iter("testcase"):
            if (
              case.find("failure") is not None or case.find("error") is not None
            ):
              summary.failed += 1
              counted_failures += 1
            elif case.find("skipped") is not None:
              summary.skipped += 1
              case_id = _case_id(case)
              ok = allowed.get(label, set())
              if "*" not in ok and case_id not in ok:
                summary.problems.append(
                  f"{label}: {case_id} was skipped and is not in the "
                  "skip allowlist (tests/skip_allowlist.txt)"
                )
            else:
              summary.passed += 1
      if status != "PASSED" and counted_failures == 0:
        # A timeout, a crash or a build failure: no test case says so.
        summary.failed += 1
        summary.problems.append(f"{label}: {status}")
  if targets == 0:
    summary.problems.append("no test target ran")
  return summary


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("bep", nargs="+", help="--build_event_json_file output")
  parser.add_argument("--allowlist", help="skipped test cases allowed")
  args = parser.parse_args(argv)
  summary = summarize(args.bep, read_allowlist(args.allowlist))
  for problem in summary.problems:
    print(f"test_summary: {problem}")
  print(summary.line())
  return 1 if summary.failed or summary.problems else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
