"""Options: what an environment's constructor accepts, checked before it does any work.

An environment declares a rule per keyword option (an :class:`Option`, or a function for what an
Option cannot say); :func:`check_options` runs them on what ``make``/the constructor was given,
so a bad value fails at once with a one-line :class:`OptionError` naming the option, the value
and what is allowed, and :func:`unknown_option` answers a misspelt name with the closest ones.
"""

from __future__ import annotations

import difflib
import numbers
import os
import reprlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PATH",
    "Option",
    "OptionError",
    "OptionRule",
    "OptionTypeError",
    "check_options",
    "unknown_option",
]


class OptionError(ValueError):
    """An option given a value it cannot take; the message (one line) names the option, the value and what is allowed.

    ``option`` is the option's name and ``value`` the value given (``None`` for an unknown option).
    """

    def __init__(self, message: str, option: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.option = option
        self.value = value

    def in_context(self, where: str) -> OptionError:
        """The same error, its message prefixed with ``where`` (e.g. ``make('multihop-qa')``)."""
        return type(self)(f"{where}: {self}", self.option, self.value)


class OptionTypeError(OptionError, TypeError):
    """An option of the wrong type, or an option the constructor does not take.

    A :class:`TypeError` as Python's own are, and an :class:`OptionError` (so a ``ValueError``), so
    that one ``except ValueError`` catches every bad option.
    """


#: ``Option(PATH)``: a file path, as a string or an ``os.PathLike``.
PATH: tuple[type, ...] = (str, os.PathLike)
#: How the message words each kind (a type, or a tuple of types, the value may be an instance of).
_KIND_WORDS: dict[Any, str] = {
    int: "an int",
    float: "a number",
    bool: "a bool",
    str: "a string",
    PATH: "a path",
    Callable: "a callable",
    list: "a list",
    tuple: "a tuple",
}
# One line, whatever the value: long strings and containers are shortened.
_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 100


def _is_kind(value: Any, kind: Any) -> bool:
    if kind is int:  # any integer (numpy's too), but not a bool: True is not a count
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind is float:  # any real number, ints included (YAML reads `5` as an int)
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if kind is Callable:
        return callable(value)
    if isinstance(kind, tuple) and kind not in _KIND_WORDS:
        return any(_is_kind(value, k) for k in kind)
    return isinstance(value, kind)


def _kind_words(kind: Any) -> str:
    if kind in _KIND_WORDS:
        return _KIND_WORDS[kind]
    if isinstance(kind, tuple):
        return " or ".join(map(_kind_words, kind))
    name = kind.__name__
    return f"{'an' if name[0] in 'AEIOU' else 'a'} {name}"


@dataclass(frozen=True)
class Option:
    """What one keyword option may be: one of ``choices``, else a ``kind`` at least ``minimum``, or ``None`` if ``optional``.

    ``kind`` is a type or a tuple of types; ``int`` means an integer that is not a bool,
    ``float`` any real number, ``Callable`` anything callable, :data:`PATH` a file path. The
    minimum is inclusive, or exclusive with ``exclusive=True`` (``> 0`` for timeouts). Calling an
    Option checks a value: :class:`OptionTypeError` for a wrong type, :class:`OptionError` for a
    value of the right type that is not allowed, either one saying what is allowed.
    """

    kind: Any = None
    choices: tuple[Any, ...] = ()
    minimum: float | None = None
    exclusive: bool = False
    optional: bool = False

    def allowed(self) -> str:
        """What the option may be, in words: ``"an int >= 1 or None"``, ``"one of ['xml', 'json'] or a ToolCallParser"``."""
        parts = [f"one of {list(self.choices)}"] if self.choices else []
        if self.kind is not None:
            bound = f" {'>' if self.exclusive else '>='} {self.minimum:g}" if self.minimum is not None else ""
            parts.append(_kind_words(self.kind) + bound)
        if self.optional:
            parts.append("None")
        return " or ".join(parts)

    def __call__(self, name: str, value: Any) -> None:
        if (value is None and self.optional) or any(type(value) is type(c) and value == c for c in self.choices):
            return
        if self.kind is not None and _is_kind(value, self.kind):
            if self.minimum is None or value > self.minimum or (value == self.minimum and not self.exclusive):
                return
            error: type[OptionError] = OptionError  # the right type, out of range
        else:
            # A value of a choice's type (a misspelt name) is a bad value; anything else a bad type.
            error = OptionError if any(type(value) is type(c) for c in self.choices) else OptionTypeError
        raise error(f"{name} must be {self.allowed()}, got {_repr.repr(value)}", name, value)


#: A check of one option's value, ``rule(name, value)``, raising :class:`OptionError`: an
#: :class:`Option`, or a function for what an Option cannot say.
OptionRule = Callable[[str, Any], None]


def check_options(rules: Mapping[str, OptionRule], given: Mapping[str, Any]) -> None:
    """Check each option of ``given`` that ``rules`` has a rule for; the first bad one raises."""
    for name, value in given.items():
        rule = rules.get(name)
        if rule is not None:
            rule(name, value)


def unknown_option(name: str, valid: Iterable[str], *, where: str = "") -> OptionTypeError:
    """The error for a keyword option that is not taken: the closest valid names, then all of them.

    ``where`` starts the message, as Python's does (``"ToolEnv.__init__() "``).
    """
    valid = sorted(valid)
    close = difflib.get_close_matches(name, valid, n=3, cutoff=0.75)  # typos, not every shared prefix
    hint = f" Did you mean {' or '.join(map(repr, close))}?" if close else ""
    return OptionTypeError(
        f"{where}got an unexpected keyword argument {name!r}.{hint} Valid options: {', '.join(valid)}.", name
    )
