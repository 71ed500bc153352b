"""Policy turns sampled by an inference server instead of rlstream's own engine.

A producer started with ``--policy openai:URL`` sends each turn to the server's
OpenAI-compatible completions endpoint (``POST URL/v1/completions``) with the whole
conversation as token ids, and reads back the ids of the tokens the server sampled and
their log-probabilities: nothing is detokenized and tokenized again, so a record holds
exactly what the server sampled. Batching is the server's (its continuous batching
serves every episode in flight); admission and staleness stay the producer's.

Weights reach the server through llama.cpp's router (``llama-server --models-dir DIR``):
each version the producer loads (full weights or adapters merged into their base) is
written as ``DIR/<namespace>-v<N>.gguf`` and loaded with ``POST /models/load``; turns then
name that model, and the version a token is recorded with is the one in the model name
the server answered with, never the one the producer asked for. Without a models folder
the server's model is version 0 for good (a producer so started refuses announced weights).

What comes back is checked before it reaches a record: token ids inside the vocabulary,
finite log-probabilities no greater than 0, no more tokens than asked for, the model that
was asked for. An unreachable server is waited for (``wait_s``), a turn the server dropped
or answered wrongly ends its episode with the reason, and the producer carries on with
the next episodes once the server answers again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.errors import InvalidConfigError
from pipeline.policy.config import ModelConfig, SamplingConfig
from pipeline.policy.llama_router import LlamaRouter, RemotePolicyError, cut, version_of
from pipeline.policy.turn import TurnResult, ends_turn

log = logging.getLogger(__name__)

PREFIX = "openai:"


def server_url(policy: str) -> str | None:
    """The base URL of ``openai:URL`` (None for the producer's own engine, ``local``);
    anything else is refused."""
    if policy == "local":
        return None
    if not policy.startswith(PREFIX):
        raise InvalidConfigError(f"policy {policy!r} is not local or openai:URL")
    url = policy[len(PREFIX) :].rstrip("/")
    if not re.fullmatch(r"https?://[^\s/]+(/[^\s]*)?", url):
        raise InvalidConfigError(
            f"policy {policy!r}: the server's address must be http(s)://HOST:PORT[/PATH]"
        )
    return url.removesuffix("/v1")


class RemotePolicy:
    """The producer's policy when an inference server samples: the same calls as
    :class:`~pipeline.policy.server.PolicyServer` (``generate``, ``release``, ``swap``,
    ``room``), each conversation's tokens kept here and sent whole every turn (the server
    reuses its cached prefix)."""

    shared_prompt_tokens = 0  # prompts are the server's to share

    def __init__(
        self,
        url: str,
        model: ModelConfig,
        sampling: SamplingConfig,
        stop_tokens: set[int],
        *,
        stop_sequences: tuple[tuple[int, ...], ...] = (),
        token_text: Callable[[int], str] | None = None,
        models_dir: Path | None = None,
        name_prefix: str = "rlstream",
        concurrency: int = 128,
        timeout_s: float = 300.0,
        wait_s: float = 60.0,
        load_timeout_s: float = 300.0,
    ) -> None:
        self.url = url
        self.model = model
        self.sampling = sampling
        self.stop_tokens = set(stop_tokens)
        self.stop_sequences = tuple(s for s in stop_sequences if s)
        #: the text of one token (special tokens as nothing), to find where llama.cpp
        #: left tokens out of its answer
        self.token_text = token_text
        self.router = (
            LlamaRouter(url, models_dir, model, name_prefix, load_timeout_s)
            if models_dir is not None
            else None
        )
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.wait_s = wait_s
        # ids past the tokenizer's vocabulary (padded rows of the output layer) are never
        # drawn, as in rlstream's engine: the same distribution, the same log-probabilities
        valid = model.output_vocab
        self._padding = (
            {str(i): -100.0 for i in range(valid, model.vocab_size)}
            if 0 < valid < model.vocab_size
            else {}
        )
        self._context: dict[int, list[int]] = {}
        #: the model turns name (None: the server's only model) and its version
        self._serving: tuple[str | None, int] = (None, 0)
        self._server_ctx: int | None = None
        self._session: Any = None
        self._unreachable_since: float | None = None
        #: turns answered, and turns that ended their episode, by reason
        self.turns = 0
        #: turns cut before a token the server reported no log-probability for
        self.cut_turns = 0
        self.failures: dict[str, int] = {}
        self.error: BaseException | None = None

    # ---- what episodes and the producer read ---------------------------------------------

    @property
    def version(self) -> int:
        return self._serving[1]

    @property
    def max_len(self) -> int:
        """Tokens one conversation may hold: the model's, or fewer where the server's
        context per sequence is smaller."""
        return min(int(self.model.max_len), self._server_ctx or self.model.max_len)

    @property
    def logprob_temperature(self) -> float:
        return self.sampling.logprob_temperature

    def room(self, slot: int) -> int:
        return self.max_len - len(self._context.get(slot, ()))

    def start(self) -> RemotePolicy:
        return self

    def stop(self) -> None:
        """Nothing runs apart: turns are the episodes' own requests."""

    async def aclose(self) -> None:
        """Close the HTTP session, on the event loop the turns ran on."""
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def release(self, slot: int) -> None:
        self._context.pop(slot, None)

    # ---- a turn --------------------------------------------------------------------------

    async def generate(
        self,
        slot: int,
        tokens: list[int],
        max_new_tokens: int,
        *,
        reset: bool = False,
        stream: int | None = None,
    ) -> TurnResult:
        """Append ``tokens`` to the slot's conversation (cleared first if ``reset``) and
        have the server sample one turn of at most ``max_new_tokens``."""
        if reset:
            self._context[slot] = []
        context = self._context.setdefault(slot, [])
        result = TurnResult()
        if len(context) + len(tokens) > self.max_len:  # never past the context
            return result
        context.extend(tokens)
        limit = min(max_new_tokens, self.max_len - len(context))
        if limit <= 0:
            return result
        name, version = self._serving
        body = self._request(context, limit, name, stream)
        try:
            answer = await self._post("/v1/completions", body)
            ids, logps, confirmed = self._parse(answer, limit, name)
        except RemotePolicyError as e:
            reason = str(e).split(":", 1)[0]
            self.failures[reason] = self.failures.get(reason, 0) + 1
            raise
        if confirmed is not None:
            version = confirmed
        usage = answer.get("usage") if isinstance(answer, dict) else None
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.cut_turns += usage["completion_tokens"] > len(ids)
        for token, logp in zip(ids, logps, strict=True):
            result.tokens.append(token)
            result.logprobs.append(logp)
            result.versions.append(version)
            if ends_turn(result.tokens, self.stop_tokens, self.stop_sequences):
                result.stopped = token
                break
        context.extend(result.tokens)
        self.turns += 1
        return result

    def _request(
        self, context: list[int], limit: int, name: str | None, stream: int | None
    ) -> dict[str, Any]:
        temperature = float(self.sampling.temperature)
        body: dict[str, Any] = {
            "prompt": list(context),
            "max_tokens": limit,
            "temperature": temperature,
            "top_p": float(self.sampling.top_p),
            "logprobs": 1,
            "seed": _seed(self.sampling.seed, stream, len(context)),
            "stream": False,
            # llama.cpp: the nucleus and the temperature only, the sampled token's id and
            # its probability after them (greedy: the unscaled softmax, as rlstream's
            # engine records it); no prompt cache: with it, a run of the test reported
            # probabilities up to 0.9 nats off the model's (a run that also had the UTF-8
            # gaps of _complete; not tested apart from them yet), so each turn is
            # prefilled whole
            "samplers": ["top_p", "temperature"],
            "top_k": 0,
            "min_p": 0.0,
            "repeat_penalty": 1.0,
            "post_sampling_probs": temperature > 0,
            "cache_prompt": False,
            # vLLM: token ids in the answer, special tokens kept
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if self._padding:
            body["logit_bias"] = self._padding
        if name is not None:
            body["model"] = name
        return body

    def _parse(
        self, answer: Any, limit: int, asked: str | None
    ) -> tuple[list[int], list[float], int | None]:
        """Token ids, log-probabilities and the confirmed version (None: no router) of an
        answer; :class:`RemotePolicyError` for anything that cannot be recorded."""
        try:
            choice = answer["choices"][0]
            logprobs = choice["logprobs"]
        except (KeyError, IndexError, TypeError):
            raise RemotePolicyError(
                f"bad answer: no choices[0].logprobs in {cut(json.dumps(answer))}"
            ) from None
        ids: list[Any]
        logps: list[Any]
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            entries = logprobs["content"]  # llama.cpp
            if not all(isinstance(e, dict) for e in entries):
                raise RemotePolicyError("bad answer: logprobs.content holds a non-object")
            entries = _complete(entries, answer.get("usage"), self.token_text)
            ids = [e.get("id") for e in entries]
            logps = [e["logprob"] if "logprob" in e else _log(e.get("prob")) for e in entries]
        elif isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
            ids = [_token_id(t) for t in logprobs["tokens"]]  # vLLM's token_id:N
            logps = list(logprobs.get("token_logprobs") or ())
        else:
            raise RemotePolicyError(
                "bad answer: no token ids in its logprobs (llama.cpp's logprobs.content "
                "or vLLM's tokens with return_tokens_as_token_ids)"
            )
        if len(ids) != len(logps):
            raise RemotePolicyError(
                f"bad answer: {len(ids)} tokens, {len(logps)} log-probabilities"
            )
        if len(ids) > limit:
            raise RemotePolicyError(f"bad answer: {len(ids)} tokens, at most {limit} asked for")
        vocab = int(self.model.vocab_size)
        for i, (t, lp) in enumerate(zip(ids, logps, strict=True)):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise RemotePolicyError(f"bad answer: token {t!r} is not an id below {vocab}")
            if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not lp <= 1e-4:
                raise RemotePolicyError(f"bad answer: log-probability {lp!r} of token {t}")
            if not math.isfinite(lp):
                raise RemotePolicyError(f"bad answer: log-probability {lp!r} of token {t}")
            logps[i] = min(float(lp), 0.0)
        if asked is None:
            return ids, logps, None
        served = answer.get("model")
        if served != asked:
            raise RemotePolicyError(f"bad answer: served by model {served!r}, asked for {asked!r}")
        return ids, logps, version_of(asked)

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        """POST ``body``; an unreachable server is retried for ``wait_s``, a dropped or
        failed request is raised at once."""
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.concurrency),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            )
        delay = 0.1
        while True:
            try:
                async with self._session.post(self.url + path, json=body) as r:
                    text = await r.text()
                    if r.status == 503 and self._waiting_allowed():  # loading a model
                        await asyncio.sleep(delay)
                        delay = min(2 * delay, 2.0)
                        continue
                    if r.status != 200:
                        raise RemotePolicyError(f"server error: {r.status} {cut(text)}")
                    self._reachable()
                    try:
                        return json.loads(text)
                    except ValueError:
                        raise RemotePolicyError(f"bad answer: not JSON: {cut(text)}") from None
            except aiohttp.ClientConnectorError as e:  # nothing was sent: wait for it
                if not self._waiting_allowed(e):
                    raise RemotePolicyError(
                        f"unreachable: {self.url} did not answer for {self.wait_s:g}s ({e})"
                    ) from None
                await asyncio.sleep(delay)
                delay = min(2 * delay, 2.0)
            except (aiohttp.ClientError, OSError) as e:
                raise RemotePolicyError(f"turn dropped: {self.url}: {e!r}") from None
            except TimeoutError:
                raise RemotePolicyError(
                    f"timeout: no answer from {self.url} within {self.timeout_s:g}s"
                ) from None

    def _waiting_allowed(self, error: BaseException | None = None) -> bool:
        now = time.monotonic()
        if self._unreachable_since is None:
            self._unreachable_since = now
            log.warning(
                "policy server %s is not answering (%s): turns wait up to %gs for it",
                self.url,
                error or "loading",
                self.wait_s,
            )
        return now - self._unreachable_since < self.wait_s

    def _reachable(self) -> None:
        if self._unreachable_since is not None:
            log.info(
                "policy server %s answers again after %.1fs",
                self.url,
                time.monotonic() - self._unreachable_since,
            )
            self._unreachable_since = None

    # ---- weights -------------------------------------------------------------------------

    def swap(self, params: Any, version: int) -> None:
        """Have the server sample with ``params`` as ``version`` from the next turn on
        (:class:`~pipeline.policy.llama_router.LlamaRouter`). Runs on the caller's thread
        (the weights subscriber's); turns in flight finish with the model they named."""
        if self.router is None:
            raise RemotePolicyError(
                f"no models folder: the server at {self.url} cannot be given version {version}"
            )
        name, context = self.router.publish(params, version)
        self._server_ctx = context
        self._serving = (name, version)  # one assignment: turns read it whole
        log.info("policy server %s samples version=%d (%s)", self.url, version, name)


def _complete(
    entries: list[dict[str, Any]], usage: Any, token_text: Callable[[int], str] | None
) -> list[dict[str, Any]]:
    """llama.cpp's entries up to the first token it left out. Its server reports a token
    only once the text generated so far ends on a whole UTF-8 character: a token that ends
    inside one (a byte of a multi-byte character) has no entry, and the entry of the token
    that completes the character carries the bytes of all of them. The turn is cut before
    the first entry whose bytes are not its own token's text (``token_text``); the
    server's count of tokens tells a gap at the end apart from none."""
    generated = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(generated, int) or generated <= len(entries):
        return entries
    if token_text is None or not all(isinstance(e.get("bytes"), list) for e in entries):
        raise RemotePolicyError(
            f"bad answer: log-probabilities of {len(entries)} of {generated} tokens"
        )
    for i, e in enumerate(entries):
        try:
            text = bytes(e["bytes"]).decode("utf-8", "replace")
            own = token_text(e["id"])
        except (ValueError, TypeError, KeyError, IndexError):
            return entries[:i]
        if text != own:
            return entries[:i]
    return entries


def _seed(seed: int, stream: int | None, position: int) -> int:
    """A turn's sampling seed: the same conversation at the same length draws the same."""
    digest = hashlib.blake2b(f"{seed}:{stream}:{position}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def _token_id(token: Any) -> Any:
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token[len("token_id:") :])
        except ValueError:
            return token
    return token


def _log(p: Any) -> float:
    """The log of a probability in (0, 1]; NaN (refused) for anything else."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
        return math.nan
    return math.log(p)
