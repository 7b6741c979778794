"""The ``agents`` command: one module a subcommand, each with ``add_arguments`` and ``run``.

- ``agents eval`` (:mod:`agents.cli.eval`): a model on environments, EM, F1, pass@k, an LLM judge;
- ``agents train`` (:mod:`agents.cli.train`): a learner on an environment, a run folder;
- ``agents sft`` (:mod:`agents.cli.sft`): the cold start, supervised fine-tuning;
- ``agents compare`` (:mod:`agents.cli.compare`): two held-out evaluations, question by question;
- ``agents demonstrations`` (:mod:`agents.cli.demonstrations`): worked episodes for ``agents sft``.

Each module only parses and prints; the work is in library functions a user can call from Python.
Building the parser imports neither torch nor transformers (nor agentenv): ``main`` fills in the
options of the one subcommand on its command line, so ``agents --help`` and ``agents train --help``
answer at once, and the subcommand's bad arguments (an unknown ``--env``, a bad ``--set`` or
``--env-arg``) are reported, in one line with exit code 2, before a model loads.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

# Only light imports at the top, here and in each command's module (tests/test_layout.py lists why the others
# wait): vLLM's workers re-import the main module (``python -m agents`` imports this one), agentenv pulls
# numba, whose objects break vLLM-CPU's start-up scan, and --help must not wait for torch.
from agents.cli import compare, demonstrations, sft, train
from agents.cli import eval as evaluate
from agents.models import ModelNotAvailableError

__all__ = ["COMMANDS", "Command", "build_parser", "main", "version"]


def version() -> str:
    """The installed version of the ``agentenv`` distribution, which ships both commands."""
    try:
        return importlib.metadata.version("agentenv")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
        return "unknown (not installed: pip install -e . in the repository gives it its version)"


@dataclass(frozen=True)
class Command:
    """One subcommand of ``agents``.

    Attributes:
        name: The word after ``agents``.
        help: Its line in ``agents --help``.
        add_arguments: Gives its parser a description, the options and the handler
            (``set_defaults(run=handler)``; the handler returns the exit code). Called only for the
            subcommand being run, so what its options need is imported only then.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]


#: The subcommands, in the order ``agents --help`` lists them.
COMMANDS: list[Command] = [
    Command("eval", "evaluate a model on environments (EM, F1, pass@k)", evaluate.add_arguments),
    Command("train", "train a learner (AT2PO, AEPO, GRPO, Tree-GRPO, ARPO) on an environment", train.add_arguments),
    Command("sft", "fine-tune a model on tool-use trajectories or chats (a cold start before RL)", sft.add_arguments),
    Command(
        "compare",
        "compare two held-out evaluations question by question (paired intervals)",
        compare.add_arguments,
    ),
    Command(
        "demonstrations",
        "write worked episodes of an environment's training tasks, for agents sft",
        demonstrations.add_arguments,
    ),
]


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``agents`` argument parser: every subcommand of :data:`COMMANDS`, with the options of those
    named in ``commands`` (default: all of them; the others are listed but take no options)."""
    parser = argparse.ArgumentParser(prog="agents", description="Train and evaluate LLM agents that use tools.")
    parser.add_argument("--version", action="version", version=f"agents {version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help)
        if commands is None or command.name in commands:
            command.add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``agents`` command; returns the exit code (2 for bad arguments, with the reason in one line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # The first word that is no option names the subcommand (the top level's options take no value).
    named = next((word for word in argv if not word.startswith("-")), None)
    parser = build_parser([named] if named is not None else [])
    args = parser.parse_args(argv)
    from agentenv import UnknownEnvError

    try:
        return args.run(args)
    except (
        ValueError,
        UnknownEnvError,
        ModelNotAvailableError,
        ImportError,
        FileExistsError,
        FileNotFoundError,
    ) as error:
        message = " ".join(str(error).split())  # one line, however the message was wrapped
        parser.exit(2, f"agents {args.command}: error: {message}\n")
