"""Bad input gives errors that name the API, the bad value and the fix."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks.axis_names import AxisNameError
from jaxworks.pmap_chunked import pmap

pytestmark = pytest.mark.skipif(
  jax.device_count() < 8, reason="needs 8 devices (XLA_FLAGS)"
)
API = "jaxworks.pmap_chunked.pmap"


def test_wrong_leading_sizes():
  f = pmap(lambda a, b: a + b)
  with pytest.raises(ValueError) as info:
    f(jnp.ones((8, 2)), jnp.ones((4, 2)))
  msg = str(info.value)
  assert msg.startswith(API)
  assert "args[0]: size 8 along axis 0" in msg
  assert "args[1]: size 4 along axis 0" in msg
  assert "same size" in msg


def test_wrong_leading_sizes_in_nested_arguments():
  f = pmap(lambda d: d["x"] + d["y"], in_axes=({"x": 0, "y": 1},))
  with pytest.raises(
    ValueError,
    match=r"args\[0\]\['y'\]: size 3 along axis "
    "1",
  ):
    f({"x": jnp.ones((8, 3)), "y": jnp.ones((8, 3))})


def test_too_many_for_the_devices():
  with pytest.raises(
    ValueError,
    match=r"needs 9 devices but only 8 are "
    r"available .* at most 8",
  ):
    pmap(lambda v: v)(jnp.ones(9))


def test_devices_argument_of_wrong_length():
  f = pmap(lambda v: v, devices=jax.devices()[:4])
  with pytest.raises(
    ValueError, match="mapped axis size is 2 but devices= lists 4 devices"
  ):
    f(jnp.ones(2))


def test_bad_devices_argument():
  with pytest.raises(ValueError, match="non-empty"):
    pmap(lambda v: v, devices=[])
  with pytest.raises(ValueError, match="more than once"):
    pmap(lambda v: v, devices=[jax.devices()[0]] * 2)
  with pytest.raises(TypeError, match="jax.Device objects"):
    pmap(lambda v: v, devices=["cpu:0"])


def test_unbound_axis_name_reported_through_axis_names():
  def uses_j(v):
    return jax.lax.psum(v, "j")  # the line the error must point at

  line = uses_j.__code__.co_firstlineno + 1
  with pytest.raises(AxisNameError) as info:
    pmap(uses_j, axis_name="i")(jnp.ones(8))
  err = info.value
  msg = str(err)
  assert msg.startswith(API)
  assert "psum" in msg and "'j'" in msg and "'i'" in msg
  assert f"errors_test.py:{line}" in msg
  assert err.primitive == "psum" and err.axis_name == "j"
  assert err.bound == ("i",)
  assert isinstance(err, NameError)  # still a NameError, as JAX raises


def test_unbound_axis_name_in_nested_pmap_lists_both_bound_names():
  inner = pmap(lambda v: jax.lax.all_gather(v, "k"), "j")
  with pytest.raises(AxisNameError) as info:
    pmap(inner, "i")(jnp.ones((2, 4)))
  err = info.value
  assert err.primitive == "all_gather" and err.axis_name == "k"
  assert set(err.bound) == {"i", "j"}


def test_static_argnums_out_of_range_and_unhashable():
  f = pmap(lambda a, b: a, static_broadcasted_argnums=(1,))
  with pytest.raises(
    ValueError,
    match=r"static_broadcasted_argnums=\(1,\) "
    r"but was called with only 1 positional argument\. .* Pass argument 1 of .*<lambda>",
  ):
    f(jnp.ones(8))
  with pytest.raises(
    TypeError, match="static argument 1 .* must be hashable, got a list"
  ):
    f(jnp.ones(8), [1, 2])
  with pytest.raises(TypeError, match="must be an int or a collection"):
    pmap(lambda a: a, static_broadcasted_argnums=[1.5])
  with pytest.raises(
    ValueError, match="both static_broadcasted_argnums and donate_argnums"
  ):
    pmap(lambda a, b: a, static_broadcasted_argnums=1, donate_argnums=1)


def test_bad_axes_specs():
  with pytest.raises(TypeError, match="in_axes must be an int, None"):
    pmap(lambda a: a, in_axes="0")
  with pytest.raises(TypeError, match="out_axes must be an int, None"):
    pmap(lambda a: a, out_axes=(0, 1.5))
  with pytest.raises(
    ValueError,
    match=r"in_axes=\(0, 0\) has 2 entries but "
    ".* 1 positional",
  ):
    pmap(lambda a: a, in_axes=(0, 0))(jnp.ones(8))
  with pytest.raises(ValueError, match="not a pytree prefix"):
    pmap(lambda a: a, in_axes=((0, 0),))(jnp.ones(8))
  # The mismatch is located by its path in in_axes.
  with pytest.raises(
    ValueError,
    match=r"key path\s+in_axes\[0\]\s+At that "
    "key path, the prefix pytree in_axes has a subtree of "
    "type tuple of length 3",
  ):
    x = jnp.ones(8)
    pmap(lambda a, b: a, in_axes=((0, 0, 0), 0))((x, x), x)
  with pytest.raises(ValueError, match="out_axes=.* not a pytree prefix"):
    pmap(lambda a: (a, a), out_axes=(0, 0, 0))(jnp.ones(8))


def test_axis_out_of_range():
  with pytest.raises(
    ValueError,
    match=r"shape \(8,\) \(rank 1\) and cannot be "
    "mapped over axis 1; use an axis below 1 or give it "
    "in_axes=None",
  ):
    pmap(lambda a: a, in_axes=1)(jnp.ones(8))
  with pytest.raises(
    ValueError,
    match=r"args\[1\] .* shape \(\) \(rank 0\) "
    "and cannot be mapped over axis 0; a scalar has no axis "
    "to map: give it in_axes=None",
  ):
    pmap(lambda a, s: a)(jnp.ones(8), jnp.float32(1))
  with pytest.raises(
    ValueError,
    match="in_axes axis -3 is out of range for "
    r"argument args\[0\] of rank 2",
  ):
    pmap(lambda a: a, in_axes=-3)(jnp.ones((8, 2)))
  with pytest.raises(
    ValueError, match="out_axes axis 3 is out of range for output"
  ):
    pmap(lambda a: a, out_axes=3)(jnp.ones((8, 2)))


def test_cannot_map_a_python_scalar_or_string():
  with pytest.raises(
    TypeError,
    match="cannot be mapped over .* in_axes=None .* static_broadcasted_argnums",
  ):
    pmap(lambda a, s: a)(jnp.ones(8), "text")
  # A mapped Python scalar is a rank-0 value, a ValueError as in jax.pmap.
  with pytest.raises(
    ValueError,
    match=r"args\[0\] .* shape \(\) \(rank 0\) "
    "and cannot be mapped over axis 0; a scalar has no axis",
  ):
    pmap(lambda a: a)(1.0)


def test_chunked_output_without_its_chunk_axis():
  with pytest.raises(
    ValueError,
    match=r"chunked=True\): output .* has "
    r"per-device shape \(3,\)",
  ):
    pmap(lambda a: a.sum(0), chunked=True)(jnp.ones((8, 3)))


def test_axis_size_mismatch_and_missing():
  with pytest.raises(ValueError, match="axis_size=4 but .* mapped size 8"):
    pmap(lambda a: a, axis_size=4)(jnp.ones(8))
  with pytest.raises(
    ValueError, match="at least one argument with a mapped axis"
  ):
    pmap(lambda a: a, in_axes=None)(jnp.ones(8))
  # As jax.pmap: a size that is no mapped size is a mismatch at the call.
  with pytest.raises(ValueError, match="axis_size=0 but"):
    pmap(lambda a: a, axis_size=0)(jnp.ones(8))


def test_constructor_type_checks():
  with pytest.raises(TypeError, match="fun must be callable"):
    pmap(3)
  with pytest.raises(TypeError, match="axis_name must be hashable"):
    pmap(lambda a: a, axis_name=["i"])
  with pytest.raises(TypeError, match="chunked must be True or False"):
    pmap(lambda a: a, chunked="yes")


def test_errors_leave_no_half_built_state():
  f = pmap(lambda a, b: a + b)
  with pytest.raises(ValueError):
    f(jnp.ones((8, 2)), jnp.ones((4, 2)))
  assert f.cache_info().entries == 0
  np.testing.assert_allclose(f(jnp.ones((8, 2)), jnp.ones((8, 2))), 2.0)


def test_failed_trace_keeps_donated_input_and_leaves_no_entry():
  def boom(v):
    raise RuntimeError("boom in user code")

  f = pmap(boom, donate_argnums=0)
  x = jnp.ones((8, 2))  # needs moving, and is donated
  with pytest.raises(RuntimeError, match="boom in user code"):
    f(x)
  assert not x.is_deleted()
  info = f.cache_info()
  assert (info.hits, info.misses, info.entries) == (0, 0, 0)
