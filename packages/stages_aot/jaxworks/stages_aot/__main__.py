"""``python -m jaxworks.stages_aot``: see ``python -m jaxworks.stages_aot --help``."""

from jaxworks.stages_aot._src.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
