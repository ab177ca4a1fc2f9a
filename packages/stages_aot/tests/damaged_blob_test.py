"""Damaged and hostile serialized programs: refused by deserialize(), never a crash.

Every blob that deserialize() accepts is called, and its result compared with
the undamaged program's.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Private imports below: some cases crash or stall the module reader child
# process itself.
from jaxworks import stages_aot as sa
from jaxworks.stages_aot._src import jax_internals
from jaxworks.stages_aot._src import module_reader

DATA = pathlib.Path(__file__).parent / "data"

C = np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)
X = np.linspace(0, 1, 24, dtype=np.float32).reshape(3, 8)
W = np.linspace(-1, 1, 16, dtype=np.float32).reshape(8, 2)


def f(params, x, *, scale):
  return jnp.tanh(x @ params["w"] + C).sum(axis=1) * scale


ARGS = ({"w": W}, X)
KWARGS = {"scale": np.float32(3.0)}


def call_and_grad(exp):
  out = np.asarray(exp(*ARGS, **KWARGS))
  grad = jax.grad(lambda x: exp(ARGS[0], x, **KWARGS).sum())(X)
  return out, np.asarray(grad)


@pytest.fixture(scope="module")
def program():
  exp = (
    sa.trace(f, *ARGS, **KWARGS)
    .lower(lowering_platforms=("cpu", "tpu"))
    .export(vjp_order=1)
  )
  blob = exp.serialize()
  loaded = sa.deserialize(blob)
  texts = (loaded.mlir_text(), loaded.vjp().mlir_text())
  return blob, loaded, texts, call_and_grad(loaded)


def refused(blob, match):
  with pytest.raises(ValueError, match=match) as info:
    sa.deserialize(blob)
  assert str(info.value).startswith("jaxworks.stages_aot.deserialize: ")
  return info.value


def reserialize(exp: jax.export.Exported, vjp_order=0) -> bytes:
  return bytes(exp.serialize(vjp_order=vjp_order))


def test_undamaged_program_equals_stock(program):
  _, loaded, _, (out, grad) = program
  stock = jax.export.export(jax.jit(f), platforms=("cpu", "tpu"))(
    *ARGS, **KWARGS
  )
  np.testing.assert_array_equal(out, stock.call(*ARGS, **KWARGS))
  assert loaded.vjp_order == 1 and loaded.vjp() is loaded.vjp()


def test_vjp_counting_does_not_leak_struct_error(program):
  """A flip that breaks the VJP table: stock jax reads the VJP lazily and
  raises struct.error (or another raw error) only when asked for it."""
  blob = program[0]
  found = 0
  for pos in range(0, len(blob), 3):
    damaged = bytearray(blob)
    damaged[pos] ^= 0x5A
    try:
      exp = jax.export.deserialize(bytearray(damaged))
    except Exception:
      continue
    try:
      while exp.has_vjp():
        exp = exp.vjp()
    except Exception:  # struct.error, IndexError, ValueError, ...
      found += 1
      refused(bytes(damaged), "not a valid serialized exported program")
  assert found > 0  # the scan must hit the case it is about


def test_device_count_that_fails_only_at_call(program):
  exp = program[1].jax_exported
  hostile = reserialize(dataclasses.replace(exp, nr_devices=14483457))
  refused(hostile, "partitioned for 1 devices, the program says 14483457")


@pytest.mark.parametrize(
  "kept, match",
  [((1, 0, 2), "not sorted"), ((0, 1, 7), "below 3"), ((0, 0, 1), "distinct")],
)
def test_kept_inputs(program, kept, match):
  exp = program[1].jax_exported
  refused(
    reserialize(dataclasses.replace(exp, module_kept_var_idx=kept)),
    f"kept input indices .*{match}",
  )


def test_kept_inputs_with_types_that_disagree(program):
  exp = program[1].jax_exported
  # Drop x from the kept inputs: main's types no longer line up.
  refused(
    reserialize(dataclasses.replace(exp, module_kept_var_idx=(0, 2))),
    "main takes 4 inputs .* needs 3 inputs",
  )


def test_module_bytes_that_do_not_deserialize(program):
  exp = program[1].jax_exported
  refused(
    reserialize(
      dataclasses.replace(exp, mlir_module_serialized=b"ML\xefR garbage")
    ),
    "StableHLO module is unreadable",
  )


def test_module_of_another_signature(program):
  exp = program[1].jax_exported
  other = jax.export.export(
    jax.jit(lambda p, x, *, scale: (x[:, :2] @ p["w"][:2]).sum(axis=1) * scale),
    platforms=("cpu", "tpu"),
  )(
    {"w": np.zeros((4, 2), np.float32)},
    np.zeros((3, 4), np.float32),
    scale=np.float32(1),
  )
  hostile = reserialize(
    dataclasses.replace(
      exp, mlir_module_serialized=other.mlir_module_serialized
    )
  )
  refused(
    hostile,
    r"input 0 is tensor<4x2xf32> in the module, the program says f32\[8,2\]",
  )


def test_single_platform_module_with_two_platforms(program):
  exp = program[1].jax_exported
  cpu_only = jax.export.export(jax.jit(f), platforms=("cpu",))(*ARGS, **KWARGS)
  hostile = reserialize(
    dataclasses.replace(
      exp, mlir_module_serialized=cpu_only.mlir_module_serialized
    )
  )
  refused(hostile, r"main takes 3 inputs .* \(1 platform index")


@pytest.mark.parametrize(
  "change, match",
  [
    (dict(platforms=("cpu", "xpu")), "platforms .* are not distinct names"),
    (dict(platforms=("cpu", "cpu")), "platforms .* are not distinct names"),
    (
      dict(calling_convention_version=99),
      "calling convention version 99 is not in",
    ),
    (dict(fun_name="f2"), None),  # only a name: accepted
  ],
)
def test_hostile_fields(program, change, match):
  exp = program[1].jax_exported
  hostile = reserialize(dataclasses.replace(exp, **change))
  if match is None:
    loaded = sa.deserialize(hostile)
    np.testing.assert_array_equal(loaded(*ARGS, **KWARGS), program[3][0])
  else:
    refused(hostile, match)


def test_output_aval_that_disagrees(program):
  exp = program[1].jax_exported
  out = exp.out_avals[0]
  bad = jax.core.ShapedArray((4,), out.dtype)
  hostile = reserialize(dataclasses.replace(exp, out_avals=(bad,)))
  refused(
    hostile,
    r"output 0 is tensor<3xf32> in the module, the program says f32\[4\]",
  )


def test_vjp_of_another_function(program):
  exp = program[1].jax_exported
  other = jax.export.export(
    jax.jit(lambda x: jnp.sin(x)), platforms=("cpu", "tpu")
  )(X)
  hostile = reserialize(
    dataclasses.replace(exp, _get_vjp=lambda _: other.vjp()), vjp_order=1
  )
  refused(
    hostile,
    "its VJP of order 1: takes 2 inputs and returns 1; a VJP of a program with 3 inputs",
  )


def interface(exp):
  return (
    exp.fun_name,
    str(exp.in_tree),
    str(exp.out_tree),
    [sa.format_aval(a) for a in exp.in_avals],
    [sa.format_aval(a) for a in exp.out_avals],
  )


def call_own_interface(exp):
  """Calls ``exp`` with zeros of its own input types; checks the output types."""
  zeros = [np.zeros(a.shape, a.dtype) for a in exp.in_avals]
  args, kwargs = exp.in_tree.unflatten(zeros)
  outs = exp.out_tree.flatten_up_to(exp(*args, **kwargs))
  assert [sa.format_aval(o) for o in outs] == [
    sa.format_aval(a) for a in exp.out_avals
  ]


def check_flip_outcome(blob_damaged, program, outcomes):
  _, original, texts, (out, grad) = program
  try:
    loaded = sa.deserialize(blob_damaged)
  except ValueError as e:
    assert "not a valid serialized exported program" in str(e)
    outcomes["refused"] += 1
    return
  # Accepted: the call must work, and give the undamaged result unless the
  # damage made another valid program (a changed constant, opcode or pytree
  # key), which bytes without a reference cannot reveal (artifacts can: see
  # artifact_damage_test.py). Such a program must still run.
  same_program = (
    loaded.mlir_text(),
    loaded.vjp().mlir_text(),
  ) == texts and interface(loaded) == interface(original)
  if same_program:
    got_out, got_grad = call_and_grad(loaded)
    np.testing.assert_array_equal(got_out, out)
    np.testing.assert_array_equal(got_grad, grad)
    outcomes["same"] += 1
  else:
    call_own_interface(loaded)
    outcomes["other program"] += 1


def test_fuzz_flipped_bytes(program):
  blob = program[0]
  rng = np.random.default_rng(2024)
  outcomes = {"refused": 0, "same": 0, "other program": 0}
  for _ in range(40):
    damaged = bytearray(blob)
    damaged[int(rng.integers(len(blob)))] ^= int(rng.integers(1, 256))
    check_flip_outcome(bytes(damaged), program, outcomes)
  assert outcomes["refused"] > 0 and outcomes["same"] > 0, outcomes


def test_fuzz_truncated_and_extended(program):
  blob = program[0]
  outcomes = {"refused": 0, "same": 0, "other program": 0}
  for cut in [0, 1, 4, 8, 16, 100] + list(
    range(200, len(blob), max(1, len(blob) // 12))
  ):
    check_flip_outcome(blob[:cut], program, outcomes)
  # Trailing bytes after the flatbuffer are ignored by its reader.
  check_flip_outcome(blob + b"\0" * 16, program, outcomes)
  assert outcomes["refused"] > 0 and outcomes["same"] >= 1, outcomes


READY = "import os, sys, time; sys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.buffer.read(16); "


def test_reader_child_crash_is_reported(monkeypatch):
  """A module that kills the StableHLO reader is refused; the next read works."""
  reader = module_reader._Reader()
  monkeypatch.setattr(module_reader, "_READER", reader)
  monkeypatch.setattr(
    jax_internals, "MODULE_READER_SOURCE", READY + "os.abort()"
  )
  (answer,) = module_reader.describe_modules([b"crashes the reader"])
  assert answer == {"error": "the StableHLO reader crashed or stalled on it"}
  assert reader._proc is None
  monkeypatch.undo()
  good = jax.export.export(jax.jit(jnp.sin), platforms=("cpu",))(X)
  (answer,) = module_reader.describe_modules([good.mlir_module_serialized])
  assert [t["text"] for t in answer["inputs"]] == ["tensor<3x8xf32>"]


def test_reader_child_stall_is_reported(monkeypatch):
  reader = module_reader._Reader()
  monkeypatch.setattr(module_reader, "_READER", reader)
  monkeypatch.setattr(module_reader, "TIMEOUT_S", 2.0)
  monkeypatch.setattr(
    jax_internals, "MODULE_READER_SOURCE", READY + "time.sleep(60)"
  )
  (answer,) = module_reader.describe_modules([b"stalls the reader"])
  assert answer == {"error": "the StableHLO reader crashed or stalled on it"}
  assert reader._proc is None  # the stuck child was killed


def test_reader_that_cannot_start_is_not_blamed_on_the_blob(
  monkeypatch, program
):
  monkeypatch.setattr(module_reader, "_READER", module_reader._Reader())
  monkeypatch.setattr(
    jax_internals, "MODULE_READER_SOURCE", "raise SystemExit(3)"
  )
  with pytest.raises(
    module_reader.ReaderUnavailable,
    match="could not import jaxlib's StableHLO reader",
  ):
    module_reader.describe_modules([b"anything"])
  with pytest.raises(
    RuntimeError,
    match="cannot validate the StableHLO modules: .* could not import jaxlib",
  ):
    sa.deserialize(program[0] + b"\0")  # bytes not seen before: not cached


@pytest.mark.parametrize(
  "name",
  [
    "segfault_module.bin",  # a flipped byte: the reader dies with SIGSEGV
    "runaway_alloc_module.bin",  # a flipped length: the reader allocates without end
  ],
)
def test_modules_that_break_the_stablehlo_reader(program, name):
  """Stock jax reads these in-process at the first call and dies (or eats the
  machine's memory); deserialize() refuses them with a ValueError."""
  data = (DATA / name).read_bytes()
  (answer,) = module_reader.describe_modules([data])
  assert set(answer) == {"error"}, answer
  exp = program[1].jax_exported
  refused(
    reserialize(dataclasses.replace(exp, mlir_module_serialized=data)),
    "StableHLO module is unreadable",
  )
  vjp_damaged = dataclasses.replace(exp.vjp(), mlir_module_serialized=data)
  hostile = reserialize(
    dataclasses.replace(exp, _get_vjp=lambda _: vjp_damaged), vjp_order=1
  )
  refused(hostile, "its VJP of order 1: its StableHLO module is unreadable")


def test_garbage_module_bytes_are_described_as_errors():
  answers = module_reader.describe_modules(
    [b"", b"ML\xefR\x00", bytes(range(256))]
  )
  assert all(set(a) == {"error"} for a in answers), answers
