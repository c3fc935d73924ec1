"""A streamed answer's text, safe to send as it grows.

Tokens arrive a few at a time; the text sent must never be taken back. So the text of the tokens
so far is held back where it may still change: a character cut in half between tokens, a tail
that may be the start of a stop string (the answer ends before it), and, where tools were
offered, anything from the start of a tool call on (the call is sent as ``tool_calls`` once the
answer is whole) and whitespace that the parsed message would strip before one.
"""

from __future__ import annotations

from rollout.agent.messages import TOOL_CALL_OPEN


class TextStream:
    def __init__(self, tokenizer, stop: list[str], tools: bool) -> None:
        self.tokenizer, self.stop, self.tools = tokenizer, [s for s in stop if s], tools
        self.ids: list[int] = []
        self.sent = ""
        self.done = False  # a stop string or a tool call began: nothing more is sent before the end

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; returns the text that may be sent now ("" when none)."""
        self.ids += new_ids
        if self.done:
            return ""
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
        safe = self._safe(text)
        if not safe.startswith(self.sent) or len(safe) <= len(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent) :], safe
        return delta

    def rest(self, final_text: str) -> str:
        """The text still to send once the answer is whole (``final_text``: the answer's content,
        cut at a stop string, without its tool calls; the parser strips the content of an answer
        with calls, so leading whitespace sent before may be missing from it)."""
        if final_text.startswith(self.sent):
            return final_text[len(self.sent) :]
        final, sent = final_text.lstrip(), self.sent.lstrip()
        return final[len(sent) :] if final.startswith(sent) else ""

    def _safe(self, text: str) -> str:
        marks = self.stop + ([TOOL_CALL_OPEN] if self.tools else [])
        found = [text.find(m) for m in marks if m in text]
        if found:
            self.done = True
            text = text[: min(found)]
        else:  # hold back a tail that may become a mark
            hold = max((k for m in marks for k in range(1, len(m)) if text.endswith(m[:k])), default=0)
            text = text[: len(text) - hold]
        return text.rstrip() if self.tools else text
