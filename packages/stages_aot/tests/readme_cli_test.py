"""The README's CLI transcripts are the output of a real run of this version.

Every ```console block of the README's "CLI" section is run: the
``mypkg/model.py`` module of the section is written into a fresh directory,
``/tmp/`` paths are moved into it, each ``$ jaxworks-aot ...`` line runs the
CLI (``python -m jaxworks.stages_aot``, the same program) and each
``$ python ...`` line this interpreter. The output must equal the README's,
except for timings, hashes and byte counts (shown as ``<...>`` below); a line
``...`` ends a transcript that the README cuts short.

To regenerate the transcripts after a change:
``python packages/stages_aot/tests/readme_cli_test.py --write
packages/stages_aot/README.md`` (with the packages on PYTHONPATH).
"""

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cli_runner import run_cli  # noqa: E402

_README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
_BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)
_MASKS = [
  (re.compile(r"\b\d+(\.\d+)? ms\b"), "<t> ms"),
  (re.compile(r"sha256 [0-9a-f]{16}"), "sha256 <hash>"),
  (re.compile(r"\b\d+ bytes\b"), "<n> bytes"),
  (re.compile(r"python 3\.\d+\.\d+"), "python <version>"),
]


def _cli_section(text):
  start = text.index("\n## CLI\n")
  end = text.index("\n## ", start + 1)
  return start, end


def _commands(block):
  """(command, README output lines) for each ``$`` line of a block."""
  out = []
  logical = block.replace("\\\n", " ")
  for line in logical.splitlines():
    if line.startswith("$ "):
      out.append((line[2:], []))
    elif out:
      out[-1][1].append(line)
  for _, lines in out:
    while lines and not lines[-1].strip():
      lines.pop()
  return out


def _run(command, workdir):
  tmp = str(workdir / "tmp")
  argv = shlex.split(command.replace("/tmp/", tmp + "/"))
  if argv[0] == "jaxworks-aot":
    result = run_cli(workdir, *argv[1:])
  elif argv[0] == "python":
    result = subprocess.run(
      [sys.executable, *argv[1:]],
      cwd=workdir,
      capture_output=True,
      text=True,
      check=False,
    )
  else:
    raise AssertionError(f"README command not understood: {command!r}")
  text = (result.stdout + result.stderr).replace(tmp + "/", "/tmp/")
  return text.rstrip("\n").splitlines() if text.strip() else []


def _mask(line):
  for pattern, repl in _MASKS:
    line = pattern.sub(repl, line)
  return line.rstrip()


def _setup(workdir, section):
  model = next(
    body
    for lang, body in _BLOCK.findall(section)
    if lang == "python" and body.startswith("# mypkg/model.py")
  )
  (workdir / "mypkg").mkdir()
  (workdir / "mypkg" / "model.py").write_text(model)
  (workdir / "tmp").mkdir()


def transcripts(workdir):
  """[(README block, the block as this version prints it)] for the section."""
  text = _README.read_text()
  start, end = _cli_section(text)
  section = text[start:end]
  _setup(workdir, section)
  pairs = []
  for m in _BLOCK.finditer(section):
    if m.group(1) != "console":
      continue
    block = m.group(2)
    regenerated = []
    for command, expected in _commands(block):
      got = _run(command, workdir)
      if expected and expected[-1].strip() == "...":
        got = got[: len(expected) - 1] + [expected[-1]]
      regenerated.append((command, expected, got))
    pairs.append((block, regenerated))
  return pairs


def test_readme_transcripts_are_current(tmp_path):
  checked = 0
  for _, commands in transcripts(tmp_path):
    for command, expected, got in commands:
      assert [_mask(x) for x in got] == [_mask(x) for x in expected], (
        f"README output of `$ {command}` is stale; regenerate it (see "
        f"{__file__}). Now prints:\n" + "\n".join(got)
      )
      checked += 1
  assert checked >= 6, f"only {checked} README commands found"


@pytest.mark.parametrize("command", [[], ["export"], ["inspect"], ["run"]])
def test_help_names_the_console_script_and_not_bazel(tmp_path, command):
  result = run_cli(tmp_path, *command, "--help")
  assert result.returncode == 0, result.stderr
  assert result.stdout.startswith(
    "usage: " + " ".join(["jaxworks-aot", *command])
  ), result.stdout
  assert "bazel" not in result.stdout.lower(), result.stdout


def _write(readme):
  import tempfile

  text = pathlib.Path(readme).read_text()
  with tempfile.TemporaryDirectory() as d:
    for block, commands in transcripts(pathlib.Path(d)):
      new = block
      for command, expected, got in commands:
        if expected:
          new = new.replace("\n".join(expected), "\n".join(got), 1)
      text = text.replace(block, new, 1)
  pathlib.Path(readme).write_text(text)


if __name__ == "__main__":
  if sys.argv[1:2] == ["--write"]:
    _write(sys.argv[2])
  else:
    raise SystemExit(__doc__)
