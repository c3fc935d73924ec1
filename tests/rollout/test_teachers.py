"""A group's teacher call, its pure parts: which positions are asked and which answers are kept."""

from __future__ import annotations

import numpy as np
import pytest

from rollout.teachers import TeacherFailed, first_generated, generated_logprobs


def test_a_multi_turn_members_environment_tokens_are_read_but_never_kept():
    # prompt (3) | turn 1 (2) | environment (2) | turn 2 (1)
    mask = np.array([0, 0, 0, 1, 1, 0, 0, 1], dtype=np.int8)
    start = first_generated(mask)
    scored = [-0.1, -0.2, -0.3, -0.4, -0.5]  # positions 3..7
    assert start == 3
    assert generated_logprobs(mask, start, scored).tolist() == pytest.approx([-0.1, -0.2, -0.5])
    assert first_generated(np.zeros(4, dtype=np.int8)) == -1


def test_an_answer_of_another_length_fails_the_group():
    mask = np.array([0, 1, 1], dtype=np.int8)
    with pytest.raises(TeacherFailed, match="1 log-probs for the 2 tokens asked"):
        generated_logprobs(mask, 1, [-0.5])
