"""ToolEnv: the multi-turn tool-use episode that every shipped environment is.

One episode: the prompt poses a task; each turn the model writes an action (reasoning plus one
tool call, or the final answer); the environment runs the call and returns its result as the
observation; the final answer is graded into the reward.

Limits (the papers' conventions): at most ``max_tool_calls`` calls (past it, the observation
says so and asks for the answer, and the call is not run); at most ``max_turns`` turns (then the
episode is truncated and graded as unanswered); observations cut to ``max_obs_chars``.

Forking is copy-on-write: the episode state is an immutable record whose history is a linked
list of turns shared between forks, so ``fork()`` costs the same at turn 1 and turn 50; only
stateful tools are copied (by their own ``fork``).
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from agentenv.core import Env, ForkStrategy
from agentenv.datasets import Example
from agentenv.graders import Grade, extract_answer, grade, normalize_answer
from agentenv.options import Option, OptionError, OptionRule, check_options, unknown_option
from agentenv.parsers import PARSERS, Action, ToolCallParser, get_parser
from agentenv.rewards import REWARD_SCHEMES, RewardScheme, acall_reward, get_reward
from agentenv.tools import Tool, ToolError, as_tool, check_tool_name, close_tools

__all__ = ["EpisodeState", "ToolEnv", "Turn"]

DEFAULT_MAX_TOOL_CALLS = 6  # AT²PO: 6 tool calls per episode (ARPO's reasoning setup: 3)
DEFAULT_MAX_OBS_CHARS = 6000  # 3 results of ~1000 characters each, with headroom
# An answer holding this many consecutive words of the question repeats it rather than answers it:
# 2% of multihop-qa's gold answers do (a comparison's "Big Stone Gap Film Festival"), 3 would flag 7%.
ECHO_WORDS = 4
#: What the observation says first when a turn held more than one tool call (only the first runs).
ONE_CALL_PER_TURN = (
    "Only the first tool call of a turn is run; the other calls in this turn were not. Call one tool per turn."
)

PROMPT_TEMPLATE = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> every time "
    "you get new information. After reasoning, if you lack some knowledge, you can use a tool; "
    "you can use tools at most {max_tool_calls} times.\n{tools}\n"
    "When no further information is needed, give the final answer inside <answer> and </answer>, "
    "{answer_format}.\n"
    "{example}Question: {question}\n"
)
# How the prompt's {answer_format} asks for the answer, matching what the grader accepts.
ANSWER_FORMATS = {
    True: "with the answer itself in \\boxed{}, for example <answer> \\boxed{Beijing} </answer>",  # AT²PO, ARPO
    False: "for example <answer> Beijing </answer>",  # Search-R1
}


@dataclass(frozen=True, slots=True)
class Turn:
    """One finished turn; ``previous`` links to the turn before (forks share these)."""

    action: str
    observation: str
    tool: str | None
    previous: Turn | None


@dataclass(frozen=True, slots=True)
class EpisodeState:
    """Everything that changes during an episode, immutable: a step makes a new one."""

    task: Example
    prompt: str
    last_turn: Turn | None = None
    turns: int = 0
    tool_calls: int = 0
    tool_counts: Mapping[str, int] = field(default_factory=dict)  # replaced, never mutated
    done: bool = False
    reward: float = 0.0
    grade: Mapping[str, Any] | None = None

    def history(self) -> list[Turn]:
        """The turns so far, first to last (walks the shared list: O(turns))."""
        turns, turn = [], self.last_turn
        while turn is not None:
            turns.append(turn)
            turn = turn.previous
        return turns[::-1]


def _check_tools(name: str, tools: Any) -> None:
    Option((list, tuple))(name, tools)
    for i, t in enumerate(tools):
        Option((Tool, Callable))(f"{name}[{i}]", t)


#: What each keyword option of :class:`ToolEnv` may be (``render_mode``: ``metadata``'s modes).
TOOL_ENV_OPTIONS: dict[str, OptionRule] = {
    "tools": _check_tools,
    "parser": Option(ToolCallParser, choices=tuple(PARSERS)),
    "reward": Option(Callable, choices=tuple(REWARD_SCHEMES)),
    "require_boxed": Option(bool),
    "grader": Option(Callable, optional=True),
    "max_tool_calls": Option(int, minimum=0),
    "max_turns": Option(int, minimum=1, optional=True),
    "max_obs_chars": Option(int, minimum=1),
    "prompt_template": Option(str),
    "example": Option(str, optional=True),
}


class ToolEnv(Env):
    """A multi-turn tool-use episode over a list of tasks.

    Args:
        tasks: The examples to pose (question + gold answers).
        tools: Tools (typed functions, stateful callables or :class:`Tool`s).
        parser: Tool-call syntax, ``"xml"`` (the papers' tags) or ``"json"`` (``<tool_call>``).
        reward: A scheme name (see :mod:`agentenv.rewards`) or a callable.
        require_boxed: The answer must be in ``\\boxed{}`` inside ``<answer>`` (the papers' format).
        grader: ``grader(response, answers) -> Grade`` for the ``<answer>`` content; default
            :func:`agentenv.graders.grade` (EM, F1, cover-EM) with ``require_boxed``.
        max_tool_calls: Tool calls allowed per episode (default 6, AT²PO).
        max_turns: Turns before truncation (default ``max_tool_calls + 2``: every call, one turn
            told the limit is reached, and the answer).
        max_obs_chars: Observations longer than this are cut and marked.
        prompt_template: ``str.format`` template with ``{question}``, ``{tools}``, ``{max_tool_calls}``,
            ``{answer_format}`` (how to write the answer, as ``require_boxed`` grades it) and
            ``{example}`` (empty, or ``"Example:\n" + example + "\n"``).
        example: A worked episode in this env's syntax (question, turns, results, answer) shown
            before the question: one-shot prompting, for models too small to follow the
            instructions alone (the 135M default model writes the answer format far more often
            with one). ``None`` (default) shows none, as the papers do.

    Every option is checked first (:meth:`check_options`, which subclasses call before their own
    work): a bad one raises :class:`~agentenv.options.OptionError`, a ``ValueError``
    (:class:`~agentenv.options.OptionTypeError`, also a ``TypeError``, for a wrong type or an option
    not taken), in one line naming the option, the value given and what is allowed.
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi"]}
    fork_strategy: ClassVar[ForkStrategy] = "copy-on-write"
    #: The rules of the options this class adds or redefines (:meth:`check_options` reads those of
    #: every class in the MRO, the nearest first).
    OPTIONS: ClassVar[Mapping[str, OptionRule]] = TOOL_ENV_OPTIONS
    #: ToolEnv options that a subclass passes on itself, so that its ``**options`` must not hold them.
    FIXED_OPTIONS: ClassVar[frozenset[str]] = frozenset()

    def __init__(
        self,
        tasks: Sequence[Example],
        tools: Sequence[Tool | Callable[..., Any]] = (),
        *,
        parser: str | ToolCallParser = "xml",
        reward: str | Callable[..., float] = "em",
        require_boxed: bool = True,
        grader: Callable[[str | None, Sequence[str]], Grade] | None = None,
        max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS,
        max_turns: int | None = None,
        max_obs_chars: int = DEFAULT_MAX_OBS_CHARS,
        prompt_template: str = PROMPT_TEMPLATE,
        example: str | None = None,
        render_mode: str | None = None,
    ) -> None:
        # On ToolEnv, not type(self): a subclass's rule for an option of the same name (QAEnv's
        # `example` is a bool or a string) applies to what the subclass is given, not to this.
        ToolEnv.check_options(
            {
                "tools": tools,
                "parser": parser,
                "reward": reward,
                "require_boxed": require_boxed,
                "grader": grader,
                "max_tool_calls": max_tool_calls,
                "max_turns": max_turns,
                "max_obs_chars": max_obs_chars,
                "prompt_template": prompt_template,
                "example": example,
            }
        )
        super().__init__(render_mode=render_mode)  # checks render_mode, naming the subclass
        if not tasks:
            raise ValueError("ToolEnv needs at least one task")
        self.tasks: Sequence[Example] = tasks
        self.tools: dict[str, Tool] = {}
        for t in map(as_tool, tools):
            check_tool_name(t.name)
            if t.name in self.tools or t.name == "answer":
                raise ValueError(f"tool name {t.name!r} is used twice (or is the reserved `answer`)")
            self.tools[t.name] = t
        self.parser = get_parser(parser)
        self.reward_fn = get_reward(reward)
        self.require_boxed = require_boxed
        self.grader = grader or functools.partial(grade, require_boxed=require_boxed)
        self.max_tool_calls = max_tool_calls
        self.max_turns = max_turns if max_turns is not None else max_tool_calls + 2
        self.max_obs_chars = max_obs_chars
        self.prompt_template = prompt_template
        self.example = example
        # The worked example's own answer, normalised: an answer equal to it was copied, not found.
        shown = self.parser.parse(example[example.rfind("<answer>") :], {}).answer if example else None
        self.example_answer = normalize_answer(extract_answer(shown, require_boxed=False) or "")
        self.state: EpisodeState | None = None

    # -- the options ------------------------------------------------------------------------

    @classmethod
    def option_names(cls) -> list[str]:
        """Every keyword option of ``cls(...)``: its parameters, and those its ``**options`` pass on to the class above."""
        names = [n for n, p in _parameters(cls).items() if p.kind is not p.VAR_KEYWORD]
        return names + [n for n in _keyword_options(cls) if n not in names]

    @classmethod
    def check_options(cls, options: Mapping[str, Any], *, extra: Mapping[str, OptionRule] | None = None) -> None:
        """Raise :class:`~agentenv.options.OptionError` for the first bad keyword option of ``cls(...)`` in ``options``.

        Bad: a name the constructor does not take (the message lists those it does), a value of
        the wrong type or out of range (the message names the option, the value and what is
        allowed). A subclass calls it first, with what it was given, so that a bad option fails
        before it loads data, builds an index or starts a sandbox. ``extra``: rules of options
        taken besides ``cls``'s (a factory's own, such as ``tool_qa``'s ``sandbox``).
        """
        extra = extra or {}
        valid = cls.option_names()
        for name in options:
            if name not in valid and name not in extra:
                # Where Python itself would have refused it: ToolEnv's constructor, at the end of **options.
                where = f"{cls.__name__}() " if name in cls.FIXED_OPTIONS else "ToolEnv.__init__() "
                raise unknown_option(name, [*valid, *extra], where=where)
        rules: dict[str, OptionRule] = {}
        for klass in reversed(cls.__mro__):  # the nearest class's rule wins
            rules.update(vars(klass).get("OPTIONS", {}))
        check_options({**rules, **extra}, {n: v for n, v in options.items() if n != "render_mode"})
        if "render_mode" in options:
            cls.check_render_mode(options["render_mode"])
        template = options.get("prompt_template", _default(cls, "prompt_template"))
        if options.get("example") and isinstance(template, str) and "{example}" not in template:
            raise OptionError("example= needs a prompt_template with an {example} field to put it in", "example")

    # -- what the model is told -------------------------------------------------------------

    @property
    def stop_strings(self) -> list[str]:
        """Where a turn's generation must stop: the end of a tool call."""
        return self.parser.stop_strings(self.tools)

    def prompt(self, task: Example) -> str:
        """The first observation for ``task``: instructions, tool syntax and the question."""
        return self.prompt_template.format(
            question=task.question,
            tools=self.parser.describe(self.tools),
            max_tool_calls=self.max_tool_calls,
            answer_format=ANSWER_FORMATS[self.require_boxed],
            example=f"Example:\n{self.example}\n" if self.example else "",
        )

    # -- the episode --------------------------------------------------------------------------

    def select_task(self, seed: int | None, options: Mapping[str, Any] | None) -> Example:
        """``options={"index": i}`` poses task i; otherwise one drawn from ``np_random``."""
        if options and "index" in options:
            index = options["index"]
            if not isinstance(index, int) or not 0 <= index < len(self.tasks):
                raise ValueError(f"options['index'] must be an int in [0, {len(self.tasks)}), got {index!r}")
            return self.tasks[index]
        return self.tasks[int(self.np_random.integers(len(self.tasks)))]

    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        self.reset_rng(seed)
        task = self.select_task(seed, options)
        for t in self.tools.values():
            t.reset()
        self.state = EpisodeState(task=task, prompt=self.prompt(task))
        return self.state.prompt, self._info(self.state)

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        self.check_open()
        state = self.state
        if state is None:
            raise RuntimeError("call reset() before step()")
        if state.done:
            raise RuntimeError("the episode is over: call reset(), or fork() an earlier state to branch")
        if not isinstance(action, str):
            raise TypeError(f"an action is the text of one model turn (str), got {type(action).__name__}")

        parsed = self.parser.parse(action, self.tools)
        turns = state.turns + 1
        tool_calls, tool_counts = state.tool_calls, state.tool_counts
        tool_name = parsed.call.name if parsed.call else None
        if parsed.answer is not None:
            observation = ""
        elif parsed.call is not None and parsed.call.name not in self.tools:
            observation = (
                f"There is no tool called `{parsed.call.name}`; available tools: {', '.join(self.tools) or 'none'}."
            )
        elif parsed.call is not None and state.tool_calls >= self.max_tool_calls:
            observation = (
                f"You have reached the limit of {self.max_tool_calls} tool calls; this call was "
                "not run. Give your final answer now, inside <answer> and </answer>."
            )
        elif parsed.call is not None:
            observation = await self._run_tool(parsed)
            tool_calls += 1
            tool_counts = {**tool_counts, parsed.call.name: tool_counts.get(parsed.call.name, 0) + 1}
        else:
            observation = parsed.error or ""

        if parsed.call is not None and parsed.more_calls:  # first, so that truncating the result keeps it
            observation = f"{ONE_CALL_PER_TURN}\n{observation}"
        terminated = parsed.answer is not None
        truncated = not terminated and turns >= self.max_turns
        observation = self._truncate(observation)
        state = replace(
            state,
            last_turn=Turn(action, observation, tool_name, state.last_turn),
            turns=turns,
            tool_calls=tool_calls,
            tool_counts=tool_counts,
            done=terminated or truncated,
        )
        if state.done:
            state = await self._graded(state, parsed)
        self.state = state
        return observation, state.reward, terminated, truncated, self._info(state, parsed)

    async def _run_tool(self, parsed: Action) -> str:
        assert parsed.call is not None
        tool = self.tools[parsed.call.name]
        try:
            return await tool.acall(parsed.call.arguments)
        except ToolError as e:
            return f"Error: {e}"
        except Exception as e:  # a failing tool is the model's observation, never a crash of step()
            return f"Error: the tool `{tool.name}` failed: {type(e).__name__}: {e}"

    def _truncate(self, text: str) -> str:
        if len(text) <= self.max_obs_chars:
            return text
        return text[: self.max_obs_chars] + f"\n[… truncated {len(text) - self.max_obs_chars} characters]"

    async def _graded(self, state: EpisodeState, parsed: Action) -> EpisodeState:
        result = self.grader(parsed.answer, state.task.answers)
        history = state.history()
        actions = [t.action for t in history]
        reward = await acall_reward(
            self.reward_fn,
            {
                "answer": result.answer,
                "answers": list(state.task.answers),
                "grade": result,
                "response": parsed.answer,
                "tool_counts": dict(state.tool_counts),
                "task": state.task,
                "actions": actions,
            },
        )
        origin = self._answer_origin(result.answer, state.task.question, history)
        graded = {**result.as_dict(), "reward": reward, **origin}
        # The papers' schemes also judge the format of the turns (a <think> pair, one <answer>):
        # format_ok says what the reward saw, and why.
        scheme = self.reward_fn
        if isinstance(scheme, RewardScheme) and scheme.checks_turns and graded.get("format_ok"):
            why = scheme.format_error(actions)
            if why is not None:
                graded.update(format_ok=False, format_error=why)
        return replace(state, reward=reward, grade=graded)

    def _answer_origin(self, answer: str | None, question: str, history: Sequence[Turn]) -> dict[str, bool]:
        """Whether the answer was found in what the tools returned, whether it is the worked example's,
        and whether it repeats the question (:data:`ECHO_WORDS` consecutive words of it).

        All normalised as EM normalises; found means a whole-word substring of the tool results.
        They tell an agent that answers from its searches from one that repeats a string (a reward
        that pays words shared with the gold, such as F1, is hacked by repeating the question).
        """
        said = normalize_answer(answer or "")
        results = normalize_answer(" ".join(t.observation for t in history if t.tool is not None))
        asked = normalize_answer(question).split()
        runs = {" ".join(asked[i : i + ECHO_WORDS]) for i in range(len(asked) - ECHO_WORDS + 1)}
        words = said.split()
        return {
            "in_results": bool(said) and f" {said} " in f" {results} ",
            "equals_example": bool(said) and said == self.example_answer,
            "echoes_question": any(" ".join(words[i : i + ECHO_WORDS]) in runs for i in range(len(words))),
        }

    def _info(self, state: EpisodeState, parsed: Action | None = None) -> dict[str, Any]:
        # Fresh containers every call: callers may keep and mutate what they receive.
        info: dict[str, Any] = {
            "id": state.task.id,
            "question": state.task.question,
            "answers": list(state.task.answers),
            "turn": state.turns,
            "tool_calls": state.tool_calls,
        }
        if parsed is not None:
            info["tool"] = parsed.call.name if parsed.call else None
            info["error"] = parsed.error
        if state.grade is not None:
            info["grade"] = dict(state.grade)
        return info

    # -- forking and the rest of the contract -------------------------------------------------

    def fork(self) -> ToolEnv:
        """Copy-on-write: the immutable episode state and history are shared, O(1)."""
        self.check_open()
        child = copy.copy(self)
        child.tools = {name: t.fork() for name, t in self.tools.items()}
        child._np_random = self._fork_rng()
        return child

    def transcript(self) -> str:
        """The episode so far as text, observations inline as ``<result>…</result>``."""
        if self.state is None:
            return ""
        parts = [self.state.prompt]
        for turn in self.state.history():
            parts.append(turn.action)
            if turn.observation:
                parts.append(f"<result>\n{turn.observation}\n</result>")
        return "\n".join(parts)

    def render(self) -> str | None:
        if self.render_mode == "ansi":
            return self.transcript()
        return None

    def demo_actions(self) -> Iterator[str]:
        """Valid actions for the current task: one call per tool, then the gold answer (boxed if required).

        Used by :func:`agentenv.testing.check_env` and demos to exercise the tools.
        """
        task = self.state.task if self.state is not None else self.tasks[0]
        for t in self.tools.values():
            yield self._call_text(t, self.example_argument(t, task))
        answer = f"\\boxed{{{task.answers[0]}}}" if self.require_boxed else task.answers[0]
        yield f"<answer> {answer} </answer>"

    def example_argument(self, tool: Tool, task: Example) -> str:
        """An argument for ``tool`` that makes sense for ``task`` (override for custom tools)."""
        return task.question

    def _call_text(self, tool: Tool, argument: str) -> str:
        if self.parser.name == "json":
            args = {tool.primary_parameter: argument} if tool.primary_parameter else {}
            return f"<tool_call>{json.dumps({'name': tool.name, 'arguments': args})}</tool_call>"
        return f"<think>I will use {tool.name}.</think>\n<{tool.name}>{argument}</{tool.name}>"

    def close(self) -> None:
        super().close()  # closed first: a tool that fails to close still leaves the env unusable
        close_tools(self.tools.values())


def _parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The keyword parameters of ``cls.__init__`` (and its ``**``), without ``self``."""
    params = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    return {n: p for n, p in list(params.items())[1:] if p.kind is not p.VAR_POSITIONAL}


def _keyword_options(cls: type) -> list[str]:
    """The names ``cls(...)`` takes as keyword-only: its own, then those its ``**options`` pass on.

    Those are the keyword-only options of the next class of the MRO with a constructor of its
    own, less :attr:`ToolEnv.FIXED_OPTIONS` (positional ones are what the subclass passes itself).
    """
    params = _parameters(cls)
    names = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        base = next(k for k in cls.__mro__[1:] if "__init__" in vars(k))
        fixed: frozenset[str] = getattr(cls, "FIXED_OPTIONS", frozenset())
        names += [n for n in _keyword_options(base) if n not in names and n not in fixed]
    return names


def _default(cls: type, name: str) -> Any:
    """The default of parameter ``name`` in the nearest constructor of ``cls``'s MRO that has one."""
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            param = inspect.signature(klass.__init__).parameters.get(name)  # type: ignore[misc]
            if param is not None and param.default is not param.empty:
                return param.default
    return None
