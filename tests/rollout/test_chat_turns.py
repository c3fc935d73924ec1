"""Multi-turn episodes are token-exact against real chat-template layouts.

SmolLM2's own template and tokenizer (a real BPE with merges, so joining or splitting text could
change the tokens), and templates written here in the layouts of Qwen2 (ChatML, a default system
prompt, tool results inside a user turn), Llama 3 (begin-of-text, headers, trimmed content, a
default system header) and Mistral (``[INST]`` blocks, ``</s>`` after answers, alternation
enforced) on the same tokenizer with their special tokens added.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from rollout.chat_turns import Conversation
from rollout.envs.base import StepResult
from rollout.episode import EpisodeConfig, run_episode
from rollout.ports import Generation
from rollout.sampling import SamplingParams
from sample_buffer.trajectory import FinishReason

SMOLLM2 = Path(__file__).resolve().parents[2] / "models" / "smollm2"

QWEN2_LIKE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_LIKE = (
    "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023<|eot_id|>"
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m['role'] == 'tool' else m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
MISTRAL_LIKE = (
    "<s>{% for m in messages %}"
    "{% if m['role'] == 'user' %}{% if loop.index0 > 0 and messages[loop.index0 - 1]['role'] == 'user' %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}[INST] {{ m['content'] }} [/INST]"
    "{% elif m['role'] == 'tool' %}[TOOL_RESULTS] {{ m['content'] }} [/TOOL_RESULTS]"
    "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
)
SPECIALS = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "[INST]",
    "[/INST]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "<s>",
    "</s>",
]
# (template, the token that ends an assistant turn); None: SmolLM2's own template
TEMPLATES = {
    "smollm2": (None, "<|im_end|>"),
    "qwen2": (QWEN2_LIKE, "<|im_end|>"),
    "llama3": (LLAMA3_LIKE, "<|eot_id|>"),
    "mistral": (MISTRAL_LIKE, "</s>"),
}
ANSWERS = ["Let me add them: 17 + 25 = 42.", "It is 42, as the tool says.", "Done!"]
OBSERVATIONS = [("tool", "calc(17 + 25) = 42"), ("user", "Are you sure? Check it again, please."), None]


@pytest.fixture(scope="module")
def base_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tok


def tokenizer_for(base, name):
    import copy

    tok = copy.deepcopy(base)
    template, end = TEMPLATES[name]
    if template is not None:
        tok.chat_template = template
    return tok, tok.convert_tokens_to_ids(end)


class ScriptedChat:
    """A multi-turn environment that says the scripted observations in order."""

    name = "scripted-chat"

    def __init__(self, observations):
        self.observations, self.actions = list(observations), []

    def reset(self, seed):
        return "What is 17 + 25? Use the calculator."

    def step(self, action):
        self.actions.append(action)
        nxt = self.observations[len(self.actions) - 1]
        if nxt is None:
            return StepResult(None, 1.0, True)
        role, text = nxt
        return StepResult(text, 0.0, False, role=role)


def scripted_engine(tok, end_id, answers, stop=True):
    """Generates ``encode(answer)`` and the end token, as an engine sampling that text would."""
    calls = []

    async def generate(input_ids, sampling, trajectory_id, timeout_s):
        ids = tok.encode(answers[len(calls)], add_special_tokens=False)
        calls.append(list(input_ids))
        out = ids + [end_id] if stop else ids
        return Generation(out, [-0.5] * len(out), [0] * len(out), FinishReason.STOP if stop else FinishReason.LENGTH)

    return generate, calls


def run(tok, env, generate):
    config = EpisodeConfig(max_turns=4, sampling=SamplingParams(max_new_tokens=64))
    return asyncio.run(run_episode(env, 0, generate, tok, config, trajectory_id="t", group_id="g", prompt_id="p"))


def conversation(env, answers):
    messages = [{"role": "user", "content": env.reset(0)}]
    for answer, obs in zip(answers, OBSERVATIONS):
        messages.append({"role": "assistant", "content": answer})
        if obs is not None:
            messages.append({"role": obs[0], "content": obs[1]})
    return messages


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_an_episode_is_the_template_of_the_whole_conversation(base_tokenizer, name):
    tok, end_id = tokenizer_for(base_tokenizer, name)
    env = ScriptedChat(OBSERVATIONS)
    generate, prompts = scripted_engine(tok, end_id, ANSWERS)
    traj = run(tok, env, generate)
    assert traj.finish_reason == FinishReason.STOP and len(prompts) == 3
    assert "chat_render" not in traj.metadata
    messages = conversation(env, ANSWERS)
    rendered = [
        tok.apply_chat_template(messages[: 2 * i + 1], add_generation_prompt=True, tokenize=False) for i in range(3)
    ]
    generated = [tok.encode(a, add_special_tokens=False) + [end_id] for a in ANSWERS]
    # The first prompt is the template's own; each later one is the one before, the answer exactly
    # as generated, then the template's text for the new turn, tokenized on its own.
    first = tok.apply_chat_template(messages[:1], add_generation_prompt=True, return_dict=True)
    assert prompts[0] == first["input_ids"]
    for i in (1, 2):
        seen = prompts[i - 1] + generated[i - 1]
        assert prompts[i][: len(seen)] == seen, f"turn {i}: earlier tokens changed"
        new_text = rendered[i][len(tok.decode(seen, skip_special_tokens=False)) :]
        assert prompts[i][len(seen) :] == tok.encode(new_text, add_special_tokens=False), f"turn {i}"
        # As text, every prompt is exactly the template applied to the conversation so far.
        assert tok.decode(prompts[i], skip_special_tokens=False) == rendered[i], f"turn {i}"
    assert traj.token_ids.tolist() == prompts[-1] + generated[-1]
    whole = tok.apply_chat_template(messages, tokenize=False)
    assert whole.startswith(tok.decode(traj.token_ids.tolist(), skip_special_tokens=False))  # all but the last "\n"
    # Loss mask: exactly the generated tokens, each answer with its end token.
    ids, mask = traj.token_ids.tolist(), traj.loss_mask.tolist()
    generated = [t for t, m in zip(ids, mask) if m]
    assert generated == [t for a in ANSWERS for t in tok.encode(a, add_special_tokens=False) + [end_id]]
    assert env.actions == [tok.decode(tok.encode(a, add_special_tokens=False)) for a in ANSWERS]


def test_a_default_system_prompt_appears_once(base_tokenizer):
    """Rendering a later turn on its own (the old way) put SmolLM2's default system prompt into the
    middle of the conversation, once per turn."""
    tok, end_id = tokenizer_for(base_tokenizer, "smollm2")
    generate, _ = scripted_engine(tok, end_id, ANSWERS)
    traj = run(tok, ScriptedChat(OBSERVATIONS), generate)
    text = tok.decode(traj.token_ids.tolist(), skip_special_tokens=False)
    assert text.count("You are a helpful AI assistant named SmolLM") == 1
    assert text.count("<|im_start|>tool\n") == 1 and text.count("<|im_start|>user\n") == 2


def test_trimmed_answers_stay_as_generated(base_tokenizer):
    """Llama 3's template trims an answer's whitespace; the episode keeps the generated tokens and
    renders the rest around them as the template does."""
    tok, end_id = tokenizer_for(base_tokenizer, "llama3")
    answers = ["  Forty-two. \n", *ANSWERS[1:]]
    env = ScriptedChat(OBSERVATIONS)
    generate, prompts = scripted_engine(tok, end_id, answers)
    run(tok, env, generate)
    messages = conversation(env, answers)
    kept = tok.encode(answers[0], add_special_tokens=False) + [end_id]
    assert prompts[1][len(prompts[0]) : len(prompts[0]) + len(kept)] == kept
    template = tok.apply_chat_template(messages[:3], add_generation_prompt=True, tokenize=False)
    as_generated = template.replace("Forty-two.<|eot_id|>", answers[0] + "<|eot_id|>")
    assert tok.decode(prompts[1], skip_special_tokens=False) == as_generated


def test_after_a_length_stop_the_closing_is_appended_unmasked(base_tokenizer):
    tok, end_id = tokenizer_for(base_tokenizer, "qwen2")
    env = ScriptedChat(OBSERVATIONS)
    generate, prompts = scripted_engine(tok, end_id, ANSWERS, stop=False)
    traj = run(tok, env, generate)
    messages = conversation(env, ANSWERS)
    second = tok.encode(
        tok.apply_chat_template(messages[:3], add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    assert prompts[1] == second  # the template's <|im_end|>\n closes the cut answer
    ids, mask = traj.token_ids.tolist(), traj.loss_mask.tolist()
    closes = [i for i, t in enumerate(ids) if t == end_id]
    assert closes and all(mask[i] == 0 for i in closes)  # never generated, never trained on
    assert traj.finish_reason == FinishReason.LENGTH


def test_a_template_that_rewrites_history_falls_back_and_says_so(base_tokenizer, caplog):
    tok, end_id = tokenizer_for(base_tokenizer, "qwen2")
    # Keeps only the latest user message, like templates that drop earlier reasoning.
    tok.chat_template = (
        "{% for m in messages %}{% if loop.last or m['role'] == 'assistant' %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    generate, prompts = scripted_engine(tok, end_id, ANSWERS)
    with caplog.at_level(logging.WARNING, logger="rollout.chat_turns"):
        traj = run(tok, ScriptedChat(OBSERVATIONS), generate)
    assert traj.metadata["chat_render"] == "alone" and len(prompts) == 3
    assert traj.finish_reason == FinishReason.STOP


def test_an_unknown_role_ends_the_episode_as_the_environments_error(base_tokenizer):
    tok, end_id = tokenizer_for(base_tokenizer, "qwen2")
    generate, _ = scripted_engine(tok, end_id, ANSWERS)
    traj = run(tok, ScriptedChat([("system", "new rules"), None]), generate)
    assert traj.finish_reason == FinishReason.ENV_ERROR and "role" in traj.metadata["error"]


def test_a_conversation_renders_the_first_prompt_like_the_template(base_tokenizer):
    tok, _ = tokenizer_for(base_tokenizer, "llama3")
    chat = Conversation(tok, "hi")
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.prompt_ids() == tok.encode(text, add_special_tokens=False)
