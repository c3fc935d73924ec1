"""The code reward: the answer's program runs against the task's tests in a sandbox; 1.0 if they
pass, 0 otherwise (a wrong answer, an error, a timeout, a program the sandbox stopped).

A task's ``answer`` is a JSON object: ``tests`` (Python: asserts, or HumanEval's ``def
check(candidate)``), and optionally ``entry_point`` (the function under test: ``check(entry_point)``
is called after the tests), ``prompt`` (code the answer continues: a HumanEval signature and
docstring, put in front unless the answer defines ``entry_point`` itself) and ``task_id`` (the
adaptive timeout's per-task anchor). The program is the last fenced code block of the response,
or the whole response when it has none.

Each run's limit is the adaptive timeout (``adaptive_timeout.py``); a correct run moves its
anchor. The reward is a plain callable, thread-safe, so environments call it as any reward: the
work happens in the sandbox's process, not under the caller's GIL, so no reward workers are
needed (and they would split the anchors between processes).
"""

from __future__ import annotations

import json
import re
import secrets
import threading
from collections import Counter
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout.verifiers.adaptive_timeout import AdaptiveTimeoutConfig, TimeoutAnchors
from rollout.verifiers.equality import PRELUDE, run_tests, strict_asserts
from rollout.verifiers.sandbox import Sandbox, SandboxConfig

# Contained faults, counted as reward failures; ``error`` (the program raised or a test failed)
# is a wrong answer, not a fault.
FAULTS = ("timeout", "memory", "output", "killed", "sandbox", "busy")
_FUTURE = re.compile(r"^from __future__ import [^\n]*\n", re.M)
_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)


class CodeRewardConfig(BaseModel):
    """``reward: {type: code, ...}``: run the answer against the task's tests in a sandbox."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["code"] = Field("code", description="Selects the code reward.")
    sandbox: SandboxConfig = Field(default_factory=lambda: SandboxConfig(), description="The sandbox's limits.")
    timeout: AdaptiveTimeoutConfig = Field(
        default_factory=lambda: AdaptiveTimeoutConfig(), description="Each run's time limit (adaptive or fixed)."
    )

    def max_seconds(self) -> float:
        """The longest one score can take: the fixed limit, and a killed run's few seconds to be gone."""
        return self.timeout.t_max_s + 6.0

    def build(self, **_) -> CodeReward:
        return CodeReward(self)


def extract_program(response: str) -> str:
    """The last fenced code block (an unclosed one runs to the end), else the whole response."""
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def program_for(response: str, task: dict, equality: str | None = None) -> str:
    """The program a run executes: the answer, then the task's tests. ``equality``: a name new each
    run for the equality helper (``equality.py``): defined first, the tests' ``==`` asserts use it,
    and the tests are compiled as ``<tests-NAME>``."""
    code = extract_program(response)
    entry = task.get("entry_point")
    if task.get("prompt") and not (entry and re.search(rf"^\s*def\s+{re.escape(entry)}\s*\(", code, re.M)):
        code = task["prompt"] + code  # the answer continues the given signature
    if equality is None:
        program = f"{code}\n\n{task['tests']}\n"
    else:
        program = f"{code}\n\n" + run_tests(strict_asserts(task["tests"], equality), f"<tests-{equality}>")
    if entry and re.search(r"^def\s+check\s*\(", task["tests"], re.M):
        program += f"\ncheck({entry})\n"
    if equality is None:
        return program
    # `from __future__` must open a file: such lines of the answer go above the helper.
    future = "".join(_FUTURE.findall(program))
    return future + PRELUDE.format(name=equality, tests=f"<tests-{equality}>") + _FUTURE.sub("", program)


def parse_task(answer: str | dict) -> dict:
    task = json.loads(answer) if isinstance(answer, str) else answer
    if not isinstance(task, dict) or not isinstance(task.get("tests"), str):
        raise ValueError(f"a code task's answer must be a JSON object with 'tests' (code), got {str(answer)[:100]!r}")
    return task


class CodeReward:
    def __init__(self, config: CodeRewardConfig) -> None:
        self.config = config
        self.sandbox = Sandbox(config.sandbox)
        self.anchors = TimeoutAnchors(config.timeout)
        self.adaptive_cuts = 0  # timeouts at a limit below t_max_s: stopped early by the adaptive rule
        self.early_exits = 0  # exited 0 without reaching the end of the tests
        self.sandbox_seconds = 0.0
        self._lock = threading.Lock()

    def __call__(self, response: str, answer: str) -> float:
        return self.scored(response, answer)[0]

    def scored(self, response: str, answer: str, timeout_s: float | None = None) -> tuple[float, str]:
        """The score and, when a contained fault cut it to 0, its cause ("" otherwise: a wrong answer
        is no fault). ``timeout_s``: the caller's own bound, when shorter than the run's limit."""
        task = parse_task(answer)
        key = str(task.get("task_id", ""))
        adaptive = self.anchors.timeout_for(key)
        limit = adaptive if timeout_s is None else min(adaptive, timeout_s)
        # Passing is exit 0 *and* a marker the program prints after the tests: an answer that exits
        # early with 0 (sys.exit(0), os._exit(0): a known reward hack of code RL) never prints it.
        # The marker is new each run and the program comes on stdin, so the answer cannot read it
        # from a file (only from its own code object in memory, which this does not stop).
        # The tests compare with a helper of a name new each run (equality.py): an object whose
        # __eq__ is always true is equal to nothing there.
        marker = secrets.token_hex(16)
        program = f"{program_for(response, task, '_rollmesh_eq_' + secrets.token_hex(8))}\nprint({marker!r})\n"
        result = self.sandbox.run(program, timeout_s=limit)
        with self._lock:
            self.sandbox_seconds += result.seconds
            if result.outcome == "timeout" and limit == adaptive < self.config.timeout.t_max_s:
                self.adaptive_cuts += 1
            if result.outcome == "ok" and result.stdout.rstrip().rpartition("\n")[2] != marker:
                self.early_exits += 1
                return 0.0, "early_exit"
        if result.outcome != "ok":
            return 0.0, result.outcome if result.outcome in FAULTS else ""
        self.anchors.correct(key, result.seconds)
        return 1.0, ""

    @property
    def outcomes(self) -> dict[str, int]:
        """Runs by outcome (``sandbox.OUTCOMES``)."""
        return dict(self.sandbox.counts)

    @property
    def failures(self) -> Counter[str]:
        """Scores cut to 0 by a contained fault, by cause (``early_exit``: exit 0 before the tests ended)."""
        failures = Counter({k: self.sandbox.counts[k] for k in FAULTS})
        failures["early_exit"] = self.early_exits
        return failures
