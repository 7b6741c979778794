import pytest

import agentenv
from agentenv import tool
from agentenv.browse import Browser, browse_tool
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


# Valid JSON that Python's parser gives up on: nesting past its recursion limit (about 1,000
# levels) raises RecursionError, an integer past 4,300 digits ValueError. Both must become errors.
DEEP = "[" * 5000 + "]" * 5000
LONG_NUMBER = "1" * 4301
NESTED = "it is nested too deeply"
TOO_LONG = "it has a number that is too long (more than 4300 digits)"
JSON_SYNTAX = (
    'Call a tool with <tool_call>{"name": "…", "arguments": {…}}</tool_call>, '
    "or give the final answer with <answer>…</answer>."
)
UNREADABLE = [
    (xml, f'<calc>{{"a": {DEEP}, "b": 1}}</calc>', f"The JSON arguments of <calc> cannot be read: {NESTED}."),
    (xml, f'<calc>{{"a": {LONG_NUMBER}, "b": 1}}</calc>', f"The JSON arguments of <calc> cannot be read: {TOO_LONG}."),
    (
        js,
        f'<tool_call>{{"name": "calc", "arguments": {{"a": {DEEP}, "b": 1}}}}</tool_call>',
        f"The tool call's JSON cannot be read: {NESTED}. {JSON_SYNTAX}",
    ),
    (
        js,
        f'<tool_call>{{"name": "calc", "arguments": {{"a": {LONG_NUMBER}, "b": 1}}}}</tool_call>',
        f"The tool call's JSON cannot be read: {TOO_LONG}. {JSON_SYNTAX}",
    ),
    (
        js,
        f'<tool_call>{{"name": "calc", "arguments": "{DEEP}"}}</tool_call>',
        f'"arguments" is a string whose JSON cannot be read: {NESTED}.',
    ),
    (
        js,
        f'<tool_call>{{"name": "calc", "arguments": "{{\\"a\\": {LONG_NUMBER}, \\"b\\": 1}}"}}</tool_call>',
        f'"arguments" is a string whose JSON cannot be read: {TOO_LONG}.',
    ),
]


@pytest.mark.parametrize("parser, text, error", UNREADABLE)
def test_json_beyond_the_parsers_limits_is_an_error_not_an_exception(parser, text, error):
    assert parser.parse(text, TOOLS) == Action(error=error)


def test_browse_arguments_nested_too_deeply_are_an_error():
    tools = {"browse": browse_tool(Browser())}
    assert xml.parse(f'<browse>{{"url": {DEEP}}}</browse>', tools) == Action(
        error=f"The JSON arguments of <browse> cannot be read: {NESTED}."
    )
    assert xml.parse(f'<browse>{{"url": "http://x", "page": {LONG_NUMBER}}}</browse>', tools) == Action(
        error=f"The JSON arguments of <browse> cannot be read: {TOO_LONG}."
    )


@pytest.mark.parametrize("parser, text, error", UNREADABLE)
def test_step_turns_unreadable_json_into_an_observation_and_the_episode_goes_on(parser, text, error):
    env = agentenv.make("multihop-qa", parser=parser.name, tools=[calc])
    env.reset(options={"index": 0})
    obs, reward, terminated, truncated, info = env.step(text)
    assert (obs, reward, terminated, truncated) == (error, 0.0, False, False)
    assert info["error"] == error and info["tool"] is None and info["tool_calls"] == 0
    call = (
        '<calc>{"a": 2, "b": 3}</calc>'
        if parser is xml
        else '<tool_call>{"name": "calc", "arguments": {"a": 2, "b": 3}}</tool_call>'
    )
    assert env.step(call)[:4] == ("5", 0.0, False, False)
    assert env.step("<answer>\\boxed{Chief of Protocol}</answer>")[1:3] == (1.0, True)
