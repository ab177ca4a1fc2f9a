"""``python -m jaxworks.stages_aot``: see ``python -m jaxworks.stages_aot --help``.

Also the entry of the Bazel binary ``//packages/stages_aot:cli``.
"""

import os

from jaxworks.stages_aot._src.cli import main

if __name__ == "__main__":
  # `bazel run` starts the binary in its runfiles tree; work where the user
  # typed the command, so that relative --out, --arg FILE.npy and MODULE
  # paths mean what they say.
  if os.environ.get("BUILD_WORKING_DIRECTORY"):
    os.chdir(os.environ["BUILD_WORKING_DIRECTORY"])
  raise SystemExit(main())
