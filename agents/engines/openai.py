"""A client for OpenAI-compatible ``/v1/completions`` servers that take and return token ids.

The server must accept a prompt given as token ids and return the sampled token ids with their
log-probs, as ``vllm serve`` does (``return_token_ids``, ``return_tokens_as_token_ids`` and the
vLLM sampling extensions ``top_k`` and ``stop_token_ids``). Its log-probs follow the server's
convention; start ``vllm serve`` with ``--logprobs-mode processed_logprobs`` to get the same
numbers as the in-process engines (see :mod:`agents.engines.base`).

Requests time out after ``timeout_s``; connection errors, timeouts and HTTP 429/5xx answers are
retried ``max_retries`` times with exponential backoff; other HTTP errors fail at once with the
server's message.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import aiohttp

from agents.engines.base import Completion, Engine, FinishReason, SamplingParams, stop_overshoot
from agents.models import load_tokenizer

__all__ = ["OpenAIEngine", "ServerError"]

_RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class ServerError(RuntimeError):
    """The server answered with an error, or with a response that lacks what the engine needs."""


class OpenAIEngine(Engine):
    """An OpenAI-compatible completions server behind the :class:`Engine` interface.

    ``base_url`` is the server's root (``http://127.0.0.1:8000``; a trailing ``/v1`` is
    accepted); ``model`` the served model name, also used to load the tokenizer unless
    ``tokenizer`` (a name or an object) is given: the client needs it only to report the text
    beyond a stop string. ``max_connections`` caps concurrent HTTP requests.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        tokenizer=None,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_connections: int = 256,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {base_url!r}")
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0:
            raise ValueError("timeout_s must be > 0, max_retries and backoff_s >= 0")
        root = base_url.rstrip("/")
        self.url = (root if root.endswith("/v1") else root + "/v1") + "/completions"
        self.model = model
        self.tokenizer = load_tokenizer(tokenizer or model) if not hasattr(tokenizer, "decode") else tokenizer
        self.vocab_size = len(self.tokenizer)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_connections = max_connections
        # aiohttp sessions belong to one event loop; keep one per loop that uses the engine.
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        ids = self._check_request(prompt_ids, params, self.vocab_size)
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": ids,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stop": list(params.stop),
            "stop_token_ids": list(params.stop_token_ids),
            "logprobs": params.logprobs_topk,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "include_stop_str_in_output": True,
        }
        if params.top_k != -1:
            body["top_k"] = params.top_k
        if params.ignore_eos:  # a vLLM (and SGLang) extension, sent only when asked for
            body["ignore_eos"] = True
        if params.seed is not None:
            body["seed"] = params.seed
        return self._parse(await self._post(body), params)

    async def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        session = self._session()
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                async with session.post(self.url, json=body, headers=self.headers) as response:
                    text = await response.text()
                    if response.status == 200:
                        return _json(text, self.url)
                    message = text[:500]
                    if response.status not in _RETRIED_STATUSES or last:
                        raise ServerError(f"{self.url} answered HTTP {response.status}: {message}")
            except (TimeoutError, aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as error:
                if last:
                    raise ServerError(
                        f"{self.url} failed after {self.max_retries + 1} attempts: {type(error).__name__}: {error}"
                    ) from error
            await asyncio.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _parse(self, data: dict[str, Any], params: SamplingParams) -> Completion:
        try:
            choice = data["choices"][0]
        except (KeyError, IndexError, TypeError) as error:
            raise ServerError(f"{self.url} answered without choices: {str(data)[:300]}") from error
        token_ids = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if token_ids is None or logprobs is None:
            raise ServerError(
                f"{self.url} returned no token ids or log-probs; the server must support vLLM's "
                f"return_token_ids and logprobs on /v1/completions"
            )
        top_logprobs = None
        if params.logprobs_topk:
            top_logprobs = [
                sorted(((_token_id(key), value) for key, value in position.items()), key=lambda kv: -kv[1])[
                    : params.logprobs_topk
                ]
                for position in choice["logprobs"]["top_logprobs"]
            ]
        stop_reason = choice.get("stop_reason")
        reason: FinishReason
        if choice.get("finish_reason") == "length":
            reason, stop_reason = "length", None
        elif stop_reason is None:
            reason = "eos"
        else:
            reason = "stop"
        return Completion(
            token_ids=list(token_ids),
            logprobs=[float(lp) for lp in logprobs],
            finish_reason=reason,
            stop_reason=stop_reason,
            stop_overshoot=stop_overshoot(self.tokenizer, token_ids, stop_reason)
            if isinstance(stop_reason, str)
            else "",
            top_logprobs=top_logprobs,
        )

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            for other in [other for other in self._sessions if other.is_closed()]:
                del self._sessions[other]
            session = aiohttp.ClientSession(
                timeout=self.timeout, connector=aiohttp.TCPConnector(limit=self.max_connections)
            )
            self._sessions[loop] = session
        return session

    async def close(self) -> None:
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()


def _json(text: str, url: str) -> dict[str, Any]:
    try:
        return json.loads(text)
    except ValueError as error:
        raise ServerError(f"{url} answered with something that is not JSON: {text[:200]!r}") from error


def _token_id(key: str) -> int:
    """``"token_id:123"`` (vLLM's ``return_tokens_as_token_ids`` form) to ``123``."""
    prefix, _, number = key.partition(":")
    if prefix != "token_id" or not number.lstrip("-").isdigit():
        raise ServerError(f"top log-prob key {key!r} is not of the form 'token_id:N'")
    return int(number)
