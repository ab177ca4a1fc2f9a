"""Command line: ``jaxworks-aot {export,inspect,run}`` (or ``python -m
jaxworks.stages_aot``).

export   trace MODULE:FUNCTION for --arg specs, lower for each --platform (one
         progress line per platform), export and write an artifact directory.
inspect  validate an artifact directory and print its summary.
run      load an artifact and run it on this host with --arg inputs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import importlib
import json
import os
import re
import stat
import sys
import time
import traceback

import numpy as np

from ..version import __version__
from . import platforms as _platforms
from .artifact import ArtifactError
from .artifact import check_destination
from .artifact import load_artifact
from .artifact import save_artifact
from .specs import format_aval
from .specs import is_concrete
from .specs import parse_arg_specs
from .stages import trace

#: The console script of the wheel; ``python -m jaxworks.stages_aot`` is the
#: same program and names itself the same way.
PROG = "jaxworks-aot"


class CliError(Exception):
  """A failure found in a file, the artifact or a stage: one line, status 1."""

  status = 1


class UsageError(CliError):
  """The command line itself is wrong (a flag or spec): one line, status 2."""

  status = 2


def _non_negative_int(text: str) -> int:
  """argparse type: an integer >= 0 (argparse names the flag)."""
  try:
    value = int(text)
  except ValueError:
    value = -1
  if value < 0:
    raise argparse.ArgumentTypeError(
      f"must be an integer >= 0, got {text!r}; pass e.g. 0"
    )
  return value


def _one_line(e: BaseException, limit: int = 600) -> str:
  text = " ".join(str(e).split()) or "(no message)"
  if len(text) > limit:
    text = text[: limit - 40] + " ... (--traceback shows all)"
  return f"{type(e).__name__}: {text}"


def _stage(name: str, fn, *args, **kwargs):
  """Runs one stage; any failure becomes a one-line CliError naming it."""
  try:
    return fn(*args, **kwargs)
  except CliError:
    raise
  except Exception as e:
    raise CliError(f"{name} failed: {_one_line(e)}") from e


class _Parser(argparse.ArgumentParser):
  """Usage errors as one line (no usage block), exit status 2."""

  def error(self, message: str):  # type: ignore[override]
    self.exit(
      2,
      f"{self.prog}: error: {' '.join(message.split())}; see "
      f"'{self.prog} --help'\n",
    )


def _build_parser() -> argparse.ArgumentParser:
  """The parser of ``jaxworks-aot``: global flags, then one subcommand each."""
  parser = _Parser(
    prog=PROG,
    description="Ahead-of-time export of JAX functions to versioned artifact "
    "directories, for cpu, cuda, rocm and tpu, from any host.",
    epilog="Also runs as 'python -m jaxworks.stages_aot'. "
    "'%(prog)s COMMAND --help' explains each command. Exit status: 0 ok, 2 "
    "the command line is wrong (a flag, a spec), 1 a file, the artifact, the "
    "function or a stage failed.",
  )
  parser.add_argument(
    "--version", action="version", version=f"jaxworks.stages_aot {__version__}"
  )
  parser.add_argument(
    "--traceback",
    action="store_true",
    help="on failure, also print the Python traceback of the failing stage",
  )
  sub = parser.add_subparsers(
    dest="command", required=True, metavar="{export,inspect,run}"
  )
  _add_export(sub)
  _add_inspect(sub)
  _add_run(sub)
  return parser


def _add_export(sub) -> None:
  """``export MODULE:FUNCTION --arg SPEC ... --out DIR``."""
  exp = sub.add_parser(
    "export",
    help="trace, lower and export a function into an artifact directory",
    description="Trace MODULE:FUNCTION for the given argument specs, lower it for "
    "each platform (one progress line each), and write DIR with exported.bin, "
    "module.stablehlo.mlir and manifest.json.",
    epilog="example: %(prog)s mypkg.model:predict --arg 'f32[b,128]' --arg "
    "'f32[128,16]' --platform cpu --platform tpu --out /tmp/predict",
  )
  exp.add_argument(
    "target", metavar="MODULE:FUNCTION", help="e.g. mypkg.model:predict"
  )
  exp.add_argument(
    "--arg",
    action="append",
    default=[],
    metavar="SPEC",
    help="one per positional argument, DTYPE[DIMS], e.g. 'f32[b,128]' (symbolic "
    "dimension b), 'i32[8]', 'f32[]'",
  )
  exp.add_argument(
    "--platform",
    action="append",
    default=[],
    metavar="PLATFORM",
    help=f"repeat for several; one of {', '.join(_platforms.KNOWN_PLATFORMS)} "
    "(default: this host's default backend)",
  )
  exp.add_argument(
    "--out", required=True, metavar="DIR", help="artifact directory to write"
  )
  exp.add_argument(
    "--vjp-order",
    type=_non_negative_int,
    default=0,
    metavar="N",
    help="orders of VJP to include (1: the loaded function supports jax.grad)",
  )
  exp.add_argument(
    "--overwrite",
    action="store_true",
    help="replace an existing artifact in DIR",
  )


def _add_inspect(sub) -> None:
  """``inspect DIR [--json]``."""
  ins = sub.add_parser(
    "inspect",
    help="validate an artifact directory and print a summary",
    description="Check the files of DIR against manifest.json (sizes, sha256), the "
    "calling-convention version and the program, then print a summary.",
  )
  ins.add_argument("directory", metavar="DIR")
  ins.add_argument(
    "--json",
    action="store_true",
    help="print manifest.json instead of a summary",
  )


def _add_run(sub) -> None:
  """``run DIR [--arg SPEC_OR_NPY ...] [--seed N] [--save FILE.npz]``."""
  run = sub.add_parser(
    "run",
    help="load an artifact and run it on this host",
    description="Load DIR (all checks of inspect, plus a platform present here) and "
    "run it. Inputs come from --arg: a concrete spec such as 'f32[4,128]' "
    "(random values from --seed) or a .npy file; without --arg, random inputs "
    "of the artifact's own shapes (which must then be concrete).",
  )
  run.add_argument("directory", metavar="DIR")
  run.add_argument(
    "--arg",
    action="append",
    default=[],
    metavar="SPEC_OR_NPY",
    help="one per input: 'f32[4,128]' or path/to/array.npy",
  )
  run.add_argument(
    "--seed",
    type=_non_negative_int,
    default=0,
    help="seed of the random inputs, an integer >= 0 (default 0)",
  )
  run.add_argument(
    "--save", metavar="FILE.npz", help="also save the outputs to this .npz file"
  )


def _import_target(target: str):
  module_name, sep, attr_path = target.partition(":")
  if not sep or not module_name or not attr_path:
    raise UsageError(
      f"target {target!r} must be MODULE:FUNCTION, e.g. mypkg.model:predict"
    )
  if os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())
  try:
    obj = importlib.import_module(module_name)
  except ImportError as e:
    raise CliError(
      f"import of {module_name!r} failed: cannot import module {module_name!r} "
      f"({e}); put its directory on PYTHONPATH or run from it"
    ) from e
  except Exception as e:  # the module itself raised while importing
    raise CliError(f"import of {module_name!r} failed: {_one_line(e)}") from e
  for part in attr_path.split("."):
    if not _stage(f"import of {target!r}", hasattr, obj, part):
      names = sorted(n for n in dir(obj) if not n.startswith("_"))
      raise CliError(
        f"{module_name!r} has no attribute {attr_path!r} (missing {part!r}); "
        f"available: {', '.join(names[:20])}"
      )
    obj = _stage(f"import of {target!r}", getattr, obj, part)
  if not callable(obj):
    raise CliError(f"{target} is a {type(obj).__name__}, not a function")
  return obj


def _cmd_export(ns, out) -> int:
  fun = _import_target(ns.target)
  try:
    specs = parse_arg_specs(ns.arg, api="--arg")
    platforms = _platforms.canonical_platforms(
      ns.platform or None, api="--platform"
    )
  except (TypeError, ValueError) as e:
    raise UsageError(str(e)) from None
  try:  # before any work: fail now, not after lowering, if --out is taken
    check_destination(ns.out, overwrite=ns.overwrite, api="--out")
  except ArtifactError as e:
    raise CliError(str(e)) from None
  present = _platforms.present_platforms()
  shown = ", ".join(format_aval(s) for s in specs)
  print(f"tracing {ns.target}({shown})", file=out, flush=True)
  traced = _stage(f"trace of {ns.target}({shown})", trace, fun, *specs)
  for i, platform in enumerate(platforms, 1):
    start = time.perf_counter()
    lowered = _stage(
      f"lowering for platform {platform}",
      traced.lower,
      lowering_platforms=(platform,),
    )
    text = _stage(f"lowering for platform {platform}", lowered.as_text)
    ms = 1e3 * (time.perf_counter() - start)
    calls = sorted(set(re.findall(r"custom_call @([\w.$-]+)", text)))
    where = (
      "present on this host"
      if platform in present
      else "cross-lowered (not present here)"
    )
    extra = f", custom calls: {', '.join(calls)}" if calls else ""
    print(
      f"[{i}/{len(platforms)}] {platform}: lowered in {ms:.1f} ms, "
      f"{len(text.splitlines())} lines of StableHLO, {where}{extra}",
      file=out,
      flush=True,
    )
  if len(platforms) > 1:
    lowered = _stage(
      f"lowering for platforms {', '.join(platforms)}",
      traced.lower,
      lowering_platforms=platforms,
    )
  exported = _stage(
    f"export of {ns.target}", lowered.export, vjp_order=ns.vjp_order
  )
  try:
    artifact = save_artifact(exported, ns.out, overwrite=ns.overwrite)
  except ArtifactError as e:
    raise CliError(str(e)) from None
  except Exception as e:
    raise CliError(f"save to {ns.out} failed: {_one_line(e)}") from e
  sizes = ", ".join(
    f"{n} {i['size']} bytes" for n, i in artifact.manifest["files"].items()
  )
  print(
    f"exported {exported.fun_name!r} for {', '.join(platforms)} "
    f"(vjp order {ns.vjp_order}) to {artifact.path}: {sizes}, manifest.json",
    file=out,
    flush=True,
  )
  return 0


def _cmd_inspect(ns, out) -> int:
  try:
    artifact = load_artifact(ns.directory, require_platform=False)
  except ArtifactError as e:
    raise CliError(str(e)) from None
  if ns.json:
    print(json.dumps(artifact.manifest, indent=2), file=out)
  else:
    print(artifact.summary(), file=out)
  return 0


def _random_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return rng.integers(0, 2, size=shape).astype(bool)
  if np.issubdtype(dtype, np.integer):
    return rng.integers(0, 10, size=shape).astype(dtype)
  if np.issubdtype(dtype, np.complexfloating):
    return (
      rng.standard_normal(shape) + 1j * rng.standard_normal(shape)
    ).astype(dtype)
  return rng.standard_normal(shape).astype(dtype)


def _run_inputs(ns, artifact) -> tuple[list[np.ndarray], list[str]]:
  inputs = artifact.manifest["inputs"]
  rng = np.random.default_rng(ns.seed)
  if not ns.arg:
    avals = artifact.exported.in_avals
    symbolic = [
      f"{v['name']}: {v['aval']}"
      for v, a in zip(inputs, avals)
      if not is_concrete(a.shape)
    ]
    if symbolic:
      raise UsageError(
        f"inputs have symbolic shapes ({'; '.join(symbolic)}); pass one --arg "
        f"per input with concrete shapes, e.g. --arg '{_concrete_example(inputs[0]['aval'])}'"
      )
    arrays = [_random_array(rng, a.shape, a.dtype) for a in avals]
    return arrays, [f"{v['name']}={v['aval']} (random)" for v in inputs]
  if len(ns.arg) != len(inputs):
    expected = ", ".join(v["aval"] for v in inputs)
    raise UsageError(
      f"{artifact.fun_name!r} takes {len(inputs)} inputs ({expected}), got "
      f"{len(ns.arg)} --arg; pass one --arg per input"
    )
  arrays, described = [], []
  avals = artifact.exported.in_avals
  for i, (arg, info, aval) in enumerate(zip(ns.arg, inputs, avals)):
    where = f"--arg {i} ({arg})"
    if _names_a_file(arg):
      array, source, error = _load_npy(where, arg), arg, CliError
    else:
      try:
        (spec,) = parse_arg_specs([arg], api=f"--arg {i}")
      except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None
      if not is_concrete(spec.shape):
        raise UsageError(
          f"--arg {i} {arg!r} has symbolic dimensions; give concrete sizes "
          f"such as '{_concrete_example(arg)}'"
        )
      array = _random_array(rng, spec.shape, spec.dtype)
      source, error = "random", UsageError
    if np.dtype(array.dtype).name != info["dtype"]:
      raise error(
        f"{where} has dtype {np.dtype(array.dtype).name}, but input "
        f"{info['name']} of {artifact.fun_name!r} is {info['aval']}; pass "
        f"{info['dtype']} values"
      )
    if len(array.shape) != len(aval.shape) or any(
      isinstance(d, int) and d != n for d, n in zip(aval.shape, array.shape)
    ):
      raise error(
        f"{where} has shape {tuple(array.shape)}, but input {info['name']} of "
        f"{artifact.fun_name!r} is {info['aval']}; pass an array of that shape"
      )
    arrays.append(array)
    described.append(f"{info['name']}={format_aval(array)} ({source})")
  return arrays, described


def _names_a_file(arg: str) -> bool:
  """Whether a run --arg names a file (a spec such as 'f32[4]' never does)."""
  return arg.endswith((".npy", ".npz")) or os.sep in arg or os.path.lexists(arg)


def _load_npy(where: str, path: str) -> np.ndarray:
  """Reads one array from a .npy file; any problem is a one-line CliError."""
  if path.endswith(".npz"):
    raise CliError(
      f"{where} is an .npz archive; save the one input array with numpy.save "
      "to a .npy file and pass that"
    )
  try:
    # Non-blocking, so that a FIFO is refused below instead of waited on.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
  except FileNotFoundError:
    raise CliError(
      f"{where}: no such file; pass a .npy file written by numpy.save, or a "
      "spec such as 'f32[4,128]'"
    ) from None
  except OSError as e:
    raise CliError(
      f"{where}: cannot open it ({e.strerror}); check the path and its "
      "permissions"
    ) from None
  mode = os.fstat(fd).st_mode
  if not stat.S_ISREG(mode):
    os.close(fd)
    kind = (
      "a directory"
      if stat.S_ISDIR(mode)
      else "a FIFO"
      if stat.S_ISFIFO(mode)
      else "not a regular file"
    )
    raise CliError(f"{where} is {kind}; pass a .npy file written by numpy.save")
  with os.fdopen(fd, "rb") as f:
    if f.read(6) != b"\x93NUMPY":
      raise CliError(
        f"{where} is not a .npy file (no NPY header); write the input with "
        "numpy.save"
      )
    f.seek(0)
    try:
      array = np.load(f, allow_pickle=False)
    except ValueError as e:
      if "allow_pickle" in str(e):
        raise CliError(
          f"{where} holds an object array, which cannot be an input; save "
          "a numeric array (e.g. numpy.save(path, x.astype(numpy.float32)))"
        ) from None
      raise CliError(
        f"{where} is damaged or truncated ({_one_line(e)}); write it again "
        "with numpy.save"
      ) from None
    except (OSError, EOFError) as e:
      raise CliError(
        f"{where} cannot be read ({_one_line(e)}); write it again with "
        "numpy.save"
      ) from None
  if not array.dtype.isnative:  # e.g. big-endian '>f4': same values, native
    array = array.astype(array.dtype.newbyteorder("="))
  return array


def _concrete_example(spec: str) -> str:
  """'f32[b,128]' -> 'f32[4,128]': a spec with every symbolic dimension set to 4."""
  dtype, _, dims = spec.partition("[")
  sizes = [
    d.strip() if d.strip().isdigit() else "4"
    for d in dims.rstrip("]").split(",")
  ]
  return f"{dtype.strip()}[{','.join(sizes)}]"


def _cmd_run(ns, out) -> int:
  try:
    artifact = load_artifact(ns.directory)
  except ArtifactError as e:
    raise CliError(str(e)) from None
  arrays, described = _run_inputs(ns, artifact)
  platform = artifact.runnable_platforms[0]
  print(
    f"running {artifact.fun_name!r} on {platform} with {', '.join(described)}",
    file=out,
    flush=True,
  )
  args, kwargs = artifact.exported.in_tree.unflatten(arrays)
  try:
    result = artifact.call(*args, **kwargs)
  except (TypeError, ValueError) as e:
    expected = ", ".join(v["aval"] for v in artifact.manifest["inputs"])
    raise CliError(
      f"the --arg inputs do not fit {artifact.fun_name!r} ({expected}): "
      f"{_one_line(e)}; pass inputs of those shapes and dtypes"
    ) from e
  except Exception as e:
    raise CliError(
      f"call of {artifact.fun_name!r} failed: {_one_line(e)}"
    ) from e
  leaves = artifact.exported.out_tree.flatten_up_to(result)
  outputs = {}
  for info, leaf in zip(artifact.manifest["outputs"], leaves):
    value = np.asarray(leaf)
    outputs[info["name"]] = value
    text = np.array2string(value, threshold=16, precision=6, separator=", ")
    print(f"{info['name']} {format_aval(value)} = {text}", file=out)
  if ns.save:
    _stage(f"saving the outputs to {ns.save}", np.savez, ns.save, **outputs)
    print(f"saved {len(outputs)} outputs to {ns.save}", file=out)
  return 0


def main(argv: Sequence[str] | None = None, *, out=None) -> int:
  """Runs the CLI; returns the exit status (0 ok, 1 error, 2 usage error)."""
  out = sys.stdout if out is None else out
  ns = _build_parser().parse_args(argv)
  commands = {"export": _cmd_export, "inspect": _cmd_inspect, "run": _cmd_run}
  try:
    return commands[ns.command](ns, out)
  except CliError as e:
    print(f"{PROG} {ns.command}: error: {e}", file=sys.stderr)
    cause, status = e.__cause__, e.status
  except Exception as e:  # outside any named stage: still one line
    print(f"{PROG} {ns.command}: error: {_one_line(e)}", file=sys.stderr)
    cause, status = e, 1
  if ns.traceback and cause is not None:
    traceback.print_exception(
      type(cause), cause, cause.__traceback__, file=sys.stderr
    )
  return status
