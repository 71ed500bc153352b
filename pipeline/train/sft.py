"""``rlstream sft``: supervised fine-tuning of a Hugging Face checkpoint on conversations,
the warm start before RL.

The conversations (:mod:`pipeline.train.sft_data`) are packed several to a row (each its
own segment: attention stays inside it, positions restart), ``rows`` rows a step, one
fixed shape; the loss is the mean negative log-likelihood of the assistant tokens. The
model is trained whole or through LoRA adapters (:mod:`pipeline.policy.lora`), with AdamW,
warm-up and cosine decay over the run. A step whose loss or gradients are not finite is
not applied. ``out`` receives ``model/`` (a Hugging Face checkpoint, LoRA merged in, that
``rlstream run --model`` starts from), ``metrics.jsonl`` (a line per step) and
``loss.png``.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pipeline.errors import InvalidConfigError, RlstreamError, TrainingDivergedError
from pipeline.policy.chat import ChatTokenizer
from pipeline.policy.hf_weights import export, load_model
from pipeline.policy.lora import init_adapters, merged
from pipeline.policy.model import finite_leaves, token_logprobs_and_entropy
from pipeline.train.batching import first_fit
from pipeline.train.config import SFTConfig, adamw
from pipeline.train.sft_data import Example, load_examples

#: steps in a row whose loss or gradients are not finite before SFT stops
MAX_NONFINITE_STEPS = 5


class Packed:
    """The examples in rows of ``length`` tokens, each row several conversations (first
    fit, longest first); an epoch is the rows in a new order."""

    def __init__(self, examples: list[Example], length: int) -> None:
        self.length = length
        self.rows = [
            [examples[i] for i in row]
            for row in first_fit([len(e.tokens) for e in examples], length)
        ]

    def batches(self, rows: int, rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
        order = rng.permutation(len(self.rows))
        return [
            self._batch([self.rows[i] for i in order[s : s + rows]], rows)
            for s in range(0, len(order), rows)
        ]

    def _batch(self, chosen: list[list[Example]], rows: int) -> dict[str, np.ndarray]:
        t = self.length
        tokens = np.zeros((rows, t), np.int32)
        mask = np.zeros((rows, t), np.float32)
        segment = np.broadcast_to((np.arange(rows) * t)[:, None], (rows, t)).copy()
        position = np.broadcast_to(np.arange(t, dtype=np.int32), (rows, t)).copy()
        for r, row in enumerate(chosen):
            at = 0
            for e in row:
                n = len(e.tokens)
                tokens[r, at : at + n] = e.tokens
                mask[r, at : at + n] = e.mask
                segment[r, at : at + n] = r * t + at
                position[r, at : at + n] = np.arange(n)
                at += n
            segment[r, at:] = r * t + at
            position[r, at:] = np.arange(t - at)
        return {
            "tokens": tokens,
            "mask": mask,
            "segment": segment.astype(np.int32),
            "position": position,
        }


def make_sft_step(graphdef: Any, tx: optax.GradientTransformation, scale: float) -> Any:
    """The jitted ``step(trained, opt_state, base, batch) -> (trained, opt_state, metrics)``:
    one AdamW update on the assistant tokens' mean negative log-likelihood (``base`` is
    None for full fine-tuning, else the frozen weights the adapters ``trained`` apply
    to); not applied when the loss, the gradients or the result would not be finite."""

    def loss_fn(trained: Any, base: Any, batch: dict[str, jax.Array]) -> jax.Array:
        weights = trained if base is None else merged(base, trained, scale)
        logp, _ = token_logprobs_and_entropy(
            nnx.merge(graphdef, weights), batch["tokens"], 1.0, batch["position"], batch["segment"]
        )
        return -jnp.sum(logp * batch["mask"]) / jnp.maximum(jnp.sum(batch["mask"]), 1.0)

    @jax.jit
    def step(trained: Any, opt_state: Any, base: Any, batch: dict[str, jax.Array]) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(trained, base, batch)
        norm = optax.tree.norm(grads)
        updates, new_state = tx.update(grads, opt_state, trained)
        new = optax.apply_updates(trained, updates)
        ok = jnp.isfinite(loss) & jnp.isfinite(norm) & finite_leaves(new)
        keep = lambda a, b: jax.tree.map(lambda x, y: jnp.where(ok, x, y), a, b)  # noqa: E731
        metrics = {"loss": loss, "grad_norm": norm, "applied": ok}
        return keep(new, trained), keep(new_state, opt_state), metrics

    return step


def run_sft(
    cfg: SFTConfig,
    progress: Callable[[str], None] = print,
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Fine-tune ``cfg.model`` on ``cfg.data``; returns the run's figures and writes
    ``cfg.out`` (see the module). ``stop`` set (SIGINT, SIGTERM) ends it after the step
    in progress, with an error and no model written: an unfinished fine-tune is not
    mistaken for one that finished."""
    if not cfg.model.path:
        raise InvalidConfigError(
            "rlstream sft needs --model DIR, a Hugging Face checkpoint directory "
            "(rlstream model init makes one)"
        )
    target = cfg.out / "model"
    if target.exists() and any(target.iterdir()):
        raise InvalidConfigError(f"{target} is not empty: choose another --out")
    length = cfg.length or cfg.model.max_len
    chat = ChatTokenizer.load(Path(cfg.model.path))
    examples = load_examples(cfg.data, chat, length, progress)
    if max(int(e.tokens.max(initial=0)) for e in examples) >= cfg.model.vocab_size:
        raise InvalidConfigError("the tokenizer makes ids beyond the model's vocab_size")
    packed = Packed(examples, length)
    per_epoch = math.ceil(len(packed.rows) / cfg.rows)
    total = per_epoch * cfg.epochs if cfg.max_steps is None else cfg.max_steps
    learned = int(sum(e.mask.sum() for e in examples))
    progress(
        f"sft: {len(examples)} conversations, {learned} assistant tokens, {len(packed.rows)} "
        f"rows of {length} tokens, {per_epoch} steps an epoch, {total} steps"
    )
    tx = adamw(
        cfg.learning_rate,
        cfg.warmup_steps,
        max(1, total - cfg.warmup_steps),
        cfg.decay_floor,
        cfg.weight_decay,
        cfg.max_grad_norm,
    )
    graphdef, params = nnx.split(load_model(cfg.model, training=True))
    base: Any = params if cfg.lora.rank else None
    trained: Any = init_adapters(cfg.model, cfg.lora, cfg.seed) if cfg.lora.rank else params
    opt_state = tx.init(trained)
    step_fn = make_sft_step(graphdef, tx, cfg.lora.scale if cfg.lora.rank else 0.0)
    cfg.out.mkdir(parents=True, exist_ok=True)
    metrics_path = cfg.out / "metrics.jsonl"
    metrics_path.write_text("")
    rng = np.random.default_rng(cfg.seed)
    start, step, bad_in_a_row, tokens_seen = time.monotonic(), 0, 0, 0
    history: list[dict[str, Any]] = []
    while step < total:
        epoch = step // per_epoch + 1
        for batch in packed.batches(cfg.rows, rng):
            if step >= total:
                break
            if stop is not None and stop.is_set():
                plot_loss(history, cfg.out / "loss.png")
                raise RlstreamError(
                    f"sft stopped at step {step} of {total}: {target} not written "
                    f"({metrics_path} and loss.png hold the steps made)"
                )
            trained, opt_state, m = step_fn(trained, opt_state, base, batch)
            m = {k: float(v) for k, v in jax.device_get(m).items()}
            step += 1
            if not m.pop("applied"):
                bad_in_a_row += 1
                if bad_in_a_row >= MAX_NONFINITE_STEPS:
                    raise TrainingDivergedError(
                        f"{bad_in_a_row} SFT steps in a row had a non-finite loss or gradient "
                        f"(loss {m['loss']}): lower the learning rate"
                    )
                continue
            bad_in_a_row = 0
            tokens_seen += int(batch["mask"].sum())
            elapsed = time.monotonic() - start
            row = {"step": step, "epoch": epoch, **m, "tokens": tokens_seen, "time_s": elapsed}
            history.append(row)
            with metrics_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
            eta = elapsed / step * (total - step)
            rate = tokens_seen / max(elapsed, 1e-9)
            progress(
                f"sft step {step}/{total} epoch {epoch}/{cfg.epochs} loss {m['loss']:.4f} "
                f"grad_norm {m['grad_norm']:.3f} learned tokens/s {rate:.0f} "
                f"elapsed {elapsed:.0f}s eta {eta:.0f}s"
            )
    final = trained if base is None else merged(base, trained, cfg.lora.scale)
    export(cfg.model, final, target)
    plot_loss(history, cfg.out / "loss.png")
    figures = {
        "conversations": len(examples),
        "assistant_tokens": learned,
        "steps": step,
        "first_loss": history[0]["loss"] if history else None,
        "final_loss": history[-1]["loss"] if history else None,
        "wall_s": time.monotonic() - start,
        "model": str(target),
    }
    progress(
        f"sft done: loss {figures['first_loss']:.4f} -> {figures['final_loss']:.4f} in "
        f"{figures['wall_s']:.0f}s; start RL with: rlstream run --model {target}"
        if history
        else f"sft done without an applied step; {target} holds the model unchanged"
    )
    return figures


def plot_loss(history: list[dict[str, Any]], path: Path) -> None:
    """The training loss against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=1.4)
    ax.set(title="SFT: loss on assistant tokens", xlabel="step", ylabel="nats per token")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
