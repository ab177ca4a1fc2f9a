"""Every private JAX name in _src/jax_internals.py still behaves as we use it.

A JAX upgrade that moves or changes one of them fails here first.
"""

import contextlib
import inspect
import logging
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

# pylint: disable=g-import-not-at-top,wrong-import-position
import jax
import jax.experimental.layout
from jax.extend.core import primitives
import jax.numpy as jnp
import numpy as np
import pytest

from jaxworks.jit_cache._src import jax_internals as ji


def _axis_env():
  return ji.axis_env_in(ji.trace_context())


def test_trace_context_and_the_axis_env():
  ctx = ji.trace_context()
  env = ji.axis_env_in(ctx)
  assert isinstance(ctx, tuple) and type(env).__name__ == "AxisEnv"
  assert len(ji.trace_context_names()) == len(ctx)
  names = ji.trace_context_names()
  assert [n for n, v in zip(names, ctx) if v is env] == ["axis_env_state"]
  assert _axis_env() is env  # interned
  assert ji.axis_env_in((1.0, "x")) is None
  seen = []
  jax.vmap(lambda x: seen.append(_axis_env()) or x, axis_name="i")(jnp.ones(3))
  assert ji.axis_env_parts(seen[0])[0] == {"i": 3}
  prev = jax.config.jax_enable_x64
  jax.config.update("jax_enable_x64", not prev)
  try:
    assert ji.trace_context() != ctx  # x64 is in the context
  finally:
    jax.config.update("jax_enable_x64", prev)


def test_axis_env_helpers():
  with ji.extend_axis_env([("j", 2)]):
    assert ji.axis_env_parts(_axis_env())[0] == {"j": 2}


def test_value_types_of_the_fingerprint():
  mesh = jax.make_mesh((1,), ("i",))
  sharding = jax.sharding.NamedSharding(mesh, jax.P())
  closed = jax.make_jaxpr(
    lambda x: jax.debug.print("{}", x) or jax.jit(lambda y: y)(x)
  )(1.0)
  eqns = {e.primitive.name: e for e in closed.jaxpr.eqns}
  assert isinstance(mesh, ji.Mesh)
  assert isinstance(mesh.abstract_mesh, ji.AbstractMesh)
  assert isinstance(sharding.spec, jax.P)
  assert isinstance(eqns["debug_print"].params["in_tree"], ji.PyTreeDef)
  assert isinstance(jnp.ones(1).aval, ji.AbstractValue)
  assert all(isinstance(e, ji.Effect) for e in eqns["debug_print"].effects)
  assert isinstance(eqns["jit"].params["in_shardings"][0], ji.UnspecifiedValue)
  assert isinstance(eqns["jit"].params["compiler_options_kvs"], tuple)
  with ji.extend_axis_env([("i", 1)]):
    assert isinstance(_axis_env().axis_sizes, ji.FrozenDict)
  assert ji.Layout is jax.experimental.layout.Layout
  assert ji.Format is jax.experimental.layout.Format


def test_trace_state_and_debug_modes():
  assert ji.trace_state_clean()
  assert ji.current_trace.value is ji.eval_trace
  seen = []
  jax.jit(
    lambda x: (
      seen.append(
        (ji.trace_state_clean(), ji.current_trace.value is ji.eval_trace)
      )
      or x
    )
  )(1.0)
  assert seen == [(False, False)]
  assert not ji.debug_modes_on()
  with jax.debug_nans(True):
    assert ji.debug_modes_on()
  assert not ji.disable_jit_on()
  with jax.disable_jit():
    assert ji.disable_jit_on()


def test_array_type_registry_and_abstractify():
  assert type(jnp.ones(1)) is ji.ArrayImpl
  # The extension reads these three properties of ArrayImpl (cc/signature.cc).
  x = jnp.ones(2)
  placed = jax.device_put(jnp.ones(2), jax.devices()[0])
  assert x.aval is jnp.zeros(2).aval  # interned
  assert x._sharding == x.sharding and not x._committed  # pylint: disable=protected-access
  assert placed._committed is True  # pylint: disable=protected-access
  leaves, tree = ji.tracing_registry.flatten(((1.0, jax.random.key(0)), {}))
  assert len(leaves) == 2 and tree.num_leaves == 2  # key arrays are leaves
  assert ji.shaped_abstractify(np.ones(3, np.float32)) is jnp.ones(3).aval
  assert ji.shaped_abstractify(2.0).weak_type


def test_traced_parts_and_make_traced():
  traced = jax.jit(lambda x, y: x * y, static_argnums=1).trace(jnp.ones(3), 2)
  params, consts, meta, in_tree, out_tree = ji.traced_parts(traced)
  assert set(params) >= {
    "jaxpr",
    "in_shardings",
    "out_shardings",
    "donated_invars",
    "ctx_mesh",
    "name",
    "keep_unused",
    "inline",
    "compiler_options_kvs",
  }
  assert consts == [] and len(meta) == 1 and out_tree.num_leaves == 1
  leaves, tree = ji.tracing_registry.flatten(((jnp.ones(3),), {}))
  assert tree == in_tree  # our flattening matches jax's in_tree
  again = ji.make_traced(
    [ji.meta_type(x) for x in leaves], params, in_tree, out_tree, []
  )
  assert again.jaxpr is traced.jaxpr
  compiled = again.lower().compile()
  exe, const_args = ji.executable_parts(compiled)
  out = exe.call(*const_args, *leaves)
  np.testing.assert_array_equal(out[0], jnp.full(3, 2.0))
  assert (
    ji.fastpath_data(
      exe, out_tree, leaves, out, params["jaxpr"].effects, const_args
    )
    is not None
  )
  assert not ji.is_high(params["jaxpr"])
  out = primitives.jit_p.bind(*leaves, **params)
  np.testing.assert_array_equal(out[0], jnp.full(3, 2.0))


def test_infer_params_runs_for_every_stock_inner_call(monkeypatch):
  """trace_cache_test counts calls of jit's parameter inference
  (``_infer_params`` of ``jax._src.pjit``, the module jax_internals binds as
  ``_pjit``)."""
  calls = []
  original = ji._pjit._infer_params  # pylint: disable=protected-access

  def counting(*args, **kwargs):
    calls.append(1)
    return original(*args, **kwargs)

  monkeypatch.setattr(ji._pjit, "_infer_params", counting)
  inner = jax.jit(lambda v: v + 1)
  jax.make_jaxpr(lambda v: v + 1)(1.0)
  outer_only = len(calls)
  calls.clear()
  jax.make_jaxpr(lambda v: inner(inner(v)))(1.0)
  assert len(calls) == outer_only + 2  # once per inner call, even cached


def test_closed_over_tracers_become_consts():
  seen = {}

  def f(x):
    traced = jax.jit(lambda y: x + y).trace(1.0)
    params, consts, _, _, _ = ji.traced_parts(traced)
    seen["n"] = len(consts)
    moved = ji.convert_invars_to_constvars(params["jaxpr"].jaxpr, len(consts))
    seen["constvars"] = len(moved.constvars)
    return x

  jax.jit(f)(2.0)
  assert seen == {"n": 1, "constvars": 1}


def test_dispatcher():
  calls = []

  def cache_miss(*args, **kwargs):
    calls.append(1)
    traced = jax.jit(lambda x: x + 1).trace(*args, **kwargs)
    params, _, _, in_tree, out_tree = ji.traced_parts(traced)
    del in_tree
    compiled = traced.lower().compile()
    exe, const_args = ji.executable_parts(compiled)
    leaves = list(args)
    out = exe.call(*const_args, *leaves)
    fast = ji.fastpath_data(
      exe, out_tree, leaves, out, params["jaxpr"].effects, const_args
    )
    return out_tree.unflatten(out), fast, False

  d = ji.make_dispatcher("f", lambda x: x + 1, cache_miss, (), (), 4)
  x = jnp.ones(2)
  np.testing.assert_array_equal(d(x), x + 1)
  np.testing.assert_array_equal(d(x), x + 1)
  assert calls == [1] and ji.dispatcher_size(d) == 1
  ji.dispatcher_clear(d)
  assert ji.dispatcher_size(d) == 0


def test_jax_parse_arguments():
  signature, dyn = ji.jax_parse_arguments((jnp.ones(2), 3.0), {"k": 1})
  assert len(dyn) == 3 and signature is not None


def test_stock_entry_points_and_jit_defaults(monkeypatch):
  import inspect  # pylint: disable=g-import-not-at-top

  stock = jax.jit
  monkeypatch.setattr(jax, "jit", lambda *a, **k: None)  # the swap
  assert ji.stock_jit is stock
  wrapped = ji.stock_jit(lambda x: x + 1)
  assert type(wrapped).__name__ == "PjitFunction"
  np.testing.assert_array_equal(wrapped(jnp.ones(2)), 2.0)
  params = inspect.signature(ji.stock_jit).parameters
  assert params["fun"].default is ji.JIT_FUN_DEFAULT
  assert params["in_shardings"].default is ji.UNSPECIFIED
  assert params["out_shardings"].default is ji.UNSPECIFIED
  # Passing the defaults explicitly means "not specified" to stock jit.
  explicit = ji.stock_jit(
    lambda x: x * 2, in_shardings=ji.UNSPECIFIED, out_shardings=ji.UNSPECIFIED
  )
  np.testing.assert_array_equal(explicit(jnp.ones(2)), 2.0)
  assert callable(ji.stock_jit(ji.JIT_FUN_DEFAULT))  # decorator factory


def test_register_cache_is_cleared_by_jax_clear_caches():
  class Cache:
    cleared = 0

    def cache_clear(self):
      self.cleared += 1

  cache = Cache()
  ji.register_cache(cache, "test")
  jax.clear_caches()
  assert cache.cleared == 1


@contextlib.contextmanager
def _count_test_events(name):
  """Counts JAX's test events called ``name`` through the listener stock's
  own tests use (``jax._src.util``, bound by jax_internals as ``_util`` for
  ``test_event``); ``with _count_test_events(n) as count: ...; count()``."""
  util = ji._util  # pylint: disable=protected-access
  prev = util.test_event_listener
  seen = []

  def listener(event, *args):
    if event == name:
      seen.append(event)
    if prev is not None:
      prev(event, *args)

  util.test_event_listener = listener
  try:
    yield lambda: len(seen)
  finally:
    util.test_event_listener = prev


def test_test_event_counts_cpp_cache_misses():
  f = jax.jit(lambda x: x * 5 + 3)
  with _count_test_events("jit_cpp_cache_miss") as count:
    f(1.0)
    f(2.0)
    ji.test_event("jit_cpp_cache_miss")
  assert count() == 2  # stock's one miss, and ours


def test_jaxworks_jit_counts_cpp_cache_misses_like_stock():
  # jaxworks.jit_cache's dispatcher emits the event where stock's does (its
  # Python call path), so JAX's own tests that count misses see the same.
  from jaxworks.jit_cache import jit  # pylint: disable=g-import-not-at-top

  counts = []
  ones = jnp.ones(2)  # made outside: jnp.ones has a jit of its own
  for j in (ji.stock_jit, jit):
    f = j(lambda x, y: x * 7 + y)
    with _count_test_events("jit_cpp_cache_miss") as count:
      f(1.0, 2.0)
      f(3.0, 4.0)
      f(ones, 1.0)
    counts.append(count())
  assert counts[0] == counts[1] == 2


def test_reset_persistent_cache_takes_a_late_directory(tmp_path):
  # JAX decides at its first compile whether its persistent cache is used;
  # without the reset a directory set later is ignored.
  jax.jit(lambda v: v - 7.25)(1.0).block_until_ready()  # decided: no cache
  assert not ji.persistent_cache_enabled()
  try:
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    assert ji.persistent_cache_enabled()
    ji.reset_persistent_cache()
    jax.jit(lambda v: v * 3.5 - 1.125)(2.0).block_until_ready()
    assert any(p.name.endswith("-cache") for p in tmp_path.iterdir())
  finally:
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    ji.reset_persistent_cache()
  assert not ji.persistent_cache_enabled()


def test_has_host_callbacks():
  def noisy(v):
    jax.debug.print("v={v}", v=v)
    return v + 1

  x = jnp.ones(3)
  assert ji.has_host_callbacks(jax.jit(noisy).lower(x).compile())
  assert not ji.has_host_callbacks(jax.jit(jnp.sin).lower(x).compile())


def test_jit_only_key_states_are_in_the_context():
  names = ji.trace_context_names()
  assert names[-3:] == (
    "concrete mesh (jax.set_mesh)",
    "jax_optimization_level",
    "jax_memory_fitting_level",
  )
  mesh = jax.make_mesh((2,), ("i",), devices=jax.devices()[:2])
  before = ji.trace_context()
  with jax.set_mesh(mesh):
    inside = ji.trace_context()
  assert inside[-3] == mesh and before[-3] != mesh
  assert ji.trace_context() == before


def test_argument_checks_and_layouts():
  x = jnp.ones((2, 3))
  assert (
    type(x) in ji.shard_arg_handlers and np.ndarray in ji.shard_arg_handlers
  )
  assert ji.can_pass_to_executable(1.5) and ji.can_pass_to_executable(x)
  assert not ji.can_pass_to_executable(jax.ShapeDtypeStruct((2,), jnp.float32))
  assert ji.layouts_key([x, 1.0]) is None  # uncommitted
  y = jax.device_put(x, jax.devices()[0])
  key = ji.layouts_key([1.0, y])
  assert key is not None and key[0][0] == 1 and key[0][1] == y.format.layout


def test_static_eq_collision_is_recognised_and_the_cache_clears():
  text = (
    "Exception raised while checking equality of metadata fields of pytree. "
    "Make sure that metadata fields are hashable"
  )
  assert ji.is_static_eq_collision(ValueError(text))
  assert not ji.is_static_eq_collision(ValueError("other"))
  jax.jit(lambda x, s: x, static_argnums=1).trace(jnp.ones(1), "static")
  ji.clear_in_shardings_cache()  # the name exists and empties it
  jax.jit(lambda x, s: x, static_argnums=1).trace(jnp.ones(1), "static")


def test_dispatcher_takes_the_cpp_cache_object_in_context():
  from jaxlib import _jax  # pylint: disable=g-import-not-at-top

  from jaxworks.jit_cache import jit  # pylint: disable=g-import-not-at-top

  cache_obj = ji._config.jax_jit_cpp_cache_obj  # pylint: disable=protected-access
  with cache_obj(_jax.PjitFunctionCache(capacity=4)):
    f = jit(lambda x: x * 2)
  g = jit(lambda x: x * 3)
  for i in range(5):
    f(np.arange(i))
    g(np.arange(i))
  assert f._cache_size() == 4  # the context's cache, capacity 4
  assert g._cache_size() == 5  # its own


def test_jax_extend_names_are_the_same_objects():
  import jax.extend.core
  import jax.extend.source_info_util

  assert ji.ClosedJaxpr is jax.extend.core.ClosedJaxpr
  assert ji.Jaxpr is jax.extend.core.Jaxpr
  assert ji.Literal is jax.extend.core.Literal
  assert ji.DropVar is jax.extend.core.DropVar
  assert ji.jit_p is primitives.jit_p
  assert (
    ji.register_source_exclusion
    is jax.extend.source_info_util.register_exclusion
  )
  closed = jax.make_jaxpr(lambda x: x + 1.0)(1.0)
  assert isinstance(closed, ji.ClosedJaxpr)
  assert isinstance(closed.jaxpr, ji.Jaxpr)
  assert isinstance(closed.jaxpr.eqns[0].invars[1], ji.Literal)


def test_warm_start_prefetch_names(tmp_path):
  jnp.ones(1).block_until_ready()  # the backend started
  backend = ji.initialized_backend("cpu")
  assert backend is jax.devices()[0].client and backend.platform == "cpu"
  assert ji.initialized_backend("tpu") is None
  assert ji.distributed_client() is None  # no jax.distributed here
  devices = ji.DeviceList((jax.devices()[0],))
  assert list(devices) == [jax.devices()[0]]
  calls = []
  try:
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    ji.reset_persistent_cache()

    def spy(read, key, options, backend, devices):
      got = read(key, options, backend, devices)
      calls.append((key, options, backend, devices, got))
      return got

    ji.wrap_cache_read(lambda *a: pytest.fail("replaced"))
    ji.wrap_cache_read(spy)  # replaces the one before
    f = lambda v: v * 2.5 - 0.75  # noqa: E731
    jax.jit(f)(1.0).block_until_ready()
    jax.clear_caches()
    jax.jit(f)(1.0).block_until_ready()  # read from the cache
  finally:
    ji.wrap_cache_read(lambda read, *a: read(*a))
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    ji.reset_persistent_cache()
  assert len(calls) == 2 and calls[0][4] == (None, None)
  key, options, backend, devices, (exe, compile_time) = calls[1]
  assert list(devices) == [jax.devices()[0]] and backend.platform == "cpu"
  again = ji.compile_options_from_bytes(options.SerializeAsString())
  assert again.SerializeAsString() == options.SerializeAsString()
  entry = (tmp_path / (key + "-cache")).read_bytes()
  serialized, t = ji.executable_and_time(entry)
  assert t == compile_time and isinstance(serialized, bytes)
  loaded = backend.deserialize_executable(serialized, devices, again)
  assert type(loaded) is type(exe)


def test_jit_wrapped_is_what_stock_jit_returns():
  """Stock jax.jit is annotated to return it (a type for checkers: at run
  time stock returns its C++ wrapper)."""
  stock = inspect.unwrap(jax.jit)
  assert "JitWrapped" in str(stock.__annotations__["return"])
  assert issubclass(ji.JitWrapped, jax.stages.Wrapped)
  assert {"trace", "eval_shape", "lower"} <= set(dir(ji.JitWrapped))


def test_tracing_miss_logger_receives_jaxs_miss_warning():
  records = []

  class Keep(logging.Handler):
    def emit(self, record):
      records.append(record)

  handler = Keep()
  ji.tracing_miss_logger.addHandler(handler)
  jax.config.update("jax_explain_cache_misses", True)
  try:
    jax.jit(lambda v: v * 3)(jnp.ones(2))
  finally:
    jax.config.update("jax_explain_cache_misses", False)
    ji.tracing_miss_logger.removeHandler(handler)
  assert any(
    r.getMessage().startswith("TRACING CACHE MISS") for r in records
  ), records
