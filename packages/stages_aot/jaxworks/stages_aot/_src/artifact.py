"""Artifact directories: an exported program on disk, with a manifest.

An artifact directory holds three files:

* ``exported.bin``: the serialized program (``Exported.serialize()``),
* ``module.stablehlo.mlir``: its StableHLO text, for reading and diffing,
* ``manifest.json``: function name, platforms, input and output avals and
  shardings, calling-convention version, VJP order, the jax / jaxlib /
  jaxworks versions that wrote it, and the size and sha256 of every other file.

:func:`load_artifact` checks, in order: the manifest parses and has every
field; every file has the recorded size and sha256 (a truncated or corrupted
file is named); this jax supports the calling-convention version; the program
deserializes and passes the checks of :func:`deserialize` (every VJP order
read, every StableHLO module read and verified, signatures consistent); it
agrees with the manifest (avals, shardings, trees, the sha256 of each order's
module) and with ``module.stablehlo.mlir``; and a platform of the artifact is
present on this host. Each failure raises :class:`ArtifactError` saying what to
do.
Modules whose sha256 the manifest records are read in-process, others (all
with ``isolate``) in a child: that guards against accidents, not an attacker.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import secrets
import shutil
from typing import Any

import jax
import numpy as np

from ..version import __version__
from . import deps
from . import platforms as _platforms
from .exported import Exported
from .exported import deserialize_trusting
from .exported import read_own_serialization
from .specs import format_aval

MANIFEST_FILE = "manifest.json"
EXPORTED_FILE = "exported.bin"
STABLEHLO_FILE = "module.stablehlo.mlir"
FORMAT = "jaxworks.stages_aot.artifact"
FORMAT_VERSION = 1

_REQUIRED_FIELDS = {
  "format": str,
  "format_version": int,
  "fun_name": str,
  "platforms": list,
  "calling_convention_version": int,
  "vjp_order": int,
  "nr_devices": int,
  "inputs": list,
  "outputs": list,
  "versions": dict,
  "files": dict,
}


class ArtifactError(ValueError):
  """An artifact directory is missing, damaged, or not usable on this host."""


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _leaf_names(tree, *, inputs: bool) -> list[str]:
  leaves = jax.tree_util.tree_flatten_with_path(
    tree.unflatten([0] * tree.num_leaves)
  )[0]
  names = []
  for path, _ in leaves:
    if inputs:
      head = "args" if path[0].idx == 0 else "kwargs"
      names.append(head + jax.tree_util.keystr(path[1:]))
    else:
      names.append("out" + jax.tree_util.keystr(path))
  return names


def _sharding_json(sharding) -> dict[str, Any] | None:
  if sharding is None:
    return None
  mesh = sharding.mesh
  return {
    "spec": [list(e) if isinstance(e, tuple) else e for e in sharding.spec],
    "mesh_axis_names": list(mesh.axis_names),
    "mesh_axis_sizes": list(mesh.axis_sizes),
    "memory_kind": sharding.memory_kind,
  }


def _values_json(names, avals, shardings) -> list[dict[str, Any]]:
  return [
    {
      "name": name,
      "aval": format_aval(aval),
      "dtype": np.dtype(aval.dtype).name,
      "shape": [d if isinstance(d, int) else str(d) for d in aval.shape],
      "sharding": _sharding_json(sharding),
    }
    for name, aval, sharding in zip(names, avals, shardings)
  ]


def _levels(exported: Exported) -> list[Exported]:
  levels = [exported]
  for _ in range(exported.vjp_order):
    levels.append(levels[-1].vjp())
  return levels


def _level_json(level: Exported) -> dict[str, Any]:
  exp = level.jax_exported
  return {
    "module_sha256": _sha256(bytes(exp.mlir_module_serialized)),
    "kept_inputs": list(exp.module_kept_var_idx),
    "inputs": [format_aval(a) for a in exp.in_avals],
    "outputs": [format_aval(a) for a in exp.out_avals],
    "effects": [
      type(e).__name__ for e in (*exp.ordered_effects, *exp.unordered_effects)
    ],
    "disabled_checks": [str(c) for c in exp.disabled_safety_checks],
  }


#: Program fields that manifests written by 0.1.0 lack.
_OPTIONAL_FIELDS = ("in_tree", "out_tree", "levels")


def _program_fields(exported: Exported) -> dict[str, Any]:
  """The manifest fields that describe the program; load checks them against it.

  ``levels`` describes the program and each serialized VJP order: the sha256
  of its StableHLO module, its kept inputs, avals and effects.
  """
  return {
    "fun_name": exported.fun_name,
    "platforms": list(exported.platforms),
    "calling_convention_version": exported.calling_convention_version,
    "vjp_order": exported.vjp_order,
    "nr_devices": exported.nr_devices,
    "uses_shape_polymorphism": exported.uses_shape_polymorphism,
    "inputs": _values_json(
      _leaf_names(exported.in_tree, inputs=True),
      exported.in_avals,
      exported.in_shardings,
    ),
    "outputs": _values_json(
      _leaf_names(exported.out_tree, inputs=False),
      exported.out_avals,
      exported.out_shardings,
    ),
    "in_tree": str(exported.in_tree),
    "out_tree": str(exported.out_tree),
    "levels": [_level_json(level) for level in _levels(exported)],
  }


def build_manifest(
  exported: Exported, files: dict[str, bytes]
) -> dict[str, Any]:
  """The manifest of ``exported``, with the size and sha256 of each of ``files``."""
  return {
    "format": FORMAT,
    "format_version": FORMAT_VERSION,
    **_program_fields(exported),
    "versions": deps.written_by(),
    "files": {
      name: {"sha256": _sha256(data), "size": len(data)}
      for name, data in sorted(files.items())
    },
  }


@dataclasses.dataclass(frozen=True)
class Artifact:
  """A loaded (or just written) artifact directory.

  Attributes:
    path: the directory.
    manifest: the parsed manifest.json.
    exported: the program, an :class:`Exported`.
  """

  path: pathlib.Path
  manifest: dict[str, Any]
  exported: Exported

  @property
  def fun_name(self) -> str:
    return self.exported.fun_name

  @property
  def platforms(self) -> tuple[str, ...]:
    return self.exported.platforms

  @property
  def runnable_platforms(self) -> tuple[str, ...]:
    """The artifact's platforms that are present on this host."""
    present = _platforms.present_platforms()
    return tuple(p for p in self.platforms if p in present)

  def call(self, *args, **kwargs):
    """Runs the program on this host (see :meth:`Exported.call`)."""
    if not self.runnable_platforms:
      raise ArtifactError(_platform_message(self.path, self.platforms, "call"))
    return self.exported.call(*args, **kwargs)

  __call__ = call

  def summary(self) -> str:
    """A human-readable description of the artifact."""
    m = self.manifest
    present = _platforms.present_platforms()
    lo = jax.export.minimum_supported_calling_convention_version
    hi = jax.export.maximum_supported_calling_convention_version
    plats = ", ".join(
      f"{p} ({'present' if p in present else 'not present'})"
      for p in m["platforms"]
    )
    lines = [
      f"artifact {self.path}",
      f"  function            {m['fun_name']}",
      f"  platforms           {plats}",
      f"  calling convention  {m['calling_convention_version']} (this jax supports {lo}..{hi})",
      f"  vjp order           {m['vjp_order']}",
      f"  devices             {m['nr_devices']}",
    ]
    width = max((len(v["name"]) for v in m["inputs"] + m["outputs"]), default=0)
    for kind in ("inputs", "outputs"):
      lines.append(f"  {kind}")
      for v in m[kind]:
        sharding = v["sharding"]
        where = "unspecified" if sharding is None else _sharding_text(sharding)
        lines.append(
          f"    {v['name']:<{width}}  {v['aval']:<16} sharding {where}"
        )
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    lines.append(f"  written by          {versions}")
    lines.append("  files (sha256 verified)")
    for name, info in m["files"].items():
      lines.append(
        f"    {name:<24} {info['size']:>10} bytes  sha256 {info['sha256'][:16]}"
      )
    return "\n".join(lines)


def _sharding_text(sharding: dict[str, Any]) -> str:
  def entry(e):
    if e is None:
      return "None"
    if isinstance(e, list):
      return "(" + ", ".join(repr(x) for x in e) + ")"
    return repr(e)

  spec = "P(" + ", ".join(entry(e) for e in sharding["spec"]) + ")"
  axes = ", ".join(
    f"{n}={s}"
    for n, s in zip(sharding["mesh_axis_names"], sharding["mesh_axis_sizes"])
  )
  return f"{spec} mesh({axes})" if axes else spec


def check_destination(directory, *, overwrite: bool, api: str) -> pathlib.Path:
  """Checks that ``directory`` may receive an artifact; returns it as a Path.

  It may be absent or empty, or (with ``overwrite``) an existing artifact.
  """
  path = pathlib.Path(directory)
  if path.exists():
    if not path.is_dir():
      raise ArtifactError(
        f"{api}: {path} exists and is not a directory; pick another path"
      )
    if any(path.iterdir()):
      if not overwrite:
        raise ArtifactError(
          f"{api}: {path} exists and is not empty; pass overwrite=True (CLI: "
          "--overwrite) to replace an artifact, or pick a new directory"
        )
      if not (path / MANIFEST_FILE).is_file():
        raise ArtifactError(
          f"{api}: refusing to overwrite {path}: it has no {MANIFEST_FILE}, so it "
          "is not a stages_aot artifact; pick a new directory"
        )
  return path


def _new_directory(parent: pathlib.Path, prefix: str) -> pathlib.Path:
  """Creates a new directory in ``parent`` with the permissions the umask gives.

  (``tempfile.mkdtemp`` would make it 0700, and the rename would keep that.)
  """
  for _ in range(100):
    candidate = parent / f"{prefix}{secrets.token_hex(8)}"
    try:
      candidate.mkdir(mode=0o777)
    except FileExistsError:
      continue
    return candidate
  raise ArtifactError(
    f"jaxworks.stages_aot.save_artifact: cannot create a new directory in {parent}"
  )


def save_artifact(
  exported: Exported, directory, *, overwrite: bool = False
) -> Artifact:
  """Writes ``exported`` as an artifact directory.

  The files are written to a temporary sibling directory that is renamed
  into place, so a failure never leaves a half-written artifact.

  Args:
    exported: an :class:`Exported` (its ``vjp_order`` orders of VJP are
      serialized).
    directory: the directory to create.
    overwrite: replace ``directory`` if it is an existing artifact.

  Returns:
    The :class:`Artifact`.

  Raises:
    TypeError: ``exported`` is not an :class:`Exported`.
    ArtifactError: ``directory`` exists and ``overwrite`` is False, or it is
      not an artifact.
  """
  api = "jaxworks.stages_aot.save_artifact"
  if not isinstance(exported, Exported):
    raise TypeError(
      f"{api}: expected a jaxworks.stages_aot.Exported (from Lowered.export()), "
      f"got {type(exported).__name__}"
    )
  path = check_destination(directory, overwrite=overwrite, api=api)
  blob = exported.serialize()
  files = {EXPORTED_FILE: blob, STABLEHLO_FILE: exported.mlir_text().encode()}
  # The manifest describes the bytes written (serialize() exports the VJP
  # orders anew each time, so they are read back from `blob`).
  manifest = build_manifest(
    read_own_serialization(blob, exported.vjp_order), files
  )
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = _new_directory(path.parent, f".{path.name}.")
  try:
    for name, data in files.items():
      (tmp / name).write_bytes(data)
    (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    if path.exists():  # keep the old artifact until the new one is in place
      old = _new_directory(path.parent, f".{path.name}.old.")
      os.replace(path, old / "a")
      try:
        os.replace(tmp, path)
      except BaseException:
        os.replace(old / "a", path)
        raise
      finally:
        shutil.rmtree(old)
    else:
      os.replace(tmp, path)
  finally:
    if tmp.exists():
      shutil.rmtree(tmp)
  return Artifact(path, manifest, exported)


def _platform_message(path, platforms, what: str) -> str:
  present = _platforms.present_platforms()
  return (
    f"jaxworks.stages_aot: cannot {what} artifact {path}: it was exported for "
    f"{tuple(platforms)}, and this host has {present}; re-export with --platform "
    f"{present[0]} (or lowering_platforms including {present[0]!r}), or run it on a "
    f"host with {' or '.join(platforms)}"
  )


def _read_bytes(fpath: pathlib.Path, api: str) -> bytes:
  try:
    return fpath.read_bytes()
  except OSError as e:
    raise ArtifactError(
      f"{api}: cannot read {fpath} ({e}); check its permissions"
    ) from None


def _read_manifest(path: pathlib.Path, api: str) -> dict[str, Any]:
  mpath = path / MANIFEST_FILE
  if not mpath.is_file():
    raise ArtifactError(
      f"{api}: {path} has no {MANIFEST_FILE}, so it is not a stages_aot artifact; "
      "pass a directory written by save_artifact or `python -m jaxworks.stages_aot export`"
    )
  data = _read_bytes(mpath, api)
  try:
    manifest = json.loads(data.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
    raise ArtifactError(
      f"{api}: {mpath} is not valid JSON ({e}); the file is truncated or corrupted: "
      "export the artifact again"
    ) from None
  if not isinstance(manifest, dict):
    raise ArtifactError(
      f"{api}: {mpath} holds {type(manifest).__name__}, not a JSON object"
    )
  if manifest.get("format") != FORMAT:
    raise ArtifactError(
      f"{api}: {mpath} has format {manifest.get('format')!r}, expected {FORMAT!r}; it "
      "is not a stages_aot manifest"
    )
  version = manifest.get("format_version")
  if version != FORMAT_VERSION:
    raise ArtifactError(
      f"{api}: {mpath} has format_version {version!r}; this jaxworks.stages_aot "
      f"({__version__}) reads version {FORMAT_VERSION}; install the version that wrote it "
      f"(see its versions field: {manifest.get('versions')})"
    )
  for field, kind in _REQUIRED_FIELDS.items():
    if field not in manifest:
      raise ArtifactError(
        f"{api}: {mpath} lacks the field {field!r}; export the artifact again"
      )
    value = manifest[field]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
      raise ArtifactError(
        f"{api}: {mpath} field {field!r} is {value!r}, expected a {kind.__name__}"
      )
  return manifest


def _check_files(
  path: pathlib.Path, manifest: dict[str, Any], api: str
) -> dict[str, bytes]:
  files = manifest["files"]
  for needed in (EXPORTED_FILE, STABLEHLO_FILE):
    if needed not in files:
      raise ArtifactError(
        f"{api}: {path / MANIFEST_FILE} does not list {needed}"
      )
  contents = {}
  for name, info in files.items():
    if (
      not isinstance(name, str)
      or pathlib.PurePath(name).name != name
      or name in (".", "..")
    ):
      raise ArtifactError(
        f"{api}: manifest lists a file {name!r} outside the artifact directory"
      )
    if not (
      isinstance(info, dict)
      and isinstance(info.get("sha256"), str)
      and isinstance(info.get("size"), int)
    ):
      raise ArtifactError(
        f"{api}: manifest entry for {name} needs 'sha256' and 'size', got {info!r}"
      )
    fpath = path / name
    if not fpath.is_file():
      raise ArtifactError(
        f"{api}: {fpath} is missing; copy the whole artifact directory"
      )
    data = _read_bytes(fpath, api)
    if len(data) != info["size"]:
      state = (
        "truncated" if len(data) < info["size"] else "longer than recorded"
      )
      raise ArtifactError(
        f"{api}: {fpath} is {state}: {len(data)} bytes, the manifest says "
        f"{info['size']}; copy the artifact again or re-export it"
      )
    digest = _sha256(data)
    if digest != info["sha256"]:
      raise ArtifactError(
        f"{api}: {fpath} is corrupted: sha256 {digest} does not match the manifest "
        f"({info['sha256']}); the file or manifest.json was modified: re-export it"
      )
    contents[name] = data
  return contents


def _check_calling_convention(manifest: dict[str, Any], api: str, path) -> None:
  version = manifest["calling_convention_version"]
  lo = jax.export.minimum_supported_calling_convention_version
  hi = jax.export.maximum_supported_calling_convention_version
  if not lo <= version <= hi:
    newer = version > hi
    fix = (
      f"upgrade jax (this is {jax.__version__}) to one that supports version {version}"
      if newer
      else f"re-export it with this jax ({jax.__version__})"
    )
    raise ArtifactError(
      f"{api}: artifact {path} uses calling convention version {version}, but this jax "
      f"supports versions {lo}..{hi}; {fix}"
    )


def _check_agreement(
  manifest: dict[str, Any], exported: Exported, api: str, path
) -> None:
  """Every program field of the manifest equals the one rebuilt from the program.

  So an edited manifest never reaches ``summary()`` or the CLI: what they
  print and use is what the program holds.
  """
  # In JSON types, as read back.
  observed = json.loads(json.dumps(_program_fields(exported)))
  for key, value in observed.items():
    if key in _OPTIONAL_FIELDS and key not in manifest:
      continue
    recorded = manifest.get(key)
    if recorded == value:
      continue
    if (
      key in ("inputs", "outputs", "levels")
      and isinstance(recorded, list)
      and len(recorded) == len(value)
    ):
      i = next(i for i, (r, v) in enumerate(zip(recorded, value)) if r != v)
      key, recorded, value = f"{key}[{i}]", recorded[i], value[i]
    raise ArtifactError(
      f"{api}: manifest.json of {path} disagrees with {EXPORTED_FILE} on {key}: "
      f"manifest {recorded!r}, program {value!r}; the manifest was edited or "
      "files were mixed from different exports: re-export the artifact"
    )


def _recorded_modules(manifest: dict[str, Any]) -> frozenset[str]:
  """The sha256 of each module the manifest records (its ``levels``)."""
  lvls = manifest.get("levels")
  lvls = lvls if isinstance(lvls, list) else []
  return frozenset(
    str(v.get("module_sha256")) for v in lvls if isinstance(v, dict)
  )


def load_artifact(
  directory, *, require_platform: bool = True, isolate: bool = False
) -> Artifact:
  """Loads and validates an artifact directory.

  Args:
    directory: a directory written by :func:`save_artifact` or the CLI.
    require_platform: also require that a platform of the artifact is
      present on this host (False to inspect, e.g., a tpu-only artifact on
      a CPU machine).
    isolate: read every StableHLO module in the module reader's child
      process, also those whose sha256 the manifest records; for artifacts
      from a source that could write both the program and its manifest.

  Returns:
    The :class:`Artifact`.

  Raises:
    ArtifactError: what is wrong and what to do (see the module docstring
      for the checks).
  """
  api = "jaxworks.stages_aot.load_artifact"
  path = pathlib.Path(directory)
  if not path.is_dir():
    raise ArtifactError(
      f"{api}: {path} is not a directory; pass the directory given to export --out"
    )
  manifest = _read_manifest(path, api)
  contents = _check_files(path, manifest, api)
  _check_calling_convention(manifest, api, path)
  try:
    exported = deserialize_trusting(
      contents[EXPORTED_FILE], _recorded_modules(manifest), isolate=isolate
    )
  except ValueError as e:
    raise ArtifactError(
      f"{api}: {path / EXPORTED_FILE} does not deserialize: {e}"
    ) from None
  _check_agreement(manifest, exported, api, path)
  if exported.mlir_text().encode() != contents[STABLEHLO_FILE]:
    raise ArtifactError(
      f"{api}: {path / EXPORTED_FILE} holds a StableHLO module that differs from "
      f"{path / STABLEHLO_FILE}; one of them was modified or they come from "
      "different exports: re-export the artifact"
    )
  if require_platform and not any(
    p in _platforms.present_platforms() for p in exported.platforms
  ):
    raise ArtifactError(_platform_message(path, exported.platforms, "load"))
  return Artifact(path, manifest, exported)
