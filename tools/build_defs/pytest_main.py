"""Runs pytest inside a Bazel py_test (see jaxworks_test in defs.bzl).

Arguments are test files (runfiles paths) and pytest options. Honours XML_OUTPUT_FILE (JUnit XML that Bazel keeps in
bazel-testlogs) and TESTBRIDGE_TEST_ONLY (`bazel test --test_filter=EXPR` becomes `pytest -k EXPR`), and exits with
pytest's status, so a failing test fails the target.
"""

import json
import os
import sys

import pytest


class _JaxworksOptions:
  """Options of tools/build_defs/doctest_test.py, which pytest only accepts from a plugin."""

  @staticmethod
  def pytest_addoption(parser):
    parser.addoption(
      "--jaxworks-package",
      default=None,
      help="package whose docstrings run as doctests",
    )
    parser.addoption(
      "--jaxworks-readme",
      default=None,
      help="README whose >>> examples run as doctests",
    )


_ACCELERATORS = {"cuda": "GPU", "rocm": "GPU", "tpu": "TPU"}


def require_accelerator():
  """On a _gpu/_tpu target, exit at once with one line when JAX sees no such device (e.g. on a CPU machine)."""
  # The first platform listed is the target's device (tpu,cpu: the TPU, with
  # the host CPU beside it for host callbacks).
  platform = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip()
  what = _ACCELERATORS.get(platform)
  if what is None:
    return
  # Probe quietly: a missing driver makes JAX's plugins log tracebacks (Python and C++) on stderr.
  saved = os.dup(2)
  devnull = os.open(os.devnull, os.O_WRONLY)
  os.dup2(devnull, 2)
  try:
    import jax

    count = len(jax.devices(platform))
    reason = "JAX lists none"
  except Exception as e:  # noqa: BLE001 - any failure to initialise the backend means "no device"
    message = (
      str(e).strip().splitlines()[0]
      if str(e).strip()
      else "backend failed to initialise"
    )
    count, reason = 0, f"{type(e).__name__}: {message}"
  finally:
    os.dup2(saved, 2)
    os.close(saved)
    os.close(devnull)
  if not count:
    config = "gpu" if what == "GPU" else "tpu"
    print(
      f"no {what} visible to JAX (JAX_PLATFORMS={platform}: {reason}); run the {platform} targets on a "
      f"machine with a {what}: ./tools/bazel test //... --config={config}",
      file=sys.stderr,
    )
    sys.exit(1)


def main():
  require_accelerator()
  args = list(sys.argv[1:])
  args += ["-p", "no:cacheprovider", "-q", "-rfE"]
  xml = os.environ.get("XML_OUTPUT_FILE")
  if xml:
    args.append(f"--junitxml={xml}")
  only = os.environ.get("TESTBRIDGE_TEST_ONLY")
  if only:
    args += ["-k", only]
  # Hypothesis keeps its example database out of the read-only runfiles tree.
  os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY",
    os.path.join(os.environ.get("TEST_TMPDIR", "/tmp"), ".hypothesis"),
  )
  status = pytest.main(args, plugins=[_JaxworksOptions()])
  devices = os.environ.get("JAXWORKS_DEVICES_FILE")
  if devices:
    write_devices(devices)
  sys.exit(status)


def write_devices(path):
  """Writes which devices the tests ran on, as JSON (tools/hardware_tests.py
  puts them in its results)."""
  try:
    import jax

    device = jax.devices()[0]
    info = {
      "platform": device.platform,
      "device_kind": device.device_kind,
      "device_count": jax.device_count(),
      "platform_version": " ".join(
        str(getattr(device.client, "platform_version", "")).split()
      ),
    }
  except Exception as e:  # noqa: BLE001 - reported by the reader
    info = {"error": f"{type(e).__name__}: {e}"}
  with open(path, "w", encoding="utf-8") as f:
    json.dump(info, f)


if __name__ == "__main__":
  main()
