"""``python -m agents``: the ``agents`` command (see :mod:`agents.cli`)."""

import sys

from agents.cli import main

if __name__ == "__main__":  # vLLM spawns workers that re-import the main module
    sys.exit(main())
