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
Modules whose sha256 the manifest records were checked (and printed into
``module.stablehlo.mlir``) by :func:`save_artifact` and are not read again;
others (all with ``isolate``, which also compares the text) are read in a
child: that guards against accidents, not an attacker.

Every file is opened relative to the artifact directory without following
links, must be a regular file (checked on the descriptor), and is read
through that descriptor, bounded by the size the manifest records (the
manifest itself by :data:`MAX_MANIFEST_BYTES`). ``save_artifact(...,
overwrite=True)`` replaces only a directory that holds nothing but an
artifact of this package (its manifest and the files it names), in one
atomic exchange where the system has one, and deletes only those files.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import hashlib
import json
import logging
import os
import pathlib
import secrets
import shutil
import stat
from typing import Any

import jax

from ..version import __version__
from . import deps
from . import jax_internals
from . import platforms as _platforms
from .exported import Exported
from .exported import deserialize_trusting
from .exported import read_own_serialization
from .specs import dtype_name
from .specs import format_aval

_log = logging.getLogger("jaxworks.stages_aot")

MANIFEST_FILE = "manifest.json"
EXPORTED_FILE = "exported.bin"
STABLEHLO_FILE = "module.stablehlo.mlir"
FORMAT = "jaxworks.stages_aot.artifact"
FORMAT_VERSION = 1
#: The most bytes read of a manifest (whose own size nothing records).
MAX_MANIFEST_BYTES = 64 << 20

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
      "dtype": dtype_name(aval.dtype),
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
    "module_sha256": level._module_digest(),  # pylint: disable=protected-access
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
#: Program fields recorded as text for people, not compared on load.
_TREE_FIELDS = ("in_tree", "out_tree")


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


def _lstat(path: pathlib.Path) -> os.stat_result | None:
  try:
    return os.lstat(path)
  except (FileNotFoundError, NotADirectoryError):
    return None


def check_destination(directory, *, overwrite: bool, api: str) -> pathlib.Path:
  """Checks that ``directory`` may receive an artifact; returns it as a Path.

  It may be absent or empty, or (with ``overwrite``) a directory holding
  nothing but an artifact of this package: a manifest of this package's
  format and version, and only regular files that manifest names.
  """
  path = pathlib.Path(directory)
  _replaceable_names(path, overwrite=overwrite, api=api)
  return path


def _replaceable_names(
  path: pathlib.Path, *, overwrite: bool, api: str
) -> frozenset[str]:
  """What an overwrite of ``path`` may delete (empty when it is absent)."""
  st = _lstat(path)
  if st is None:
    return frozenset()
  if stat.S_ISLNK(st.st_mode):
    raise ArtifactError(
      f"{api}: {path} is a symbolic link; pass the directory it points to, "
      "or a new path (an artifact is never written through a link)"
    )
  if not stat.S_ISDIR(st.st_mode):
    raise ArtifactError(
      f"{api}: {path} exists and is not a directory; pick another path"
    )
  entries = sorted(os.listdir(path))
  if not entries:
    return frozenset()
  if not overwrite:
    raise ArtifactError(
      f"{api}: {path} exists and is not empty; pass overwrite=True (CLI: "
      "--overwrite) to replace an artifact, or pick a new directory"
    )
  if MANIFEST_FILE not in entries:
    raise ArtifactError(
      f"{api}: refusing to overwrite {path}: it has no {MANIFEST_FILE}, so it "
      "is not a stages_aot artifact; pick a new directory"
    )
  try:
    manifest = _read_manifest(path, api)
  except ArtifactError as e:
    raise ArtifactError(
      f"{api}: refusing to overwrite {path}: its {MANIFEST_FILE} is not a "
      f"readable stages_aot manifest ({e}); pick a new directory"
    ) from None
  names = frozenset(manifest["files"]) | {MANIFEST_FILE}
  for name in entries:
    entry = _lstat(path / name)
    if name not in names or entry is None or not stat.S_ISREG(entry.st_mode):
      raise ArtifactError(
        f"{api}: refusing to overwrite {path}: it holds {name!r}, which is "
        f"not a file its {MANIFEST_FILE} names, so the directory is not only "
        "a stages_aot artifact; move that file away or pick a new directory"
      )
  return names


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
  """Swaps two paths atomically (Linux ``renameat2``); False where the
  system or file system has no such exchange."""
  try:
    renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
  except (AttributeError, OSError):
    return False
  r = renameat2(
    _AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE
  )
  if r == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
    return False
  raise OSError(err, os.strerror(err), str(a), None, str(b))


def _remove_replaced(old: pathlib.Path, names: frozenset[str], api: str):
  """Deletes the files of a replaced artifact (only ``names``, only regular
  files), then its directory; anything else found there is left, with the
  directory, and logged."""
  for name in names:
    entry = _lstat(old / name)
    if entry is not None and stat.S_ISREG(entry.st_mode):
      os.unlink(old / name)
  try:
    os.rmdir(old)
  except OSError:
    _log.warning(
      "%s: the replaced artifact's directory %s holds files its manifest "
      "did not name (added while it was replaced); they were left there",
      api,
      old,
    )


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


@jax_internals.api_boundary
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
  path = pathlib.Path(directory)
  _replaceable_names(path, overwrite=overwrite, api=api)
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
    # Checked again right before the swap: what it may delete.
    names = _replaceable_names(path, overwrite=overwrite, api=api)
    if _lstat(path) is None:
      os.rename(tmp, path)
    elif _exchange(tmp, path):  # one atomic step; tmp now holds the old one
      _remove_replaced(tmp, names, api)
    else:  # keep the old artifact until the new one is in place
      old = _new_directory(path.parent, f".{path.name}.old.")
      os.rename(path, old / "a")
      try:
        os.rename(tmp, path)
      except BaseException:
        os.rename(old / "a", path)
        raise
      _remove_replaced(old / "a", names, api)
      os.rmdir(old)
  finally:
    if tmp.exists():
      shutil.rmtree(tmp)
  _log.info("%s: wrote %s (%s)", api, path, exported.fun_name)
  return Artifact(path, manifest, exported)


def _platform_message(path, platforms, what: str) -> str:
  present = _platforms.present_platforms()
  return (
    f"jaxworks.stages_aot: cannot {what} artifact {path}: it was exported for "
    f"{tuple(platforms)}, and this host has {present}; re-export with --platform "
    f"{present[0]} (or lowering_platforms including {present[0]!r}), or run it on a "
    f"host with {' or '.join(platforms)}"
  )


def _open_dir(path: pathlib.Path, api: str) -> int:
  """A descriptor of the directory ``path`` (O_DIRECTORY: a file is refused)."""
  try:
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
  except (FileNotFoundError, NotADirectoryError):
    raise ArtifactError(
      f"{api}: {path} is not a directory; pass the directory given to export --out"
    ) from None
  except OSError as e:
    raise ArtifactError(f"{api}: cannot open {path} ({e})") from None


def _read_file(
  path: pathlib.Path,
  name: str,
  api: str,
  size: int | None,
  dir_fd: int | None = None,
) -> bytes:
  """The bytes of ``path/name``, opened without following links, refused
  unless a regular file, read through that descriptor: exactly ``size``
  bytes (a longer or shorter file is named), or at most
  :data:`MAX_MANIFEST_BYTES` when ``size`` is None. ``dir_fd``: an open
  descriptor of ``path`` (None: opened here)."""
  fpath = path / name
  own_dir = dir_fd is None
  if dir_fd is None:
    try:
      dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
      raise ArtifactError(f"{api}: cannot open {path} ({e})") from None
  else:
    dfd = dir_fd
  try:
    try:
      fd = os.open(
        name,
        os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
        dir_fd=dfd,
      )
    except FileNotFoundError:
      raise ArtifactError(
        f"{api}: {fpath} is missing; copy the whole artifact directory"
      ) from None
    except OSError as e:
      if e.errno == errno.ELOOP:
        raise ArtifactError(
          f"{api}: {fpath} is a symbolic link; an artifact's files are read "
          "only as regular files inside its directory: copy the file itself "
          "there"
        ) from None
      raise ArtifactError(
        f"{api}: cannot read {fpath} ({e}); check its permissions"
      ) from None
  finally:
    if own_dir:
      os.close(dfd)
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      raise ArtifactError(
        f"{api}: {fpath} is not a regular file; copy the artifact again"
      )
    limit = MAX_MANIFEST_BYTES if size is None else size
    if st.st_size > limit and size is None:
      raise ArtifactError(
        f"{api}: {fpath} is {st.st_size} bytes, more than any manifest "
        f"({MAX_MANIFEST_BYTES}); it is not a stages_aot manifest"
      )
    if size is not None and st.st_size != size:
      raise ArtifactError(_size_message(api, fpath, st.st_size, size))
    # Ask for the size seen (plus the one byte past it that tells a growing
    # file), not for the limit: a read allocates what it asks for.
    expected = st.st_size
    chunks, got = [], 0
    while got <= limit:  # one byte past the limit tells a growing file
      want = max(expected + 1 - got, 1 << 16)
      chunk = os.read(fd, min(limit + 1 - got, want, 1 << 24))
      if not chunk:
        break
      chunks.append(chunk)
      got += len(chunk)
  except OSError as e:
    raise ArtifactError(
      f"{api}: cannot read {fpath} ({e}); check its permissions"
    ) from None
  finally:
    os.close(fd)
  data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
  if size is not None and len(data) != size:
    raise ArtifactError(_size_message(api, fpath, len(data), size))
  if size is None and len(data) > limit:
    raise ArtifactError(
      f"{api}: {fpath} grew past {MAX_MANIFEST_BYTES} bytes while read; it is "
      "not a stages_aot manifest"
    )
  return data


def _size_message(api: str, fpath: pathlib.Path, got: int, size: int) -> str:
  state = "truncated" if got < size else "longer than recorded"
  return (
    f"{api}: {fpath} is {state}: {got} bytes, the manifest says {size}; copy "
    "the artifact again or re-export it"
  )


def _read_manifest(
  path: pathlib.Path, api: str, dir_fd: int | None = None
) -> dict[str, Any]:
  mpath = path / MANIFEST_FILE
  try:
    data = _read_file(path, MANIFEST_FILE, api, None, dir_fd)
  except ArtifactError:
    if _lstat(mpath) is None:
      raise ArtifactError(
        f"{api}: {path} has no {MANIFEST_FILE}, so it is not a stages_aot artifact; "
        "pass a directory written by save_artifact or `python -m jaxworks.stages_aot export`"
      ) from None
    raise
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
  path: pathlib.Path,
  manifest: dict[str, Any],
  api: str,
  dir_fd: int | None = None,
) -> tuple[dict[str, bytes], dict[str, str]]:
  """The bytes of every file the manifest lists, and their sha256."""
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
      and type(info.get("size")) is int
      and info["size"] >= 0
    ):
      raise ArtifactError(
        f"{api}: manifest entry for {name} needs 'sha256' and 'size', got {info!r}"
      )
    fpath = path / name
    data = _read_file(path, name, api, info["size"], dir_fd)
    digest = _sha256(data)
    if digest != info["sha256"]:
      raise ArtifactError(
        f"{api}: {fpath} is corrupted: sha256 {digest} does not match the manifest "
        f"({info['sha256']}); the file or manifest.json was modified: re-export it"
      )
    contents[name] = data
  return contents, {name: info["sha256"] for name, info in files.items()}


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
  observed = _as_json(_program_fields(exported))
  for key, value in observed.items():
    if key in _OPTIONAL_FIELDS and key not in manifest:
      continue
    if key in _TREE_FIELDS:
      # The trees' text is for people: a node's auxiliary data may print
      # with an object address. The trees themselves are in exported.bin,
      # and the leaf names (inputs, outputs) are compared.
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


def _as_json(value: Any) -> Any:
  """``value`` as ``json.loads(json.dumps(value))`` returns it (tuples become
  lists, keys strings), for the plain values of :func:`_program_fields`."""
  if isinstance(value, dict):
    return {str(k): _as_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_as_json(v) for v in value]
  if value is None or type(value) in (str, int, bool):
    return value
  return json.loads(json.dumps(value))


def _recorded_modules(manifest: dict[str, Any]) -> frozenset[str]:
  """The sha256 of each module the manifest records (its ``levels``)."""
  lvls = manifest.get("levels")
  lvls = lvls if isinstance(lvls, list) else []
  return frozenset(
    str(v.get("module_sha256")) for v in lvls if isinstance(v, dict)
  )


def _levels_recorded(manifest: dict[str, Any], exported: Exported) -> bool:
  """Whether the manifest records the digest of the program's own module."""
  lvls = manifest.get("levels")
  if not isinstance(lvls, list) or not lvls or not isinstance(lvls[0], dict):
    return False
  return lvls[0].get("module_sha256") == exported._module_digest()  # pylint: disable=protected-access


@jax_internals.api_boundary
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
  dir_fd = _open_dir(path, api)
  try:
    manifest = _read_manifest(path, api, dir_fd)
    contents, digests = _check_files(path, manifest, api, dir_fd)
  finally:
    os.close(dir_fd)
  _check_calling_convention(manifest, api, path)
  recorded = _recorded_modules(manifest)
  # Default load: the manifest's files and module digests matched, so these
  # are the bytes save_artifact wrote, which it checked (module against
  # program, module text against module) before writing: nothing is parsed
  # again. isolate=True trusts no manifest: every module is read in the
  # child and the text is compared.
  verified = frozenset() if isolate else recorded
  try:
    exported = deserialize_trusting(
      contents[EXPORTED_FILE],
      recorded,
      isolate=isolate,
      verified_modules=verified,
      blob_sha256=bytes.fromhex(digests[EXPORTED_FILE]),
    )
  except ValueError as e:
    raise ArtifactError(
      f"{api}: {path / EXPORTED_FILE} does not deserialize: {e}"
    ) from None
  _check_agreement(manifest, exported, api, path)
  # With the manifest's levels agreeing, every module is one save_artifact
  # printed into module.stablehlo.mlir (whose digest matched); a manifest
  # without levels (0.1.0) or an isolated load compares the text.
  if (
    isolate or not verified or not _levels_recorded(manifest, exported)
  ) and exported.mlir_text().encode() != contents[STABLEHLO_FILE]:
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


# Imported from jaxworks.stages_aot (a lazy package): the module tracebacks and repr name;
# doctest finds their examples through __test__.
__test__ = {"Artifact": Artifact, "ArtifactError": ArtifactError}
Artifact.__module__ = "jaxworks.stages_aot"
ArtifactError.__module__ = "jaxworks.stages_aot"
