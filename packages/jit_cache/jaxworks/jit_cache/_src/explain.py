"""``f.explain_miss``: which argument property differs from the cache.

Compares a call's ``Signature`` with the newest signature of every cached
entry and reports the nearest one's differences, one line each, in terms of
the argument path and property: ``x['w']: dtype float32 -> float64``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import jax
import numpy as np

from . import cache as _cache
from . import closures as _closures
from . import jax_internals as ji
from . import signature as _sig

#: jit_cache's executable reuses are logged here (INFO) while
#: ``jax_explain_cache_misses`` is on; never otherwise. Its explanation of a
#: trace miss joins the one warning JAX logs for that miss.
logger = logging.getLogger("jaxworks.jit_cache")
_jax_config = jax.config


class _JoinJaxsMissWarning(logging.Filter):
  """Appends jit_cache's explanation of a trace miss to the warning JAX logs
  for the same miss, so each miss is logged once (and code counting JAX's
  records sees as many as under ``jax.jit``)."""

  def __init__(self):
    super().__init__()
    self.pending = threading.local()

  def filter(self, record: logging.LogRecord) -> bool:
    text = getattr(self.pending, "text", None)
    if text is not None and str(record.msg).startswith("TRACING CACHE MISS"):
      self.pending.text = None
      record.msg = f"{record.msg}\n{text}"
    return True


_JOIN = _JoinJaxsMissWarning()
ji.tracing_miss_logger.addFilter(_JOIN)

_PROPERTIES = ("kind", "shape", "dtype", "weak_type", "sharding", "committed")


def _fmt(value: Any) -> str:
  if isinstance(value, np.dtype):
    return value.name
  if isinstance(value, tuple):
    trailing = "," if len(value) == 1 else ""
    return "(" + ", ".join(str(v) for v in value) + trailing + ")"
  return str(value)


def _static_label(where: Any, fn: Any) -> str:
  if isinstance(where, int):
    names = fn.param_names or []
    return names[where] if where < len(names) else f"args[{where}]"
  return str(where)


def _context_diffs(entry: Any, old_ctx: Any, ctx: Any) -> list[str]:
  out = []
  now = _cache.config_snapshot()
  for name, value in now.items():
    if name in entry.config and entry.config[name] != value:
      out.append(f"config {name}: {entry.config[name]} -> {value}")
  # The axis environment is found by its type, never by its position: user
  # contexts (jax.make_user_context) append to the trace context.
  old_env, new_env = ji.axis_env_in(old_ctx.values), ji.axis_env_in(ctx.values)
  if old_env is not new_env and old_env is not None and new_env is not None:
    old_sizes = ji.axis_env_parts(old_env)[0]
    new_sizes = ji.axis_env_parts(new_env)[0]
    if old_sizes != new_sizes:
      out.append(f"axis environment: {old_sizes} -> {new_sizes}")
  if not out and old_ctx.values != ctx.values:
    names = ji.trace_context_names()
    if len(old_ctx.values) == len(ctx.values) == len(names):
      changed = [
        names[i]
        for i, (a, b) in enumerate(zip(old_ctx.values, ctx.values))
        if a is not b and a != b
      ]
      out.append("tracing context differs in " + ", ".join(changed))
    else:
      out.append("tracing context differs (a context was added since)")
  return out


def _diffs(fn: Any, entry: Any, sig: Any, paths: list[str]) -> list[str]:
  """Differences from the closest of the entry's recorded signatures."""
  candidates = [_diffs_one(fn, entry, old, sig, paths) for old in entry.sigs]
  return min(candidates, key=len, default=["(no recorded signature)"])


def _diffs_one(
  fn: Any, entry: Any, old: Any, sig: Any, paths: list[str]
) -> list[str]:
  old_tree, old_statics, old_ctx = old.extra
  new_tree, new_statics, new_ctx = sig.extra
  out: list[str] = []
  if old_tree != new_tree:
    return [f"argument structure: {old_tree} -> {new_tree}"]
  old_s = {w: v for w, _, v in old_statics}
  new_s = {w: v for w, _, v in new_statics}
  for where in sorted(set(old_s) | set(new_s), key=str):
    a, b = old_s.get(where, "<absent>"), new_s.get(where, "<absent>")
    if type(a) is not type(b) or a != b:
      out.append(f"static argument {_static_label(where, fn)}: {a!r} -> {b!r}")
  if old_ctx != new_ctx:
    out.extend(_context_diffs(entry, old_ctx, new_ctx))
  for i, (a, b) in enumerate(zip(old.describe(), sig.describe())):
    pa, pb = _sig.leaf_properties(a), _sig.leaf_properties(b)
    where = paths[i] if i < len(paths) else f"leaf {i}"
    for prop in _PROPERTIES:
      if pa[prop] is None and pb[prop] is None:
        continue
      if pa[prop] != pb[prop]:
        out.append(f"{where}: {prop} {_fmt(pa[prop])} -> {_fmt(pb[prop])}")
  return out


def explain(
  fn: Any,
  leaves: list,
  treedef: Any,
  statics: tuple,
  ctx: Any,
  sig: Any,
  args: tuple,
  kwargs: dict,
) -> str:
  """The explanation text for ``fn.explain_miss(*args, **kwargs)``."""
  name = fn.name
  cache = fn.cache
  if sig in cache.by_sig:
    return f"{name}: hit (this exact signature is cached)"
  paths = fn.leaf_paths(args, kwargs)
  entries = cache.by_key.values()
  if not entries:

    def argument_diffs(earlier: Any) -> list[str] | None:
      known = list(earlier.cache.by_key.values())
      if not known:
        return None
      return min((_diffs(earlier, e, sig, paths) for e in known), key=len)

    return _closures.explain_new_function(fn, argument_diffs) or (
      f"{name}: miss: nothing is cached for {name} yet"
    )
  avals = tuple(ji.shaped_abstractify(x) for x in leaves)
  same = cache.by_key.peek((avals, treedef, statics, ctx))
  if same is not None:
    lines = _diffs(fn, same, sig, paths)
    return (
      f"{name}: hit: the abstract values match a cached trace, which "
      "is reused (a new placement or leaf kind only needs an "
      "executable):\n  " + "\n  ".join(lines or ["(no difference)"])
    )
  best = min((_diffs(fn, e, sig, paths) for e in entries), key=len)
  return (
    f"{name}: miss; the nearest of {len(entries)} cached entries "
    "differs in:\n  " + "\n  ".join(best or ["(no recorded difference)"])
  )


def _explaining() -> bool:
  return bool(getattr(_jax_config, "jax_explain_cache_misses"))


def _defined_at(fn: Any) -> str:
  code = getattr(fn.user_function, "__code__", None)
  if code is None:
    return fn.name
  return f"{fn.name} defined at {code.co_filename}:{code.co_firstlineno}"


def log_miss(fn: Any, args: tuple, kwargs: dict) -> Any:
  """With ``jax_explain_cache_misses`` on, explains why ``fn`` traces now:
  the explanation joins JAX's warning for the miss. Returns a callable to
  run once the trace is done (it logs the explanation at INFO if JAX logged
  nothing for this miss), or None."""
  if not _explaining():
    return None
  try:
    leaves, treedef, statics, ctx, sig = fn.key(args, kwargs)
    text = explain(fn, leaves, treedef, statics, ctx, sig, args, kwargs)
  except Exception as e:  # pylint: disable=broad-except
    text = f"(no explanation: {type(e).__name__}: {e})"
  _, _, why = text.partition(": miss")
  lines = why.lstrip(":;").strip().splitlines() or [text]
  message = f"JIT_CACHE TRACING CACHE MISS for {_defined_at(fn)}:\n  " + (
    "\n  ".join(lines)
  )
  _JOIN.pending.text = message

  def done() -> None:
    if getattr(_JOIN.pending, "text", None) is not None:
      _JOIN.pending.text = None
      logger.info("%s", message)  # JAX logged nothing for this miss

  return done


def log_reuse(counters: Any) -> None:
  """With ``jax_explain_cache_misses`` on, logs that the function owning
  ``counters`` reused an executable instead of compiling."""
  if not _explaining():
    return
  fn = _closures.owner_of(counters)
  logger.info(
    "JIT_CACHE EXECUTABLE REUSE for %s:\n  not compiled: a structurally "
    "identical program was compiled in this process",
    _defined_at(fn) if fn is not None else "a jit_cache function",
  )
