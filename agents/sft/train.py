"""Supervised fine-tuning on tool-use examples: the cold start before RL (``agents sft``).

ARPO and AEPO start RL from a model fine-tuned on a small set of tool-use trajectories. :func:`sft`
does that with the trainer of ``agents train`` (:class:`~agents.training.trainer.Trainer`, loss
``"sft"``: the mean negative log-likelihood of the action tokens, docs/algorithms/steps.md eq. 80), so
the run folder is a training run's: ``metrics.jsonl``, ``tensorboard/``, ``curves.png`` and
``checkpoints/step_NNNNNN/model``, which ``agents eval --model`` and ``agents train --model`` load.

One step (read :func:`sft` top to bottom):

1. the next ``batch_size`` examples of the epoch's order (a permutation drawn from ``(seed,
   epoch)``, as :class:`agents.run.task_order.TaskOrder` draws tasks);
2. :meth:`Trainer.step <agents.training.trainer.Trainer.step>` on their training paths: one AdamW
   update (``mini_batches=1``) whose gradient accumulates over micro-batches of
   ``micro_batch_size`` examples, weighted by action tokens, so that it is the whole batch's;
3. every ``checkpoint_every`` steps and after the last, a checkpoint.

The data (:func:`load_sft_data`) is a JSONL file, each line one of

- a **trajectory** written by ``agents eval --save-trajectories``
  (:meth:`agents.rollout.Trajectory.to_dict`): its exact token ids, trained on the tokens its
  ``mask`` marks (the sampled actions), one turn per ``turns[k]["action_span"]``; ``--min-reward``
  keeps the episodes whose ``reward`` is at least R;
- a **chat** ``{"messages": [{"role": "system" | "user" | "assistant" | "tool", "content": "..."}]}``,
  tokenised as the environments' episodes are (:class:`agentenv.wrappers.TokenEnv`): the messages
  before the first assistant one are the prompt, rendered by the tokenizer's chat template with
  its generation prompt; each assistant message is an action, trained on; a tool message is an
  observation, not trained on. With ``observations="inline"`` (TokenEnv's default, the papers'
  layout) the episode is one assistant turn, each action its content's tokens and each tool
  result ``\\n<result>\\n…\\n</result>\\n`` inside it, the last action followed by the
  tokenizer's end-of-sequence token (a sampled episode ends with it: the model's stop); with
  ``"turn"`` every message is a turn of the chat template, an action being the assistant content
  and the end-of-turn token after it (what the model samples before it stops), the template's
  headers and the rest being context. A chat may carry a ``"reward"``; one without is kept by
  ``--min-reward``.

The saved log-probs of a trajectory are kept as the paths' ``sampler_logprobs`` (0 for chats, which
have none). The trainer takes them as π_old (``old_logprobs="sampler"``: the loss ignores π_old, so
recomputing it would cost a forward pass for nothing), which makes ``mismatch/*`` in the metrics
the distance of the first batch's log-probs from the sampler that wrote the trajectories, and for
chats the NLL itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np

from agentenv.wrappers.token_env import ChatLayout
from agents.eval.heldout import HeldOut, HeldOutEvaluation, HeldOutLog, evaluate_heldout
from agents.models import load_tokenizer
from agents.progress import note
from agents.rollout.episodes import DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_MAX_RESPONSE_TOKENS
from agents.rollout.tree import RolloutTree, TrainingPath
from agents.run.config import TrainConfig, build

if TYPE_CHECKING:
    from agents.training.trainer import Trainer

__all__ = [
    "ROLES",
    "SFT_FILE",
    "SFTConfig",
    "SFTData",
    "SFTDataError",
    "SFTExample",
    "SFTResult",
    "SFTTurn",
    "chat_example",
    "epoch_order",
    "load_sft_data",
    "record_example",
    "sft",
    "training_path",
    "trajectory_example",
]

#: The run's settings, data and example counts, in the run folder (``train`` writes ``config.json``).
SFT_FILE = "sft.json"

#: The roles a chat message may have.
ROLES = ("system", "user", "assistant", "tool")

_EXPECTED = (
    'expected a chat {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]} '
    "or a trajectory of `agents eval --save-trajectories` (ids, mask, turns, reward)"
)
_TRAJECTORY_FIELDS = ("ids", "mask", "turns")


@dataclass
class SFTConfig:
    """Every hyper-parameter of :func:`sft`, with its default and where the default comes from.

    Attributes:
        epochs: Passes over the examples: 2, a short pass for a small cold-start set (transformers'
            and TRL's trainers default to 3).
        lr: AdamW's constant learning rate: 1e-5, the common SFT default for small models (TRL's
            SFTConfig uses 2e-5), ten times the papers' RL rate of 1e-6.
        batch_size: Examples per step, one optimiser update each: 8, transformers' (and TRL's)
            ``per_device_train_batch_size`` default. The last step of an epoch may take fewer.
        micro_batch_size: Examples per forward/backward pass, the gradients accumulated: 4, the
            trainer's own default (``TrainerConfig.micro_batch_size``); memory only, not the update.
        max_tokens: The longest example kept, prompt included: 8192, the longest sequence RL gives
            the model (the papers' 2000 prompt + 6192 response tokens). Longer examples are dropped,
            not truncated (a cut trajectory would teach an episode without its answer), and counted.
        min_reward: Keep the examples whose reward is at least this (``--min-reward``); ``None``:
            all. Chats without a reward are kept.
        observations: How chats are laid out, as :class:`~agentenv.wrappers.TokenEnv` lays out the
            episodes RL trains on: ``"inline"`` (its default) or ``"turn"`` (see the module docstring).
        seed: Seeds each epoch's order of the examples (``SeedSequence(seed, epoch)``): 0, ``agents
            train``'s default seed.
        checkpoint_every: A checkpoint every N steps and after the last; ``None``: after the last
            only (each is the model and its AdamW state: 1.6 GB for the embedded model).
        report_to: Reporters besides ``metrics.jsonl``, as ``agents train``'s ``trainer.report_to``.
        device: Where the model trains; ``None``: CUDA if present, else the CPU (the trainer's default).
    """

    epochs: int = 2
    lr: float = 1e-5
    batch_size: int = 8
    micro_batch_size: int = 4
    max_tokens: int = DEFAULT_MAX_PROMPT_TOKENS + DEFAULT_MAX_RESPONSE_TOKENS
    min_reward: float | None = None
    observations: Literal["inline", "turn"] = "inline"
    seed: int = 0
    checkpoint_every: int | None = None
    report_to: Sequence[str] = ("tensorboard",)
    device: str | None = None

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "micro_batch_size", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SFTConfig.{name} must be an int >= 1, got {value!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"SFTConfig.lr must be a finite number > 0, got {self.lr!r}")
        if self.checkpoint_every is not None and (
            isinstance(self.checkpoint_every, bool)
            or not isinstance(self.checkpoint_every, int)
            or self.checkpoint_every < 1
        ):
            raise ValueError(f"SFTConfig.checkpoint_every must be an int >= 1 or None, got {self.checkpoint_every!r}")
        if self.min_reward is not None and not (
            isinstance(self.min_reward, numbers.Real) and math.isfinite(self.min_reward)
        ):
            raise ValueError(f"SFTConfig.min_reward must be a finite number or None, got {self.min_reward!r}")
        if self.observations not in ("inline", "turn"):
            raise ValueError(f"SFTConfig.observations must be 'inline' or 'turn', got {self.observations!r}")

    def to_dict(self) -> dict[str, Any]:
        """The settings as JSON-ready values."""
        return {**dataclasses.asdict(self), "report_to": list(self.report_to)}


class SFTDataError(ValueError):
    """A line of an SFT data file that is no example: the message names the file, the line, what is wrong
    and what is expected."""


class SFTTurn(NamedTuple):
    """One turn of an example: the context tokens before the action, and the action's tokens."""

    obs_ids: list[int]
    action_ids: list[int]
    sampler_logprobs: list[float]  # where the record has them; 0.0 otherwise


@dataclass
class SFTExample:
    """One training example: the prompt, then each turn's observation and action tokens.

    Attributes:
        prompt_ids: The context before the first action (chat template applied).
        turns: The turns, first to last; only their ``action_ids`` are trained on.
        reward: The record's reward (``None``: it has none).
        kind: ``"trajectory"`` or ``"chat"``.
        line: The record's line in its file (1-based; 0 when made in code).
    """

    prompt_ids: list[int]
    turns: list[SFTTurn]
    reward: float | None = None
    kind: str = "chat"
    line: int = 0

    @property
    def ids(self) -> list[int]:
        """Every token: the prompt, then each turn's observation and action."""
        ids = list(self.prompt_ids)
        for turn in self.turns:
            ids += turn.obs_ids + turn.action_ids
        return ids

    @property
    def mask(self) -> list[int]:
        """1 on action tokens (trained on), 0 elsewhere; aligned with :attr:`ids`."""
        mask = [0] * len(self.prompt_ids)
        for turn in self.turns:
            mask += [0] * len(turn.obs_ids) + [1] * len(turn.action_ids)
        return mask

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + sum(len(turn.obs_ids) + len(turn.action_ids) for turn in self.turns)

    @property
    def num_action_tokens(self) -> int:
        return sum(len(turn.action_ids) for turn in self.turns)


def training_path(example: SFTExample) -> TrainingPath:
    """The example as the trainer's :class:`~agents.rollout.tree.TrainingPath`: a one-leaf rollout tree.

    Every action token gets advantage 1 (imitation), which the ``sft`` loss ignores; the leaf's reward
    is the example's (0 without one), reported as ``reward/*``.
    """
    if not example.turns:
        raise ValueError("an example needs at least one action token to train on")
    tree = RolloutTree(example.prompt_ids)
    node = tree.root
    for position, turn in enumerate(example.turns):
        last = position == len(example.turns) - 1
        node = tree.add_turn(
            node,
            obs_ids=turn.obs_ids,
            action_ids=turn.action_ids,
            sampler_logprobs=turn.sampler_logprobs,
            terminal=last,
            reward=(example.reward or 0.0) if last else None,
        )
    node.advantage = 1.0
    return tree.paths(advantage="leaf")[0]


# -- reading the data -------------------------------------------------------------------------


@dataclass
class SFTData:
    """The examples of a data file and what became of its records.

    Attributes:
        path: The file.
        examples: The examples kept, in file order.
        read: Records read (non-blank lines).
        trajectories: Trajectory records among them.
        chats: Chat records among them.
        below_min_reward: Records dropped for a reward below ``min_reward``.
        without_actions: Trajectories dropped for having no action token (an episode that failed
            before its first turn).
        too_long: Records dropped for more than ``max_tokens`` tokens.
        best_reward: The highest reward of any record read (``None``: no record has one).
        min_reward: The filter applied; max_tokens: the length limit applied.
    """

    path: Path
    examples: list[SFTExample] = field(default_factory=list)
    read: int = 0
    trajectories: int = 0
    chats: int = 0
    below_min_reward: int = 0
    without_actions: int = 0
    too_long: int = 0
    best_reward: float | None = None
    min_reward: float | None = None
    max_tokens: int | None = None

    @property
    def dropped(self) -> int:
        return self.below_min_reward + self.without_actions + self.too_long

    def counts(self) -> dict[str, Any]:
        """The counts as JSON-ready values (written to the run folder's ``sft.json``)."""
        return {
            "read": self.read,
            "trajectories": self.trajectories,
            "chats": self.chats,
            "kept": len(self.examples),
            "below_min_reward": self.below_min_reward,
            "without_actions": self.without_actions,
            "too_long": self.too_long,
            "best_reward": self.best_reward,
            "action_tokens": sum(example.num_action_tokens for example in self.examples),
            "tokens": sum(example.num_tokens for example in self.examples),
        }

    def summary(self) -> str:
        """One line: records read, kept, and why the others were dropped."""
        reasons = [] if self.min_reward is None else [f"{self.below_min_reward} below --min-reward {self.min_reward:g}"]
        reasons.append(f"{self.without_actions} without action tokens")
        if self.max_tokens is not None:
            reasons.append(f"{self.too_long} longer than --max-tokens {self.max_tokens}")
        best = "none" if self.best_reward is None else f"{self.best_reward:g}"
        tokens = sum(example.num_action_tokens for example in self.examples)
        return (
            f"{self.path}: read {_count(self.read, 'record')} ({_count(self.trajectories, 'trajectory')}, "
            f"{_count(self.chats, 'chat')}); kept {len(self.examples)} ({tokens} action tokens), dropped "
            f"{self.dropped} ({', '.join(reasons)}); best reward {best}"
        )


def load_sft_data(
    path: str | Path,
    tokenizer: Any = None,
    *,
    min_reward: float | None = None,
    max_tokens: int | None = None,
    observations: Literal["inline", "turn"] = "inline",
) -> SFTData:
    """Read the examples of a JSONL file of trajectories and chats (see the module docstring).

    ``tokenizer`` tokenises chats (trajectories carry their ids). A line that is no example raises
    :class:`SFTDataError` naming the file and line; so does a file from which nothing is left after
    filtering, with how many records were read and the best reward among them.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such file; --data takes a JSONL file of trajectories (agents eval --save-trajectories) "
            'or chats ({"messages": [...]})'
        )
    data = SFTData(path, min_reward=min_reward, max_tokens=max_tokens)
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            data.read += 1
            where = f"{path} line {number}"
            try:
                record = json.loads(line.rstrip())
            except json.JSONDecodeError as error:
                raise SFTDataError(f"{where}: not JSON ({error.msg} at column {error.colno}); {_EXPECTED}") from None
            example = record_example(record, tokenizer, where=where, observations=observations)
            example.line = number
            if example.kind == "chat":
                data.chats += 1
            else:
                data.trajectories += 1
            if example.reward is not None:
                data.best_reward = example.reward if data.best_reward is None else max(data.best_reward, example.reward)
            if min_reward is not None and example.reward is not None and example.reward < min_reward:
                data.below_min_reward += 1
            elif not example.turns:
                data.without_actions += 1
            elif max_tokens is not None and example.num_tokens > max_tokens:
                data.too_long += 1
            else:
                data.examples.append(example)
    if not data.examples:
        raise SFTDataError(_nothing_left(data))
    return data


def _nothing_left(data: SFTData) -> str:
    if not data.read:
        return f"{data.path} holds no record (every line is blank); {_EXPECTED}"
    best = "no record has a reward" if data.best_reward is None else f"the best reward seen is {data.best_reward:g}"
    reasons = []
    if data.below_min_reward:
        reasons.append(f"{data.below_min_reward} below --min-reward {data.min_reward:g}")
    if data.without_actions:
        reasons.append(f"{data.without_actions} without action tokens")
    if data.too_long:
        reasons.append(f"{data.too_long} longer than --max-tokens {data.max_tokens}")
    return f"{data.path}: no example left to train on: read {_count(data.read, 'record')}, dropped {', '.join(reasons)}; {best}"


def _count(number: int, noun: str) -> str:
    """``1 record``, ``2 records``, ``2 trajectories``."""
    if number == 1:
        return f"1 {noun}"
    return f"{number} {noun[:-1] + 'ies' if noun.endswith('y') else noun + 's'}"


def record_example(
    record: Any, tokenizer: Any = None, *, where: str = "record", observations: Literal["inline", "turn"] = "inline"
) -> SFTExample:
    """The example of one parsed JSONL record: a chat (``messages``) or a trajectory (``ids``, ``mask``, ``turns``)."""
    if not isinstance(record, dict):
        raise SFTDataError(f"{where}: a JSON {_json_type(record)}, not an object; {_EXPECTED}")
    if "messages" in record:
        if tokenizer is None:
            raise SFTDataError(f"{where}: a chat record needs a tokenizer to be tokenised")
        reward = _reward(record, where)
        return chat_example(record["messages"], tokenizer, observations=observations, reward=reward, where=where)
    if any(name in record for name in _TRAJECTORY_FIELDS):
        return trajectory_example(record, where=where)
    raise SFTDataError(
        f"{where}: no 'messages' list and no trajectory fields ({', '.join(repr(n) for n in _TRAJECTORY_FIELDS)}); "
        f"{_EXPECTED}"
    )


def trajectory_example(record: Mapping[str, Any], *, where: str = "record") -> SFTExample:
    """The example of a trajectory record (:meth:`agents.rollout.Trajectory.to_dict`): its exact ids.

    The actions are the tokens where ``mask`` is 1, one turn per ``turns[k]["action_span"]`` when the
    record has them (else per run of 1s); the saved ``logprobs`` are kept (0 where null). Tokens
    after the last action (a final observation) are dropped: they are trained on by no loss and
    change no log-prob before them.
    """
    for name in ("ids", "mask"):
        if name not in record:
            raise SFTDataError(
                f"{where}: a trajectory record needs 'ids' and 'mask' (lists of one length, mask 1 on action "
                f"tokens) and has no {name!r}; {_EXPECTED}"
            )
    ids, mask = record["ids"], record["mask"]
    if not isinstance(ids, list) or not all(_is_token_id(value) for value in ids):
        raise SFTDataError(f"{where}: 'ids' must be a list of token ids (ints >= 0), got {_short(ids)}")
    if not isinstance(mask, list) or len(mask) != len(ids) or any(value not in (0, 1) for value in mask):
        raise SFTDataError(
            f"{where}: 'mask' must be a list of 0s and 1s as long as 'ids' ({len(ids)}), got {_short(mask)}"
        )
    # Trajectories saved before the sampler's log-probs kept one name from the engine to the loss hold "logprobs".
    key = "sampler_logprobs" if "sampler_logprobs" in record else "logprobs"
    logprobs = _trajectory_logprobs(record.get(key), key, len(ids), where)
    spans = _action_spans(record.get("turns"), mask, where)
    if spans and spans[0][0] == 0:
        raise SFTDataError(f"{where}: the trajectory starts with an action token; a path needs a prompt before it")
    prompt_end = spans[0][0] if spans else len(ids)
    turns, previous = [], prompt_end
    for start, end in spans:
        turns.append(SFTTurn(ids[previous:start], ids[start:end], logprobs[start:end]))
        previous = end
    return SFTExample(ids[:prompt_end], turns, _reward(record, where), "trajectory")


def _action_spans(turns: Any, mask: list[int], where: str) -> list[tuple[int, int]]:
    """The actions' ``(start, end)``: the record's ``action_span``s when it has them (checked against
    the mask), else the runs of 1s of the mask."""
    runs, start = [], None
    for index, value in enumerate([*mask, 0]):
        if value and start is None:
            start = index
        elif not value and start is not None:
            runs.append((start, index))
            start = None
    if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) and "action_span" in t for t in turns):
        return runs
    spans = []
    for k, turn in enumerate(turns):
        span = turn["action_span"]
        if not (isinstance(span, list) and len(span) == 2 and all(_is_token_id(v) for v in span)):
            raise SFTDataError(f"{where}: turns[{k}].action_span must be [start, end], got {_short(span)}")
        if span[1] > span[0]:
            spans.append((int(span[0]), int(span[1])))
    covered = [0] * len(mask)
    for start, end in spans:
        covered[start:end] = [1] * (end - start)
    if covered != mask or any(end > len(mask) for _, end in spans) or spans != sorted(spans):
        raise SFTDataError(
            f"{where}: the turns' action_span do not cover exactly the tokens where 'mask' is 1; "
            "a record of agents eval --save-trajectories has them agree (was it edited?)"
        )
    return spans


def _trajectory_logprobs(values: Any, key: str, length: int, where: str) -> list[float]:
    if values is None:
        return [0.0] * length
    if not isinstance(values, list) or len(values) != length:
        raise SFTDataError(f"{where}: {key!r} must be a list as long as 'ids' ({length}) or null")
    logprobs = []
    for value in values:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
        logprobs.append(min(float(value), 0.0) if ok else 0.0)
    return logprobs


def chat_example(
    messages: Any,
    tokenizer: Any,
    *,
    observations: Literal["inline", "turn"] = "inline",
    reward: float | None = None,
    where: str = "chat",
) -> SFTExample:
    """The example of a chat: the messages before the first assistant one as the prompt, then actions
    (assistant messages, trained on) and observations (tool messages), laid out as
    :class:`~agentenv.wrappers.TokenEnv` lays out an episode (``observations``: see the module docstring)."""
    _check_messages(messages, where)
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        raise SFTDataError(
            f"{where}: no assistant message, so nothing to train on; a chat needs at least one message with "
            "role 'assistant' after the prompt"
        )
    if first == 0:
        raise SFTDataError(
            f"{where}: the chat starts with an assistant message; it needs a prompt (a system or user message) first"
        )
    if getattr(tokenizer, "chat_template", None) is None:
        raise SFTDataError(f"{where}: the tokenizer has no chat template, which chat records need")
    layout = ChatLayout(tokenizer)  # the template's text and its ids, as TokenEnv renders and encodes them
    if observations == "inline":
        return _inline_chat(messages, first, layout, reward, where)
    return _turn_chat(messages, layout, reward, where)


def _inline_chat(
    messages: list[dict[str, str]], first: int, layout: ChatLayout, reward: float | None, where: str
) -> SFTExample:
    """TokenEnv's ``observations="inline"``: one assistant turn, tool results inside it as ``<result>`` blocks."""
    for index, message in enumerate(messages[:first]):
        if message["role"] not in ("system", "user"):
            raise SFTDataError(
                f"{where}: messages[{index}] is a {message['role']!r} message before the first assistant one; "
                "the prompt is the system and user messages"
            )
    prompt_ids = layout.encode(_render(layout, messages[:first], True, where))
    turns: list[SFTTurn] = []
    obs: list[int] = []
    for index, message in enumerate(messages[first:], start=first):
        if message["role"] == "assistant":
            action = layout.encode(message["content"])
            if action:
                turns.append(SFTTurn(obs, action, [0.0] * len(action)))
                obs = []
        elif message["role"] == "tool":
            obs = obs + layout.observation_ids(message["content"], turns[-1].action_ids if turns else [])
        else:
            raise SFTDataError(
                f"{where}: messages[{index}] is a {message['role']!r} message after the first assistant one; with "
                "observations 'inline' (tool results inside the assistant turn, as the environments give them) only "
                "assistant and tool messages may follow it; lay out chats of several user turns with "
                "observations 'turn'"
            )
    eos = getattr(layout.tokenizer, "eos_token_id", None)
    if turns and messages[-1]["role"] == "assistant" and eos is not None:
        # The episode's last action ends where the model stops it, with its end-of-sequence token,
        # as sampled episodes do: trained on, so that the model learns to stop after its answer.
        last = turns[-1]
        turns[-1] = SFTTurn(last.obs_ids, [*last.action_ids, eos], [*last.sampler_logprobs, 0.0])
    return SFTExample(prompt_ids, turns, reward, "chat")


def _turn_chat(messages: list[dict[str, str]], layout: ChatLayout, reward: float | None, where: str) -> SFTExample:
    """TokenEnv's ``observations="turn"``: every message a turn of the chat template.

    The text of the whole chat is cut where each assistant message starts (after the template's
    generation prompt) and where its action ends: its content and the end-of-turn special token
    right after it. The text between two actions (the template's delimiters, tool and user turns,
    the next generation prompt) is one observation, tokenised alone as TokenEnv tokenises one.
    A chat may hold user turns between actions, which an episode's fixed observation role cannot,
    so the cuts are made in the rendered chat rather than with the layout's turn delimiters.
    """
    full = _render(layout, messages, False, where)
    specials = sorted(getattr(layout.tokenizer, "all_special_tokens", ()), key=len, reverse=True)
    pieces: list[tuple[str, str]] = []  # (context text, action text)
    cursor = 0
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(layout, messages[:index], True, where)
        upto = _render(layout, messages[: index + 1], False, where)
        if not (full.startswith(upto) and upto.startswith(before) and len(before) >= cursor):
            raise SFTDataError(
                f"{where}: the chat template renders messages[{index}] differently once later messages follow "
                "(it rewrites earlier turns), so the assistant's tokens cannot be found; use observations 'inline'"
            )
        segment = upto[len(before) :]
        at = segment.find(message["content"])
        if at < 0:
            raise SFTDataError(
                f"{where}: the chat template changes the content of messages[{index}] (an assistant message), so "
                "its tokens cannot be found in the rendered chat; use observations 'inline'"
            )
        end = at + len(message["content"])
        closing = next((token for token in specials if token and segment.startswith(token, end)), "")
        end += len(closing)  # the end-of-turn token is sampled (the model's stop), so it is trained on
        pieces.append((full[cursor : len(before)], segment[:end]))
        cursor = len(before) + end
    (prompt_text, _), *_ = pieces
    prompt_ids = layout.encode(prompt_text)
    turns: list[SFTTurn] = []
    obs: list[int] = []
    for position, (context, action_text) in enumerate(pieces):
        if position:
            obs = obs + layout.encode(context)
        action = layout.encode(action_text)
        if action:
            turns.append(SFTTurn(obs, action, [0.0] * len(action)))
            obs = []
    return SFTExample(prompt_ids, turns, reward, "chat")


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise SFTDataError(
            f'{where}: \'messages\' must be a non-empty list of {{"role": ..., "content": ...}} objects, '
            f"got {_short(messages)}"
        )
    for index, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise SFTDataError(
                f"{where}: messages[{index}] must be an object with a 'role' ({', '.join(ROLES)}) and a string "
                f"'content', got {_short(message)}"
            )


def _render(layout: ChatLayout, messages: list[dict[str, str]], add_generation_prompt: bool, where: str) -> str:
    """The chat template's text (:meth:`ChatLayout.render`), its errors naming the record."""
    try:
        return layout.render(messages, add_generation_prompt)
    except Exception as error:  # jinja raises its own types, and templates raise what they like
        raise SFTDataError(f"{where}: the chat template cannot render these messages ({error})") from None


def _reward(record: Mapping[str, Any], where: str) -> float | None:
    value = record.get("reward")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise SFTDataError(f"{where}: 'reward' must be a finite number or null, got {_short(value)}")
    return float(value)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _json_type(value: Any) -> str:
    names = {list: "list", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _short(value: Any, width: int = 60) -> str:
    text = json.dumps(value) if _jsonable(value) else repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# -- training ---------------------------------------------------------------------------------


@dataclass
class SFTResult:
    """What a finished :func:`sft` call leaves behind.

    Attributes:
        out_dir: The run folder.
        data: The examples and the counts of what was dropped.
        steps: Steps (optimiser updates) trained.
        checkpoint: The last checkpoint written.
        history: The trainer's metric records, one per step.
        heldout: The held-out evaluations (``heldout=``): before the first step (step 0) and after the last.
    """

    out_dir: Path
    data: SFTData
    steps: int
    checkpoint: Path
    history: list[dict[str, float]] = field(default_factory=list)
    heldout: list[HeldOut] = field(default_factory=list)

    @property
    def model_dir(self) -> Path:
        """The fine-tuned model: ``--model`` of ``agents eval`` and ``agents train``."""
        return self.checkpoint / "model"


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The order of ``count`` examples in ``epoch`` (0-based): a permutation drawn from ``(seed, epoch)``."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(epoch,)))
    return [int(i) for i in rng.permutation(count)]


async def sft(
    data: str | Path,
    model: Any,
    out_dir: str | Path,
    config: SFTConfig | None = None,
    *,
    tokenizer: Any = None,
    heldout: TrainConfig | None = None,
    progress: bool | None = None,
    log: Callable[[str], None] = note,
) -> SFTResult:
    """Fine-tune ``model`` on the examples of ``data`` and write the run to ``out_dir``.

    Args:
        data: A JSONL file of trajectories and chats (:func:`load_sft_data`).
        model: A model name, local folder or Hugging Face id (:func:`agents.models.load_model`), or a
            transformers causal LM with float32 parameters (then pass ``tokenizer``).
        out_dir: The run folder; one that holds a checkpoint or a trained step of a run is refused.
        config: The settings (:class:`SFTConfig`).
        tokenizer: The model's tokenizer; loaded by name when ``model`` is a name.
        heldout: The RL run this cold start is for: its held-out questions are scored before the
            first step and after the last, exactly as ``agents train`` with this config scores them
            (its env and options, first ``eval_questions`` tasks, greedy within its limits), into
            ``heldout/metrics.jsonl`` and ``heldout.png``; ``None`` (or ``eval_questions=0``): none.
        progress: The ``train`` bar of the steps and the update bars (:mod:`agents.progress`): ``False``
            none, ``True`` or ``None`` bars on a terminal and lines every 30 s elsewhere.
        log: Where one-line notes go (the data's counts, each step, checkpoints; default stdout).
    """
    config = config or SFTConfig()
    out = Path(out_dir)
    _check_run_folder(out)
    if tokenizer is None:
        if not isinstance(model, str):
            raise ValueError("sft(model=...) with a model object needs its tokenizer (tokenizer=...)")
        tokenizer = load_tokenizer(model)
    dataset = load_sft_data(
        data,
        tokenizer,
        min_reward=config.min_reward,
        max_tokens=config.max_tokens,
        observations=config.observations,
    )
    log(dataset.summary())
    paths = [training_path(example) for example in dataset.examples]
    per_epoch = -(-len(paths) // config.batch_size)
    steps = config.epochs * per_epoch
    trainer = _sft_trainer(model, tokenizer, out, config, steps, progress)
    cleanup = contextlib.AsyncExitStack()  # the held-out engine and log, closed before the trainer
    try:
        _check_vocabulary(dataset, trainer.base_model)
        name = model if isinstance(model, str) else type(model).__name__
        _write_run_record(out, dataset, name, config)
        title = f"sft · {dataset.path.name} · {name} ({out})"
        log(
            f"training on {len(paths)} examples: {config.epochs} epochs of {per_epoch} steps of up to "
            f"{config.batch_size} examples, lr {config.lr:g}"
        )
        evaluation = None
        if heldout is not None and heldout.eval_questions:
            evaluation = _heldout_evaluation(heldout, trainer, out, config, progress, log, title, cleanup)
            await evaluation.run(0)
        checkpoint = await _train_epochs(trainer, paths, steps, config, log, title)
        if evaluation is not None:
            await evaluation.run(trainer.step_count)
        history = list(trainer.metrics.history) if trainer.metrics is not None else []
        results = list(evaluation.log.results) if evaluation is not None else []
        return SFTResult(out, dataset, trainer.step_count, checkpoint, history, results)
    finally:
        await cleanup.aclose()
        trainer.close()


def _sft_trainer(
    model: Any, tokenizer: Any, out: Path, config: SFTConfig, steps: int, progress: bool | None
) -> Trainer:
    """The trainer of ``agents train`` with the ``sft`` loss: one AdamW update a step, no KL, no entropy bonus."""
    from agents.training.trainer import Trainer, TrainerConfig

    trainer_config = TrainerConfig(
        loss="sft",
        lr=config.lr,
        kl_coef=0.0,
        entropy_coef=0.0,
        mini_batches=1,
        micro_batch_size=config.micro_batch_size,
        old_logprobs="sampler",  # the sft loss ignores π_old: no forward pass to recompute it
        total_steps=steps,
        report_to=config.report_to,
        device=config.device,
        progress=progress,
    )
    return Trainer(model, trainer_config, tokenizer=tokenizer, out_dir=out)


def _write_run_record(out: Path, dataset: SFTData, model_name: str, config: SFTConfig) -> None:
    """The run folder, with its :data:`SFT_FILE`: the data, the model, the settings and the records' counts."""
    out.mkdir(parents=True, exist_ok=True)  # only now: bad data or a missing model leave no folder behind
    record = {"data": str(dataset.path), "model": model_name, "config": config.to_dict(), "records": dataset.counts()}
    (out / SFT_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


async def _train_epochs(
    trainer: Trainer,
    paths: Sequence[TrainingPath],
    steps: int,
    config: SFTConfig,
    log: Callable[[str], None],
    title: str,
) -> Path:
    """The ``steps`` steps of every epoch (see the module docstring), a note a step; returns the last checkpoint."""
    trainer.open_steps_bar()
    checkpoint: Path | None = None
    for epoch in range(config.epochs):
        order = epoch_order(len(paths), config.seed, epoch)
        for start in range(0, len(order), config.batch_size):
            batch = [paths[i] for i in order[start : start + config.batch_size]]
            record = await trainer.step(batch, {"sft/epoch": float(epoch + 1)})
            step = trainer.step_count
            log(_step_note(step, steps, epoch + 1, config.epochs, record))
            if step == steps or (config.checkpoint_every and step % config.checkpoint_every == 0):
                position = {"epoch": epoch, "offset": start + len(batch)}
                checkpoint = trainer.save_checkpoint(data_position=position, plot_title=title)
                log(f"step {step}: checkpoint {checkpoint}")
    assert checkpoint is not None  # the last step always writes one
    return checkpoint


def _heldout_evaluation(
    run: TrainConfig,
    trainer: Trainer,
    out: Path,
    config: SFTConfig,
    progress: bool | None,
    log: Callable[[str], None],
    title: str,
    cleanup: contextlib.AsyncExitStack,
) -> HeldOutEvaluation:
    """The RL run's held-out evaluation, on an engine that shares the trainer's model (no weight sync)."""
    from agents.engines.hf import HFEngine

    tree = build(run).tree
    engine = HFEngine(trainer.model, trainer.tokenizer, max_batch_size=tree.rollout.concurrency, seed=run.seed)
    cleanup.push_async_callback(engine.close)
    heldout = HeldOutLog(out, report_to=config.report_to)
    cleanup.callback(heldout.close)

    async def evaluate(request: dict[str, Any]) -> HeldOut:
        return await evaluate_heldout(engine, trainer.tokenizer, **request)

    return HeldOutEvaluation(run, tree, evaluate, heldout, progress, log, title)


def _step_note(step: int, steps: int, epoch: int, epochs: int, record: Mapping[str, float]) -> str:
    """One line about a finished step: its loss, its tokens and its time."""
    return (
        f"step {step}/{steps} (epoch {epoch}/{epochs}): loss {record['policy/loss']:.4f} (NLL per action token) "
        f"over {record['batch/sequences']:.0f} examples; {record['tokens/action']:.0f} action tokens of "
        f"{record['tokens/trained']:.0f}; {record['time/step_s']:.1f} s (update {record['time/update_s']:.1f})"
    )


def _check_run_folder(out: Path) -> None:
    """Refuse a folder that holds a run (a checkpoint, trained steps, or ``agents train``'s configuration)."""
    found = sorted((out / "checkpoints").glob("step_*")) if (out / "checkpoints").is_dir() else []
    if found:
        raise FileExistsError(
            f"{out} already holds a run (its newest checkpoint is {found[-1].name}); choose another --out"
        )
    metrics = out / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        raise FileExistsError(f"{out} already holds the metrics of a run; choose another --out")
    if (out / "config.json").is_file():
        raise FileExistsError(f"{out} holds the config.json of an agents train run; choose another --out")


def _check_vocabulary(data: SFTData, model: Any) -> None:
    """Every token id of the examples is one of the model's (trajectories carry the ids of the model that wrote them)."""
    embeddings = model.get_input_embeddings()
    size = int(getattr(embeddings, "num_embeddings", 0) or model.config.vocab_size)
    for example in data.examples:
        largest = max(example.ids)
        if largest >= size:
            raise SFTDataError(
                f"{data.path} line {example.line}: token id {largest} is outside the model's vocabulary of {size}; "
                "the trajectories were written with another model's tokenizer"
            )
