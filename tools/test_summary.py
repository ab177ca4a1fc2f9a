"""Adds up the test cases of a `bazel test` run from the JUnit XML files in bazel-testlogs.

Prints one closing line, `tests: N passed, N failed, N skipped`, and exits 1 if any failed. GPU and TPU targets
(never run on a CPU machine) are left out.
"""

import os
import sys
import xml.etree.ElementTree as ET


def summarize(testlogs):
    passed = failed = skipped = 0
    for root, _, files in os.walk(testlogs, followlinks=True):
        if "test.xml" not in files or root.endswith(("_gpu", "_tpu")):
            continue
        tree = ET.parse(os.path.join(root, "test.xml"))
        for suite in tree.iter("testsuite"):
            cases = suite.findall("testcase")
            for case in cases:
                if case.find("failure") is not None or case.find("error") is not None:
                    failed += 1
                elif case.find("skipped") is not None:
                    skipped += 1
                else:
                    passed += 1
    return passed, failed, skipped


if __name__ == "__main__":
    p, f, s = summarize(sys.argv[1] if len(sys.argv) > 1 else "bazel-testlogs")
    print(f"tests: {p} passed, {f} failed, {s} skipped")
    sys.exit(1 if f else 0)
