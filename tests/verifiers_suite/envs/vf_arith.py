"""A verifiers SingleTurnEnv, written as verifiers' own examples write one: sums of two
digits, the rubric's reward the exact answer (weight 1) plus a small format score."""

import verifiers as vf
from datasets import Dataset


def load_environment(size: int = 50, eval_size: int = 10) -> vf.Environment:
    def rows(n: int, offset: int) -> list[dict[str, str]]:
        out = []
        for i in range(offset, offset + n):
            a, b = i % 10, (i * 7) % 10
            out.append(
                {"question": f"What is {a} + {b}? Answer with the number.", "answer": str(a + b)}
            )
        return out

    def correct(completion, answer) -> float:
        text = completion[-1].content if completion else ""
        return 1.0 if str(text).strip() == answer else 0.0

    def short(completion) -> float:
        text = completion[-1].content if completion else ""
        return 1.0 if len(str(text).strip()) <= 3 else 0.0

    rubric = vf.Rubric(funcs=[correct, short], weights=[1.0, 0.1])
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows(size, 0)),
        eval_dataset=Dataset.from_list(rows(eval_size, 1000)),
        system_prompt="You add numbers.",
        rubric=rubric,
    )
