"""verifiers environments built from the library's own classes (its classic API, ``import verifiers
as vf``), on the quickstart's task: find the digit hidden in a string. ``load_environment(kind=...)``:
``single`` (a SingleTurnEnv with a system prompt, a few-shot turn and a rubric of two weighted
functions), ``retry`` (the same prompt in a MultiTurnEnv whose ``env_response`` says "No. Try again." after
a wrong answer, up to two turns; its rubric rewards the last answer, less on the second try), ``judged`` (a
JudgeRubric asking a model off this machine, which the driver refuses)."""

from __future__ import annotations

import json
from pathlib import Path

import verifiers as vf
from datasets import Dataset

TRAIN = Path(__file__).resolve().parents[1] / "find_digit_train.jsonl"
SYSTEM = "Answer with the digit only."


def _rows(n: int) -> Dataset:
    rows = [json.loads(x) for x in TRAIN.read_text().splitlines()[:n]]
    return Dataset.from_list([{"question": r["prompt"], "answer": r["answer"]} for r in rows])


def _answer(parser, completion) -> str:
    return (parser.parse_answer(completion) or "").strip()


class Retry(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "No. Try again."}]

    @vf.stop
    async def answered_right(self, state) -> bool:
        steps = state["trajectory"]
        return bool(steps) and _answer(self.parser, steps[-1]["completion"]) == state["answer"]


def load_environment(kind: str = "single", rows: int = 64) -> vf.Environment:
    parser = vf.Parser()

    def correct(completion, answer, **kwargs) -> float:
        return 1.0 if _answer(parser, completion) == answer else 0.0

    def a_digit(completion, **kwargs) -> float:
        return 1.0 if _answer(parser, completion).isdigit() else 0.0

    if kind == "single":
        rubric = vf.Rubric(funcs=[correct, a_digit], weights=[1.0, 0.1], parser=parser)
        few_shot = [{"role": "user", "content": "ab3c"}, {"role": "assistant", "content": "3"}]
        return vf.SingleTurnEnv(
            dataset=_rows(rows), system_prompt=SYSTEM, few_shot=few_shot, parser=parser, rubric=rubric
        )
    if kind == "retry":

        def discounted(completion, answer, state, **kwargs) -> float:
            return correct(completion, answer) * (1.0 if len(state["trajectory"]) == 1 else 0.5)

        rubric = vf.Rubric(funcs=[discounted, a_digit], weights=[1.0, 0.1], parser=parser)
        few_shot = [{"role": "user", "content": "ab3c"}, {"role": "assistant", "content": "3"}]
        return Retry(
            dataset=_rows(rows), system_prompt=SYSTEM, few_shot=few_shot, parser=parser, rubric=rubric, max_turns=2
        )
    if kind == "judged":  # a judge model at OpenAI's API: refused by the driver
        from openai import AsyncOpenAI

        rubric = vf.JudgeRubric(judge_client=AsyncOpenAI(api_key="unused"), parser=parser)
        return vf.SingleTurnEnv(dataset=_rows(rows), parser=parser, rubric=rubric)
    raise ValueError(f"kind: single, retry or judged, got {kind!r}")
