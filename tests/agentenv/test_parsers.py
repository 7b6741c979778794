import pytest

from agentenv import tool
from agentenv.parsers import Action, JSONToolCallParser, ToolCall, XMLTagParser, get_parser


@tool
def search(query: str) -> str:
    """Search the corpus."""
    return query


@tool
def calc(a: int, b: int) -> str:
    """Add."""
    return str(a + b)


TOOLS = {"search": search, "calc": calc}
xml, js = XMLTagParser(), JSONToolCallParser()


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "<think>hm</think>\n<search> capital of France </search>",
            Action(call=ToolCall("search", {"query": "capital of France"})),
        ),
        ("<think>maybe <answer>x</answer></think><search>q</search>", Action(call=ToolCall("search", {"query": "q"}))),
        ("<answer> first </answer> then <answer> \\boxed{Paris} </answer>", Action(answer="\\boxed{Paris}")),
        ('<calc>{"a": 2, "b": "3"}</calc>', Action(call=ToolCall("calc", {"a": 2, "b": "3"}))),
        ("<search>q</search> and later <answer>a</answer>", Action(call=ToolCall("search", {"query": "q"}))),
    ],
)
def test_xml_parses_calls_and_answers(text, expected):
    assert xml.parse(text, TOOLS) == expected


@pytest.mark.parametrize(
    "text, error",
    [
        ("<search>capital of", "The <search> tag was opened but never closed: write <search>…</search>."),
        ("<search>   </search>", "The <search> tag is empty: put the query between <search> and </search>."),
        (
            "<browse>http://x</browse>",
            "There is no tool called <browse>. Call a tool with <search>…</search>, "
            "<calc>…</calc>, or give the final answer with <answer>…</answer>.",
        ),
        (
            "I think it is Paris.",
            "No tool call or answer was found in your turn. Call a tool with <search>…</search>, "
            "<calc>…</calc>, or give the final answer with <answer>…</answer>.",
        ),
        ("<answer>Paris", "The <answer> tag was opened but never closed: write <answer>…</answer>."),
    ],
)
def test_xml_errors_are_observations(text, error):
    assert xml.parse(text, TOOLS) == Action(error=error)


def test_xml_stop_strings_and_description():
    assert xml.stop_strings(TOOLS) == ["</search>", "</calc>"]
    assert xml.describe({"search": search}) == (
        "Tools (write the call as a tag; its result comes back between <result> and </result>):\n"
        "- <search> query </search>: Search the corpus."
    )


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            '<tool_call>{"name": "search", "arguments": {"query": "q"}}</tool_call>',
            Action(call=ToolCall("search", {"query": "q"})),
        ),
        (
            '<tool_call>{"name": "calc", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>',
            Action(call=ToolCall("calc", {"a": 1, "b": 2})),
        ),
        ('<tool_call>{"name": "nope"}</tool_call>', Action(call=ToolCall("nope", {}))),
        (
            '<answer>\\boxed{4}</answer><tool_call>{"name": "calc", "arguments": {}}</tool_call>',
            Action(answer="\\boxed{4}"),
        ),
        (
            '<tool_call>{"name": "search", "arguments": {"query": "q"}}</tool_call><answer>x</answer>',
            Action(call=ToolCall("search", {"query": "q"})),
        ),
    ],
)
def test_json_parses_calls_and_answers(text, expected):
    assert js.parse(text, TOOLS) == expected


@pytest.mark.parametrize(
    "text, error_start",
    [
        (
            '<tool_call>{"name": "search", "arguments": {"query": }}</tool_call>',
            "The tool call is not valid JSON (Expecting value at character 42).",
        ),
        ('<tool_call>["search"]</tool_call>', 'A tool call must be a JSON object with a "name" string.'),
        (
            '<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>',
            '"arguments" must be a JSON object of named arguments.',
        ),
        (
            '<tool_call>{"name": "calc", "arguments": "{oops"}</tool_call>',
            '"arguments" is a string that is not valid JSON',
        ),
        ('<tool_call>{"name": "search"', "The <tool_call> tag was opened but never closed"),
        ("plain text", "No tool call or answer was found in your turn."),
    ],
)
def test_json_errors_are_observations(text, error_start):
    action = js.parse(text, TOOLS)
    assert action.call is None and action.answer is None
    assert action.error.startswith(error_start)


def test_json_stop_strings_and_schema_description():
    assert js.stop_strings(TOOLS) == ["</tool_call>"]
    text = js.describe({"search": search})
    assert '{"type": "function", "function": {"name": "search", "description": "Search the corpus."' in text
    assert text.endswith("</tools>")


def test_get_parser():
    assert isinstance(get_parser("xml"), XMLTagParser)
    assert get_parser(js) is js
    with pytest.raises(ValueError, match=r"unknown tool-call parser 'yaml'; choose one of \['json', 'xml'\]"):
        get_parser("yaml")
