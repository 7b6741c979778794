"""The ``agentenv`` command: list the registered environments, check them against the contract.

agentenv list
agentenv check ID [ID ...]      # Gymnasium's checker plus the fork contract
agentenv --version
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

import agentenv
from agentenv.testing import EnvCheckError, check_env


def _version() -> str:
    try:
        return importlib.metadata.version("agentenv")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
        return "unknown (not installed: pip install -e . in the repository gives it its version)"


def main(argv: list[str] | None = None) -> int:
    """Run the ``agentenv`` command; returns the exit code."""
    parser = argparse.ArgumentParser(prog="agentenv", description="Forkable tool-use environments for agent RL.")
    parser.add_argument("--version", action="version", version=f"agentenv {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="list the registered environments")
    check = commands.add_parser("check", help="run agentenv.testing.check_env on environments")
    check.add_argument("ids", nargs="+", metavar="ID", help="registered environment ids")
    args = parser.parse_args(argv)

    if args.command == "list":
        for env_id in sorted(agentenv.registry):
            spec = agentenv.spec(env_id)
            print(f"{env_id:<26}{spec.description}")
        return 0

    failed = 0
    for env_id in args.ids:
        try:
            check_env(agentenv.make(env_id))
        except (EnvCheckError, agentenv.UnknownEnvError, TypeError, ValueError) as e:
            failed += 1
            print(f"FAIL {env_id}: {e}")
        else:
            print(f"ok   {env_id}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
