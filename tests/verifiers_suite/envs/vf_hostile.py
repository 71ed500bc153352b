"""A verifiers environment that misbehaves as `mode` says: a NaN or infinite reward, an
env_response that raises or hangs, image content in the prompt, a group reward function,
or a load_environment that returns something else."""

import asyncio
import math

import verifiers as vf
from datasets import Dataset


class Hostile(vf.MultiTurnEnv):
    def __init__(self, mode: str, **kwargs):
        super().__init__(**kwargs)
        self.mode = mode

    async def env_response(self, messages, state, **kwargs):
        if self.mode == "raise":
            raise RuntimeError("env_response failed on purpose")
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "flood":
            return [vf.UserMessage(content="x" * 5_000_000)]
        return [vf.UserMessage(content="again")]


def load_environment(mode: str = "nan"):
    if mode == "not_an_env":
        return {"not": "an environment"}
    prompt = "Say anything."
    if mode == "image":
        rows = [
            {
                "prompt": [
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "data:,"}}],
                    }
                ],
                "answer": "x",
            }
        ]
    else:
        rows = [{"question": prompt, "answer": "x"}]

    def score(completion) -> float:
        return {"nan": math.nan, "inf": math.inf}.get(mode, 1.0)

    funcs = [score]
    if mode == "group":

        def relative(completions) -> list[float]:
            return [0.0 for _ in completions]

        funcs = [relative]
    return Hostile(
        mode, dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=funcs), max_turns=3
    )
