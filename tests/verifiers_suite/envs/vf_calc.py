"""A verifiers ToolEnv: a multiplication question and a `multiply` tool the environment
runs itself. Reward: the final answer is the product; a metric counts the tool calls."""

import verifiers as vf
from datasets import Dataset


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def load_environment() -> vf.Environment:
    rows = [
        {"question": f"What is {a} * {b}?", "answer": str(a * b)}
        for a, b in [(12, 34), (56, 78), (91, 23)]
    ]

    def correct(completion, answer) -> float:
        return 1.0 if completion and str(completion[-1].content).strip() == answer else 0.0

    return vf.ToolEnv(
        dataset=Dataset.from_list(rows),
        tools=[multiply],
        rubric=vf.Rubric(funcs=[correct]),
        max_turns=4,
    )
