"""A verifiers MultiTurnEnv: guess a number from 1 to 8; the environment answers "higher"
or "lower" until the guess is right or the turns run out. Reward: 1 when guessed."""

import verifiers as vf
from datasets import Dataset


class Guess(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        guess = str(messages[-1].content).strip()
        target = state["answer"]
        if guess == target:
            state["final_env_response"] = [vf.UserMessage(content="Correct.")]
            return state["final_env_response"]
        hint = "higher" if guess.isdigit() and int(guess) < int(target) else "lower"
        return [vf.UserMessage(content=f"No: {hint}.")]


def load_environment(max_turns: int = 4) -> vf.Environment:
    rows = [{"question": "Guess my number from 1 to 8.", "answer": str(n)} for n in range(1, 9)]

    def guessed(completion, answer) -> float:
        said = [str(m.content).strip() for m in completion if m.role == "assistant"]
        return 1.0 if answer in said else 0.0

    return Guess(
        dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[guessed]), max_turns=max_turns
    )
