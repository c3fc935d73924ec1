"""Verifiers that misbehave, for the reward pool's tests (imported by name in worker processes)."""

import os
import re
import time


def slow_right(response: str, answer: str) -> float:
    time.sleep(0.3)
    return float(response == answer)


def hang(response: str, answer: str) -> float:
    if response == "hang":
        time.sleep(3600)
    return 1.0


def crash(response: str, answer: str) -> float:
    if response == "crash":
        os._exit(3)
    return 1.0


def raise_(response: str, answer: str) -> float:
    if response == "raise":
        raise ValueError("the verifier cannot read this answer")
    return 1.0


def busy(response: str, answer: str) -> float:
    """Half a second or more in one C call that keeps the GIL (a regex backtracking, as a parser of
    answers may): run in a caller's process, it stalls every thread of it, its event loop too."""
    re.match(r"(a+)+$", "a" * 25 + "b")  # 0.8 s on this project's machines; each "a" doubles it
    return 1.0


def always_raise(response: str, answer: str) -> float:
    raise ValueError("no answer can be read")


def misbehave(response: str, answer: str) -> float:
    """Each fault on cue (hang, crash, raise); otherwise an exact match."""
    {"hang": hang, "crash": crash, "raise": raise_}.get(response, lambda r, a: 1.0)(response, answer)
    return float(response == answer)


def length_share(response: str, answer: str) -> float:
    """A reward that differs between answers, also a random model's (0.01 a character)."""
    return len(response) / 100
