"""Rendering an agent's conversation with the model's chat template, a new turn at a time.

The same rule as an episode's (``rollout/chat_turns.py``): the tokens of a conversation are the
template's for the whole of it, except that assistant turns the policy generated stay exactly as
generated. A request that continues a conversation the gateway generated is rendered as the
text the template adds after that assistant turn: the rest of the turn's closing, then the new
messages and the generation prompt. Here the assistant message comes back from the agent (with
its tool calls in the OpenAI shape, which the template re-renders in its own way), so the
closing is found with a placeholder content instead of the message itself.

A vision-language model's images stand in the messages' text as the model's placeholder (one per
image, where its part was) and their bytes ride along (``IMAGES``); a rendering is then two
spellings of one prompt: what the engines take (``sent``: one placeholder per image, with the
images) and what the model reads (``ids``: each placeholder expanded to its image's tokens), which
the trajectory records.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout.agent.messages import IMAGES
from rollout.chat_turns import NotAPrefix, token_ids
from sample_buffer.vision import PromptImage, Vision, VisionError

_PLACEHOLDER = "\x00rollmesh-assistant-content\x00"


class ImageError(ValueError):
    """Images that do not fit the prompt: placeholders written in the text, or images for a text-only model."""


@dataclass(frozen=True)
class Rendered:
    """A prompt: its token ids (images expanded), the template's text for it (with the generation
    prompt), and, where it shows images, the ids as the engines take them and the images."""

    ids: list[int]
    text: str
    sent: list[int] | None = None  # None: the same as ids (no images)
    images: tuple[PromptImage, ...] = ()


class TemplateRenderer:
    """The model's chat template (or ``chat_template``, a Jinja string, in its place) with tools."""

    def __init__(self, tokenizer, chat_template: str | None = None, vision: Vision | None = None) -> None:
        self.tokenizer, self.chat_template, self.vision = tokenizer, chat_template, vision
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
        return self._with_images(self.encode(text), text, messages)

    def _with_images(self, sent: list[int], text: str, messages: list[dict]) -> Rendered:
        """``sent`` (the rendering of ``messages``, one placeholder per image) with the images expanded."""
        images = tuple(im for m in messages for im in m.get(IMAGES) or ())
        if self.vision is None:
            if images:
                raise ImageError("messages: this model takes no images")
            return Rendered(sent, text)
        try:  # also where the text itself holds a placeholder: the count no longer matches
            ids = self.vision.expand(sent, [im.tokens for im in images], "messages")
        except VisionError as e:
            raise ImageError(str(e)) from None
        return Rendered(ids, text, sent, images) if images else Rendered(sent, text)

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
        added = self.encode(closing + after_text[len(closed_text) :])
        return self._with_images(added, after_text, messages[assistant_index + 1 :])
