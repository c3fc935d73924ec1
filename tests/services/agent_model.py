"""A tiny model that has learned one agent's script: call ``add`` on the user's numbers, then say the sum.

The embedded engine then runs a real model that really emits Hermes tool calls (no pretrained
model small enough for a test does so reliably), so an agent framework's tool loop runs for real
against the gateway. 100 supervised steps on the one transcript (about 20 s), rendered with a
compact tool template; loss on the assistant turns only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# ChatML with tools named, not described: a short prompt the tiny model learns by heart in seconds
# (the Hermes boilerplate of examples/agent/chatml_tools.jinja is ~700 tokens at a token per byte).
TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools: {{ tools | map(attribute='function.name') | join(', ') }}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ 'user' if m['role'] == 'tool' else m['role'] }}\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}{% for c in m['tool_calls'] or [] %}"
    '<tool_call>{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}}</tool_call>'
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
INSTRUCTIONS = "Add the numbers with the add tool."


def script(a: int, b: int) -> list[dict]:
    """The conversation the agent has with the policy, as the OpenAI API carries it."""
    call = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": json.dumps({"a": a, "b": b})}}
    return [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": f"Add {a} and {b}."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": str(a + b)},
        {"role": "assistant", "content": f"The sum is {a + b}."},
    ]


def build_tool_agent_model(out: Path, tools: list[dict], steps: int = 100, seed: int = 0) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.tiny_model import TinyModelConfig, build_tiny_model

    path = build_tiny_model(out, TinyModelConfig(seed=seed))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    messages = script(3, 4)  # one script, learned by heart: the test needs the tool loop, not arithmetic

    def render(upto: int, prompt: bool) -> list[int]:
        text = tok.apply_chat_template(
            messages[:upto], tools=tools, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=prompt
        )
        return tok.encode(text if prompt else text.rstrip("\n"), add_special_tokens=False)

    ids = render(len(messages), False)
    labels = [-100] * len(ids)
    for i, m in enumerate(messages):  # each assistant turn, its <|im_end|> included, is a target
        if m["role"] == "assistant":
            start, end = len(render(i, True)), len(render(i + 1, False))
            labels[start:end] = ids[start:end]
    x, y = torch.tensor([ids]), torch.tensor([labels])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=x, labels=y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(path)
    tok.chat_template = TEMPLATE  # the template it learned is its own: a gateway needs no other
    tok.save_pretrained(path)
    return str(path)
