"""A streamed answer's text, safe to send as it grows.

Tokens arrive a few at a time; the text sent must never be taken back. So the text of the tokens
so far is held back where it may still change: a character cut in half between tokens, a tail
that may be the start of a stop string (the answer ends before it), and, where tools were
offered, anything from the start of a tool call on (the call is sent as ``tool_calls`` once the
answer is whole) and whitespace that the parsed message would strip before one.

Each push costs what its new tokens cost, not what the answer so far does: only the new tokens
are decoded (after the last ones, for context) and only the text they add, with a mark's length
before it, is searched. Decoding the whole answer every push made a 4,096-token stream quadratic
on the gateway's event loop.
"""

from __future__ import annotations

from rollout.agent.messages import TOOL_CALL_OPEN


class TextStream:
    def __init__(self, tokenizer, stop: list[str], tools: bool) -> None:
        self.tokenizer, self.tools = tokenizer, tools
        self.marks = [s for s in stop if s] + ([TOOL_CALL_OPEN] if tools else [])
        self.ids: list[int] = []
        self.text = ""  # the text of ids[: self._read], whole characters only
        # ids[_prefix:_read] are decoded again before new ones: a token's text depends on the one
        # before it (a space it adds or drops, a character split across tokens)
        self._prefix = self._read = 0
        self._searched = 0  # no mark starts before text[: self._searched - longest mark + 1]
        self.sent = ""
        self.done = False  # a stop string or a tool call began: nothing more is sent before the end

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; returns the text that may be sent now ("" when none)."""
        self.ids += new_ids
        if self.done or not self._decode_new():
            return ""
        safe = self._safe()
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

    def _decode_new(self) -> bool:
        """Extend ``text`` by the new tokens' whole characters; False when they add none yet."""
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read], skip_special_tokens=True)
        after = decode(self.ids[self._prefix :], skip_special_tokens=True)
        if after.endswith("\ufffd"):
            return False  # a character still cut in half: wait for more
        if not after.startswith(before):  # a decode that rewrote the text before (spaces cleaned up):
            self.text = decode(self.ids, skip_special_tokens=True)  # the whole answer again, once
            self._prefix, self._read, self._searched = max(0, len(self.ids) - 1), len(self.ids), 0
            return True
        if len(after) <= len(before):
            return False  # nothing printable yet
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self.ids)
        return True

    def _safe(self) -> str:
        text, longest = self.text, max(map(len, self.marks), default=0)
        start = max(0, self._searched - longest + 1)
        self._searched = len(text)
        found = [i for m in self.marks if (i := text.find(m, start)) >= 0]
        if found:
            self.done = True
            text = text[: min(found)]
        elif text:  # hold back a tail that may become a mark
            text = text[: len(text) - max((_tail_of(text, m) for m in self.marks), default=0)]
        return text.rstrip() if self.tools else text


def _tail_of(text: str, mark: str) -> int:
    """The longest k < len(mark) with text ending in mark[:k] (0 when none); tries only the k
    whose mark[k - 1] is the text's last character."""
    k, last = len(mark) - 1, text[-1]
    while (k := mark.rfind(last, 0, k)) >= 0:
        if text.endswith(mark[: k + 1]):
            return k + 1
    return 0
