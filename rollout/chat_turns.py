"""Multi-turn chat rendering, token-exact against the model's own chat template.

An episode's tokens must be what the chat template gives for the whole conversation, except
that each assistant turn is exactly the tokens the engine generated (never re-tokenized, its
end-of-turn token as generated). Rendering a later turn on its own breaks this: many templates
open every conversation with a default system prompt (Qwen2, SmolLM2) or a begin-of-text token
(Llama 3), which would then reappear mid-conversation, and a template decides how a turn is
joined to the one before it.

So a new turn is rendered as the text the template adds for it: template(conversation + turn)
minus template(conversation), as strings, tokenized without special tokens of its own. Before
it comes what the template closes the assistant turn with, less the end token the engine
already generated (``<|im_end|>`` is generated, the ``\\n`` after it is not); after a length stop
nothing was generated to close the turn, so the whole closing is appended (loss mask 0, like
every rendered token).

Where a template does not render a conversation as a growing prefix of itself (one that
rewrites earlier turns, or rejects a role), a turn is rendered on its own as before, with a
warning, and the trajectory says so (``metadata["chat_render"] == "alone"``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict

ROLES = ("user", "tool")  # who may speak after the assistant: the environment says which
log = logging.getLogger(__name__)
_warned: set[str] = set()


def token_ids(rendered) -> list[int]:
    """``apply_chat_template`` returns a list or, in newer transformers, a mapping."""
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


# Each tokenizer's rendered first turns, text -> ids, most recent last (kept with the tokenizer).
_RENDERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_RENDERED_MAX = 4096
_rendered_lock = threading.Lock()


def render_prompt(tokenizer, text: str) -> list[int]:
    """The first turn: one user message and the generation prompt, as the template gives it. A
    group's members render the same prompt: it is rendered once and kept (the last few thousand)."""
    with _rendered_lock:
        seen = _RENDERED.setdefault(tokenizer, OrderedDict())
        ids = seen.get(text)
        if ids is not None:
            seen.move_to_end(text)
            return list(ids)
    rendered = token_ids(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    with _rendered_lock:
        seen[text] = tuple(rendered)
        if len(seen) > _RENDERED_MAX:
            seen.popitem(last=False)
    return rendered


class NotAPrefix(ValueError):
    """The template does not render this conversation as an extension of the one before it."""


class Conversation:
    """The messages of one episode so far and the text the template rendered for them."""

    def __init__(self, tokenizer, first_message: str | list[dict]) -> None:
        """``first_message``: the user's first message, or the messages before the first generation
        (a system prompt, few-shot turns, then the user's), as chat templates take them."""
        self.tokenizer = tokenizer
        if isinstance(first_message, str):
            self.messages: list[dict] = [{"role": "user", "content": first_message}]
        else:
            self.messages = [dict(m) for m in first_message]
            if not self.messages or self.messages[-1].get("role") not in ROLES:
                raise ValueError("messages: the last message before a generation is the user's (or a tool's)")
        self.exact = True  # False once a turn had to be rendered on its own
        self._text: str | None = None  # the template's text for ``messages`` + generation prompt

    def prompt_ids(self) -> list[int]:
        if len(self.messages) == 1 and self.messages[0]["role"] == "user":
            return render_prompt(self.tokenizer, self.messages[0]["content"])
        return token_ids(self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True))

    def next_turn(self, generated_ids: list[int], stopped: bool, role: str, content: str) -> list[int]:
        """Tokens between one generation and the next: the rest of the assistant turn's closing,
        then the new ``role`` message and the generation prompt. ``stopped``: the generation
        ended with an end token (not at its length limit)."""
        if role not in ROLES:
            raise ValueError(f"role: {role!r} is not one of {list(ROLES)}")
        answer = self.tokenizer.decode(generated_ids, skip_special_tokens=True)
        before = self.messages
        closed = [*before, {"role": "assistant", "content": answer}]
        after = [*closed, {"role": role, "content": content}]
        self.messages = after
        if self.exact:
            try:
                text, self._text = self._delta(before, closed, after, answer, generated_ids, stopped)
                return token_ids(self.tokenizer.encode(text, add_special_tokens=False))
            except Exception as e:  # a template that raises on a role or layout: not a prefix either
                self.exact = False
                self._warn(e)
        alone = [{"role": role, "content": content}]
        return token_ids(self.tokenizer.apply_chat_template(alone, add_generation_prompt=True))

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)

    def _delta(self, before, closed, after, answer, generated_ids, stopped) -> tuple[str, str]:
        prompt = self._text if self._text is not None else self._render(before, True)
        closed_text, after_text = self._render(closed, False), self._render(after, True)
        if not closed_text.startswith(prompt) or not after_text.startswith(closed_text):
            raise NotAPrefix("the template rewrites earlier turns when a turn is added")
        turn = closed_text[len(prompt) :]
        # Templates may trim the content (Llama 3 does); the closing is what follows it.
        body = next((b for b in (answer, answer.strip()) if turn.startswith(b)), None)
        if body is None:
            raise NotAPrefix("the template changes the assistant's content")
        closing = turn[len(body) :]
        if stopped and generated_ids:
            end = self.tokenizer.decode(generated_ids[-1:], skip_special_tokens=False)
            if end and closing.startswith(end):  # generated already: its tokens stay as generated
                closing = closing[len(end) :]
        return closing + after_text[len(closed_text) :], after_text

    def _warn(self, error: Exception) -> None:
        key = getattr(self.tokenizer, "name_or_path", "") or type(self.tokenizer).__name__
        if key not in _warned:
            _warned.add(key)
            log.warning(
                "%s: chat template is not prefix-stable (%s); later turns are rendered on their own, "
                "so episodes are not token-exact against the template",
                key,
                error,
            )
