"""Argument specs such as 'f32[b,128]': parsing, errors, formatting, fuzz."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Private imports below, no public counterpart: is_concrete, and
# parse_arg_specs's own check that it got a list, not a single string.
from jaxworks import stages_aot as sa
from jaxworks.stages_aot._src.specs import is_concrete
from jaxworks.stages_aot._src.specs import parse_arg_specs


@pytest.mark.parametrize(
  "spec, shape, dtype",
  [
    ("f32[2,3]", (2, 3), jnp.float32),
    ("bf16[]", (), jnp.bfloat16),
    ("i8[ 4 ]", (4,), jnp.int8),
    ("bool[1,1]", (1, 1), jnp.bool_),
    ("pred[2]", (2,), jnp.bool_),
    ("u32[0]", (0,), jnp.uint32),
    ("float16[5]", (5,), jnp.float16),
    ("c64[2]", (2,), jnp.complex64),
    ("float8_e4m3fn[8]", (8,), jnp.float8_e4m3fn),
  ],
)
def test_concrete_specs(spec, shape, dtype):
  s = sa.arg_spec(spec)
  assert isinstance(s, jax.ShapeDtypeStruct)
  assert s.shape == shape and s.dtype == jnp.dtype(dtype)
  assert is_concrete(s.shape)


def test_symbolic_specs_share_a_scope_and_trace():
  x, y = sa.arg_specs("f32[b,128]", "f32[b, 2*b]")
  assert not is_concrete(x.shape)
  assert x.shape[0] == y.shape[0] and str(y.shape[1]) == "2*b"
  exp = (
    sa.trace(lambda a, c: a.sum(axis=1) + c.sum(axis=1), x, y).lower().export()
  )
  assert [sa.format_aval(a) for a in exp.out_avals] == ["f32[b]"]


def test_separate_arg_spec_calls_have_separate_scopes():
  x, y = sa.arg_spec("f32[b]"), sa.arg_spec("f32[b]")
  with pytest.raises(
    ValueError,
    match=r"trace: the symbolic dimensions of args\[0\] and args\[1\] come from different scopes",
  ):
    sa.trace(lambda a, c: a + c, x, y)


@pytest.mark.parametrize(
  "spec, match",
  [
    ("f32", r"cannot parse argument spec 'f32'; expected DTYPE\[DIMS\]"),
    ("[3]", "cannot parse argument spec"),
    ("f32[3", "cannot parse argument spec"),
    (
      "f33[4]",
      r"unknown dtype 'f33' in spec 'f33\[4\]'; use one of bool, pred",
    ),
    ("object[4]", "unknown dtype 'object'"),
    (
      "f32[-1]",
      "dimension 0 of spec 'f32\\[-1\\]' is -1; dimensions must be non-negative",
    ),
    (
      "f32[b,,3]",
      r"bad dimensions in argument spec 'f32\[b,,3\]': syntax error",
    ),
    ("f32[1.5]", "bad dimensions"),
    (
      "f64[2]",
      "asks for float64, but 64-bit types are disabled in this process; set JAX_ENABLE_X64=1",
    ),
  ],
)
def test_bad_specs(spec, match):
  with pytest.raises(ValueError, match=match):
    sa.arg_spec(spec)


def test_non_string_specs():
  with pytest.raises(
    TypeError, match="must be a string such as 'f32\\[b,128\\]', got int 3"
  ):
    sa.arg_specs(3)
  with pytest.raises(
    TypeError, match="expected a list of specs, got the single string"
  ):
    parse_arg_specs("f32[2]")


def test_format_aval():
  assert sa.format_aval(jax.ShapeDtypeStruct((3, 4), np.int32)) == "i32[3,4]"
  assert sa.format_aval(jax.core.ShapedArray((), jnp.bfloat16)) == "bf16[]"
  assert sa.format_aval(sa.arg_spec("f32[b, 2*b + 1]")) == "f32[b,2*b+1]"
  assert (
    sa.format_aval(jax.ShapeDtypeStruct((), jnp.float8_e5m2)) == "float8_e5m2[]"
  )


DTYPES = ["f32", "bf16", "f16", "i8", "i32", "u8", "bool", "c64", "float8_e5m2"]
DIM = st.one_of(
  st.integers(0, 64).map(str), st.sampled_from(["b", "n", "2*b", "b+1", "n*b"])
)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(DTYPES), st.lists(DIM, max_size=4))
def test_fuzz_format_parse_roundtrip(dtype, dims):
  spec = f"{dtype}[{','.join(dims)}]"
  parsed = sa.arg_spec(spec)
  assert len(parsed.shape) == len(dims)
  assert sa.arg_spec(
    sa.format_aval(parsed)
  ).shape == parsed.shape or not is_concrete(parsed.shape)
  assert sa.format_aval(sa.arg_spec(sa.format_aval(parsed))) == sa.format_aval(
    parsed
  )


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=24))
def test_fuzz_arbitrary_text_gives_value_error_or_spec(text):
  try:
    parsed = sa.arg_spec(text)
  except ValueError as e:
    assert str(e).startswith("jaxworks.stages_aot.arg_spec: ")
  else:
    assert isinstance(parsed, jax.ShapeDtypeStruct)
