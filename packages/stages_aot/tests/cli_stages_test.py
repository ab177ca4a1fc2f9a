"""The CLI's failures, one per stage, each through a subprocess, and the umask.

Every stage failure exits with status 1 and prints one line naming the stage (import,
trace, lowering for platform P, export, save), not a traceback.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import re
import stat

from cli_runner import run_cli
import pytest

FAILING_MODULE = """
import jax
from jax.extend.core import Primitive
from jax.interpreters import mlir

def trace_fails(x):
    raise TypeError("cannot trace this\\nsecond line of the message")

cpu_only_p = Primitive("cpu_only_demo")
cpu_only_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(cpu_only_p, lambda ctx, x: [x], platform="cpu")

def lowers_on_cpu_only(x):
    return cpu_only_p.bind(x) * 2

def export_fails(x):
    return jax.pure_callback(lambda a: a, jax.ShapeDtypeStruct(x.shape, x.dtype), x)

def count(n):
    return n * 2
"""


@pytest.fixture
def workdir(tmp_path):
  (tmp_path / "cli_failing_mod.py").write_text(FAILING_MODULE)
  (tmp_path / "cli_broken_mod.py").write_text(
    "raise RuntimeError('broken at import')\n"
  )
  (tmp_path / "a_file").write_text("not a directory\n")
  return tmp_path


# Lines that XLA's C++ logging may add to stderr (glog format), not the CLI's.
GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d")


@pytest.mark.parametrize(
  "argv, message",
  [
    (
      ["cli_broken_mod:f"],
      "import of 'cli_broken_mod' failed: RuntimeError: broken at import",
    ),
    (
      ["cli_failing_mod:trace_fails"],
      "trace of cli_failing_mod:trace_fails(f32[3]) failed: TypeError: cannot trace this second line of the message",
    ),
    (
      [
        "cli_failing_mod:lowers_on_cpu_only",
        "--platform",
        "cpu",
        "--platform",
        "tpu",
      ],
      "lowering for platform tpu failed: NotImplementedError: MLIR translation rule for primitive 'cpu_only_demo' not found for platform tpu",
    ),
    (
      ["cli_failing_mod:export_fails"],
      "export of cli_failing_mod:export_fails failed: NotImplementedError: serialization of host_callbacks",
    ),
    (
      ["cli_failing_mod:lowers_on_cpu_only", "--out", "a_file/art"],
      "save to a_file/art failed: FileExistsError: ",
    ),
  ],
)
def test_each_failing_stage_is_one_line_and_exit_1(workdir, argv, message):
  target, *rest = argv
  if "--out" not in rest:
    rest += ["--out", "art"]
  r = run_cli(workdir, "export", target, "--arg", "f32[3]", *rest)
  assert r.returncode == 1, (r.stdout, r.stderr)
  lines = [l for l in r.stderr.splitlines() if not GLOG_LINE.match(l)]
  assert len(lines) == 1, r.stderr
  assert lines[0].startswith("jaxworks-aot export: error: " + message), lines[0]
  assert "Traceback" not in r.stderr
  assert not (workdir / "art").exists()


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o077, 0o700)])
def test_exported_directory_follows_the_umask(workdir, umask, mode):
  r = run_cli(
    workdir,
    "export",
    "cli_failing_mod:count",
    "--arg",
    "i32[3]",
    "--out",
    "art",
    umask=umask,
  )
  assert r.returncode == 0, r.stderr
  assert stat.S_IMODE((workdir / "art").stat().st_mode) == mode
  assert (
    stat.S_IMODE((workdir / "art" / "manifest.json").stat().st_mode)
    == mode & 0o666
  )
