"""OpenAI chat messages as the gateway keys and reads them: a hash chain over the conversation,
and tool calls parsed out of the model's text.

A message is keyed by its index, role, content and tool calls, chained to the key before it, so a
key names a whole conversation up to that message. Agents send their history back in many
spellings of the same thing (``content: null`` or ``""``, a list of text parts, arguments with
other whitespace), so the key is taken over a normal form; what differs after that (an edited
message) is a different conversation, and forks.

Tool calls are read in the Hermes format that Qwen2.5, Hermes and SmolLM2 are trained on:
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass

ROOT_KEY = ""
# A rendered message's images (``sample_buffer.vision.PromptImage``), in the order of their
# placeholders in its content; chat templates do not read the key.
IMAGES = "rollmesh_images"
TOOL_CALL_OPEN = "<tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def text_of(content) -> str:
    """A message's content as text: None is empty, a list of parts is its text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise ValueError(f"content: must be a string, null or a list of parts, got {type(content).__name__}")


def _arguments(raw) -> object:
    """Tool-call arguments in a normal form: JSON text is parsed, so spacing does not matter."""
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def normal_form(message: dict) -> dict:
    """What of a message decides what the model saw: role, content text, tool calls (name and
    arguments) and its images (by content hash); which call a tool result answers is left out (ids
    are the client's)."""
    calls = [
        {"name": c.get("function", {}).get("name", ""), "arguments": _arguments(c.get("function", {}).get("arguments"))}
        for c in message.get("tool_calls") or []
    ]
    form = {"role": message.get("role", ""), "content": text_of(message.get("content")).strip(), "tool_calls": calls}
    if images := message.get(IMAGES):  # the same words beside another picture are another conversation
        form["images"] = [im.hash for im in images]
    return form


def chain_key(previous: str, index: int, message: dict) -> str:
    """The key of a conversation: the key of the one before it and its last message."""
    body = json.dumps([previous, index, normal_form(message)], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def tools_key(tools: list | None) -> str:
    """The root of a chain: the tools a conversation was rendered with change its system prompt."""
    if not tools:
        return ROOT_KEY
    return hashlib.sha256(json.dumps(tools, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:32]


def conversation_keys(messages: list[dict], tools: list | None = None) -> list[str]:
    """``keys[i]``: the key of ``messages[: i + 1]`` (rendered with ``tools``)."""
    keys, key = [], tools_key(tools)
    for i, m in enumerate(messages):
        key = chain_key(key, i, m)
        keys.append(key)
    return keys


@dataclass(frozen=True)
class ParsedReply:
    """The model's text as an assistant message: its content and its tool calls."""

    content: str
    tool_calls: list[dict]

    def message(self) -> dict:
        return {
            "role": "assistant",
            "content": self.content,
            **({"tool_calls": self.tool_calls} if self.tool_calls else {}),
        }


def parse_tool_calls(text: str) -> ParsedReply:
    """Split ``<tool_call>`` blocks out of ``text``. A block that is not a JSON object with a
    ``name`` is left in the content: the agent sees what the model wrote, not a call it did not make."""
    calls, kept, last = [], [], 0
    for m in _TOOL_CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        kept.append(text[last : m.start()])
        last = m.end()
        arguments = call.get("arguments", call.get("parameters", {}))
        if not isinstance(arguments, str):  # the model may write them as a JSON string already
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": call["name"], "arguments": arguments},
            }
        )
    kept.append(text[last:])
    return ParsedReply("".join(kept).strip() if calls else text, calls)
