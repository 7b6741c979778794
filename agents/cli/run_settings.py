"""The settings of the ``agents train`` run a cold start prepares (``agents demonstrations``, ``agents sft``),
taken as ``agents train`` takes them, and the check of an environment's options before a model loads."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agents.cli.config_flags import add_config_flags, given_fields
from agents.run.config import PRESETS, TrainConfig, resolve

__all__ = ["add_run_settings", "check_env_options", "check_run_env", "given_run_settings", "run_settings"]


def check_env_options(env_ids: Sequence[str], env_kwargs: Mapping[str, Any], source: str) -> None:
    """Make each environment with ``env_kwargs`` once (then close it), so that a bad option is reported in one
    line before any model loads; ``source`` says where the options came from."""
    import agentenv

    for env_id in env_ids:
        try:
            agentenv.make(env_id, **env_kwargs).close()
        except (TypeError, ValueError) as error:
            options = ", ".join(f"{name}={value!r}" for name, value in env_kwargs.items())
            raise ValueError(f"{env_id} with the options {options} (from {source}): {error}") from None


def check_run_env(config: TrainConfig) -> None:
    """The run's environment id and options, checked before anything loads or is written: an unknown id raises
    UnknownEnvError listing the registered ones, a bad option one line naming it (:func:`check_env_options`)."""
    import agentenv

    agentenv.spec(config.env)
    if config.env_kwargs:
        check_env_options([config.env], config.env_kwargs, "env_kwargs: --preset, --config or --set env_kwargs.NAME")


def add_run_settings(p: argparse.ArgumentParser, uses: str) -> None:
    """The settings of the ``agents train`` run that this command prepares, taken as ``agents train`` takes them."""
    group = p.add_argument_group(
        "the RL run this is for",
        f"agents train's settings, resolved as agents train resolves them (defaults, --preset, --config, the "
        f"flags, --set); this command uses {uses}. Give the same ones to agents train.",
    )
    group.add_argument("--preset", choices=list(PRESETS), help="A preset of agents train --preset.")
    group.add_argument("--config", type=Path, metavar="FILE", help="A YAML or JSON config file, as agents train's.")
    group.add_argument(
        "--set",
        dest="assignments",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="A setting by its dotted name, e.g. env_kwargs.example=false (repeatable).",
    )
    # Prefixed: the command's own flags may set fields of the same names in its config (agents sft --seed).
    add_config_flags(group, TrainConfig, ("env", "holdout", "eval_questions"), dest_prefix=_PREFIX)


_PREFIX = "run."


def given_run_settings(args: argparse.Namespace) -> bool:
    """Whether any of :func:`add_run_settings`'s flags was given."""
    return bool(args.assignments or args.preset or args.config or given_fields(args, TrainConfig, _PREFIX))


def run_settings(args: argparse.Namespace) -> TrainConfig:
    """The ``agents train`` config that :func:`add_run_settings`'s flags describe, its env options checked."""
    values = given_fields(args, TrainConfig, _PREFIX)
    config = resolve(preset_name=args.preset, file=args.config, values=values, assignments=args.assignments)
    check_run_env(config)
    return config
