"""KV-cached batched sampling with per-token log-probabilities.

A :class:`DecodeEngine` holds ``slots`` rows of one key-value cache; each row is one
conversation at its own length. ``append`` queues tokens the environment produced (they
are prefilled in fixed-size chunks, batched across rows), ``step`` samples one token for
every row that is generating, in one forward pass of fixed shape: after the first call of
each kind nothing recompiles. Parameters can be swapped between steps; each sampled token
carries the policy version that produced it.

The random draw of a token depends on the sampling seed, the conversation's ``stream``
(given at :meth:`DecodeEngine.reset`) and the token's position, never on the slot, the
other rows or the step count: a conversation replayed with the same stream and weights
samples the same tokens however episodes were batched.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pipeline.errors import InvalidConfigError
from pipeline.policy.config import SamplingConfig, check_swap_kv
from pipeline.policy.model import KVCache, Transformer

#: vocabulary entries per block of the two-level draw (:func:`_inverse_cdf`)
_BLOCK = 256


def _inverse_cdf(p: jax.Array, u: jax.Array) -> jax.Array:
    """The entry of each row of ``p [B, V]`` (non-negative, a positive sum) where ``u [B]``
    (in [0, 1)) of the row's mass is reached. In two levels, blocks of 256 entries, then
    the entries of the chosen block: a running sum over the whole vocabulary is slow on a
    CPU (150 ms for 64 rows of 151,936), a sum per block is not."""
    rows, vocab = p.shape
    blocks = jnp.pad(p, ((0, 0), (0, -vocab % _BLOCK))).reshape(rows, -1, _BLOCK)
    sums = blocks.sum(axis=-1)
    running = jnp.cumsum(sums, axis=-1)
    target = u * running[:, -1]
    find = jax.vmap(lambda c, x: jnp.searchsorted(c, x, side="right"))
    block = jnp.minimum(find(running, target), sums.shape[1] - 1)
    before = jnp.take_along_axis(running - sums, block[:, None], axis=-1)[:, 0]
    inner = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]
    entry = jnp.minimum(find(jnp.cumsum(inner, axis=-1), target - before), _BLOCK - 1)
    # (rounding can land past the block's last positive entry: take its likeliest instead)
    positive = jnp.take_along_axis(inner, entry[:, None], axis=-1)[:, 0] > 0
    entry = jnp.where(positive, entry, jnp.argmax(inner, axis=-1))
    return block * _BLOCK + entry


def _first_max(x: jax.Array, top: jax.Array) -> jax.Array:
    """``argmax`` of each row of ``x`` given its maximum ``top [B, 1]``: a comparison and
    a minimum vectorize on a CPU, the (value, index) reduction of ``argmax`` does not (22
    ms against 3 for 64 rows of 151,936)."""
    index = jnp.arange(x.shape[-1], dtype=jnp.int32)
    first = jnp.min(jnp.where(x == top, index, x.shape[-1]), axis=-1)
    return jnp.minimum(first, x.shape[-1] - 1)  # (a row of NaN has no maximum)


def sample_tokens(
    logits: jax.Array, key: jax.Array, temperature: float | jax.Array, top_p: float | jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row of ``logits [B, V]`` with ``key`` (one key, or one per row:
    shape ``[B]``); return tokens and their log-probabilities under the temperature-scaled
    policy (before top-p truncation, the distribution the trainer recomputes).

    One uniform number per row picks the token from the cumulative probabilities (inverse
    transform sampling): no random number per vocabulary entry, and no sort of the
    vocabulary unless ``top_p < 1`` asks for the nucleus (at 64 rows of Qwen's 151,936
    entries the sort alone took 3 s a step on two CPU cores)."""
    logits = logits.astype(jnp.float32)
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)
    top = jnp.max(scaled, axis=-1, keepdims=True)
    weights = jnp.exp(scaled - top)  # the probabilities times the row's ``total``
    total = jnp.sum(weights, axis=-1, keepdims=True)

    def nucleus(w: jax.Array) -> jax.Array:
        order = jnp.argsort(-w, axis=-1)
        sorted_p = jnp.take_along_axis(w, order, axis=-1) / total
        keep_sorted = (jnp.cumsum(sorted_p, axis=-1) - sorted_p) < top_p
        rows = jnp.arange(w.shape[0])[:, None]
        keep = jnp.zeros_like(keep_sorted).at[rows, order].set(keep_sorted)
        return jnp.where(keep, w, 0.0)

    if isinstance(top_p, (int, float)):  # known when traced: only what it needs compiles
        kept = nucleus(weights) if top_p < 1 else weights
    else:  # (a conditional copies its operand: 30 ms a step at 64 rows of Qwen's vocabulary)
        kept = jax.lax.cond(top_p < 1, nucleus, lambda w: w, weights)
    if key.shape:  # a key per row: each row's draw is its own
        u = jax.vmap(lambda k: jax.random.uniform(k))(key)
    else:
        u = jax.random.uniform(key, (logits.shape[0],))
    drawn = _inverse_cdf(kept, u)
    tokens = jnp.where(greedy, _first_max(scaled, top), drawn)
    chosen = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)
    return tokens, (chosen - top - jnp.log(total))[:, 0]


class DecodeEngine:
    """Batched incremental decoding over ``slots`` conversations.

    Per slot: ``length`` tokens are in the cache and one ``pending`` token (the latest)
    waits to be fed. ``append(slot, tokens)`` adds tokens; ``step(slots)`` feeds each
    listed slot's pending token and samples the next one.
    """

    def __init__(
        self,
        model: Transformer,
        slots: int,
        sampling: SamplingConfig | None = None,
        *,
        chunk: int = 16,
        prefill_rows: int = 8,
        version: int = 0,
        swap_kv: str = "keep",
    ) -> None:
        check_swap_kv(swap_kv)
        self.swap_kv = swap_kv
        self.cfg = model.cfg
        self.slots = slots
        self.chunk = chunk
        self.prefill_rows = min(prefill_rows, slots)
        self.sampling = sampling or SamplingConfig()
        # Parameters and cache are committed to one device, whatever produced them (a
        # restored checkpoint is committed, a fresh model is not): mixing the two would
        # make every jitted call compile again.
        self.device = jax.devices()[0]
        self.graphdef, state = nnx.split(model)
        self.state = jax.device_put(state, self.device)
        self.version = version
        self.cache = jax.device_put(KVCache.zeros(self.cfg, slots), self.device)
        self.length = np.zeros(slots, np.int64)
        self.pending: list[int | None] = [None] * slots
        self._queued: list[list[int]] = [[] for _ in range(slots)]
        #: each slot's tokens in the cache, in order, and whether all of them were
        #: computed with the current parameters (a swap makes every row older)
        self._cached: list[list[int]] = [[] for _ in range(slots)]
        self._current = [True] * slots
        #: each slot's conversation stream (see :meth:`reset`); fresh ones count down from
        #: 2**32 - 1, away from the small numbers and hashes callers pass
        self.stream = np.arange(slots, dtype=np.uint32)
        self._fresh = (1 << 32) - 1
        self._key = jax.random.key(self.sampling.seed)
        graphdef = self.graphdef
        top_p = float(self.sampling.top_p)

        @functools.partial(jax.jit, donate_argnums=1)
        def prefill(
            state: Any,
            cache: KVCache,
            rows: jax.Array,
            tokens: jax.Array,
            positions: jax.Array,
            write: jax.Array,
        ) -> KVCache:
            # only the rows being prefilled are computed: gathered, run, scattered back
            model = nnx.merge(graphdef, state)
            sub = KVCache(tuple(k[rows] for k in cache.k), tuple(v[rows] for v in cache.v))
            _, new = model(tokens, positions, sub, write)
            assert new is not None
            return KVCache(
                tuple(k.at[rows].set(n) for k, n in zip(cache.k, new.k, strict=True)),
                tuple(v.at[rows].set(n) for v, n in zip(cache.v, new.v, strict=True)),
            )

        @functools.partial(jax.jit, donate_argnums=1)
        def decode(
            state: Any,
            cache: KVCache,
            tokens: jax.Array,
            positions: jax.Array,
            write: jax.Array,
            key: jax.Array,
            streams: jax.Array,
            temperature: jax.Array,
        ) -> tuple[KVCache, jax.Array, jax.Array]:
            model = nnx.merge(graphdef, state)
            logits, new = model(tokens, positions, cache, write)
            assert new is not None
            # row r's key: the seed's, folded with its stream and the sampled position
            keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(key, s), p))(
                streams, positions[:, 0] + 1
            )
            nxt, logp = sample_tokens(logits[:, -1], keys, temperature, top_p)  # (a constant)
            return new, nxt, logp

        @functools.partial(jax.jit, donate_argnums=0)
        def copy_rows(cache: KVCache, src: jax.Array, dst: jax.Array) -> KVCache:
            return KVCache(
                tuple(k.at[dst].set(k[src]) for k in cache.k),
                tuple(v.at[dst].set(v[src]) for v in cache.v),
            )

        self._prefill = prefill
        self._decode = decode
        self._copy_rows = copy_rows
        #: prompts prefilled once and copied to the other slots that start with them
        self.shared_prompt_tokens = 0

    # ---- slots ---------------------------------------------------------------------------

    def reset(self, slot: int, stream: int | None = None) -> None:
        """Start a new conversation in ``slot`` (its old cache rows are overwritten).
        ``stream`` (an integer below 2**32) names the conversation's random draws: the
        same stream, weights and tokens sample the same continuation in any slot and
        batch; None draws a stream no other conversation of this engine has used."""
        if stream is None:
            stream, self._fresh = self._fresh, self._fresh - 1
        if not 0 <= stream < 1 << 32:
            raise InvalidConfigError(f"stream {stream!r} is not an integer in [0, 2**32)")
        self.stream[slot] = stream
        self.length[slot] = 0
        self.pending[slot] = None
        self._queued[slot] = []
        self._cached[slot] = []
        self._current[slot] = True

    def append(self, slot: int, tokens: list[int]) -> None:
        """Tokens produced outside the policy (prompt, observations), in order. Tokens
        that do not fit in the slot's context are refused (InvalidConfigError with the
        numbers) before anything is queued: the other slots never wait for them."""
        if not tokens:
            return
        if len(tokens) > self.room(slot):
            raise InvalidConfigError(
                f"{len(tokens)} tokens do not fit in slot {slot}: it has room for "
                f"{self.room(slot)} of its context of {self.cfg.max_len} "
                f"({int(self.length[slot])} in the cache)"
            )
        low, high = min(tokens), max(tokens)
        if low < 0 or high >= self.cfg.vocab_size:
            raise InvalidConfigError(
                f"token ids span [{low}, {high}], outside the model's [0, {self.cfg.vocab_size})"
            )
        if self.pending[slot] is not None:
            self._queued[slot].append(self.pending[slot])  # type: ignore[arg-type]
        self._queued[slot].extend(tokens[:-1])
        self.pending[slot] = tokens[-1]

    def room(self, slot: int) -> int:
        """How many more tokens fit in the slot's context."""
        queued = len(self._queued[slot]) + (self.pending[slot] is not None)
        return int(self.cfg.max_len - self.length[slot] - queued)

    def swap(self, state: Any, version: int) -> None:
        """Use new parameters from the next step on (same structure and shapes). With
        ``swap_kv="recompute"`` every conversation's cached tokens are queued to be
        prefilled again with them (tokens keep the version that sampled them)."""
        self.state = jax.device_put(state, self.device)
        self.version = version
        if self.swap_kv == "keep":
            self._current = [False] * self.slots
            return
        for s in range(self.slots):
            self._queued[s] = self._cached[s] + self._queued[s]
            self._cached[s] = []
            self.length[s] = 0
        self._current = [True] * self.slots

    # ---- compute ------------------------------------------------------------------------

    def flush(self) -> None:
        """Prefill every queued token: chunks of ``chunk`` tokens for up to
        ``prefill_rows`` slots per call (1, 2, 4 ... rows: a few shapes, each compiled
        once). A slot that starts a conversation with tokens another slot holds already,
        computed with the current parameters, or that it is about to prefill (a GRPO
        group's members: one prompt), takes a copy of that slot's cache rows instead of
        computing them."""
        self._copy(self._share_cached())
        followers = self._share_queued()
        self._prefill_queued()
        self._copy(followers)

    def _share_cached(self) -> list[tuple[int, int]]:
        """(lead, follower): fresh slots whose queued tokens begin a lead's cache."""
        pairs: list[tuple[int, int]] = []
        copied: set[int] = set()  # (whose rows are not there until the copy)
        for s, q in enumerate(self._queued):
            if not q or self.length[s] != 0:
                continue
            n = len(q)
            lead = next(
                (
                    x
                    for x in range(self.slots)
                    if x != s and x not in copied and self._current[x] and self._cached[x][:n] == q
                ),
                None,
            )
            if lead is not None:
                pairs.append((lead, s))
                copied.add(s)
                self._take(s, n)
        return pairs

    def _share_queued(self) -> list[tuple[int, int]]:
        """(lead, follower): fresh slots whose queued tokens are the same (the lead's
        cache rows are copied once it is prefilled)."""
        leads: dict[tuple[int, ...], int] = {}
        pairs = []
        for s, q in enumerate(self._queued):
            if not q or self.length[s] != 0:
                continue
            lead = leads.setdefault(tuple(q), s)
            if lead != s:
                pairs.append((lead, s))
                self._take(s, len(q))
        return pairs

    def _take(self, follower: int, n: int) -> None:
        """The follower's ``n`` queued tokens come from a copy, not a prefill."""
        self._cached[follower] = self._queued[follower]
        self._queued[follower] = []
        self.length[follower] = n
        self.shared_prompt_tokens += n

    def _copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each lead's cache rows to its follower (one call of a fixed shape: the
        rows that copy nothing copy themselves)."""
        if not pairs:
            return
        followers = {f for _, f in pairs}
        rest = [x for x in range(self.slots) if x not in followers]
        src = np.asarray([lead for lead, _ in pairs] + rest, np.int32)
        dst = np.asarray([f for _, f in pairs] + rest, np.int32)
        self.cache = self._copy_rows(self.cache, src, dst)

    def _prefill_queued(self) -> None:
        while True:
            waiting = [s for s, q in enumerate(self._queued) if q][: self.prefill_rows]
            if not waiting:
                return
            # as many rows as waiting slots, rounded up to a power of two (a few shapes,
            # each compiled once): one slot's observation is not computed eight times
            # over; padded with other slots that write nothing (rows must be distinct)
            n_rows = min(self.prefill_rows, 1 << (len(waiting) - 1).bit_length())
            others = [s for s in range(self.slots) if s not in waiting]
            rows = (waiting + others)[:n_rows]
            tokens = np.zeros((len(rows), self.chunk), np.int32)
            positions = np.zeros((len(rows), self.chunk), np.int32)
            write = np.zeros(len(rows), bool)
            for r, s in enumerate(waiting):
                q = self._queued[s]
                n = min(len(q), self.chunk)
                tokens[r, :n] = q[:n]
                self._cached[s] += q[:n]
                positions[r] = self.length[s] + np.arange(self.chunk)
                # padding repeats the last real token at its position: it writes the same
                # keys and values there again, and nothing past the real tokens
                positions[r, n:] = positions[r, n - 1]
                tokens[r, n:] = tokens[r, n - 1]
                write[r] = True
                self.length[s] += n
                del q[:n]
            self.cache = self._prefill(
                self.state, self.cache, np.asarray(rows, np.int32), tokens, positions, write
            )

    def step(self, slots: list[int]) -> dict[int, tuple[int, float, int]]:
        """Feed the pending token of each slot and sample its successor: returns
        ``{slot: (token, logprob, version)}``; the sampled token becomes pending."""
        self.flush()
        tokens = np.zeros((self.slots, 1), np.int32)
        positions = np.zeros((self.slots, 1), np.int32)
        write = np.zeros(self.slots, bool)
        for s in slots:
            pending = self.pending[s]
            if pending is None:
                raise InvalidConfigError(f"slot {s} has no token to continue from")
            tokens[s, 0] = pending
            self._cached[s].append(pending)
            positions[s, 0] = self.length[s]
            write[s] = True
        sp = self.sampling
        self.cache, nxt, logp = self._decode(
            self.state,
            self.cache,
            tokens,
            positions,
            write,
            self._key,
            self.stream,
            jnp.float32(sp.temperature),
        )
        nxt_np, logp_np = np.asarray(nxt), np.asarray(logp)
        out = {}
        for s in slots:
            self.length[s] += 1
            self.pending[s] = int(nxt_np[s])
            out[s] = (int(nxt_np[s]), float(logp_np[s]), self.version)
        return out
