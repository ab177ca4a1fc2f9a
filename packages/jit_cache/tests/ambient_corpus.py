"""Corpus of the ambient-state differential harness (``ambient_harness``).

Each program is a factory: ``make(variant)`` returns a fresh ``Inst`` (a new
closure, a function building fresh arguments, jit options), so a case can run
the same program as one function object or as re-created closures. Programs
whose closures hold constants (NaN payloads, ``-0.0``) differ by ``variant``
in those constants only; the others ignore it. Arguments are built when a
step runs, inside that step's ambient state (so ``default_device``, x64 and
``set_mesh`` apply to them as they would in user code).
"""

from collections.abc import Callable
import dataclasses
import struct
from typing import Any

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

P = jax.sharding.PartitionSpec

# Host callbacks append here; the harness resets it before each run and
# compares what stock and jaxworks callbacks saw.
SINK: list = []


@dataclasses.dataclass
class Inst:
  """One instance of a program: a fresh function, its arguments, options."""

  fn: Callable[..., Any]
  args: Callable[[], tuple]
  jit_kwargs: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Program:
  """A named factory of ``Inst``; ``tags`` say which dimensions suit it."""

  name: str
  make: Callable[[int], Inst]
  tags: frozenset = frozenset()


CORPUS: dict[str, Program] = {}


def program(*tags):
  """Registers ``make`` under its function name (minus ``p_``)."""

  def register(make):
    name = make.__name__.removeprefix("p_")
    CORPUS[name] = Program(name, make, frozenset(tags))
    return make

  return register


def _mat(n=4, seed=0):
  rng = np.random.RandomState(seed)
  a = rng.uniform(-1, 1, (n, n)).astype(np.float32)
  return a


def _spd(n=4):
  a = _mat(n)
  return a @ a.T + n * np.eye(n, dtype=np.float32)


def _f32_from_bits(bits):
  return np.frombuffer(struct.pack("<I", bits), np.float32)[0]


# NaN constants that compare equal as Python floats' ``hex()`` ('nan') but
# differ in sign bit or payload; the pair at index v is the variant's.
NANS = (_f32_from_bits(0x7FC00000), _f32_from_bits(0xFFC00000))
NAN_PAYLOADS = (_f32_from_bits(0x7FC00001), _f32_from_bits(0x7FC0BEEF))
ZEROS = (0.0, -0.0)


# ----------------------------------------------------------------- linalg


@program("linalg", "matrix")
def p_linalg_solve(v):
  del v
  return Inst(
    lambda a, b: jnp.linalg.solve(a, b),
    lambda: (jnp.asarray(_spd()), jnp.arange(4.0, dtype=jnp.float32)),
  )


@program("linalg", "matrix")
def p_linalg_eigh(v):
  del v
  return Inst(lambda a: jnp.linalg.eigh(a), lambda: (jnp.asarray(_spd()),))


@program("linalg", "matrix")
def p_linalg_svd(v):
  del v
  return Inst(lambda a: jnp.linalg.svd(a), lambda: (jnp.asarray(_mat()),))


@program("linalg", "matrix")
def p_linalg_qr(v):
  del v
  return Inst(lambda a: jnp.linalg.qr(a), lambda: (jnp.asarray(_mat()),))


@program("linalg", "matrix")
def p_linalg_cholesky(v):
  del v
  return Inst(lambda a: jnp.linalg.cholesky(a), lambda: (jnp.asarray(_spd()),))


@program("linalg", "matrix")
def p_linalg_inv_det(v):
  del v
  return Inst(
    lambda a: (jnp.linalg.inv(a), jnp.linalg.slogdet(a)),
    lambda: (jnp.asarray(_spd()),),
  )


@program("matrix", "precision")
def p_matmul_f32(v):
  del v
  return Inst(
    lambda a, b: a @ b,
    lambda: (jnp.asarray(_mat(4, 1) * 1.1e3), jnp.asarray(_mat(4, 2) / 3)),
  )


# ----------------------------------------------------------------- random


@program("random")
def p_random_in_body(v):
  del v

  def f(x):
    k = jax.random.key(0)
    return x + jax.random.normal(k, x.shape), jax.random.bits(k, (2,))

  return Inst(f, lambda: (jnp.zeros(4),))


@program("random")
def p_random_typed_key_arg(v):
  del v

  def f(key, x):
    k1, k2 = jax.random.split(key)
    return jax.random.uniform(k1, x.shape) * x, k2

  return Inst(f, lambda: (jax.random.key(3), jnp.ones(4)))


@program("random")
def p_random_raw_key_arg(v):
  del v

  def f(key):
    return jax.random.normal(key, (3,)), jax.random.randint(key, (2,), 0, 9)

  return Inst(f, lambda: (jax.random.PRNGKey(5),))


@program("random")
def p_random_fold_in(v):
  del v

  def f(key, i):
    return jax.random.key_data(jax.random.fold_in(key, i))

  return Inst(f, lambda: (jax.random.key(1), jnp.int32(7)))


# -------------------------------------------------------------- callbacks


def _host_double(x):
  SINK.append(("pure", np.asarray(x).tobytes()))
  return (np.asarray(x) * 2).astype(np.asarray(x).dtype)


@program("callback")
def p_pure_callback(v):
  del v

  def f(x):
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.pure_callback(_host_double, out, x) + 1

  return Inst(f, lambda: (jnp.arange(3.0),))


@program("callback")
def p_debug_callback(v):
  del v

  def f(x):
    jax.debug.callback(
      lambda y: SINK.append(("debug", np.asarray(y).tobytes())), x
    )
    return x * 3

  return Inst(f, lambda: (jnp.arange(3.0),))


@program("callback")
def p_io_callback(v):
  del v

  def f(x):
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return jax.experimental.io_callback(_host_double, out, x, ordered=True)

  return Inst(f, lambda: (jnp.arange(3.0),))


# ------------------------------------------------------------------- refs


@program("ref")
def p_closed_over_ref_read(v):
  ref = jax.new_ref(jnp.full((3,), 1.0 + v))

  def f(x):
    return x + ref[...]

  return Inst(f, lambda: (jnp.arange(3.0),))


@program("ref")
def p_closed_over_ref_write(v):
  del v
  ref = jax.new_ref(jnp.zeros(3))

  def f(x):
    ref[...] += x
    return ref[...] * 2

  return Inst(f, lambda: (jnp.arange(3.0),))


@program("ref")
def p_ref_inside_body(v):
  del v

  def f(x):
    r = jax.new_ref(x)
    r[...] = r[...] * 2
    return r[...]

  return Inst(f, lambda: (jnp.arange(3.0),))


# ------------------------------------------------------------ custom rules


@program("autodiff")
def p_custom_jvp_grad(v):
  del v

  @jax.custom_jvp
  def g(x):
    return jnp.sin(x)

  g.defjvp(lambda p, t: (g(p[0]), 2.0 * t[0]))
  return Inst(
    lambda x: jax.grad(lambda y: g(y).sum())(x), lambda: (jnp.arange(3.0),)
  )


@program("autodiff")
def p_custom_vjp_grad(v):
  del v

  @jax.custom_vjp
  def g(x):
    return x * x

  g.defvjp(lambda x: (x * x, x), lambda r, ct: (ct * 3.0 * r,))
  return Inst(
    lambda x: jax.grad(lambda y: g(y).sum())(x), lambda: (jnp.arange(3.0),)
  )


@program("autodiff")
def p_softmax_grad(v):
  del v
  return Inst(
    lambda x: jax.grad(lambda y: jax.nn.softmax(y)[0])(x),
    lambda: (jnp.arange(4.0),),
  )


# ----------------------------------------------------------- control flow


@program("control")
def p_scan(v):
  del v

  def f(x):
    return lax.scan(lambda c, y: (c + y, c * y), 0.0, x)

  return Inst(f, lambda: (jnp.arange(5.0),))


@program("control")
def p_cond(v):
  del v
  return Inst(
    lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x),
    lambda: (jnp.bool_(True), jnp.arange(3.0)),
  )


@program("control")
def p_while_loop(v):
  del v
  return Inst(
    lambda x: lax.while_loop(
      lambda c: c[0] < 10, lambda c: (c[0] + 1, c[1] * 1.5), (0, x)
    ),
    lambda: (jnp.arange(3.0),),
  )


@program("control")
def p_fori_switch(v):
  del v

  def f(i, x):
    x = lax.fori_loop(0, 3, lambda j, c: c + j, x)
    return lax.switch(i, [jnp.sin, jnp.cos, jnp.tanh], x)

  return Inst(f, lambda: (jnp.int32(1), jnp.arange(3.0)))


# ----------------------------------------------------------- axis probes


def _probe(x):
  try:
    n = lax.axis_size("j")
  except NameError:
    return x - 1.0
  return x + n


@program("axis")
def p_axis_probe(v):
  del v
  return Inst(_probe_fresh(), lambda: (jnp.arange(4.0),))


def _probe_fresh():
  def f(x):
    return _probe(x)

  return f


@program("axis")
def p_axis_index_probe(v):
  del v

  def f(x):
    try:
      i = lax.axis_index("j")
    except NameError:
      return x
    return x * 10 + i

  return Inst(f, lambda: (jnp.arange(4.0),))


@program("axis")
def p_psum_probe(v):
  del v

  def f(x):
    try:
      return lax.psum(x, "j")
    except NameError:
      return -x

  return Inst(f, lambda: (jnp.arange(4.0),))


@program("axis", "mesh")
def p_shard_map_inner(v):
  del v

  def f(x):
    mesh = jax.sharding.get_abstract_mesh()
    if "i" not in mesh.axis_names:
      return x * 0.5
    body = lambda y: y + lax.axis_index("i").astype(y.dtype)
    return jax.shard_map(body, in_specs=P("i"), out_specs=P("i"))(x)

  return Inst(f, lambda: (jnp.arange(8.0),))


@program("mesh")
def p_mesh_probe(v):
  del v

  def f(x):
    mesh = jax.sharding.get_abstract_mesh()
    return x + float(len(mesh.axis_names)) + float(mesh.size)

  return Inst(f, lambda: (jnp.arange(8.0),))


# ------------------------------------------------------------ sharding


@program("sharded")
def p_sharded_elementwise(v):
  del v
  return Inst(
    lambda x: jnp.tanh(x) * 2, lambda: (jnp.arange(16.0).reshape(8, 2),)
  )


@program("sharded")
def p_sharded_reduce(v):
  del v
  return Inst(
    lambda x: (x.sum(0), x.max()), lambda: (jnp.arange(16.0).reshape(8, 2),)
  )


@program("sharded", "mesh")
def p_sharding_constraint(v):
  del v

  def f(x):
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "i" not in mesh.axis_names:
      return x + 1
    return jax.lax.with_sharding_constraint(x + 1, P("i"))

  return Inst(f, lambda: (jnp.arange(16.0).reshape(8, 2),))


@program("sharded", "matrix")
def p_sharded_matmul(v):
  del v
  return Inst(
    lambda x, w: x @ w,
    lambda: (jnp.arange(16.0).reshape(8, 2), jnp.ones((2, 3))),
  )


# ------------------------------------------------- NaN payloads and zeros


@program("consts")
def p_nan_sign_copysign(v):
  c = float(NANS[v % 2])  # a Python float: float.hex() is 'nan' for both

  def f(x):
    return x * jnp.copysign(1.0, c)

  return Inst(f, lambda: (jnp.arange(3.0),))


@program("consts")
def p_nan_sign_np_scalar(v):
  c = NANS[v % 2]

  def f(x):
    return x * jnp.copysign(1.0, c)

  return Inst(f, lambda: (jnp.arange(3.0),))


@program("consts")
def p_nan_payload_bits(v):
  c = np.full((2,), NAN_PAYLOADS[v % 2])

  def f(x):
    return lax.bitcast_convert_type(jnp.asarray(c) + 0 * x[:2], jnp.uint32)

  return Inst(f, lambda: (jnp.arange(3.0),))


@program("consts")
def p_neg_zero_recip(v):
  c = ZEROS[v % 2]

  def f(x):
    return x / c

  return Inst(f, lambda: (jnp.arange(1.0, 4.0),))


@program("consts")
def p_neg_zero_np_const(v):
  c = np.array([ZEROS[v % 2]] * 3, np.float32)

  def f(x):
    return jnp.copysign(x, c), 1.0 / c

  return Inst(f, lambda: (jnp.arange(1.0, 4.0),))


@program("consts")
def p_nan_python_float_where(v):
  c = float(NANS[v % 2])

  def f(x):
    return lax.bitcast_convert_type(jnp.where(x > 1, c, x), jnp.uint32)

  return Inst(f, lambda: (jnp.arange(3.0),))


# ------------------------------------------------------------- statics


class RaisingEq:
  """Static argument whose ``__eq__`` raises against any other object.

  One instance per variant is kept for the whole process: stock ``jax.jit``
  then only ever compares it with itself (a treedef's hash leaves node data
  out, so a new instance would be compared with the old one and raise in
  stock as well, from the second call of the process on).
  """

  def __init__(self, k):
    self.k = k

  def __hash__(self):
    return hash(self.k)

  def __eq__(self, other):
    if other is self:
      return True
    raise TypeError("RaisingEq.__eq__ called with another object")


RAISING_EQ = (RaisingEq(2), RaisingEq(3))


@program("static")
def p_static_raising_eq(v):
  k = RAISING_EQ[v % 2]
  return Inst(
    lambda x, s: x * s.k, lambda: (jnp.arange(3.0), k), {"static_argnums": 1}
  )


@program("static", "consts")
def p_static_neg_zero(v):
  c = ZEROS[v % 2]
  return Inst(
    lambda x, s: x / s, lambda: (jnp.arange(1.0, 4.0), c), {"static_argnums": 1}
  )


# ------------------------------------------------------------- donation


@program("donate")
def p_donate(v):
  del v
  return Inst(
    lambda x, y: (x + y, y * 2),
    lambda: (jnp.arange(4.0), jnp.ones(4)),
    {"donate_argnums": 0},
  )


@program("donate", "matrix")
def p_donate_matrix(v):
  del v
  return Inst(
    lambda a: a.T @ a, lambda: (jnp.asarray(_mat(4, 3)),), {"donate_argnums": 0}
  )


# ------------------------------------------------ dtype and config readers


@program("dtype")
def p_weak_scalar(v):
  del v
  return Inst(lambda x: (x * 2, x + 1.5), lambda: (jnp.float32(2.0),))


@program("dtype")
def p_int8_promotion(v):
  del v
  return Inst(
    lambda x, y: (x + 3, x * y),
    lambda: (jnp.int8(5), jnp.arange(3, dtype=jnp.int8)),
  )


@program("dtype")
def p_arange_in_body(v):
  del v
  return Inst(lambda n: (jnp.arange(3) + n, jnp.zeros(2)), lambda: (1,))


@program("dtype")
def p_rank_promotion(v):
  del v
  return Inst(lambda x, y: x + y, lambda: (jnp.ones((3, 2)), jnp.arange(2.0)))


@program("dtype")
def p_mixed_float_dtypes(v):
  del v
  return Inst(
    lambda x, y: (x + y, (x * y).sum()),
    lambda: (jnp.ones(3, jnp.bfloat16), jnp.arange(3.0, dtype=jnp.float16)),
  )


@program("dtype")
def p_numpy_args(v):
  del v
  return Inst(
    lambda x, y: x * y + 1,
    lambda: (np.arange(4.0, dtype=np.float32), np.float32(2)),
  )


@program("nan")
def p_nan_producing(v):
  del v
  return Inst(lambda x: jnp.log(x) * 0, lambda: (jnp.arange(-1.0, 3.0),))


@program("nan")
def p_inf_producing(v):
  del v
  return Inst(lambda x: 1.0 / x, lambda: (jnp.arange(-1.0, 3.0),))


@program("nan")
def p_oob_gather(v):
  del v
  return Inst(lambda x, i: x[i], lambda: (jnp.arange(4.0), jnp.int32(9)))
