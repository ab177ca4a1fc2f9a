"""The CLI, end to end through subprocesses, and its error paths in-process."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import io
import json
import re
import textwrap

from cli_runner import run_cli
import numpy as np
import pytest

# Private imports below: the CLI's main run in-process (run_cli runs the
# public ``python -m jaxworks.stages_aot``).
from jaxworks.stages_aot._src import cli

MODULE = textwrap.dedent(
  """
    import jax.numpy as jnp

    def predict(x, w):
        q, r = jnp.linalg.qr(w[:16])
        return jnp.tanh(x @ w).sum(axis=1) + jnp.abs(r).sum()

    def count(n):
        return n * 2
    """
)


FAILING_MODULE = textwrap.dedent(
  """
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
    """
)


def predict(x, w):
  import jax.numpy as jnp

  q, r = jnp.linalg.qr(w[:16])
  return jnp.tanh(x @ w).sum(axis=1) + jnp.abs(r).sum()


@pytest.fixture
def workdir(tmp_path):
  (tmp_path / "cli_demo_mod.py").write_text(MODULE)
  (tmp_path / "cli_failing_mod.py").write_text(FAILING_MODULE)
  return tmp_path


def test_export_inspect_run_end_to_end(workdir):
  out_dir = workdir / "artifact"
  r = run_cli(
    workdir,
    "export",
    "cli_demo_mod:predict",
    "--arg",
    "f32[b,128]",
    "--arg",
    "f32[128,16]",
    "--platform",
    "cpu",
    "--platform",
    "tpu",
    "--vjp-order",
    "1",
    "--out",
    str(out_dir),
  )
  assert r.returncode == 0, r.stderr
  lines = r.stdout.splitlines()
  assert lines[0] == "tracing cli_demo_mod:predict(f32[b,128], f32[128,16])"
  progress = [l for l in lines if re.match(r"^\[\d/\d\] ", l)]
  assert len(progress) == 2
  assert (
    progress[0].startswith("[1/2] cpu: lowered in ")
    and "lapack_sgeqrf_ffi" in progress[0]
  )
  assert (
    progress[1].startswith("[2/2] tpu: lowered in ")
    and "cross-lowered" in progress[1]
    and "Qr" in progress[1]
  )
  assert lines[-1].startswith(
    f"exported 'predict' for cpu, tpu (vjp order 1) to {out_dir}"
  )
  manifest = json.loads((out_dir / "manifest.json").read_text())
  assert manifest["platforms"] == ["cpu", "tpu"] and manifest["vjp_order"] == 1

  # As `bazel run //packages/stages_aot:cli` starts it: in another directory,
  # with the user's one in BUILD_WORKING_DIRECTORY, where relative paths resolve.
  elsewhere = workdir / "elsewhere"
  elsewhere.mkdir()
  r = run_cli(
    workdir,
    "inspect",
    out_dir.name,
    cwd=elsewhere,
    BUILD_WORKING_DIRECTORY=str(workdir),
  )
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith("artifact artifact\n")
  assert "function            predict" in r.stdout
  assert "platforms           cpu (present), tpu (not present)" in r.stdout
  assert "args[0]  f32[b,128]" in r.stdout

  rng = np.random.default_rng(1)
  x = rng.standard_normal((3, 128)).astype(np.float32)
  w = rng.standard_normal((128, 16)).astype(np.float32)
  np.save(workdir / "x.npy", x)
  np.save(workdir / "w.npy", w)
  r = run_cli(
    workdir,
    "run",
    str(out_dir),
    "--arg",
    "x.npy",
    "--arg",
    "w.npy",
    "--save",
    "out.npz",
  )
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith(
    "running 'predict' on cpu with args[0]=f32[3,128] (x.npy), args[1]=f32[128,16] (w.npy)"
  )
  saved = np.load(workdir / "out.npz")
  np.testing.assert_allclose(saved["out"], predict(x, w), rtol=1e-5, atol=1e-5)

  # A damaged artifact fails with a message, not a traceback.
  blob = out_dir / "exported.bin"
  blob.write_bytes(blob.read_bytes()[:-10])
  r = run_cli(workdir, "run", str(out_dir), "--arg", "x.npy", "--arg", "w.npy")
  assert r.returncode == 1
  assert (
    "run: error: jaxworks.stages_aot.load_artifact:" in r.stderr
    and "exported.bin is truncated" in r.stderr
  )
  assert "Traceback" not in r.stderr


def test_help_of_each_command(capsys):
  for argv, text in [
    ([], "{export,inspect,run}"),
    (["export"], "MODULE:FUNCTION"),
    (["inspect"], "sha256"),
    (["run"], "SPEC_OR_NPY"),
  ]:
    with pytest.raises(SystemExit) as info:
      cli.main([*argv, "--help"])
    assert info.value.code == 0
    assert text in capsys.readouterr().out


def test_help_through_subprocess(workdir):
  r = run_cli(workdir, "export", "--help")
  assert (
    r.returncode == 0
    and "--platform PLATFORM" in r.stdout
    and "f32[b,128]" in r.stdout
  )


def main_in_process(workdir, monkeypatch, *argv):
  monkeypatch.chdir(workdir)
  monkeypatch.syspath_prepend(str(workdir))
  out = io.StringIO()
  try:
    code = cli.main(list(argv), out=out)
  except SystemExit as e:  # argparse's usage errors
    code = e.code
  return code, out.getvalue()


@pytest.mark.parametrize(
  "argv, message, status",
  [
    (
      ["export", "cli_demo_mod", "--out", "o"],
      "target 'cli_demo_mod' must be MODULE:FUNCTION",
      2,
    ),
    (
      ["export", "no_such_mod_xyz:f", "--out", "o"],
      "cannot import module 'no_such_mod_xyz'",
      1,
    ),
    (
      ["export", "cli_demo_mod:nope", "--out", "o"],
      "has no attribute 'nope' (missing 'nope'); available: count, jnp, predict",
      1,
    ),
    (
      ["export", "cli_demo_mod:count", "--arg", "f32[4", "--out", "o"],
      "--arg: cannot parse argument spec 'f32[4'",
      2,
    ),
    (
      ["export", "cli_demo_mod:count", "--arg", "q8[4]", "--out", "o"],
      "--arg: unknown dtype 'q8' in spec 'q8[4]'",
      2,
    ),
    (
      [
        "export",
        "cli_demo_mod:count",
        "--arg",
        "i32[]",
        "--platform",
        "gpu",
        "--out",
        "o",
      ],
      "'gpu' is ambiguous",
      2,
    ),
    (
      [
        "export",
        "cli_demo_mod:count",
        "--arg",
        "i32[]",
        "--vjp-order",
        "-1",
        "--out",
        "o",
      ],
      "argument --vjp-order: must be an integer >= 0, got '-1'; pass e.g. 0",
      2,
    ),
    (["inspect", "missing_dir"], "missing_dir is not a directory", 1),
  ],
)
def test_cli_errors(workdir, monkeypatch, capsys, argv, message, status):
  code, _ = main_in_process(workdir, monkeypatch, *argv)
  assert code == status
  err = capsys.readouterr().err
  assert err.startswith(f"jaxworks-aot {argv[0]}: error: ")
  assert message in err and err.count("\n") == 1


def test_run_input_checks(workdir, monkeypatch, capsys):
  code, out = main_in_process(
    workdir,
    monkeypatch,
    "export",
    "cli_demo_mod:count",
    "--arg",
    "i32[n]",
    "--out",
    "art",
  )
  assert code == 0 and "[1/1] cpu: lowered in" in out
  for argv, message in [
    (
      [],
      "inputs have symbolic shapes (args[0]: i32[n]); pass one --arg per input with concrete shapes, e.g. --arg 'i32[4]'",
    ),
    (
      ["--arg", "i32[2]", "--arg", "i32[2]"],
      "'count' takes 1 inputs (i32[n]), got 2 --arg",
    ),
    (
      ["--arg", "f32[2]"],
      "--arg 0 (f32[2]) has dtype float32, but input args[0] of 'count' is "
      "i32[n]; pass int32 values",
    ),
    (
      ["--arg", "i32[m]"],
      "--arg 0 'i32[m]' has symbolic dimensions; give concrete sizes such as 'i32[4]'",
    ),
  ]:
    code, _ = main_in_process(workdir, monkeypatch, "run", "art", *argv)
    assert code == 2  # the command line is wrong
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
  code, out = main_in_process(
    workdir, monkeypatch, "run", "art", "--arg", "i32[3]", "--seed", "5"
  )
  assert code == 0
  n = np.random.default_rng(5).integers(0, 10, size=(3,)).astype(np.int32)
  last = out.splitlines()[-1]
  assert last.startswith("out i32[3] = [")
  assert [int(v) for v in re.findall(r"-?\d+", last.split("=", 1)[1])] == list(
    n * 2
  )
  code, out = main_in_process(workdir, monkeypatch, "inspect", "art", "--json")
  assert code == 0 and json.loads(out)["inputs"][0]["aval"] == "i32[n]"


def test_export_refuses_existing_directory(workdir, monkeypatch, capsys):
  (workdir / "busy").mkdir()
  (workdir / "busy" / "keep.txt").write_text("x")
  code, out = main_in_process(
    workdir,
    monkeypatch,
    "export",
    "cli_demo_mod:count",
    "--arg",
    "i32[]",
    "--out",
    "busy",
  )
  err = capsys.readouterr().err
  assert (
    code == 1
    and "--out: " in err
    and "busy exists and is not empty; pass overwrite=True (CLI: --overwrite)"
    in err
  )
  assert out == ""  # refused before tracing
  assert (workdir / "busy" / "keep.txt").read_text() == "x"


def test_traceback_flag_shows_the_failing_stage(workdir, monkeypatch, capsys):
  code, _ = main_in_process(
    workdir,
    monkeypatch,
    "--traceback",
    "export",
    "cli_failing_mod:trace_fails",
    "--arg",
    "f32[3]",
    "--out",
    "art",
  )
  err = capsys.readouterr().err
  assert code == 1
  assert err.startswith(
    "jaxworks-aot export: error: trace of cli_failing_mod:trace_fails(f32[3]) failed: TypeError"
  )
  assert "Traceback (most recent call last)" in err and "in trace_fails" in err


def test_unexpected_failure_in_run_is_one_line(workdir, monkeypatch, capsys):
  code, _ = main_in_process(
    workdir,
    monkeypatch,
    "export",
    "cli_demo_mod:count",
    "--arg",
    "i32[3]",
    "--out",
    "art",
  )
  assert code == 0
  monkeypatch.setattr(
    np,
    "savez",
    lambda *a, **k: (_ for _ in ()).throw(
      OSError(28, "No space left on device")
    ),
  )
  code, _ = main_in_process(
    workdir, monkeypatch, "run", "art", "--save", "out.npz"
  )
  err = capsys.readouterr().err
  assert code == 1 and err.count("\n") == 1
  assert (
    "run: error: saving the outputs to out.npz failed: OSError: [Errno 28] No space left on device"
    in err
  )
