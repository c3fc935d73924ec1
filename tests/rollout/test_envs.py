import pytest

from rollout.envs import SingleTurnEnv, load_jsonl
from rollout.rewards import exact_match, resolve_reward


def test_single_turn_env_scores_and_ends(tmp_path):
    env = SingleTurnEnv([{"prompt": "2+3=", "answer": "5"}, {"prompt": "1+1=", "answer": "2"}], exact_match)
    assert env.reset(3) == "1+1="
    res = env.step(" 2 ")
    assert res.done and res.reward == 1.0 and res.observation is None
    env.reset(0)
    assert env.step("6").reward == 0.0


def test_a_wrong_answer_is_told_and_answered_again_until_the_tries_run_out():
    from pydantic import TypeAdapter, ValidationError

    from rollout.envs.config import EnvConfig
    from rollout.rewards import digit_answer

    config = TypeAdapter(EnvConfig).validate_python

    rows = [{"prompt": "kq7x", "answer": "7"}]
    env = config({"type": "single_turn", "tries": 3}).build(rows, digit_answer)
    env.reset(0)
    first = env.step("3")
    assert (first.observation, first.reward, first.done) == ("No. Try again.", 0.0, False)
    assert env.step("7").reward == 0.5  # solved at the second try: 1.0 x 0.5
    env.reset(0)
    assert env.step("7").reward == 1.0  # a new episode starts from its first try
    env.reset(0)
    results = [env.step(a) for a in ("1", "x", "2")]
    assert [r.done for r in results] == [False, False, True]
    assert results[-1].info["tries"] == 3  # out of tries: the last answer's reward, discounted as a solve would be
    assert results[-1].reward == pytest.approx(0.1 * 0.5**2)
    with pytest.raises(ValidationError, match="tries"):
        config({"type": "single_turn", "tries": 0})


def test_jsonl_errors_name_the_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a", "answer": "b"}\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: missing field 'answer'"):
        load_jsonl(p)
    p.write_text("{nope\n")
    with pytest.raises(ValueError, match="d.jsonl:1: not JSON"):
        load_jsonl(p)
    assert len(load_jsonl("examples/find_digit_train.jsonl")) == 500


def test_reward_registry():
    assert resolve_reward("exact_match") is exact_match
    assert resolve_reward("rollout.rewards:first_token_match")("7 apples", "7") == 1.0
    with pytest.raises(ValueError, match="unknown"):
        resolve_reward("nope")


def test_the_calculator_evaluates_arithmetic_and_nothing_else():
    from rollout.envs.calculator import CalculatorError, calculate

    assert [calculate(e) for e in ("12 * (3 + 4)", "7 / 2", " -3 + 10 ", "9 // 2", "2 ** 10", "1/3")] == [
        "84",
        "3.5",
        "7",
        "4",
        "1024",
        "0.333333",
    ]
    for bad in ("__import__('os').system('true')", "1 / 0", "2 ** 1000", "x + 1", "3 +", "1" * 300):
        with pytest.raises(CalculatorError):
            calculate(bad)


def test_calculator_env_answers_tool_calls_then_scores_the_answer():
    from rollout.envs.calculator import CalculatorEnv, CalculatorEnvConfig

    env = CalculatorEnv(
        [{"prompt": "Ann has 12 boxes of 7 pens. How many pens?", "answer": "84"}],
        exact_match,
        CalculatorEnvConfig(max_calls=2),
    )
    assert env.reset(0).startswith("Ann has 12 boxes") and "<calc>" in env.reset(0)
    call = env.step("Let me compute <calc>12*7</calc>")
    assert (call.observation, call.role, call.done, call.reward) == ("84", "tool", False, 0.0)
    assert env.step("<calc>12 *</calc>").observation.startswith("error: cannot parse")  # a bad call costs a call
    out_of_calls = env.step("<calc>1+1</calc> 84")  # the third call is over max_calls: this is the answer
    assert out_of_calls.done and out_of_calls.reward == 1.0 and out_of_calls.info["calls"] == 2
    env.reset(0)
    assert env.step("85").reward == 0.0 and env.budgets.step_s == 5.0


def test_a_gem_game_is_played_to_a_win_and_a_loss():
    import re

    from rollout.envs.gem_game import GemEnv, GemEnvConfig

    env = GemEnv(GemEnvConfig(env_id="game:GuessTheNumber-v0-easy"))
    first = env.reset(7)
    assert "Guess The Number" in first and "between 1 and 10" in first
    lo, hi, result = 1, 10, None
    for _ in range(4):  # binary search wins in at most 4 guesses of 1..10
        guess = (lo + hi) // 2
        result = env.step(f"My guess: \\boxed{{{guess}}}")
        if result.done:
            break
        lo, hi = (guess + 1, hi) if "higher" in result.observation else (lo, guess - 1)
        assert re.search(r"guessed \d+", result.observation) and "next guess" in result.observation
    assert result.done and result.reward == 1.0
    lose = GemEnv(GemEnvConfig(env_id="game:GuessTheNumber-v0-easy", reward_on_loss=0.0))
    lose.reset(7)
    target = int(re.search(r"\d+", result.info["feedback"].split("number")[-1]).group())
    wrong = 1 if target != 1 else 2
    steps = [lose.step(f"\\boxed{{{wrong}}}") for _ in range(4)]
    assert steps[-1].done and steps[-1].reward == 0.0  # GEM's partial credit for a near miss, replaced


def test_a_bare_number_is_boxed_only_where_asked():
    from rollout.envs.gem_game import GemEnv, GemEnvConfig

    strict = GemEnv(GemEnvConfig(env_id="game:GuessTheNumber-v0-easy"))
    strict.reset(7)
    assert strict.step("I guess 5").done  # GEM cannot read it: the game ends
    lenient = GemEnv(GemEnvConfig(env_id="game:GuessTheNumber-v0-easy", box_bare_number=True))
    lenient.reset(7)
    target = lenient.game.game_number  # GEM's secret
    a, b = (1, 2) if target not in (1, 2) else (9, 10)
    first = lenient.step(f"I guess {a}, or maybe {b}")
    assert not first.done and f"guessed {a}," in first.info["feedback"]  # read as \\boxed{a}
    second = lenient.step(f"\\boxed{{{b}}} and not {a}")  # already boxed: passed on as written
    assert f"guessed {b}," in second.info["feedback"]


def test_a_rows_pictures_are_checked_at_load_and_decoded_per_episode(tmp_path):
    import json

    from rollout.config import TaskConfig
    from rollout.envs.base import Observation
    from rollout.envs.digit_pictures import digit_picture_rows
    from sample_buffer.vision import image_bytes

    rows = digit_picture_rows(3, seed=0)
    path = tmp_path / "pictures.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, _, build = TaskConfig(dataset_path=str(path), reward="digit_answer").env_factory()
    shown = build().reset(1)
    assert isinstance(shown, Observation) and shown.images == (image_bytes(rows[1]["images"][0]),)
    rows[2]["images"] = ["data:image/png;base64,bm90IGEgcGljdHVyZQ=="]  # "not a picture": base64, but no image
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"row 2: images\[0\]"):
        TaskConfig(dataset_path=str(path), reward="digit_answer").env_factory()
