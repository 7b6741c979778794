"""TokenEnv: the token-in-token-out view of a text environment.

The episode is one token sequence, exactly::

    prompt_ids + action_ids_1 + obs_ids_1 + action_ids_2 + obs_ids_2 + … + action_ids_n

Action ids are taken as the sampler returned them and never re-encoded (decoding then encoding
a model's output does not give back its ids: the trainer would compute log-probs of tokens the
model never sampled). Only the new observation segment is tokenised, wrapped either

- ``observations="inline"``: inside the assistant turn, as the papers do: ``\\n<result>\\n…\\n</result>\\n``;
- ``observations="turn"``: as a chat turn of ``observation_role`` with the chat template's own
  delimiters (end of the assistant turn, the observation turn, the start of the next assistant
  turn), derived once from the template.

``info`` of each step gives the spans of the action and the observation in the sequence;
:meth:`TokenEnv.sequence` gives the whole sequence and its action mask. :class:`ChatLayout` is
that layout on its own (``TokenEnv.layout``): ``agents sft`` lays out written chats with it, so a
chat trains on the ids an episode of the same turns would have.

Tokenising a long text (a prompt, three retrieved passages) takes ~0.5 ms, more than the rest
of a turn's bookkeeping; :meth:`TokenEnv.areset` and :meth:`TokenEnv.astep` do it in a worker
thread, off the event loop, where the tokenizer is a Rust (``tokenizers``) one, which releases
the GIL while it works.

``TokenEnv`` is a wrapper as Gymnasium's are: ``env`` is the wrapped environment, ``unwrapped``
the innermost one, and a public attribute it does not define itself is read from ``env``;
``token_env.tasks`` is the innermost environment's task list (:attr:`agentenv.Env.tasks`).
"""

from __future__ import annotations

import asyncio
import copy
import functools
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import gymnasium

from agentenv.core import Env, run_sync

__all__ = ["ChatLayout", "TokenEnv", "inline_observation", "skip_special_decoder"]

_ACTION, _OBSERVATION = "AGENTENV-ACTION-SENTINEL", "AGENTENV-OBSERVATION-SENTINEL"


def inline_observation(observation: str) -> str:
    """The text of an observation with ``observations="inline"``: a ``<result>`` block inside the assistant turn."""
    return f"\n<result>\n{observation}\n</result>\n"


#: Texts shorter than this are tokenised on the event loop: the hop to a thread and back costs
#: the loop ~50 µs, about what tokenising 256 characters does.
OFF_LOOP_MIN_CHARS = 256


def skip_special_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, as a function of a list of ints.

    transformers' decode of a fast tokenizer is the Rust decode plus, where configured, a
    clean-up of spaces; without the clean-up the Rust decode alone gives the same text and skips
    a Python check of every id (~40 µs for a turn of 200 tokens).
    """
    from tokenizers import Tokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer) and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return functools.partial(backend.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


class _OffLoopEncoder:
    """Tokenises in worker threads, each with its own copy of the Rust tokenizer.

    Why copies: transformers' ``encode`` reconfigures truncation on the shared Rust object, and
    PyO3 refuses that while another thread's encode borrows it ("Already borrowed"); a copy per
    thread is never shared. Its ``encode_batch_fast`` is ``encode_batch`` (what transformers' fast
    ``encode`` calls) without the offsets, so the ids are the same (tested).
    """

    _pool: ThreadPoolExecutor | None = None
    _pool_lock = threading.Lock()
    _of_tokenizer: weakref.WeakKeyDictionary[Any, _OffLoopEncoder] = weakref.WeakKeyDictionary()

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self._serialized: str | None = None  # made on first use: serialising takes ~0.1 s
        self._local = threading.local()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> _OffLoopEncoder | None:
        """The encoder of a fast tokenizer that adds nothing of its own to ``encode``; else ``None``."""
        from tokenizers import Tokenizer

        backend = getattr(tokenizer, "backend_tokenizer", None)
        if not isinstance(backend, Tokenizer) or getattr(tokenizer, "split_special_tokens", False):
            return None
        with cls._pool_lock:  # one a tokenizer, so the copies are made once however many envs use it
            if tokenizer not in cls._of_tokenizer:
                cls._of_tokenizer[tokenizer] = cls(backend)
            return cls._of_tokenizer[tokenizer]

    def _encode(self, text: str) -> list[int]:
        backend = getattr(self._local, "backend", None)
        if backend is None:
            from tokenizers import Tokenizer

            with self._pool_lock:
                if self._serialized is None:
                    self._serialized = self._backend.to_str()
            backend = self._local.backend = Tokenizer.from_str(self._serialized)
        # encode_batch_fast skips the character offsets, which nothing here reads: ~30% less CPU for a
        # search result's passages, the same ids (tested against transformers' encode)
        return backend.encode_batch_fast([text], add_special_tokens=False)[0].ids

    async def encode(self, text: str) -> list[int]:
        if _OffLoopEncoder._pool is None:
            with _OffLoopEncoder._pool_lock:
                if _OffLoopEncoder._pool is None:  # one pool a process: threads are shared by all envs
                    workers = min(4, os.cpu_count() or 1)
                    _OffLoopEncoder._pool = ThreadPoolExecutor(workers, thread_name_prefix="agentenv-tokenize")
        return await asyncio.get_running_loop().run_in_executor(_OffLoopEncoder._pool, self._encode, text)


class ChatLayout:
    """How a chat becomes token ids: TokenEnv's episodes, and the chats ``agents sft`` trains on.

    - the prompt: the chat template's text of the messages before the first action, with its
      generation prompt, encoded alone (:meth:`prompt_ids`);
    - an action: the ids the model sampled, never re-encoded (a written chat's action is its
      content encoded, :meth:`encode`);
    - an observation: the text :meth:`observation_text` wraps it in, encoded alone, less the
      end-of-turn token when the action before it already closed its turn (:meth:`observation_ids`).

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template.
        chat_template: A Jinja chat template to use instead of the tokenizer's own.
        observations: ``"inline"`` (papers' ``<result>`` inside the assistant turn) or ``"turn"``.
        observation_role: The role of observation turns when ``observations="turn"``.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        observations: Literal["inline", "turn"] = "inline",
        observation_role: str = "user",
    ) -> None:
        if observations not in ("inline", "turn"):
            raise ValueError(f"observations must be 'inline' or 'turn', got {observations!r}")
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.observations = observations
        if observations == "turn":
            self._before_obs, self._after_obs = self._turn_delimiters(observation_role)
            self._end_of_turn = self.encode(self._before_obs)[:1]

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The chat template's text of ``messages``."""
        return str(
            self.tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, no special tokens added (the template's own are in the text)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def prompt_text(self, messages: list[dict[str, str]]) -> str:
        """The prompt's text: ``messages`` rendered with the template's generation prompt."""
        return self.render(messages, add_generation_prompt=True)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt's ids: :meth:`prompt_text`, encoded alone."""
        return self.encode(self.prompt_text(messages))

    def observation_text(self, observation: str) -> str:
        """An observation with its delimiters: a ``<result>`` block, or a chat turn of ``observation_role``."""
        if self.observations == "inline":
            return inline_observation(observation)
        return self._before_obs + observation + self._after_obs

    def observation_ids(self, observation: str, action_ids: Sequence[int]) -> list[int]:
        """The ids of the segment that follows an action: the observation with its delimiters."""
        return self.closed_once(self.encode(self.observation_text(observation)), action_ids)

    def closed_once(self, observation_ids: list[int], action_ids: Sequence[int]) -> list[int]:
        """``observation_ids`` less its end-of-turn token when the action already ended with it."""
        if self.observations == "inline":
            return observation_ids
        end_of_turn = self._end_of_turn[0] if self._end_of_turn else None
        closed = bool(action_ids) and action_ids[-1] == end_of_turn
        if closed and end_of_turn in set(getattr(self.tokenizer, "all_special_ids", ())):
            return observation_ids[1:]  # the model already closed its turn: do not close it twice
        return observation_ids

    def _turn_delimiters(self, role: str) -> tuple[str, str]:
        """The template's text between an assistant message and an observation, and after it."""
        messages = [
            {"role": "user", "content": "question"},
            {"role": "assistant", "content": _ACTION},
            {"role": role, "content": _OBSERVATION},
        ]
        try:
            text = self.render(messages, add_generation_prompt=True)
        except Exception as e:
            raise ValueError(
                f"the chat template cannot render a {role!r} turn ({e}); choose another observation_role (e.g. 'user')"
            ) from e
        if _ACTION not in text or _OBSERVATION not in text:
            raise ValueError("the chat template drops message contents; pass chat_template= explicitly")
        action_end = text.index(_ACTION) + len(_ACTION)
        obs_start = text.index(_OBSERVATION)
        return text[action_end:obs_start], text[obs_start + len(_OBSERVATION) :]


@dataclass(frozen=True, slots=True)
class _Segment:
    """A run of tokens that are all action or all non-action; linked to the one before (shared by forks)."""

    ids: tuple[int, ...]
    is_action: bool
    previous: _Segment | None
    end: int  # length of the whole sequence up to and including this segment


class TokenEnv:
    """Wrap an :class:`~agentenv.core.Env` so that it takes and returns token ids.

    It forwards what it documents: :attr:`tasks`, :attr:`spec`, :attr:`unwrapped` and :attr:`stop_strings`
    are the wrapped environment's. Anything else of ``env``'s is reached explicitly, as Gymnasium 1.x
    wrappers have it: ``token_env.get_wrapper_attr("max_tool_calls")`` (through any wrappers between)
    or ``token_env.unwrapped.max_tool_calls``. ``observation_space`` and ``action_space`` describe the
    wrapped env's text, not the token ids ``TokenEnv`` exchanges, so it has neither.

    Args:
        env: The text environment.
        tokenizer: A Hugging Face tokenizer with a chat template.
        chat_template: A Jinja chat template to use instead of the tokenizer's own.
        observations: ``"inline"`` (papers' ``<result>`` inside the assistant turn) or ``"turn"``.
        observation_role: The role of observation turns when ``observations="turn"``.
        system_prompt: A system message to put before the task, if any.
    """

    def __init__(
        self,
        env: Env,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        observations: Literal["inline", "turn"] = "inline",
        observation_role: str = "user",
        system_prompt: str | None = None,
    ) -> None:
        self.env = env
        #: How the episode's chat becomes token ids (the prompt and each observation).
        self.layout = ChatLayout(
            tokenizer, chat_template=chat_template, observations=observations, observation_role=observation_role
        )
        self.system_prompt = system_prompt
        self._last: _Segment | None = None
        self._off_loop = _OffLoopEncoder.for_tokenizer(tokenizer)
        self._decode = skip_special_decoder(tokenizer)

    @property
    def tokenizer(self) -> Any:
        """The Hugging Face tokenizer (the layout's)."""
        return self.layout.tokenizer

    @property
    def chat_template(self) -> str | None:
        """The chat template used instead of the tokenizer's own, if any (the layout's)."""
        return self.layout.chat_template

    @property
    def observations(self) -> Literal["inline", "turn"]:
        """``"inline"`` or ``"turn"`` (the layout's)."""
        return self.layout.observations

    # -- the wrapper protocol -------------------------------------------------------------------
    # Not a gymnasium.Wrapper subclass on purpose: that would make TokenEnv a gymnasium.Env whose
    # action_space/observation_space are (by default) the wrapped env's Text spaces while it takes
    # and returns token ids. The protocol (env, unwrapped, spec, *_wrapper_attr) is mirrored here,
    # and like Gymnasium 1.x's Wrapper it forwards no other attribute implicitly.

    @property
    def tasks(self) -> Sequence[Any] | None:
        """The wrapped environment's task list (:attr:`agentenv.Env.tasks`), or ``None`` where each reset
        draws its own task."""
        return self.unwrapped.tasks  # type: ignore[attr-defined]  # an agentenv.Env's

    @property
    def unwrapped(self) -> gymnasium.Env[Any, Any]:
        """The innermost environment, under this and any other wrappers."""
        return self.env.unwrapped

    @property
    def spec(self) -> gymnasium.envs.registration.EnvSpec | None:
        """The registry entry the wrapped environment was made from (``None`` if it was built directly)."""
        return self.env.spec

    def __getattr__(self, name: str) -> Any:
        # Called only when normal lookup fails: say how to reach the wrapped env's attribute, never forward it.
        env = self.__dict__.get("env")  # absent mid-copy or unpickling: never recurse through self.env
        has = env.has_wrapper_attr if isinstance(env, gymnasium.Env) else lambda n: hasattr(env, n)
        if name.startswith("__") or env is None or not has(name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        if name in ("observation_space", "action_space"):
            raise AttributeError(
                f"{type(self).__name__} has no {name}: it takes and returns token ids, not the "
                f"wrapped env's text (its text space is .env.{name})"
            )
        raise AttributeError(
            f"{type(self).__name__} does not forward {name!r} of its env ({type(env).__name__}): "
            f"use .get_wrapper_attr({name!r}) or .unwrapped.{name}"
        )

    # Gymnasium's lookups through a stack of wrappers: TokenEnv's own attributes first, then env's.
    def _has_own(self, name: str) -> bool:
        return name in self.__dict__ or hasattr(type(self), name)

    def has_wrapper_attr(self, name: str) -> bool:
        return self._has_own(name) or self.env.has_wrapper_attr(name)

    def get_wrapper_attr(self, name: str) -> Any:
        return getattr(self, name) if self._has_own(name) else self.env.get_wrapper_attr(name)

    def set_wrapper_attr(self, name: str, value: Any, *, force: bool = True) -> bool:
        if not self._has_own(name):
            if self.env.set_wrapper_attr(name, value, force=False):
                return True
            if not force:
                return False
        setattr(self, name, value)
        return True

    # -- tokenisation of what the environment says (never of what the model sampled) --------

    async def _aencode(self, text: str) -> list[int]:
        if self._off_loop is None or len(text) < OFF_LOOP_MIN_CHARS:
            return self.layout.encode(text)
        return await self._off_loop.encode(text)

    # -- the episode ------------------------------------------------------------------------

    def _append(self, ids: Sequence[int], is_action: bool) -> tuple[int, int]:
        start = self._last.end if self._last else 0
        self._last = _Segment(tuple(ids), is_action, self._last, start + len(ids))
        return start, self._last.end

    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[int], dict[str, Any]]:
        """Reset the episode; returns the prompt ids (chat template applied) and the env's info."""
        obs, info = await self.env.areset(seed=seed, options=options)
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        prompt_ids = await self._aencode(self.layout.prompt_text([*messages, {"role": "user", "content": obs}]))
        self._last = None
        info["prompt_span"] = self._append(prompt_ids, is_action=False)
        return prompt_ids, info

    async def astep(self, action_ids: Sequence[int]) -> tuple[list[int], float, bool, bool, dict[str, Any]]:
        """Apply the sampled action ids; returns the observation ids (empty once the episode is over)."""
        if self._last is None:
            raise RuntimeError("call reset() before step()")
        action_ids = list(map(int, action_ids))
        action_text = self._decode(action_ids)
        obs, reward, terminated, truncated, info = await self.env.astep(action_text)
        info["action_span"] = self._append(action_ids, is_action=True)
        obs_ids = (
            []
            if terminated or truncated
            else self.layout.closed_once(await self._aencode(self.layout.observation_text(obs)), action_ids)
        )
        info["obs_span"] = self._append(obs_ids, is_action=False)
        info["length"] = self._last.end
        return obs_ids, reward, terminated, truncated, info

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[int], dict[str, Any]]:
        """Sync form of :meth:`areset`."""
        return run_sync(self.areset(seed=seed, options=options))

    def step(self, action_ids: Sequence[int]) -> tuple[list[int], float, bool, bool, dict[str, Any]]:
        """Sync form of :meth:`astep`."""
        return run_sync(self.astep(action_ids))

    def sequence(self) -> tuple[list[int], list[int]]:
        """The whole episode's token ids and its mask (1 on action tokens)."""
        segments, seg = [], self._last
        while seg is not None:
            segments.append(seg)
            seg = seg.previous
        ids: list[int] = []
        mask: list[int] = []
        for seg in reversed(segments):
            ids.extend(seg.ids)
            mask.extend([int(seg.is_action)] * len(seg.ids))
        return ids, mask

    def __len__(self) -> int:
        return self._last.end if self._last else 0

    @property
    def stop_strings(self) -> list[str]:
        """Where generation of a turn must stop: the wrapped environment's, through any Gymnasium wrappers
        between (which forward no attribute themselves); none if it has none."""
        env = self.env
        if isinstance(env, gymnasium.Env):
            return list(env.get_wrapper_attr("stop_strings")) if env.has_wrapper_attr("stop_strings") else []
        return list(getattr(env, "stop_strings", []))

    def fork(self) -> TokenEnv:
        """An independent copy: the environment is forked, the token history shared (O(1))."""
        child = copy.copy(self)
        child.env = self.env.fork()
        return child

    def close(self) -> None:
        self.env.close()
