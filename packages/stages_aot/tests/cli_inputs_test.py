"""`run` inputs and flags that are wrong: one line naming them, status 2 or 1.

Status 2: the command line itself is wrong (a flag, a spec, the number of
inputs). Status 1: a file, the artifact or the call failed.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Private imports below: the CLI's main run in-process (the public face is
# ``python -m``).
from jaxworks import stages_aot as sa
from jaxworks.stages_aot._src import cli

PROG = "jaxworks-aot"
X = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
W = np.linspace(-1, 1, 8, dtype=np.float32).reshape(4, 2)


def f(x, w):
  return jnp.tanh(x @ w).sum(axis=1)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  d = tmp_path_factory.mktemp("cli_inputs")
  specs = sa.arg_specs("f32[b,4]", "f32[4,2]")
  sa.save_artifact(sa.trace(f, *specs).lower().export(), d / "art")
  np.save(d / "x.npy", X)
  np.save(d / "w.npy", W)
  np.save(d / "big_endian.npy", X.astype(">f4"))
  np.save(d / "fortran.npy", np.asfortranarray(X))
  np.save(d / "f64.npy", X.astype(np.float64))
  np.save(d / "rank1.npy", X.reshape(-1))
  np.save(d / "x5.npy", np.ones((5, 4), np.float32))
  np.save(d / "w_t.npy", W.T)
  np.save(
    d / "objects.npy", np.array([1, "a"], dtype=object), allow_pickle=True
  )
  np.save(d / "strings.npy", np.array([["a"] * 4] * 3))
  np.savez(d / "both.npz", x=X, w=W)
  (d / "text.npy").write_text("not an array\n")
  (d / "truncated.npy").write_bytes((d / "x.npy").read_bytes()[:100])
  (d / "dir.npy").mkdir()
  os.mkfifo(d / "fifo.npy")
  return d


def run(workdir, monkeypatch, capsys, *argv):
  monkeypatch.chdir(workdir)
  out = io.StringIO()
  try:
    code = cli.main(["run", "art", *argv], out=out)
  except SystemExit as e:  # argparse's usage errors
    code = e.code
  return code, out.getvalue(), capsys.readouterr().err


def printed_output(out):
  line = out.splitlines()[-1]
  return [float(v) for v in re.findall(r"-?\d+\.\d+", line.split("=", 1)[1])]


@pytest.mark.parametrize("name", ["big_endian.npy", "fortran.npy"])
def test_byte_order_and_memory_order_give_the_same_result(
  workdir, monkeypatch, capsys, name
):
  code, out, err = run(
    workdir, monkeypatch, capsys, "--arg", name, "--arg", "w.npy"
  )
  assert code == 0, err
  code, ref, err = run(
    workdir, monkeypatch, capsys, "--arg", "x.npy", "--arg", "w.npy"
  )
  assert code == 0, err
  assert printed_output(out) == printed_output(ref)
  np.testing.assert_allclose(
    printed_output(out), np.asarray(jax.jit(f)(X, W)), rtol=1e-5
  )


@pytest.mark.parametrize(
  "argv, status, message",
  [
    (
      ["--arg", "f32[3,4]", "--arg", "w.npy", "--seed", "-5"],
      2,
      "error: argument --seed: must be an integer >= 0, got '-5'; pass e.g. 0",
    ),
    (["--seed", "x"], 2, "argument --seed: must be an integer >= 0, got 'x'"),
    (["--sead", "1"], 2, "unrecognized arguments: --sead 1; see"),
    (["--arg", "x.npy"], 2, "'f' takes 2 inputs (f32[b,4], f32[4,2]), got 1"),
    (
      ["--arg", "f32[3,5]", "--arg", "w.npy"],
      2,
      "--arg 0 (f32[3,5]) has shape (3, 5), but input args[0] of 'f' is "
      "f32[b,4]; pass an array of that shape",
    ),
    (
      ["--arg", "i32[3,4]", "--arg", "w.npy"],
      2,
      "--arg 0 (i32[3,4]) has dtype int32, but input args[0] of 'f' is "
      "f32[b,4]; pass float32 values",
    ),
    (
      ["--arg", "q7[3,4]", "--arg", "w.npy"],
      2,
      "--arg 0: unknown dtype 'q7'",
    ),
    (
      ["--arg", "f64.npy", "--arg", "w.npy"],
      1,
      "--arg 0 (f64.npy) has dtype float64, but input args[0] of 'f' is "
      "f32[b,4]; pass float32 values",
    ),
    (
      ["--arg", "strings.npy", "--arg", "w.npy"],
      1,
      "--arg 0 (strings.npy) has dtype str32, but input args[0]",
    ),
    (
      ["--arg", "rank1.npy", "--arg", "w.npy"],
      1,
      "--arg 0 (rank1.npy) has shape (12,), but input args[0] of 'f' is "
      "f32[b,4]; pass an array of that shape",
    ),
    (
      ["--arg", "x.npy", "--arg", "w_t.npy"],
      1,
      "--arg 1 (w_t.npy) has shape (2, 4), but input args[1] of 'f' is f32[4,2]",
    ),
    (
      ["--arg", "objects.npy", "--arg", "w.npy"],
      1,
      "--arg 0 (objects.npy) holds an object array, which cannot be an input; "
      "save a numeric array",
    ),
    (
      ["--arg", "text.npy", "--arg", "w.npy"],
      1,
      "--arg 0 (text.npy) is not a .npy file (no NPY header); write the input "
      "with numpy.save",
    ),
    (
      ["--arg", "truncated.npy", "--arg", "w.npy"],
      1,
      "--arg 0 (truncated.npy) is damaged or truncated (",
    ),
    (
      ["--arg", "both.npz", "--arg", "w.npy"],
      1,
      "--arg 0 (both.npz) is an .npz archive; save the one input array with "
      "numpy.save",
    ),
    (
      ["--arg", "dir.npy", "--arg", "w.npy"],
      1,
      "--arg 0 (dir.npy) is a directory; pass a .npy file written by numpy.save",
    ),
    (
      ["--arg", "fifo.npy", "--arg", "w.npy"],
      1,
      "--arg 0 (fifo.npy) is a FIFO; pass a .npy file written by numpy.save",
    ),
    (
      ["--arg", "missing.npy", "--arg", "w.npy"],
      1,
      "--arg 0 (missing.npy): no such file; pass a .npy file written by "
      "numpy.save, or a spec such as 'f32[4,128]'",
    ),
    (
      ["--arg", "no/such/dir/x", "--arg", "w.npy"],
      1,
      "--arg 0 (no/such/dir/x): no such file",
    ),
  ],
)
def test_bad_flags_and_inputs(
  workdir, monkeypatch, capsys, argv, status, message
):
  code, out, err = run(workdir, monkeypatch, capsys, *argv)
  assert code == status, err
  assert err.count("\n") == 1, err  # one line, no usage block, no traceback
  assert err.startswith(f"{PROG}"), err
  assert message in err, err
  assert " at 0x" not in err and "Traceback" not in err
  assert "running" not in out  # refused before the call


def test_inputs_that_disagree_on_a_symbolic_dimension(
  workdir, monkeypatch, capsys
):
  """b = 3 from one input and 5 from another cannot both hold; the call
  refuses it, and the message names the artifact's inputs."""
  specs = sa.arg_specs("f32[b,4]", "f32[b,4]")
  sa.save_artifact(
    sa.trace(lambda x, y: x + y, *specs).lower().export(), workdir / "add"
  )
  monkeypatch.chdir(workdir)
  code = cli.main(["run", "add", "--arg", "x.npy", "--arg", "x5.npy"])
  err = capsys.readouterr().err
  assert code == 1 and err.count("\n") == 1, err
  assert "the --arg inputs do not fit '<lambda>' (f32[b,4], f32[b,4]): " in err
  assert "pass inputs of those shapes and dtypes" in err
