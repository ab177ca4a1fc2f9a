"""Platform names: validation of lowering platforms and the platforms present here."""

from __future__ import annotations

from collections.abc import Sequence

import jax

from . import jax_internals as ji

#: The platforms ``Traced.lower`` can lower for, on any host.
KNOWN_PLATFORMS: tuple[str, ...] = ("cpu", "cuda", "rocm", "tpu")


def canonical_platforms(
  platforms: Sequence[str] | None, *, api: str
) -> tuple[str, ...]:
  """Validates a sequence of lowering platforms and returns it as a tuple.

  ``None`` means the default backend of this process (``jax.default_backend()``
  with ``gpu`` spelled ``cuda`` or ``rocm``).

  Args:
    platforms: e.g. ``("cpu", "tpu")``, or None.
    api: the public API name to put in error messages.

  Returns:
    A non-empty tuple of distinct names from :data:`KNOWN_PLATFORMS`.

  Raises:
    TypeError: ``platforms`` is a string or not a sequence of strings.
    ValueError: an unknown, duplicate or empty list of platforms.

  >>> canonical_platforms(["tpu", "cpu"], api="demo")
  ('tpu', 'cpu')
  >>> canonical_platforms(None, api="demo")
  ('cpu',)
  """
  if platforms is None:
    return (jax.export.default_export_platform(),)
  if isinstance(platforms, (str, bytes)):
    raise TypeError(
      f"{api}: lowering_platforms must be a tuple of platform names, got the "
      f"string {platforms!r}; write lowering_platforms=({platforms!r},)"
    )
  try:
    plats = tuple(platforms)
  except TypeError:
    raise TypeError(
      f"{api}: lowering_platforms must be a tuple of platform names such as "
      f"('cpu', 'tpu'), got {platforms!r}"
    ) from None
  if not plats:
    raise ValueError(
      f"{api}: lowering_platforms is empty; pass at least one of "
      f"{KNOWN_PLATFORMS}, or None for the default backend"
    )
  for p in plats:
    if not isinstance(p, str):
      raise TypeError(
        f"{api}: lowering platform {p!r} is not a string; use names from "
        f"{KNOWN_PLATFORMS}"
      )
    if p == "gpu":
      raise ValueError(
        f"{api}: lowering platform 'gpu' is ambiguous; write 'cuda' or 'rocm'"
      )
    if p not in KNOWN_PLATFORMS:
      fix = f"use names from {KNOWN_PLATFORMS}"
      if p.lower() in KNOWN_PLATFORMS:
        fix = f"did you mean {p.lower()!r}?"
      raise ValueError(f"{api}: unknown lowering platform {p!r}; {fix}")
  dups = sorted({p for p in plats if plats.count(p) > 1})
  if dups:
    raise ValueError(
      f"{api}: lowering platform(s) {dups} listed twice in {plats}; list each once"
    )
  return plats


def present_platforms() -> tuple[str, ...]:
  """Returns the platforms that have an initialized backend in this process.

  ``gpu`` backends are reported as ``cuda`` or ``rocm``.

  >>> "cpu" in present_platforms()
  True
  """
  present = []
  for client in ji.backends().values():
    platform = client.platform
    if platform == "gpu":
      platform = "rocm" if "rocm" in client.platform_version.lower() else "cuda"
    if platform not in present:
      present.append(platform)
  default = jax.export.default_export_platform()
  present.sort(key=lambda p: (p != default, p))
  return tuple(present)


def choose_platform(
  lowered_for: tuple[str, ...],
  requested: str | None,
  *,
  api: str,
  fun_name: str,
) -> str:
  """Picks the platform to compile or run on, among ``lowered_for``.

  Args:
    lowered_for: the platforms of the lowering or export.
    requested: a platform the caller asked for, or None for the first present
      one (the default backend first).
    api: the public API name to put in error messages.
    fun_name: the function name to put in error messages.

  Returns:
    A platform that is both in ``lowered_for`` and present in this process.

  Raises:
    TypeError, ValueError: ``requested`` is not a platform name.
    ValueError: no such platform, with the platforms lowered for and present.
  """
  present = present_platforms()
  if requested is not None:
    # A known name, or a TypeError/ValueError.
    canonical_platforms((requested,), api=api)
    if requested not in lowered_for:
      raise ValueError(
        f"{api}: {fun_name!r} was lowered for {lowered_for}, not for "
        f"{requested!r}; lower with lowering_platforms including {requested!r}"
      )
    if requested not in present:
      raise ValueError(
        f"{api}: platform {requested!r} is not present on this host (present: "
        f"{present}); compile on a host that has it, or pick one of "
        f"{tuple(p for p in lowered_for if p in present)}"
      )
    return requested
  for p in present:
    if p in lowered_for:
      return p
  raise ValueError(
    f"{api}: {fun_name!r} was lowered for {lowered_for}, but the platforms present "
    f"on this host are {present}; lower for one of them (e.g. "
    f"lowering_platforms=({present[0]!r},)), or export() and load the artifact on "
    f"a host with {' or '.join(lowered_for)}"
  )
