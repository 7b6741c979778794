"""Command-line flags generated from a config dataclass, so that each setting is described once.

A field's flag takes its help from the field's entry in the class docstring's Google-style ``Attributes:``
section (the text the API reference renders), its type from the annotation and its default from the
dataclass. TRL's ``HfArgumentParser`` generates flags from dataclass fields in the same way; its help
lives in each field's metadata, which the API reference does not show, so here it stays in the docstring.
Only the standard library: ``--help`` must not wait for torch.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

__all__ = ["add_config_flags", "field_docs", "given_fields"]

_NAMES = re.compile(r"(\w+(?:, \w+)*):(?:\s+(.*))?$")  # "name: text" or "a, b, c: text"
_ROLE = re.compile(r":(?:py:)?[a-z]+:`~?([^`<]*?)\s*(?:<[^>]*>)?`")  # :class:`~agents.x.Y` -> agents.x.Y
_LITERAL = re.compile(r"``([^`]+)``")
_SCALARS: dict[str, Callable[[str], Any]] = {"int": int, "float": float, "str": str}


def field_docs(cls: type) -> dict[str, str]:
    """Each field's entry in ``cls``'s ``Attributes:`` docstring section, as one line of plain text.

    Raises:
        ValueError: ``cls`` has no ``Attributes:`` section.
    """
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    if "Attributes:" not in lines:
        raise ValueError(f"{cls.__qualname__} has no 'Attributes:' section in its docstring to take flag help from")
    entries: dict[str, list[str]] = {}
    names: list[str] = []
    indent = None
    for line in lines[lines.index("Attributes:") + 1 :]:
        text = line.strip()
        depth = len(line) - len(line.lstrip())
        if text and depth == 0:
            break  # the next section
        if not text:
            continue
        indent = depth if indent is None else indent
        entry = _NAMES.match(text) if depth == indent else None
        if entry:
            names = entry.group(1).split(", ")
            for name in names:
                entries[name] = [entry.group(2) or ""]
        else:
            for name in names:
                entries[name].append(text)
    return {name: _plain(" ".join(parts)) for name, parts in entries.items()}


def _plain(text: str) -> str:
    """reStructuredText roles and literals as a terminal shows them."""
    text = _ROLE.sub(lambda match: match.group(1).rsplit(".", 1)[-1], text)
    return _LITERAL.sub(r"\1", " ".join(text.split()))


def _argument(cls: type, name: str, annotation: str) -> dict[str, Any]:
    """argparse's keywords for a field of this (string) annotation."""
    base = annotation.removesuffix(" | None")
    if base in _SCALARS:
        return {"type": _SCALARS[base]}
    if base == "bool":
        return {"action": argparse.BooleanOptionalAction}
    sequence = re.fullmatch(r"tuple\[(\w+), \.\.\.\]|Sequence\[(\w+)\]", base)
    if sequence and (sequence.group(1) or sequence.group(2)) in _SCALARS:
        return {"type": _SCALARS[sequence.group(1) or sequence.group(2)], "nargs": "+"}
    literal = re.fullmatch(r"Literal\[(.*)\]", base)
    if literal:
        return {"choices": ast.literal_eval(f"({literal.group(1)},)")}
    raise TypeError(
        f"{cls.__qualname__}.{name}: no flag for a field of type {annotation!r}; give add_config_flags a 'types' "
        "entry for it"
    )


def _shown(value: Any) -> str:
    """A default as the command line writes it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value)) if value else "none"
    return f"{value:g}" if isinstance(value, float) else str(value)


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    names: Sequence[str],
    *,
    dest_prefix: str = "",
    flags: Mapping[str, str] | None = None,
    types: Mapping[str, Callable[[str], Any]] | None = None,
    choices: Mapping[str, Collection[str]] | None = None,
    metavars: Mapping[str, str] | None = None,
    presets: Mapping[str, Mapping[str, Any]] | None = None,
) -> None:
    """Add a flag for each of ``cls``'s fields ``names``: ``--field-name``, help from :func:`field_docs`.

    Every flag defaults to ``None`` (a boolean one is ``--name``/``--no-name``), so the command sees which
    ones were given and leaves the others to the config's own layers; the help shows the dataclass's
    default instead.

    Args:
        parser: The parser or argument group the flags go in.
        cls: A dataclass whose docstring has an ``Attributes:`` entry for each of ``names``.
        names: The fields, in the order ``--help`` lists them.
        dest_prefix: Prefix of each flag's attribute on the parsed namespace (``"cluster."``).
        flags: A flag other than ``--field-name`` for some fields.
        types: The argument's type for fields whose annotation has no flag of its own.
        choices: The values allowed for some fields.
        metavars: The metavariable shown for some fields.
        presets: Named presets' values of top-level fields, shown after the default.

    Raises:
        ValueError: A name is no field of ``cls`` or has no docstring entry.
        TypeError: A field's type has no flag and ``types`` gives none.
    """
    docs = field_docs(cls)
    fields = {field.name: field for field in dataclasses.fields(cls)}
    for name in names:
        if name not in fields or name not in docs:
            missing = "field" if name not in fields else "'Attributes:' entry"
            raise ValueError(f"{cls.__qualname__} has no {missing} {name!r} to make a flag of")
        field = fields[name]
        keywords: dict[str, Any] = (
            {"type": types[name]} if types and name in types else _argument(cls, name, str(field.type))
        )
        if choices and name in choices:
            keywords["choices"] = list(choices[name])
        if metavars and name in metavars:
            keywords["metavar"] = metavars[name]
        elif "choices" not in keywords and "action" not in keywords:
            keywords["metavar"] = name.upper()  # not argparse's DEST, which carries dest_prefix
        default = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
        notes = [] if default is None else [f"default {_shown(default)}"]
        for preset, values in (presets or {}).items():
            if name in values:
                notes.append(f"--preset {preset}: {_shown(values[name])}")
        help_text = docs[name].removesuffix(".") + (f" ({'; '.join(notes)})." if notes else ".")
        help_text = help_text.replace("%", "%%")  # argparse formats help with %
        flag = (flags or {}).get(name, "--" + name.replace("_", "-"))
        parser.add_argument(flag, dest=dest_prefix + name, default=None, help=help_text, **keywords)


def given_fields(args: argparse.Namespace, cls: type, dest_prefix: str = "") -> dict[str, Any]:
    """The values of ``cls``'s fields whose flags (added by :func:`add_config_flags`) were given, by field name."""
    return {
        field.name: getattr(args, dest_prefix + field.name)
        for field in dataclasses.fields(cls)
        if getattr(args, dest_prefix + field.name, None) is not None
    }
