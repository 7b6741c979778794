"""The ``python`` tool: code runs in a persistent, isolated, forkable sandbox session.

``<python>x = 6 * 7\\nx</python>`` (or the JSON form ``{"name": "python", "arguments": {"code": …}}``)
runs in one Python session per episode: variables, imports and functions persist between calls.
The observation is what the papers' interpreter prints: stdout, the value of a trailing
expression, the error trimmed to the user's code, and notes when a limit killed the session.

The tool is stateful: when its environment forks, its sandbox forks (``os.fork`` of the warm
interpreter for :class:`~sandboxes.LocalSandbox`), so branches of a rollout tree each continue
the same Python session independently. A fresh sandbox is started at every ``reset`` (its
interpreter warms up, importing numpy and sympy, while the model generates its first turn).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Literal

from agentenv.tools import Tool, tool
from sandboxes import DEFAULT_PREIMPORT, DockerSandbox, Limits, LocalSandbox, Sandbox
from sandboxes.docker_sandbox import connect

__all__ = ["PythonSession", "python_tool"]

DEFAULT_TIMEOUT = 10.0  # seconds of wall clock per call
_FENCE = re.compile(r"^\s*```(?:python|py)?\s*\n(.*?)\n?\s*```\s*$", re.DOTALL)

SandboxKind = Literal["local", "docker"]


class PythonSession:
    """One episode's Python session; forked with the environment.

    Args:
        sandbox: ``"local"`` (bubblewrap-isolated worker processes), ``"docker"``, or a
            callable returning a fresh :class:`~sandboxes.Sandbox`.
        limits: Resource limits of the sandbox (memory, CPU, processes, files, output).
        timeout: Wall-clock seconds per call.
        isolation: For ``sandbox="local"``: ``"auto"`` (default), ``"bubblewrap"`` (required),
            ``"process"`` or ``"unsafe-process"`` (see :class:`~sandboxes.LocalSandbox`). Checked
            here, so that e.g. root without bubblewrap fails at ``make`` with the fix.
        preimport: Modules every session has imported before its first call (default
            :data:`~sandboxes.DEFAULT_PREIMPORT`, numpy and sympy among them). Each episode
            starts a sandbox: ``("math",)`` starts one in ~70 ms here instead of ~330 ms.
    """

    def __init__(
        self,
        sandbox: SandboxKind | Callable[[], Sandbox] = "local",
        *,
        limits: Limits | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        isolation: str | None = None,
        preimport: Sequence[str] | None = None,
    ) -> None:
        if preimport is not None and sandbox not in ("local", "docker"):
            raise ValueError(
                f"preimport={preimport!r} applies to sandbox='local' or 'docker' only; a callable imports what it chooses"
            )
        warm = DEFAULT_PREIMPORT if preimport is None else tuple(preimport)
        if isolation is not None and sandbox != "local":
            raise ValueError(
                f"isolation={isolation!r} applies to sandbox='local' only, not to sandbox={sandbox!r}; "
                "a Docker sandbox is isolated by its container, a callable chooses its own"
            )
        if sandbox == "local":
            level = isolation or "auto"
            LocalSandbox.isolation_for(level, limits=limits)  # SandboxError (with the fix) now, not mid-episode
            self.new_sandbox: Callable[[], Sandbox] = lambda: LocalSandbox(limits, isolation=level, preimport=warm)
        elif sandbox == "docker":
            connect()  # fail now, with the reason, rather than at the first call of some episode
            self.new_sandbox = lambda: DockerSandbox(limits, preimport=warm)
        elif callable(sandbox):
            self.new_sandbox = sandbox
        else:
            raise ValueError(f"sandbox must be 'local', 'docker' or a callable returning a Sandbox, got {sandbox!r}")
        self.timeout = timeout
        self.sandbox: Sandbox | None = None

    async def __call__(self, code: str) -> str:
        """Execute Python code in a persistent session (variables and imports persist between calls).

        Args:
            code: Python source; the value of a trailing expression is printed, as in a REPL.
        """
        fenced = _FENCE.match(code)  # models often wrap code in a markdown fence
        if self.sandbox is None:
            self.sandbox = self.new_sandbox()
        result = await self.sandbox.arun(fenced.group(1) if fenced else code, self.timeout)
        return result.render()

    def fork(self) -> PythonSession:
        child = PythonSession.__new__(PythonSession)
        child.new_sandbox, child.timeout = self.new_sandbox, self.timeout
        child.sandbox = self.sandbox.fork() if self.sandbox is not None else None
        return child

    def reset(self) -> None:
        """A new episode starts with a fresh session, warming up from now on."""
        self.close()
        self.sandbox = self.new_sandbox()

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
            self.sandbox = None


def python_tool(
    sandbox: SandboxKind | Callable[[], Sandbox] = "local",
    *,
    limits: Limits | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    isolation: str | None = None,
    preimport: Sequence[str] | None = None,
) -> Tool:
    """The ``python`` tool over a fresh :class:`PythonSession`."""
    session = PythonSession(sandbox, limits=limits, timeout=timeout, isolation=isolation, preimport=preimport)
    return tool(session, name="python")
