"""Tool-call syntaxes: how a model's turn is read as a tool call, a final answer, or an error.

Two syntaxes, chosen per environment:

- :class:`XMLTagParser` — the papers' tags: ``<search>query</search>``, ``<python>code</python>``,
  ``<answer>…</answer>``. Reasoning inside ``<think>…</think>`` is ignored.
- :class:`JSONToolCallParser` — chat models' ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``,
  with the final answer still in ``<answer>…</answer>``.

A parser never raises on model output: whatever is wrong becomes :attr:`Action.error`, which the
environment shows to the model as the observation.
"""

from __future__ import annotations

import json
import re
import sys
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agentenv.tools import Tool

__all__ = ["Action", "JSONToolCallParser", "ToolCall", "ToolCallParser", "XMLTagParser", "get_parser"]

ANSWER_TAG = "answer"
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_ANY_TAG_PAIR = re.compile(r"<([A-Za-z_][\w-]*)>(.*?)</\1>", re.DOTALL)
# Tags that may appear in a turn without being a call.
_NOT_CALLS = {"think", "result", "information"}


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A request to run tool ``name`` with ``arguments``."""

    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Action:
    """What one model turn asks for: a tool call, a final answer, or neither (``error`` says why)."""

    call: ToolCall | None = None
    answer: str | None = None
    error: str | None = None


class ToolCallParser(ABC):
    """Reads model turns in one tool-call syntax and describes that syntax to the model."""

    name: str

    @abstractmethod
    def parse(self, text: str, tools: Mapping[str, Tool]) -> Action:
        """Read one model turn. Never raises on bad model output."""

    @abstractmethod
    def stop_strings(self, tools: Mapping[str, Tool]) -> list[str]:
        """Strings at which generation of a turn must stop (the end of a call)."""

    @abstractmethod
    def describe(self, tools: Mapping[str, Tool]) -> str:
        """Instructions for the prompt: how to call each tool and how to answer."""


class _UnreadableJSON(ValueError):
    """Valid JSON that Python's parser gives up on; the message says why, for the model."""


def _load_json(text: str) -> Any:
    """``json.loads``, with the limits of Python's parser raised as :class:`_UnreadableJSON`.

    Syntax errors stay :class:`json.JSONDecodeError` (each caller words those itself).
    """
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:  # the parser recurses per level: about 1,000 levels exhaust the stack
        raise _UnreadableJSON("it is nested too deeply") from None
    except ValueError:  # the only other failure: an integer past the int-string conversion limit
        raise _UnreadableJSON(
            f"it has a number that is too long (more than {sys.get_int_max_str_digits()} digits)"
        ) from None


def _answer_text(text: str) -> str | None:
    """Content of the last complete ``<answer>`` tag, or None."""
    found = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    return found[-1].strip() if found else None


class XMLTagParser(ToolCallParser):
    """The papers' syntax: ``<toolname>argument</toolname>`` and ``<answer>…</answer>``.

    The first complete known tag outside ``<think>`` decides what the turn is. The tag's body
    fills the tool's first parameter; for tools with several parameters the body may be a JSON
    object of arguments.
    """

    name = "xml"

    def parse(self, text: str, tools: Mapping[str, Tool]) -> Action:
        visible = _THINK.sub("", text)
        known = [ANSWER_TAG, *tools]
        pattern = re.compile(r"<(" + "|".join(map(re.escape, known)) + r")>(.*?)</\1>", re.DOTALL)
        match = pattern.search(visible)
        if match is None:
            return Action(error=self._why_no_call(visible, tools))
        tag, body = match.group(1), match.group(2).strip()
        if tag == ANSWER_TAG:
            return Action(answer=_answer_text(visible))
        if not body:
            return Action(
                error=f"The <{tag}> tag is empty: put the {tools[tag].primary_parameter or 'input'} "
                f"between <{tag}> and </{tag}>."
            )
        try:
            arguments = self._arguments(tools[tag], body)
        except _UnreadableJSON as e:
            return Action(error=f"The JSON arguments of <{tag}> cannot be read: {e}.")
        return Action(call=ToolCall(tag, arguments))

    @staticmethod
    def _arguments(tool: Tool, body: str) -> Mapping[str, Any]:
        """The call's arguments; raises :class:`_UnreadableJSON` for JSON beyond the parser's limits."""
        params = tool.parameters["properties"]
        if len(params) > 1 and body.startswith("{"):
            try:
                parsed = _load_json(body)
            except json.JSONDecodeError:
                parsed = None  # not JSON after all: the whole body is the first argument
            if isinstance(parsed, dict):
                return parsed
        return {tool.primary_parameter: body} if tool.primary_parameter else {}

    def _why_no_call(self, visible: str, tools: Mapping[str, Tool]) -> str:
        for tag in [*tools, ANSWER_TAG]:
            if f"<{tag}>" in visible:
                return f"The <{tag}> tag was opened but never closed: write <{tag}>…</{tag}>."
        unknown = [t for t, _ in _ANY_TAG_PAIR.findall(visible) if t not in _NOT_CALLS]
        if unknown:
            return f"There is no tool called <{unknown[0]}>. {self._syntax(tools)}"
        return f"No tool call or answer was found in your turn. {self._syntax(tools)}"

    @staticmethod
    def _syntax(tools: Mapping[str, Tool]) -> str:
        calls = ", ".join(f"<{t}>…</{t}>" for t in tools)
        return (f"Call a tool with {calls}, " if tools else "") + "or give the final answer with <answer>…</answer>."

    def stop_strings(self, tools: Mapping[str, Tool]) -> list[str]:
        return [f"</{t}>" for t in tools]

    def describe(self, tools: Mapping[str, Tool]) -> str:
        lines = [f"- <{t.name}> {t.primary_parameter or ''} </{t.name}>: {t.description}" for t in tools.values()]
        return "Tools (write the call as a tag; its result comes back between <result> and </result>):\n" + "\n".join(
            lines
        )


class JSONToolCallParser(ToolCallParser):
    """Chat models' syntax: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``.

    ``arguments`` may also be a JSON-encoded string (the OpenAI wire form). The final answer is
    given in ``<answer>…</answer>``.
    """

    name = "json"
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, tools: Mapping[str, Tool]) -> Action:
        visible = _THINK.sub("", text)
        call = self._CALL.search(visible)
        answer = _answer_text(visible)
        if answer is not None and (call is None or visible.find("<answer>") < call.start()):
            return Action(answer=answer)
        if call is None:
            if "<tool_call>" in visible:
                return Action(
                    error="The <tool_call> tag was opened but never closed: write <tool_call>{…}</tool_call>."
                )
            return Action(error=f"No tool call or answer was found in your turn. {self._syntax()}")
        try:
            payload = _load_json(call.group(1).strip())
        except json.JSONDecodeError as e:
            return Action(error=f"The tool call is not valid JSON ({e.msg} at character {e.pos}). {self._syntax()}")
        except _UnreadableJSON as e:
            return Action(error=f"The tool call's JSON cannot be read: {e}. {self._syntax()}")
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return Action(error=f'A tool call must be a JSON object with a "name" string. {self._syntax()}')
        arguments = payload.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = _load_json(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return Action(error=f'"arguments" is a string that is not valid JSON ({e.msg}).')
            except _UnreadableJSON as e:
                return Action(error=f'"arguments" is a string whose JSON cannot be read: {e}.')
        if not isinstance(arguments, dict):
            return Action(error='"arguments" must be a JSON object of named arguments.')
        return Action(call=ToolCall(payload["name"], arguments))

    @staticmethod
    def _syntax() -> str:
        return (
            'Call a tool with <tool_call>{"name": "…", "arguments": {…}}</tool_call>, '
            "or give the final answer with <answer>…</answer>."
        )

    def stop_strings(self, tools: Mapping[str, Tool]) -> list[str]:
        return ["</tool_call>"]

    def describe(self, tools: Mapping[str, Tool]) -> str:
        schemas = "\n".join(json.dumps(t.schema, ensure_ascii=False) for t in tools.values())
        return (
            "You may call the functions below. For each call, write "
            '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call>; '
            "its result comes back between <result> and </result>.\n<tools>\n" + schemas + "\n</tools>"
        )


PARSERS: dict[str, type[ToolCallParser]] = {"xml": XMLTagParser, "json": JSONToolCallParser}


def get_parser(parser: str | ToolCallParser) -> ToolCallParser:
    """A parser instance from its name (``"xml"`` or ``"json"``) or as given."""
    if isinstance(parser, ToolCallParser):
        return parser
    try:
        return PARSERS[parser]()
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {parser!r}; choose one of {sorted(PARSERS)} or pass a ToolCallParser instance"
        ) from None
