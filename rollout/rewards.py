"""Reward functions: ``fn(response, answer) -> float``. A registry, plus ``module:function``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from sample_buffer.registry import resolve

if TYPE_CHECKING:  # reward workers import this module: they need none of the ports' imports
    from rollout.ports import Rewarder


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response, stripped of surrounding whitespace, is exactly the answer."""
    return 1.0 if response.strip() == str(answer).strip() else 0.0


def first_token_match(response: str, answer: str) -> float:
    """1.0 when the response starts with the answer (the rest is ignored)."""
    return 1.0 if response.strip().startswith(str(answer).strip()) else 0.0


def digit_answer(response: str, answer: str) -> float:
    """1.0 for the right first character; 0.1 for a wrong digit (the format is right). The small
    format credit gives a randomly initialised model a signal long before it guesses an answer."""
    head = response.strip()[:1]
    if head == str(answer).strip()[:1]:
        return 1.0
    return 0.1 if head.isdigit() else 0.0


def math_verify(response: str, answer: str) -> float:
    """1.0 when the free-form ``response`` states a value equal to ``answer`` (HF math-verify:
    LaTeX, plain expressions and numbers, compared symbolically: "The answer is 42." and
    "\\boxed{42}" both match 42). Its time limits use SIGALRM, which only the main thread may set;
    elsewhere they are off rather than failing every answer."""
    import threading

    from math_verify import parse, verify

    limits = threading.current_thread() is threading.main_thread()
    timeout = {} if limits else {"parsing_timeout": None}
    try:
        gold = parse(str(answer), **timeout)
        said = parse(response, **timeout)
        return 1.0 if said and verify(gold, said, **({} if limits else {"timeout_seconds": None})) else 0.0
    except Exception:  # math-verify raises on what it cannot read: an unreadable answer is a wrong one
        return 0.0


def word_count(response: str, answer: str) -> float:
    """A format reward: 1.0 when the response has exactly ``answer`` words (whitespace-separated, a
    closing period allowed), 0.5 when one word off, 0 otherwise (``rollmesh make-dataset word_count``)."""
    words = len(response.split())
    off = abs(words - int(answer))
    return 1.0 if off == 0 else 0.5 if off == 1 else 0.0


REWARDS: dict[str, Callable[[str, str], float]] = {
    "exact_match": exact_match,
    "first_token_match": first_token_match,
    "digit_answer": digit_answer,
    "math_verify": math_verify,
    "word_count": word_count,
}


def resolve_reward(name: str) -> Callable[[str, str], float]:
    return resolve("reward", name, REWARDS)


def build_reward(spec, **ports) -> Rewarder:
    """A reward from config: a name (``resolve_reward``) or a typed variant with ``build(**ports)``
    (``reward: {type: code}``; ``{type: judge}`` takes ``judge`` and ``{type: service}`` takes
    ``reward_service``, builders that ``services/`` passes)."""
    return resolve_reward(spec) if isinstance(spec, str) else spec.build(**ports)
