"""Arithmetic word problems with a calculator tool: a multi-turn environment with tool use.

The model reads a problem and may call the calculator any number of times (up to
``max_calls``) by writing ``<calc>12 * (3 + 4)</calc>``; the result comes back as a ``tool``
message. Any reply without a call is its answer, scored by the task's reward function against
the row's answer (``exact_match``, ``math_verify``, ...), and the episode ends. A call that does
not parse is answered with the error, as a real tool would, and costs a call.

Expressions are evaluated from their syntax tree (numbers, + - * / // % **, parentheses), never
with ``eval``: an action is model output, and a provider hosting this runs it on its machine.
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout.budgets import Budgets
from rollout.envs.base import StepResult

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
INSTRUCTIONS = (
    "\n\nYou may use a calculator: write <calc>expression</calc> (for example <calc>12 * (3 + 4)</calc>) and its "
    "result comes back. When you know the answer, reply with the number alone."
)
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64  # 10 ** 10 ** 10 would hang the provider


class CalculatorError(ValueError):
    """An expression the calculator does not take; its message is what the model reads."""


def calculate(expression: str) -> str:
    """The calculator's answer: an integer where the result is one, else a float with 6 significant digits."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError(f"cannot parse {expression.strip()!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.6g}"


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _OPS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
    raise CalculatorError(f"only numbers and + - * / // % ** ( ) are allowed, not {type(node).__name__}")


class CalculatorEnvConfig(BaseModel):
    """Word problems with a calculator tool (``rollout/envs/calculator.py``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["calculator"] = Field("calculator", description="Selects the calculator environment.")
    max_calls: int = Field(3, ge=0, description="Calculator calls per episode; the next reply is the answer.")
    instructions: bool = Field(True, description="Append how to call the calculator to each problem.")
    budgets: Budgets = Field(
        default_factory=lambda: Budgets(step_s=5.0, episode_s=300.0),
        description="The latency budgets it declares: a calculator answers at once; a whole problem in minutes.",
    )

    def build(self, rows: list[dict], reward_fn: Callable) -> CalculatorEnv:
        return CalculatorEnv(rows, reward_fn, self)


class CalculatorEnv:
    name = "calculator"

    def __init__(
        self, rows: list[dict], reward_fn: Callable[[str, str], float], config: CalculatorEnvConfig | None = None
    ) -> None:
        self.rows, self.reward_fn = rows, reward_fn
        self.config = config or CalculatorEnvConfig()
        self.budgets = self.config.budgets
        self._row: dict | None = None
        self.calls = 0

    def reset(self, seed: int) -> str:
        self._row, self.calls = self.rows[seed % len(self.rows)], 0
        return self._row["prompt"] + (INSTRUCTIONS if self.config.instructions else "")

    def step(self, action: str) -> StepResult:
        if self._row is None:
            raise RuntimeError("step() before reset()")
        call = CALL.search(action)
        if call is None or self.calls >= self.config.max_calls:  # the reply is the answer
            reward = float(self.reward_fn(CALL.sub("", action).strip(), self._row["answer"]))
            return StepResult(None, reward, True, {"answer": self._row["answer"], "calls": self.calls})
        self.calls += 1
        try:
            result = calculate(call.group(1))
        except CalculatorError as e:
            result = f"error: {e}"
        return StepResult(result, 0.0, False, {"calls": self.calls}, role="tool")
