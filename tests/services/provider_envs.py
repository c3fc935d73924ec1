"""Environments the provider tests host, and an OpenEnv server written with openenv-core alone.

``ScriptEnv`` plays a short multi-turn episode and misbehaves on request: the action says how
(``hang``, ``raise``, ``huge``, ``empty``, ``number``), so one provider process serves every
fault a test needs.
"""

from __future__ import annotations

import time

from rollout.budgets import Budgets
from rollout.envs.base import Observation, StepResult


class ScriptEnv:
    """reset(seed) -> "start <seed>"; each step answers the action back as a tool result; the third
    step ends the episode with reward 1.0 if the action is "7"."""

    name = "script"
    budgets = Budgets(step_s=5.0, generation_tokens=64)  # declared to every caller

    def __init__(self, rows=None, reward_fn=None, turns: int = 3) -> None:
        self.turns, self.steps, self.seed = turns, 0, None

    def reset(self, seed: int) -> str:
        self.seed, self.steps = seed, 0
        return f"start {seed}"

    def step(self, action: str) -> StepResult:
        self.steps += 1
        match action:
            case "hang":
                time.sleep(3600)
            case "raise":
                raise ValueError("the script was told to raise")
            case "huge":
                return StepResult("x" * 200_000, 0.0, False, role="tool")
            case "empty":
                return StepResult("", 0.0, False, role="tool")
            case "number":
                return StepResult(5, 0.0, False)  # type: ignore[arg-type]  # not text: the env's bug
        if self.steps >= self.turns:
            return StepResult(None, float(action == "7"), True, {"steps": self.steps})
        return StepResult(f"echo {action}", 0.1, False, role="tool")


def openenv_app():
    """An OpenEnv server, written against openenv-core only: guess a number in 1..4, told
    "higher"/"lower". Its observation and action fields are its own (``message`` / ``guess``)."""
    from openenv.core.env_server import Environment, create_app
    from openenv.core.env_server.types import Action, Observation, State

    class GuessAction(Action):
        guess: str

    class GuessObservation(Observation):
        message: str = ""

    class GuessEnv(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self._state, self.target = State(), 1

        def reset(self, seed=None, episode_id=None, **kwargs) -> GuessObservation:
            self._state = State(episode_id=episode_id, step_count=0)
            self.target = (seed or 0) % 4 + 1
            return GuessObservation(message="Guess a number from 1 to 4.")

        def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
            self._state.step_count += 1
            if action.guess.strip() == str(self.target):
                return GuessObservation(message="Correct!", reward=1.0, done=True)
            hint = "higher" if action.guess.strip().isdigit() and int(action.guess) < self.target else "lower"
            return GuessObservation(message=f"No, {hint}.", reward=0.0, done=self._state.step_count >= 4)

        @property
        def state(self) -> State:
            return self._state

    return create_app(GuessEnv, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=16)


def openenv_one_session_app():
    """OpenEnv's shapes from its repository's examples, written with openenv-core alone: one session
    at a time (``max_concurrent_envs=1``: a second socket gets CAPACITY_REACHED), and a last
    observation whose text field is null (reasoning_gym_env's ``question: null`` with ``done``)."""
    from openenv.core.env_server import Environment, create_app
    from openenv.core.env_server.types import Action, Observation, State

    class AnswerAction(Action):
        answer: str

    class QuestionObservation(Observation):
        question: str | None = None
        score: float | None = None

    class SumEnv(Environment):
        def __init__(self) -> None:
            super().__init__()
            self._state, self.total = State(), 0

        def reset(self, seed=None, episode_id=None, **kwargs) -> QuestionObservation:
            self._state = State(episode_id=episode_id, step_count=0)
            self.total = 2 + (seed or 0)
            return QuestionObservation(question=f"What is 2 + {seed or 0}?")

        def step(self, action: AnswerAction, timeout_s=None, **kwargs) -> QuestionObservation:
            self._state.step_count += 1
            score = float(action.answer.strip() == str(self.total))
            return QuestionObservation(question=None, score=score, reward=score, done=True)

        @property
        def state(self) -> State:
            return self._state

    return create_app(SumEnv, AnswerAction, QuestionObservation, env_name="sum", max_concurrent_envs=1)


def openenv_feedback_app():
    """textarena_env's shape, written with openenv-core alone: the rules in ``prompt`` (every
    observation), the game's feedback in ``messages`` (a list of messages, empty at first)."""
    from openenv.core.env_server import Environment, create_app
    from openenv.core.env_server.types import Action, Observation, State

    class GuessAction(Action):
        message: str

    class ChatObservation(Observation):
        prompt: str = ""
        messages: list[dict] = []

    class GuessEnv(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self._state, self.target = State(), 1

        def reset(self, seed=None, episode_id=None, **kwargs) -> ChatObservation:
            self._state, self.target = State(episode_id=episode_id, step_count=0), (seed or 0) % 4 + 1
            return ChatObservation(prompt="Guess a number from 1 to 4 in [brackets].", messages=[])

        def step(self, action: GuessAction, timeout_s=None, **kwargs) -> ChatObservation:
            self._state.step_count += 1
            guess = action.message.strip(" []")
            won = guess == str(self.target)
            hint = "You win." if won else "Higher." if guess.isdigit() and int(guess) < self.target else "Lower."
            feedback = [{"role": "game", "content": f"You guessed {guess}."}, {"role": "game", "content": hint}]
            return ChatObservation(
                prompt="Guess a number from 1 to 4 in [brackets].",
                messages=feedback,
                reward=float(won),
                done=won or self._state.step_count >= 4,
            )

        @property
        def state(self) -> State:
            return self._state

    return create_app(GuessEnv, GuessAction, ChatObservation, env_name="feedback", max_concurrent_envs=8)


def game_text(observation: dict) -> str:
    """An ``env.observation_format``: the newest message only."""
    return observation["messages"][-1]["content"] if observation["messages"] else observation["prompt"]


class PictureEnv:
    """A vision-language task over the wire: reset(seed) shows a picture of digit ``seed % 10``; a
    step answered ``more`` shows another picture, any other ends the episode (reward 1.0 if right)."""

    name = "pictures"

    def __init__(self, rows=None, reward_fn=None) -> None:
        self.seed = 0

    @staticmethod
    def picture(seed: int) -> bytes:
        import random

        from rollout.envs.digit_pictures import picture

        return picture(seed % 10, random.Random(seed))

    def reset(self, seed: int) -> Observation:
        self.seed = seed
        return Observation("Which digit?", (self.picture(seed),))

    def step(self, action: str) -> StepResult:
        if action == "more":
            self.seed += 1
            return StepResult(Observation("And this one?", (self.picture(self.seed),)), 0.0, False)
        return StepResult(None, float(action == str(self.seed % 10)), True)


def openenv_grid_app():
    """An OpenEnv server with a typed action and no text in its observation (a grid game), written
    with openenv-core alone: ``{"move": 0..3}`` (up, down, left, right) from (0, 0); (0, 1) wins. An
    answer its action class does not validate ("go up", 7) is refused with its validation error."""
    from openenv.core.env_server import Environment, create_app
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field

    class MoveAction(Action):
        move: int = Field(ge=0, le=3)

    class GridObservation(Observation):
        position: list[int] = [0, 0]
        legal: list[int] = [0, 1, 2, 3]

    class GridEnv(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self) -> None:
            super().__init__()
            self._state, self.at = State(), [0, 0]

        def reset(self, seed=None, episode_id=None, **kwargs) -> GridObservation:
            self._state, self.at = State(episode_id=episode_id, step_count=0), [0, 0]
            return GridObservation(position=self.at)

        def step(self, action: MoveAction, timeout_s=None, **kwargs) -> GridObservation:
            self._state.step_count += 1
            dx, dy = [(0, 1), (0, -1), (-1, 0), (1, 0)][action.move]
            self.at = [self.at[0] + dx, self.at[1] + dy]
            won = self.at == [0, 1]
            return GridObservation(position=self.at, reward=float(won), done=won or self._state.step_count >= 3)

        @property
        def state(self) -> State:
            return self._state

    return create_app(GridEnv, MoveAction, GridObservation, env_name="grid", max_concurrent_envs=16)


def grid_text(observation: dict) -> str:
    """An ``env.observation_format`` for the grid: its position and legal moves, as text."""
    return f"You are at {observation['position']}; moves {observation['legal']} (0 up, 1 down, 2 left, 3 right)."


def first_integer(text: str) -> dict:
    """An ``env.action_format``: the answer's first integer as the move; no integer: no action."""
    import re

    found = re.search(r"-?\d+", text)
    if found is None:
        raise ValueError(f"no integer in {text[:40]!r}")
    return {"move": int(found.group())}
