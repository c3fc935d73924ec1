"""The OpenAI API's shapes as the gateway reads and writes them: requests, answers, stream chunks, errors.

Requests accept fields this gateway does not act on (``user``, ``store``, ``parallel_tool_calls``,
``metadata``, ...) and ignore them, as OpenAI-compatible servers do, because agent frameworks
send them; fields whose meaning it cannot honour are refused by name (``echo``). A forced tool
call (``tool_choice: "required"`` or a named function) and ``response_format`` (``json_object``,
``json_schema``) are decoded under a grammar (``rollout/agent/constraints.py``).
"""

from __future__ import annotations

import time
import uuid

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollout.agent.constraints import response_grammar, tool_call_grammar
from rollout.agent.messages import IMAGES, text_of
from rollout.agent.sessions import ChatResult, Choice, SessionError
from sample_buffer.vision import (
    MAX_IMAGES,
    MAX_REQUEST_IMAGE_BYTES,
    PromptImage,
    Vision,
    VisionError,
    check_image,
    image_bytes,
)

MAX_STOP_CHARS = 1024  # characters of one stop sequence (OpenAI takes short ones: a word, a tag)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}


def error(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {
        "error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param, "code": code}
    }
    # OpenAI's clients retry 409 (and 408, 429, 5xx) by themselves: the same request cannot succeed here.
    headers = {"x-should-retry": "false"} if 400 <= status < 500 and status not in (408, 429) else None
    return JSONResponse(status_code=status, content=body, headers=headers)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(..., description="The served model's name.")
    n: int = Field(1, ge=1, description="Choices to generate.")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = Field(None)
    seed: int | None = Field(None)
    stream: bool = Field(False)
    stream_options: dict | None = Field(None)
    response_format: dict | None = Field(None)

    @field_validator("response_format")
    @classmethod
    def _format_we_can_honour(cls, fmt):
        # Silently ignored, a JSON mode or schema got free text, which the agent failed to parse far
        # from the cause (LangChain's with_structured_output): each one is followed or refused by name.
        if fmt is None:
            return fmt
        if fmt.get("type", "text") not in ("text", "json_object", "json_schema"):
            raise ValueError(f"type {fmt.get('type')!r}: text, json_object or json_schema")
        spec = fmt.get("json_schema")
        if fmt.get("type") == "json_schema" and not (
            isinstance(spec, dict) and isinstance(spec.get("schema", {}), dict)
        ):
            raise ValueError("json_schema: an object {name, schema, strict} expected, its schema an object")
        return fmt

    def grammar(self) -> tuple[str, str] | None:
        """The grammar the answer is decoded under, as a sampling param ``(field, text)``; None: free."""
        return response_grammar(self.response_format)

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        # Each is looked for in every streamed piece's held-back tail: a 100k-character one cost
        # 0.22 s of blocked event loop a chunk.
        if long := [len(x) for x in stops if len(x) > MAX_STOP_CHARS]:
            raise ValueError(f"a stop sequence of {long[0]} characters; at most {MAX_STOP_CHARS}")
        return stops

    def stops(self) -> list[str]:
        return list(self.stop or [])

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatRequest(_Request):
    messages: list[dict] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = Field(None)
    tool_choice: str | dict | None = Field(None)

    @field_validator("messages")
    @classmethod
    def _messages(cls, messages: list[dict]) -> list[dict]:
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str):
                raise ValueError(f"[{i}].role: missing")
            if m["role"] not in ("system", "developer", "user", "assistant", "tool"):
                raise ValueError(f"[{i}].role: {m['role']!r} is not system, developer, user, assistant or tool")
        return messages

    @field_validator("tool_choice")
    @classmethod
    def _choice_we_can_honour(cls, choice):
        if choice in (None, "auto", "none", "required"):
            return choice
        fn = choice.get("function") if isinstance(choice, dict) else None
        if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(fn, dict)):
            raise ValueError('auto, none, required or {"type": "function", "function": {"name": ...}}')
        if not isinstance(fn.get("name"), str):
            raise ValueError("function.name: a tool's name (a string) expected")
        return choice

    def forced_tool(self) -> tuple[bool, str | None]:
        """Whether a tool call is forced, and which tool's (None: any offered one)."""
        if self.tool_choice == "required":
            return True, None
        if isinstance(self.tool_choice, dict):
            return True, self.tool_choice["function"]["name"]
        return False, None

    def grammar(self) -> tuple[str, str] | None:
        forced, name = self.forced_tool()
        if not forced:
            return super().grammar()
        if not self.tools:
            raise SessionError("tool_choice: a call is forced but no tools are offered", "tool_choice")
        if (self.response_format or {}).get("type", "text") != "text":
            raise SessionError(
                "response_format: a forced tool call and a response format cannot both hold", "response_format"
            )
        return tool_call_grammar(self.tools, name)  # xgrammar's translation (cached): CPU work, for a thread

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, k, info):
        if k and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return k

    def top_k(self) -> int:
        """How many most likely tokens to report at each position."""
        return (self.top_logprobs or 0) if self.logprobs else 0

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def image_urls(self, vision: Vision | None) -> list[tuple[str, str]]:
        """``(field, url)`` of each image part (``{"type": "image_url", "image_url": {"url": ...}}``),
        in order. Images go in user messages, to a vision-language model, as data URLs: a remote
        URL is refused, since nothing downloads."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.get("content")
            for j, part in enumerate(content if isinstance(content, list) else []):
                if not isinstance(part, dict) or part.get("type") != "image_url":
                    continue
                field = f"messages[{i}].content[{j}].image_url"
                if vision is None:
                    raise SessionError(f"{field}: this model takes no images", field)
                if m["role"] != "user":
                    raise SessionError(f"{field}: images go in user messages, not {m['role']}", field)
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else None
                if not isinstance(url, str):
                    raise SessionError(f"{field}.url: missing (an object {{'url': 'data:image/...'}})", field)
                if not url.startswith("data:"):
                    raise SessionError(
                        f"{field}.url: only data URLs (data:image/png;base64,...); remote images are not downloaded",
                        field,
                    )
                out.append((f"{field}.url", url))
        if len(out) > MAX_IMAGES:
            raise SessionError(f"messages: {len(out)} images; at most {MAX_IMAGES} per conversation", "messages")
        return out

    def rendered_messages(self, placeholder: str = "", images: list[PromptImage] = ()) -> list[dict]:
        """Messages for the chat template: ``developer`` is OpenAI's new name for ``system``; content
        given as a list of parts is its text, as the message's key reads it, each image part the
        model's ``placeholder`` where it stands, the next of ``images`` (``image_urls``' order,
        measured) riding along under ``IMAGES``; content null or left out (an assistant turn of tool
        calls, as LangChain sends it back) is empty text, since most templates read
        ``message['content']`` unconditionally."""
        out, shown = [], iter(images)
        for m in self.messages:
            m = {**m, "role": "system"} if m["role"] == "developer" else dict(m)
            if isinstance(m.get("content"), list):
                parts = [p for p in m["content"] if isinstance(p, dict)]
                if mine := [next(shown) for p in parts if p.get("type") == "image_url"]:
                    m[IMAGES] = mine
                m["content"] = "".join(placeholder if p.get("type") == "image_url" else text_of([p]) for p in parts)
            elif m.get("content") is None:
                m["content"] = ""
            out.append(m)
        return out

    def template_tools(self) -> list[dict] | None:
        """Tools the template renders; ``tool_choice: none`` hides them."""
        return None if self.tool_choice == "none" else self.tools


class CompletionRequest(_Request):
    prompt: str | list[int] = Field(..., description="Text, or token ids (token-in, token-out).")
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = Field(False)

    def top_k(self) -> int:
        return self.logprobs or 0

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("not supported: the prompt is not echoed")
        return echo

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt):
        if not prompt:
            raise ValueError("empty")
        return prompt

    def requested_tokens(self) -> int | None:
        return self.max_tokens


class SessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    group: str | None = Field(None, max_length=200, description="Sessions with one group key form one group.")
    group_size: int = Field(1, ge=1, description="How many sessions the group has; it is trained once all ended.")


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float = Field(..., allow_inf_nan=False)


class EndRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reward: float | None = Field(None, allow_inf_nan=False)


# ---------------------------------------------------------------- answers
def usage(result: ChatResult) -> dict:
    completion = sum(len(c.generation.output_ids) for c in result.choices)
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": result.prompt_tokens + completion,
    }


def _entry(tokenizer, token_id: int, logprob: float) -> dict:
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def token_logprobs(tokenizer, choice: Choice) -> list[dict]:
    """Chat's ``logprobs.content``: each token's log-prob and, when asked, its position's most likely tokens."""
    gen = choice.generation
    tops = gen.top_logprobs or [[] for _ in gen.output_ids]
    return [
        _entry(tokenizer, tid, lp) | {"top_logprobs": [_entry(tokenizer, t, x) for t, x in top]}
        for tid, lp, top in zip(gen.output_ids, gen.behavior_logprobs, tops, strict=True)
    ]


def _message(choice: Choice) -> dict:
    msg = dict(choice.message)
    if msg.get("tool_calls") and not msg.get("content"):
        msg["content"] = None  # as OpenAI answers a call without text
    return msg


def chat_answer(req: ChatRequest, result: ChatResult, model: str, tokenizer, session_id: str | None) -> dict:
    choices = [
        {
            "index": i,
            "message": _message(c),
            "finish_reason": c.finish_reason,
            "logprobs": {"content": token_logprobs(tokenizer, c)} if req.logprobs else None,
        }
        for i, c in enumerate(result.choices)
    ]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(result),
        "rollmesh": _extra(result, session_id),
    }


def completion_logprobs(tokenizer, choice: Choice, k: int) -> dict:
    """The legacy completions' ``logprobs``: tokens, their log-probs, the top ``k`` of each position
    (as ``{token: logprob}``) and where each token starts in the text."""
    gen = choice.generation
    tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in gen.output_ids]
    tops = (
        [{tokenizer.decode([t], skip_special_tokens=False): x for t, x in top} for top in gen.top_logprobs]
        if k
        else None
    )
    return {
        "tokens": tokens,
        "token_logprobs": list(gen.behavior_logprobs),
        "top_logprobs": tops,
        "text_offset": _offsets(tokens),
    }


def completion_answer(
    req: CompletionRequest, result: ChatResult, model: str, tokenizer, session_id: str | None
) -> dict:
    choices = []
    for i, c in enumerate(result.choices):
        logprobs = completion_logprobs(tokenizer, c, req.top_k()) if req.logprobs is not None else None
        choices.append({"index": i, "text": c.text, "finish_reason": completion_finish(c), "logprobs": logprobs})
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(result),
        "rollmesh": _extra(result, session_id),
    }


def completion_finish(c: Choice) -> str:
    return "length" if c.finish_reason == "length" else "stop"


def _offsets(tokens: list[str]) -> list[int]:
    out, at = [], 0
    for t in tokens:
        out.append(at)
        at += len(t)
    return out


def _extra(result: ChatResult, session_id: str | None) -> dict:
    """What rollmesh adds: the session, and how much of the prompt the prefix tree reused."""
    return {
        "session": session_id,
        "rendered_tokens": result.rendered_tokens,
        "reused_tokens": result.reused_tokens,
        "output_token_ids": [c.generation.output_ids for c in result.choices],
    }


def measure_images(vision: Vision, urls: list[tuple[str, str]]) -> list[PromptImage]:
    """Each image's bytes and how many tokens it becomes (decoded once: CPU work, for a thread). A
    corrupt image, a wrong data URL type or one over the size limits raises ``SessionError`` naming
    its part, before any pixel is decoded; the conversation's images over a request's limits
    together (every request carries them all) name ``messages``."""
    try:
        raw = [check_image(image_bytes(url, field), field) for field, url in urls]
        if (size := sum(map(len, raw))) > MAX_REQUEST_IMAGE_BYTES:
            raise VisionError("messages", f"{size} bytes of images; at most {MAX_REQUEST_IMAGE_BYTES} per conversation")
        return vision.measure(raw, "messages")  # the pixels of all together bounded too
    except VisionError as e:
        raise SessionError(str(e), e.field) from None
