"""Rendering an agent's conversation with the model's chat template, a new turn at a time.

The same rule as an episode's (``rollout/chat_turns.py``): the tokens of a conversation are the
template's for the whole of it, except that assistant turns the policy generated stay exactly as
generated. A request that continues a conversation the gateway generated is rendered as the
text the template adds after that assistant turn: the rest of the turn's closing, then the new
messages and the generation prompt. Here the assistant message comes back from the agent (with
its tool calls in the OpenAI shape, which the template re-renders in its own way), so the
closing is found with a placeholder content instead of the message itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout.chat_turns import NotAPrefix, token_ids

_PLACEHOLDER = "\x00rollmesh-assistant-content\x00"


@dataclass(frozen=True)
class Rendered:
    """A prompt: its token ids and the template's text for it (with the generation prompt)."""

    ids: list[int]
    text: str


class TemplateRenderer:
    """The model's chat template (or ``chat_template``, a Jinja string, in its place) with tools."""

    def __init__(self, tokenizer, chat_template: str | None = None) -> None:
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self._special = set(tokenizer.all_special_ids)

    def text(self, messages: list[dict], tools: list | None, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )

    def encode(self, text: str) -> list[int]:
        """Text the template made: its special tokens are read as such, nothing is added."""
        return token_ids(self.tokenizer.encode(text, add_special_tokens=False))

    def whole(self, messages: list[dict], tools: list | None) -> Rendered:
        """A conversation rendered from its start."""
        text = self.text(messages, tools, True)
        return Rendered(self.encode(text), text)

    def after(
        self, prompt_text: str, generated_ids: list[int], messages: list[dict], assistant_index: int, tools: list | None
    ) -> Rendered:
        """The tokens that follow a generated assistant turn (``messages[assistant_index]``, made
        of ``generated_ids`` for a prompt whose text was ``prompt_text``) up to the generation
        prompt after ``messages``; ``text`` is the template's text of the whole conversation.
        Raises ``NotAPrefix`` where the template rewrites what came before."""
        before, closed = messages[:assistant_index], messages[: assistant_index + 1]
        closed_text, after_text = self.text(closed, tools, False), self.text(messages, tools, True)
        if not closed_text.startswith(prompt_text) or not after_text.startswith(closed_text):
            raise NotAPrefix("the template rewrites earlier turns when a turn is added")
        marked = self.text([*before, {"role": "assistant", "content": _PLACEHOLDER}], tools, False)
        if not marked.startswith(prompt_text) or _PLACEHOLDER not in marked:
            raise NotAPrefix("the template does not render an assistant turn after its prompt")
        closing = marked[marked.index(_PLACEHOLDER) + len(_PLACEHOLDER) :]
        if generated_ids and generated_ids[-1] in self._special:  # the end token was generated: it stays
            end = self.tokenizer.decode(generated_ids[-1:], skip_special_tokens=False)
            if closing.lstrip(" ").startswith(end):
                closing = closing.lstrip(" ")[len(end) :]
        return Rendered(self.encode(closing + after_text[len(closed_text) :]), after_text)
