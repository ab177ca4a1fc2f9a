"""Platform names: validation, platforms present, choice of a platform to run on."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import pytest

# Private imports below: choose_platform (the platform Compiled/Exported run on)
# has no public entry.
from jaxworks import stages_aot as sa
from jaxworks.stages_aot._src.platforms import choose_platform


def test_known_platforms():
  assert sa.KNOWN_PLATFORMS == ("cpu", "cuda", "rocm", "tpu")


def test_canonical_platforms_keeps_order():
  assert sa.canonical_platforms(["tpu", "cpu", "rocm"], api="t") == (
    "tpu",
    "cpu",
    "rocm",
  )
  assert sa.canonical_platforms(None, api="t") == (
    jax.export.default_export_platform(),
  )


def test_present_platforms_match_devices():
  present = sa.present_platforms()
  assert present[0] == jax.export.default_export_platform()
  assert {d.platform.replace("gpu", "cuda") for d in jax.devices()} <= set(
    present
  ) | {"gpu"}
  assert "cpu" in present


def test_choose_platform():
  # The default platform when it was lowered for (the TPU on a TPU machine),
  # else the CPU.
  default = sa.present_platforms()[0]
  want = default if default in ("tpu", "cpu") else "cpu"
  assert choose_platform(("tpu", "cpu"), None, api="t", fun_name="f") == want
  assert choose_platform(("cpu",), "cpu", api="t", fun_name="f") == "cpu"
  absent = "tpu" if "tpu" not in sa.present_platforms() else "rocm"
  with pytest.raises(
    ValueError,
    match=rf"t: 'f' was lowered for \('{absent}',\), but the platforms "
    "present on this host are",
  ):
    choose_platform((absent,), None, api="t", fun_name="f")
  with pytest.raises(
    ValueError, match=r"'f' was lowered for \('cpu',\), not for 'tpu'"
  ):
    choose_platform(("cpu",), "tpu", api="t", fun_name="f")
  with pytest.raises(
    ValueError,
    match="t: lowering platform 'gpu' is ambiguous; write 'cuda' or 'rocm'",
  ):
    choose_platform(("cpu",), "gpu", api="t", fun_name="f")
  with pytest.raises(
    ValueError, match="t: unknown lowering platform 'CPU'; did you mean 'cpu'"
  ):
    choose_platform(("cpu",), "CPU", api="t", fun_name="f")
  with pytest.raises(
    TypeError, match=r"t: lowering platform \('cpu',\) is not a string"
  ):
    choose_platform(("cpu",), ("cpu",), api="t", fun_name="f")


def test_bad_platform_types():
  with pytest.raises(TypeError, match="got 7"):
    sa.canonical_platforms(7, api="t")
