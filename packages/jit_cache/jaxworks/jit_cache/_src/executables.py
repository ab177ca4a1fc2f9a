"""Compiled executables of trace entries: building, sharing, replaying.

``build`` lowers and compiles an entry for one argument placement. Programs
with a structural fingerprint go through the process-wide
``cache.EXECUTABLES`` (a re-created closure reuses what an earlier one
compiled). Every compile goes through JAX's persistent compilation cache when
``set_cache_dir`` turned it on (``monitoring.py`` records what it did).
"""

from __future__ import annotations

import time
from typing import Any
import warnings

import jax

from . import cache as _cache
from . import explain
from . import fingerprint as _fingerprint
from . import jax_internals as ji
from . import monitoring as _monitoring
from . import prefetch as _prefetch

_tree_leaves = jax.tree_util.tree_leaves


class Executable:
  """A compiled program and what calling it needs."""

  __slots__ = (
    "compiled",
    "mesh_executable",
    "const_args",
    "compile_seconds",
    "warnings",
    "__weakref__",
  )

  def __init__(self, compiled: Any, compile_seconds: float):
    self.compiled = compiled
    self.mesh_executable, self.const_args = ji.executable_parts(compiled)
    self.compile_seconds = compile_seconds
    #: Warnings lowering issued that jax.jit would issue again when it lowers
    #: the program anew (unusable donated buffers): replayed on reuse.
    self.warnings: tuple = ()


def lower_keeping_donation_warnings(traced: Any) -> tuple[Any, tuple]:
  """``traced.lower()`` and the "donated buffers were not usable" warnings it
  issued (as they were issued: every warning is shown as usual).

  Only programs that donate come here. ``catch_warnings`` is process-wide:
  a warning another thread issues meanwhile is recorded and shown from here.
  """
  with warnings.catch_warnings(record=True) as caught:
    lowered = traced.lower()
  keep = []
  for w in caught:
    warnings.warn_explicit(
      w.message, w.category, w.filename, w.lineno, source=w.source
    )
    if issubclass(w.category, UserWarning) and "donated buffers" in str(
      w.message
    ):
      keep.append(w.message)
  return lowered, tuple(keep)


#: Host memory counted for a loaded executable beyond its generated code:
#: somewhat more than a one-operation program holds on XLA:CPU, which reports
#: no code size (there this is the whole estimate).
_EXECUTABLE_OVERHEAD_BYTES = 256 << 10


def estimated_bytes(exe: Executable) -> int:
  """What keeping ``exe`` costs in memory, estimated: its generated code
  (as the loaded executable reports it) plus a fixed overhead. Not
  ``memory_analysis()``, which would add an analysis to every compile and
  reports no code size on CPU."""
  try:
    runtime = exe.mesh_executable.xla_executable
    code = int(runtime.size_of_generated_code_in_bytes())
  except Exception:  # pylint: disable=broad-except
    code = 0  # not every backend reports it
  return code + _EXECUTABLE_OVERHEAD_BYTES


def build(
  entry: Any, leaves: list, placement: Any, counters: _cache.Counters
) -> Executable:
  """The executable of ``entry`` for arguments ``leaves`` placed as
  ``placement``: reused from the shared cache or compiled."""
  traced = ji.make_traced(
    [ji.meta_type(x) for x in leaves],
    entry.params,
    entry.in_tree,
    entry.out_tree,
    [],
  )

  donates = any(entry.params["donated_invars"])

  def build() -> Executable:
    t0 = time.perf_counter()
    if donates:
      lowered, replay = lower_keeping_donation_warnings(traced)
    else:
      lowered, replay = traced.lower(), ()
    with _prefetch.building():
      compiled = lowered.compile()
    exe = Executable(compiled, time.perf_counter() - t0)
    exe.warnings = replay
    counters.compiles += 1
    _cache.GLOBAL_COUNTERS.compiles += 1
    return exe

  build = _monitoring.observed(build, entry, counters)
  program = _fingerprint.fingerprint(entry.jaxpr)
  params = _fingerprint.params_key(entry.params)
  if program is None or params is None:
    return build()
  # Programs holding no user object (callback, array kept by identity) and
  # little constant data outlive their functions in the shared cache.
  keep = (
    not program.pins
    and not params.pins
    and program.nbytes <= _fingerprint.CONTENT_HASH_MAX_BYTES
    and _fingerprint.plain(placement[0].extra.values)
  )
  exe, reused = _cache.EXECUTABLES.get_or_build(
    (program, params, placement), build, keep, size=estimated_bytes
  )
  if reused:
    _monitoring.note_reused(entry, counters)
    explain.log_reuse(counters)  # with jax_explain_cache_misses on
    for warning in exe.warnings:  # what lowering anew would have said
      warnings.warn(warning, stacklevel=4)
    counters.executable_reuses += 1
    counters.time_saved_s += exe.compile_seconds
    _cache.GLOBAL_COUNTERS.executable_reuses += 1
    _cache.GLOBAL_COUNTERS.time_saved_s += exe.compile_seconds
  return exe
