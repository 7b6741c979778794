"""Math with a Python interpreter: ``python-math`` (MATH-500 by default, or GSM8K).

The model reasons, runs code in a sandboxed persistent Python session through the ``python``
tool, and answers in ``<answer>…\\boxed{…}…</answer>``; the answer is graded by mathematical
equivalence (math-verify), so ``\\frac{1}{2}`` and ``0.5`` are the same answer.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, get_args

from agentenv.datasets import Example, load_examples
from agentenv.graders import grade, prepare_math_grading
from agentenv.options import PATH, Option, OptionRule
from agentenv.python_tool import DEFAULT_TIMEOUT, SandboxKind, python_tool
from agentenv.tool_env import ToolEnv
from agentenv.tools import Tool
from sandboxes import Limits, Sandbox
from sandboxes.isolation import CHOICES as ISOLATION_CHOICES

__all__ = ["MATH_PROMPT_TEMPLATE", "PYTHON_OPTIONS", "MathEnv"]

#: The rules of the ``python`` tool's options (of ``python-math`` and ``tool-qa``).
PYTHON_OPTIONS: dict[str, OptionRule] = {
    "sandbox": Option(Callable, choices=get_args(SandboxKind)),
    "limits": Option(Limits, optional=True),
    "timeout": Option(float, minimum=0, exclusive=True),
    "isolation": Option(choices=ISOLATION_CHOICES, optional=True),
    "preimport": Option((list, tuple), optional=True),
}

MATH_PROMPT_TEMPLATE = (
    "Solve the given problem. You must conduct reasoning inside <think> and </think> every time "
    "you get new information. You can write Python code to compute or check intermediate results; "
    "you can use tools at most {max_tool_calls} times.\n{tools}\n"
    "When you are done, give the final answer inside <answer> and </answer>, with the answer "
    "itself in \\boxed{{}}, for example <answer> \\boxed{{\\frac{{1}}{{2}}}} </answer>.\n"
    "Problem: {question}\n"
)


class MathEnv(ToolEnv):
    """Solve a math problem with a sandboxed Python session; graded by math-verify equivalence.

    Args:
        dataset: ``"math500"`` (default) or ``"gsm8k"``.
        data: A MATH- or GSM8K-format file; overrides ``dataset``.
        sandbox: ``"local"`` or ``"docker"`` (or a callable returning a Sandbox).
        limits: The sandbox's resource limits.
        timeout: Wall-clock seconds per code call.
        isolation: A local sandbox's isolation: ``"auto"`` (default), ``"bubblewrap"`` (required),
            ``"process"`` or ``"unsafe-process"`` (see :class:`~sandboxes.LocalSandbox`).
        preimport: Modules each episode's session has imported (default: numpy and sympy among
            them; see :class:`~agentenv.python_tool.PythonSession`).
        tools: Extra tools besides ``python``.
        reward: ``"math"`` (1 if equivalent) by default; any scheme of :mod:`agentenv.rewards`.
        prompt_template: The prompt (the papers' tags, a math problem).
        **options: The options of :class:`~agentenv.tool_env.ToolEnv` (``parser``,
            ``max_tool_calls``, ``max_turns``, ``max_obs_chars``, …).
    """

    OPTIONS: ClassVar[Mapping[str, OptionRule]] = {
        "dataset": Option(PATH),
        "data": Option(PATH, optional=True),
        **PYTHON_OPTIONS,
    }
    FIXED_OPTIONS: ClassVar[frozenset[str]] = frozenset({"grader"})  # math-verify's equivalence is the grade

    def __init__(
        self,
        dataset: str = "math500",
        *,
        data: str | Path | None = None,
        sandbox: SandboxKind | Callable[[], Sandbox] = "local",
        limits: Limits | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        isolation: str | None = None,
        preimport: Sequence[str] | None = None,
        tools: Sequence[Tool | Callable[..., Any]] = (),
        reward: str | Callable[..., float] = "math",
        prompt_template: str = MATH_PROMPT_TEMPLATE,
        **options: Any,
    ) -> None:
        MathEnv.check_options(  # MathEnv's rules, for a subclass too (ArithmeticEnv fixes data)
            {
                "dataset": dataset,
                "data": data,
                "sandbox": sandbox,
                "limits": limits,
                "timeout": timeout,
                "isolation": isolation,
                "preimport": preimport,
                "tools": tools,
                "reward": reward,
                "prompt_template": prompt_template,
                **options,
            }
        )
        super().__init__(
            self.load_tasks(dataset, data),
            [python_tool(sandbox, limits=limits, timeout=timeout, isolation=isolation, preimport=preimport), *tools],
            reward=reward,
            grader=functools.partial(grade, math=True),
            prompt_template=prompt_template,
            **options,
        )
        prepare_math_grading()

    def load_tasks(self, dataset: str, data: str | Path | None) -> Sequence[Example]:
        """The problems to pose: the ``data`` file, else the shipped ``dataset``."""
        return load_examples(data if data is not None else dataset)

    def example_argument(self, tool: Tool, task: Any) -> str:
        if tool.name == "python":
            return "import math\nx = 6 * 7\nprint(x)\nmath.sqrt(x * x)"
        return super().example_argument(tool, task)
