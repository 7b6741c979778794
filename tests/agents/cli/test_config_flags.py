"""Flags generated from a config dataclass: help from its docstring, types from annotations, defaults shown."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Literal

import pytest

from agents.cli.config_flags import add_config_flags, field_docs, given_fields


@dataclass
class Example:
    """A config of every kind of field.

    Attributes:
        steps: Rollout batches, ``N`` of :func:`agents.run.train.train`: 100% of them.
        lr: The learning rate.
        name: A name; ``None``: the default one.
        on: Whether it is on,
            over two lines.
        points: Token counts.
        layout: ``inline`` or ``turn``.
        extras, more: Two fields of one entry.

    Raises:
        ValueError: never read as a field.
    """

    steps: int = 100
    lr: float = 1e-5
    name: str | None = None
    on: bool = True
    points: tuple[int, ...] = ()
    layout: Literal["inline", "turn"] = "inline"
    extras: dict[str, int] = field(default_factory=dict)
    more: dict[str, int] = field(default_factory=dict)


def parser(**kwargs) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="x")
    add_config_flags(p, Example, ("steps", "lr", "name", "on", "points", "layout"), **kwargs)
    return p


def test_field_docs_reads_the_attributes_section_as_plain_text():
    assert field_docs(Example) == {
        "steps": "Rollout batches, N of train: 100% of them.",
        "lr": "The learning rate.",
        "name": "A name; None: the default one.",
        "on": "Whether it is on, over two lines.",
        "points": "Token counts.",
        "layout": "inline or turn.",
        "extras": "Two fields of one entry.",
        "more": "Two fields of one entry.",
    }


def test_a_class_without_an_attributes_section_is_refused():
    @dataclass
    class Bare:
        """No section."""

        x: int = 1

    with pytest.raises(ValueError, match="Bare has no 'Attributes:' section"):
        field_docs(Bare)


def test_flags_parse_by_type_and_default_to_none():
    p = parser()
    args = p.parse_args([])
    assert given_fields(args, Example) == {}
    args = p.parse_args(
        ["--steps", "3", "--lr", "2e-5", "--name", "a", "--no-on", "--points", "10", "20", "--layout", "turn"]
    )
    assert given_fields(args, Example) == {
        "steps": 3,
        "lr": 2e-5,
        "name": "a",
        "on": False,
        "points": [10, 20],
        "layout": "turn",
    }
    with pytest.raises(SystemExit):
        p.parse_args(["--layout", "block"])  # not one of the Literal's values


def test_help_carries_the_docstring_the_default_and_the_presets(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    parser(presets={"demo": {"steps": 3, "on": False}}).print_help()
    text = " ".join(capsys.readouterr().out.split())
    for expected in (
        "--steps STEPS Rollout batches, N of train: 100% of them (default 100; --preset demo: 3).",
        "--lr LR The learning rate (default 1e-05).",
        "--name NAME A name; None: the default one.",  # no default shown for None: the text says what it means
        "--on, --no-on Whether it is on, over two lines (default on; --preset demo: off).",
        "--points POINTS [POINTS ...] Token counts (default none).",
        "--layout {inline,turn} inline or turn (default inline).",
    ):
        assert expected in text, expected


def test_prefix_flag_names_types_choices_and_metavars_are_the_caller_s():
    p = argparse.ArgumentParser(prog="x")
    add_config_flags(
        p,
        Example,
        ("steps", "name"),
        dest_prefix="section.",
        flags={"name": "--the-name"},
        types={"steps": lambda text: int(text) * 2},
        choices={"name": ("a", "b")},
        metavars={"steps": "N"},
    )
    args = p.parse_args(["--steps", "4", "--the-name", "b"])
    assert vars(args) == {"section.steps": 8, "section.name": "b"}
    assert given_fields(args, Example, "section.") == {"steps": 8, "name": "b"}
    assert "--steps N" in p.format_help() and "--the-name {a,b}" in p.format_help()


def test_a_field_without_a_flag_type_or_docs_is_refused_by_name():
    p = argparse.ArgumentParser(prog="x")
    with pytest.raises(TypeError, match=r"Example.extras: no flag for a field of type 'dict\[str, int\]'"):
        add_config_flags(p, Example, ("extras",))
    with pytest.raises(ValueError, match="Example has no field 'nope' to make a flag of"):
        add_config_flags(p, Example, ("nope",))
