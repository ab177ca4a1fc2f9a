"""Bounded, derandomized run of the ambient-state differential harness.

One pytest case per (program, dimension) pair, so each failure class shows as
its own case id: every dimension runs with the program that targets it, and
every program of the corpus runs under at least one dimension (chosen with a
fixed seed). Each case runs both orders (A then B, B then A), as one
function and as re-created closures, with stock ``jax.jit`` and with
``jaxworks.jit_cache.jit``, and compares every step bit for bit (see
``ambient_harness``). A failing case prints each mismatch and the command
that re-runs it with ``//packages/jit_cache:ambient_fuzz``.

Deeper, random runs (several dimensions at once, any program):
``bazel run //packages/jit_cache:ambient_fuzz -- --seed 1 --cases 500``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import random

import ambient_corpus as corpus
import ambient_harness as harness
import jax
import pytest

# Private imports below: the names of JAX's trace-context entries, which no
# public API lists.
from jaxworks.jit_cache._src import jax_internals as ji

SEED = 0

# The program that targets each dimension; a dimension not named here runs
# with a program chosen with SEED among those it applies to.
TARGETS = {
  "set_mesh_other_devices": "mesh_probe",
  "set_mesh_permuted": "sharded_elementwise",
  "set_mesh_2d": "sharding_constraint",
  "set_mesh_vs_none": "shard_map_inner",
  "with_mesh_permuted": "sharding_constraint",
  "abstract_mesh": "shard_map_inner",
  "axis_vmap": "axis_probe",
  "axis_vmap_other_name": "axis_probe",
  "outer_jit_vs_vmap": "axis_index_probe",
  "axis_shard_map": "psum_probe",
  "axis_shard_map_other_name": "axis_probe",
  "debug_nans": "nan_producing",
  "debug_infs": "inf_producing",
  "transfer_guard": "numpy_args",
  "transfer_guard_numpy": "weak_scalar",
  "default_device": "arange_in_body",
  "matmul_precision": "matmul_f32",
  "layout_column_major": "matmul_f32",
  "committed": "static_raising_eq",
  "committed_devices": "donate",
  "sharded_args": "sharded_reduce",
  "shape_dtype_struct_args": "weak_scalar",
  "closure_variant": "nan_sign_copysign",
  "user_context": "random_in_body",
  "xla_metadata": "scan",
  "cfg:jax_enable_x64": "arange_in_body",
  "cfg:jax_default_matmul_precision": "matmul_f32",
  "cfg:jax_numpy_rank_promotion": "rank_promotion",
  "cfg:jax_numpy_dtype_promotion": "mixed_float_dtypes",
  "cfg:jax_threefry_partitionable": "random_typed_key_arg",
  "cfg:jax_random_seed_offset": "random_in_body",
  "cfg:jax_debug_key_reuse": "random_typed_key_arg",
  "cfg:jax_softmax_custom_jvp": "softmax_grad",
  "cfg:jax_error_checking_behavior_nan": "nan_producing",
  "cfg:jax_error_checking_behavior_divide": "inf_producing",
  "cfg:jax_error_checking_behavior_oob": "oob_gather",
  "cfg:jax_check_static_indices": "oob_gather",
  "cfg:jax_disable_jit": "closed_over_ref_write",
  "cfg:jax_use_simplified_jaxpr_constants": "neg_zero_np_const",
  "cfg:jax_embedded_constants_max_bytes": "nan_payload_bits",
  "cfg:jax_custom_vjp3": "custom_vjp_grad",
  "cfg:jax_use_direct_linearize": "custom_jvp_grad",
  "cfg:jax_scan3": "scan",
  "cfg:jax_mutable_array_checks": "ref_inside_body",
  "cfg:jax_use_shardy_partitioner": "sharded_matmul",
  "cfg:jax_explicit_x64_dtypes": "int8_promotion",
  "cfg:check_vma": "psum_probe",
}

# More targeted pairs: programs re-created with values that compare equal but
# compute differently (NaN payloads, -0.0, a closed-over ref), and programs
# under context they read without naming it (a probed axis, the default
# device, the mesh, an array layout).
EXTRA = [
  ("nan_python_float_where", "closure_variant"),
  ("nan_payload_bits", "closure_variant"),
  ("neg_zero_recip", "closure_variant"),
  ("closed_over_ref_read", "closure_variant"),
  ("axis_index_probe", "axis_shard_map_other_name"),
  ("static_neg_zero", "closure_variant"),
  ("linalg_solve", "default_device"),
  ("numpy_args", "set_mesh_other_devices"),  # silent: outputs on mesh A
  ("linalg_cholesky", "layout_column_major"),
]


def _pairs():
  table = harness.dimensions()
  rng = random.Random(SEED)
  programs = sorted(corpus.CORPUS)
  pairs = []
  for dim in sorted(table):
    prog = TARGETS.get(dim)
    if prog is None:
      prog = rng.choice(
        [p for p in programs if harness.applicable(p, table[dim])]
      )
    pairs.append((prog, dim))
  pairs += EXTRA
  covered = {p for p, _ in pairs}
  for prog in programs:
    if prog not in covered:
      fits = [d for d in sorted(table) if harness.applicable(prog, table[d])]
      pairs.append((prog, rng.choice(fits)))
  return pairs


PAIRS = _pairs()


def test_corpus_size():
  assert len(corpus.CORPUS) >= 40, sorted(corpus.CORPUS)


def test_every_trace_context_entry_is_a_dimension():
  """A new JAX trace-context option must get a dimension (or a reason)."""
  table = harness.dimensions()
  names = ji.trace_context_names()
  assert "jax_enable_x64" in names and "axis_env_state" in names
  missing = [
    n
    for n in names
    if f"cfg:{n}" not in table
    and n not in harness.NON_FLAG_CONTEXT
    and n not in harness.SKIPPED_FLAGS
  ]
  assert not missing, missing
  for reason in harness.NON_FLAG_CONTEXT.values():
    if reason.startswith("dimension "):
      dim = reason.split()[1].rstrip("*").rstrip("_")
      assert any(d.startswith(dim) for d in table), reason


def test_every_program_and_dimension_runs():
  table = harness.dimensions()
  assert {p for p, _ in PAIRS} == set(corpus.CORPUS)
  assert {d for _, d in PAIRS} == set(table)
  for prog, dim in PAIRS:
    assert harness.applicable(prog, table[dim]), (prog, dim)


def test_the_harness_sees_a_difference():
  """The comparison is not vacuous: a NaN's sign and a device order count."""
  a = harness.outcome(lambda: jax.numpy.float32(float("nan")) * 1)
  b = harness.outcome(lambda: jax.numpy.float32(-float("nan")) * 1)
  assert a != b and harness.diff(a, b) == "leaf 0 bits"
  x = jax.numpy.arange(8.0)
  devs = jax.devices()
  m1 = jax.make_mesh((8,), ("i",), devices=devs)
  m2 = jax.make_mesh((8,), ("i",), devices=devs[::-1])
  s = lambda m: jax.sharding.NamedSharding(m, jax.P("i"))
  a = harness.outcome(lambda: jax.device_put(x, s(m1)))
  b = harness.outcome(lambda: jax.device_put(x, s(m2)))
  assert harness.diff(a, b) == "leaf 0 mesh devices"
  a = harness.outcome(lambda: 1 / 0)
  assert a == ("raises", "builtins.ZeroDivisionError")


def test_case_keys_round_trip():
  table = harness.dimensions()
  for case in harness.random_cases(SEED, 20):
    again = harness.parse_case(case.key(), table)
    assert again.key() == case.key()
    assert [[s.name for s in st] for st in again.states] == [
      [s.name for s in st] for st in case.states
    ]


@pytest.mark.parametrize("prog,dim", PAIRS, ids=[f"{d}-{p}" for p, d in PAIRS])
def test_ambient(prog, dim):
  table = harness.dimensions()
  found = []
  for case in harness.cases_for(prog, (dim,), table):
    found += harness.run_case(case)
  lines = []
  for m in found:
    lines += [m.line(), "  " + m.repro()]
  assert not found, "\n".join(lines)


# A few cases with several dimensions at once (derandomized: SEED); deeper
# runs of this kind are ambient_fuzz's.
RANDOM = list(harness.random_cases(SEED, 6, max_dims=3))


@pytest.mark.parametrize("key", [c.key() for c in RANDOM])
def test_ambient_combined(key):
  found = harness.run_case(harness.parse_case(key))
  lines = []
  for m in found:
    lines += [m.line(), "  " + m.repro()]
  assert not found, "\n".join(lines)
