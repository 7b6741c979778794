"""Demonstrations for the cold start: worked episodes of the training tasks, written from their gold answers.

ARPO and AEPO fine-tune the model on a few hundred tool-use trajectories before RL; theirs came
from a stronger model. Offline, without one, :func:`demonstrations` writes them from the task
list itself: each training task is played in the real environment, with its real tools, by the
environment's own ``demo_actions()`` (for the QA environments: search for the question, then
answer with the gold answer), and the episode is kept only when its answer is in what the tools
returned (``grade["in_results"]``). A kept episode teaches the model to call the tool and answer
from its result; an episode whose search missed the answer would teach it to state an answer it
was never shown, and is dropped.

Each demonstration is a chat (``{"messages": [...], "reward": r, "index": i, "id": ...}``), the
record :func:`agents.sft.train.load_sft_data` reads: the env's prompt as the user message, each action
an assistant message, each tool result a tool message. ``agents demonstrations`` writes them to a
JSONL file for ``agents sft --data``.

Only training tasks are used: the first ``holdout`` tasks, which ``agents train`` keeps for
evaluation, are never played.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DemonstrationCounts", "demonstration", "demonstrations", "write_demonstrations"]


@dataclass(frozen=True)
class DemonstrationCounts:
    """What :func:`write_demonstrations` played and kept."""

    tasks: int  # training tasks played
    written: int  # kept: the answer is in the tool results
    not_grounded: int  # dropped: the tools did not return the answer

    def summary(self) -> str:
        """One line for a log."""
        return (
            f"{self.written} demonstrations of {self.tasks} training tasks; {self.not_grounded} dropped because "
            "their tools did not return the answer"
        )


def demonstration(env: Any, index: int) -> dict[str, Any]:
    """Play task ``index`` of ``env`` with its ``demo_actions()``; the chat, its reward and its grade.

    ``env`` is an environment made by :func:`agentenv.make` whose base environment has
    ``demo_actions()`` (:class:`agentenv.ToolEnv` and its subclasses). The record's ``grounded``
    says whether the final answer is in what the tools returned.
    """
    base = env.unwrapped
    if not callable(getattr(base, "demo_actions", None)):
        raise TypeError(
            f"{type(base).__name__} has no demo_actions(), so it cannot write its own demonstrations; "
            "use a ToolEnv (multihop-qa, singlehop-qa, tool-qa, …) or write the chats yourself"
        )
    observation, info = env.reset(seed=index, options={"index": index})
    messages = [{"role": "user", "content": observation}]
    grade: Mapping[str, Any] = {}
    reward = 0.0
    for action in base.demo_actions():
        observation, reward, terminated, truncated, info = env.step(action)
        messages.append({"role": "assistant", "content": action})
        if terminated or truncated:
            grade = info.get("grade") or {}
            break
        messages.append({"role": "tool", "content": observation})
    return {
        "messages": messages,
        "reward": float(reward),
        "index": index,
        "id": info.get("id"),
        "grounded": bool(grade.get("in_results")),
    }


def demonstrations(
    env_id: str, *, env_kwargs: Mapping[str, Any] | None = None, holdout: int = 0, limit: int | None = None
) -> Iterator[dict[str, Any]]:
    """Every training task's demonstration (tasks ``holdout``, ``holdout + 1``, …; at most ``limit``), grounded or not."""
    import agentenv

    env = agentenv.make(env_id, **(env_kwargs or {}))
    try:
        task_list = env.tasks
        if task_list is None:
            raise TypeError(f"{env_id} has no task list (env.tasks), so it has no training tasks to play")
        tasks = len(task_list)
        if holdout >= tasks:
            raise ValueError(
                f"holdout={holdout} keeps all {tasks} tasks of {env_id} for evaluation, leaving none to demonstrate; "
                "lower it"
            )
        end = tasks if limit is None else min(tasks, holdout + limit)
        for index in range(holdout, end):
            yield demonstration(env, index)
    finally:
        env.close()


def write_demonstrations(
    env_id: str,
    path: str | Path,
    *,
    env_kwargs: Mapping[str, Any] | None = None,
    holdout: int = 0,
    limit: int | None = None,
) -> DemonstrationCounts:
    """Write the grounded demonstrations of ``env_id``'s training tasks to the JSONL file ``path``.

    ``holdout``: the first tasks, kept for evaluation, are skipped (``agents train``'s ``holdout``);
    ``limit``: play at most this many training tasks.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be a positive number of tasks (or None for all), got {limit!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    played = written = 0
    with path.open("w") as file:
        for record in demonstrations(env_id, env_kwargs=env_kwargs, holdout=holdout, limit=limit):
            played += 1
            if record.pop("grounded"):
                file.write(json.dumps(record) + "\n")
                written += 1
    return DemonstrationCounts(played, written, played - written)
