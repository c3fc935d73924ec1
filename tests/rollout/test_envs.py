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
