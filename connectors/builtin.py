"""Built-in multi-turn environments with verifiable rewards and simulated latency.

- ``guess``: find a secret number with higher/lower feedback (learnable from scratch by
  the tiny default policy on two CPU cores);
- ``calc``: answer an arithmetic question, optionally using the ``calc`` tool;
- ``echo``: repeat a string of digits and operators exactly: copying, which a pretrained
  model knows and a random one must learn (its demonstrations are copy drills to mix into
  another task's SFT data);
- ``lookup``: ask the ``lookup`` tool for a key's value and answer it: the same copying
  inside the tool-call format (key into the call, the tool's answer into the reply).

All take ``latency`` (a :class:`LatencyModel`) to stand in for tools and remote
environments, with a heavy tail.
"""

from __future__ import annotations

import ast
import asyncio
import operator
import random
import re
from collections.abc import Awaitable, Callable
from typing import Any

from connectors.base import Environment, LatencyModel, Step, Task
from connectors.tools import Tool, ToolRegistry
from pipeline.errors import InvalidConfigError

_INT = re.compile(r"-?\d+")
_DIGIT = re.compile(r"\d+")
#: digits of an answer read at most (Python refuses to read more than 4300 into an int;
#: no environment's target here is that long)
_MAX_DIGITS = 4000


def _number(action: str, pattern: re.Pattern[str] = _INT) -> int | None:
    """The first number ``pattern`` finds in ``action`` (its first :data:`_MAX_DIGITS`
    digits), None when there is none."""
    m = pattern.search(action)
    return None if m is None else int(m.group()[: _MAX_DIGITS + 1])


class GuessNumber(Environment):
    """Guess a secret integer in ``[low, high]``; after each guess the environment says
    ``higher`` or ``lower``. Reward 1 for finding it within ``max_turns`` guesses."""

    name = "guess"

    def __init__(
        self,
        low: int = 1,
        high: int = 8,
        max_turns: int = 4,
        latency: LatencyModel | None = None,
        seed: int | None = None,
    ) -> None:
        for what, v in (("low", low), ("high", high), ("max_turns", max_turns)):
            if not isinstance(v, int) or isinstance(v, bool) or abs(v) > 2**31:
                raise InvalidConfigError(
                    f"guess: {what} must be an integer within 2**31, got {v!r}"[:200]
                )
        if not (low <= high and 1 <= max_turns <= 1000):
            raise InvalidConfigError(
                f"guess: low must not exceed high and max_turns must lie in [1, 1000], got "
                f"{low}, {high}, {max_turns}"
            )
        self.low, self.high, self.max_turns = low, high, max_turns
        self.latency = latency or LatencyModel()
        self._rng = random.Random(seed)
        self._secret = low
        self._turns = 0

    def sample_task(self, rng: random.Random) -> Task:
        secret = rng.randint(self.low, self.high)
        return Task(f"guess-{self.low}-{self.high}-{secret}", {"secret": secret})

    async def reset(self, task: Task) -> str:
        self._secret = int(task.params["secret"])
        self._turns = 0
        await asyncio.sleep(self.latency.sample(self._rng))
        return f"Guess my number from {self.low} to {self.high}."

    async def step(self, action: str) -> Step:
        await asyncio.sleep(self.latency.sample(self._rng))
        self._turns += 1
        guess = _number(action, _DIGIT)
        last = self._turns >= self.max_turns
        if guess is None:
            return Step("Say a number.", 0.0, last, {"valid": False})
        if guess == self._secret:
            return Step("Correct!", 1.0, True, {"valid": True, "solved": True})
        hint = "Higher." if guess < self._secret else "Lower."
        return Step(hint, 0.0, last, {"valid": True, "solved": False})

    def random_success(self) -> float:
        """A uniform guess in ``[low, high]`` each turn, hints ignored."""
        return 1.0 - (1.0 - 1.0 / (self.high - self.low + 1)) ** self.max_turns


_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
}


def safe_arithmetic(text: str, max_len: int = 64) -> int:
    """Value of an integer expression of ``+ - * //`` and parentheses. Nothing is
    evaluated but these operators on integer literals; anything else raises ValueError."""
    if len(text) > max_len:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {text!r}") from e

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.FloorDiv) and right == 0:
                raise ValueError("division by zero")
            if abs(left) > 10**9 or abs(right) > 10**9:
                raise ValueError("number too large")
            return int(_OPS[type(node.op)](left, right))
        raise ValueError(f"unsupported element {type(node).__name__}")

    return ev(tree)


CALC_DESCRIPTION = "evaluates an integer expression of + - * // and parentheses"
CALC_PARAMETERS = {
    "type": "object",
    "properties": {"expression": {"type": "string", "maxLength": 64}},
    "required": ["expression"],
    "additionalProperties": False,
}


def estimate(value: int, figures: int = 2) -> int:
    """``value`` rounded to ``figures`` significant figures (halves away from zero)."""
    digits = len(str(abs(value)))
    if digits <= figures:
        return value
    step = 10 ** (digits - figures)
    rounded = (abs(value) + step // 2) // step * step
    return rounded if value >= 0 else -rounded


class Calculator(Environment):
    """Answer ``a op b op c``; the ``calc`` tool evaluates expressions. Reward 1 for the
    right integer as the final answer (the first turn that is not a tool call).

    Its scripted demonstrations call the tool and answer what it returns, except on a
    ``mental_share`` of the tasks (0 to 1, chosen by the task), where the demonstrator
    answers from mental arithmetic without the tool: the value to two significant
    figures, as someone who skips the calculator estimates it (right only where the value
    has two significant figures). Transcripts people write mix both; fine-tuned on them, a
    model calls the tool on about the rest of the tasks, and RL can learn that the tool
    pays."""

    name = "calc"

    def __init__(
        self,
        max_operand: int = 9,
        max_turns: int = 3,
        mental_share: float = 0.0,
        latency: LatencyModel | None = None,
        seed: int | None = None,
    ) -> None:
        if (
            isinstance(mental_share, bool)
            or not isinstance(mental_share, int | float)
            or not 0.0 <= mental_share <= 1.0
        ):
            raise InvalidConfigError(
                f"calc: mental_share must be a number in [0, 1], got {mental_share!r}"
            )
        self.max_operand, self.max_turns = max_operand, max_turns
        self.mental_share = float(mental_share)
        self.latency = latency or LatencyModel()
        self._rng = random.Random(seed)
        self._answer = 0
        self._turns = 0
        self.tools = ToolRegistry([Tool("calc", CALC_DESCRIPTION, CALC_PARAMETERS, self._calc)])

    def sample_task(self, rng: random.Random) -> Task:
        a, b, c = (rng.randint(0, self.max_operand) for _ in range(3))
        op1, op2 = rng.choice("+-*"), rng.choice("+-")
        expr = f"{a}{op1}{b}{op2}{c}"
        return Task(f"calc-{expr}", {"expression": expr, "answer": safe_arithmetic(expr)})

    async def reset(self, task: Task) -> str:
        self._answer = int(task.params["answer"])
        self._turns = 0
        await asyncio.sleep(self.latency.sample(self._rng))
        return f"What is {task.params['expression']}?"

    async def step(self, action: str) -> Step:
        await asyncio.sleep(self.latency.sample(self._rng))
        self._turns += 1
        said = _number(action)
        if said == self._answer:
            return Step("Correct!", 1.0, True, {"solved": True})
        last = self._turns >= self.max_turns
        return Step(
            "Wrong, try again." if said is not None else "Answer with a number.",
            0.0,
            last,
            {"solved": False},
        )

    def random_success(self) -> float:
        """A uniform integer each turn among those an answer can be (``a op b op c``
        with operands in ``[0, max_operand]``: from ``-2 max`` to ``max² + max``)."""
        m = self.max_operand
        n = max(m * m + m, 3 * m) + 2 * m + 1
        return 1.0 - (1.0 - 1.0 / n) ** self.max_turns

    async def demonstrate(
        self, task: Task, call: Callable[[str, dict[str, Any]], Awaitable[str]]
    ) -> str | None:
        """The tool's way: ask ``calc`` for the expression, answer what it says; on a
        ``mental_share`` of the tasks an estimate without the tool."""
        if random.Random(task.task_id).random() < self.mental_share:
            return str(estimate(int(task.params["answer"])))
        return await call("calc", {"expression": task.params["expression"]})

    async def _calc(self, expression: str) -> str:
        await asyncio.sleep(self.latency.sample(self._rng))
        return str(safe_arithmetic(expression))


class Echo(Environment):
    """Repeat a string of 1 to ``max_numbers`` numbers below 1000 joined by ``+ - *``
    (sometimes negative) exactly. Reward 1 for the exact string as the answer."""

    name = "echo"

    def __init__(
        self, max_numbers: int = 4, latency: LatencyModel | None = None, seed: int | None = None
    ) -> None:
        self.max_numbers = _count("echo: max_numbers", max_numbers, 16)
        self.latency = latency or LatencyModel()
        self._rng = random.Random(seed)
        self._text = ""

    def sample_task(self, rng: random.Random) -> Task:
        text = _numbers(rng, rng.randint(1, self.max_numbers))
        if rng.random() < 0.3:
            text = "-" + text
        return Task(f"echo-{text}", {"text": text})

    async def reset(self, task: Task) -> str:
        self._text = str(task.params["text"])
        await asyncio.sleep(self.latency.sample(self._rng))
        return f"Repeat: {self._text}"

    async def step(self, action: str) -> Step:
        await asyncio.sleep(self.latency.sample(self._rng))
        solved = action.strip() == self._text
        return Step("Correct!" if solved else "Wrong.", float(solved), True, {"solved": solved})

    async def demonstrate(
        self, task: Task, call: Callable[[str, dict[str, Any]], Awaitable[str]]
    ) -> str | None:
        """Say the string."""
        return str(task.params["text"])


def _count(what: str, value: object, top: int) -> int:
    """``value`` when it is an integer in ``[1, top]``; InvalidConfigError otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidConfigError(f"{what} must be an integer, got {value!r}"[:200])
    if not 1 <= value <= top:
        raise InvalidConfigError(f"{what} must lie in [1, {top}], got {value}")
    return value


def _numbers(rng: random.Random, count: int) -> str:
    """``count`` numbers below 1000 joined by ``+ - *``."""
    text = str(rng.randint(0, 999))
    for _ in range(count - 1):
        text += rng.choice("+-*") + str(rng.randint(0, 999))
    return text


LOOKUP_PARAMETERS = {
    "type": "object",
    "properties": {"key": {"type": "string", "maxLength": 64}},
    "required": ["key"],
    "additionalProperties": False,
}


class Lookup(Environment):
    """Look up a key with the ``lookup`` tool and answer its value: copy drills in the
    tool-call format, as calc's episodes lay them out (a tools listing, a question, a call
    whose argument copies text of the question, a reply that copies the tool's answer),
    what a pretrained tool-calling model knows and a random one must learn. Keys are
    three numbers below 1000 joined by ``+ - *`` (as calc's questions); values random
    integers of 1 to ``max_digits`` digits, unrelated to the key (nothing to compute).
    Reward 1 for the value as the answer; one answer an episode."""

    name = "lookup"

    def __init__(
        self, max_digits: int = 6, latency: LatencyModel | None = None, seed: int | None = None
    ) -> None:
        self.max_digits = _count("lookup: max_digits", max_digits, 18)
        self.latency = latency or LatencyModel()
        self._rng = random.Random(seed)
        self._key, self._value = "", 0
        self.tools = ToolRegistry(
            [Tool("lookup", "the value stored under a key", LOOKUP_PARAMETERS, self._lookup)]
        )

    def sample_task(self, rng: random.Random) -> Task:
        key = _numbers(rng, 3)
        digits = rng.randint(1, self.max_digits)
        value = rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)
        value = -value if rng.random() < 0.3 else value
        return Task(f"lookup-{key}-{value}", {"key": key, "value": value})

    async def reset(self, task: Task) -> str:
        self._key, self._value = str(task.params["key"]), int(task.params["value"])
        await asyncio.sleep(self.latency.sample(self._rng))
        return f"What is stored under {self._key}?"

    async def step(self, action: str) -> Step:
        await asyncio.sleep(self.latency.sample(self._rng))
        solved = _number(action) == self._value
        return Step("Correct!" if solved else "Wrong.", float(solved), True, {"solved": solved})

    async def demonstrate(
        self, task: Task, call: Callable[[str, dict[str, Any]], Awaitable[str]]
    ) -> str | None:
        """Ask the tool for the key, answer what it says."""
        return await call("lookup", {"key": task.params["key"]})

    async def _lookup(self, key: str) -> str:
        await asyncio.sleep(self.latency.sample(self._rng))
        return str(self._value) if key == self._key else f"nothing is stored under {key}"
