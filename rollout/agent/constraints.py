"""What an agent's request forces its answer to be, as a grammar the engine decodes under.

OpenAI's ``response_format`` (``json_object``; ``json_schema``, strict or not: it is followed either
way) and a forced tool call (``tool_choice: "required"`` or a named function) become an ``ebnf``
sampling param. A forced call is one Hermes block, the format the gateway reads calls in
(``messages.py``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, whose JSON is the
named tool's (or any offered tool's) call, its arguments following the tool's parameter schema.
The JSON part is xgrammar's own translation of the schema, so the engines that compile it (the
embedded one, SGLang, vLLM: all xgrammar) read the same text. It is JSON as ``json.dumps`` writes
it (``", "`` and ``": "``, no other whitespace): a policy that has not learned JSON otherwise wanders
into the whitespace a schema allows without end (a tiny one filled 48 tokens with tabs and newlines).

The answer is then sampled from the policy's distribution masked to the grammar; the trajectory
records the grammar per turn and the trainer masks π the same way (``trainer/grammar_masks.py``).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from rollout.agent.sessions import SessionError
from sample_buffer.grammars import MAX_GRAMMAR_CHARS

ANY_OBJECT = {"type": "object"}


def _refused(field: str, message: str) -> SessionError:
    """A 400 naming the request's part."""
    return SessionError(f"{field}: {message}", field)


def response_grammar(fmt: dict | None) -> tuple[str, str] | None:
    """``response_format`` as ``("ebnf", text)``: ``json_object`` any JSON object, ``json_schema``
    its schema (an object left out: any object); ``text`` or none: free."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "ebnf", _ebnf("response_format", _bounded("response_format", ANY_OBJECT), False)
    field = "response_format.json_schema.schema"
    schema = (fmt.get("json_schema") or {}).get("schema")
    return "ebnf", _ebnf(field, _bounded(field, ANY_OBJECT if schema is None else schema), False)


def tool_call_grammar(tools: list[dict], name: str | None) -> tuple[str, str]:
    """A forced call as ``("ebnf", text)``: one ``<tool_call>`` block calling ``name`` (None: any of
    ``tools``) with arguments valid against its parameters. The newlines around the JSON are
    optional: Hermes templates write them, compact ones (and models trained on them) do not."""
    calls = []
    for tool in tools:
        fn = tool.get("function") or {}
        if name is None or fn.get("name") == name:
            params = fn.get("parameters") or ANY_OBJECT
            calls.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": fn.get("name")}, "arguments": params},
                    "required": ["name", "arguments"],
                }
            )
    if not calls:
        raise _refused("tool_choice.function.name", f"no tool named {name!r} is offered")
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return "ebnf", _ebnf("tools", _bounded("tools", schema), True)


def _bounded(field: str, schema) -> str:
    if not isinstance(schema, dict):
        raise _refused(field, "a JSON schema (an object) expected")
    text = json.dumps(schema, separators=(",", ":"))
    if len(text) > MAX_GRAMMAR_CHARS:
        raise _refused(field, f"a schema of {len(text)} characters; at most {MAX_GRAMMAR_CHARS}")
    return text


@lru_cache(maxsize=64)  # an agent's every turn offers the same tools, asks for the same schema
def _ebnf(field: str, schema: str, tool_call: bool) -> str:
    """xgrammar's EBNF of ``schema``, inside a ``<tool_call>`` block if ``tool_call``."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise _refused(field, "decoding under a grammar needs xgrammar (pip install rollmesh[grammar])") from None
    try:
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    except Exception as e:  # xgrammar's errors name the schema's part, after its own time and source line
        why = re.sub(r"^\[[\d:]+\] \S+: ", "", str(e).strip())[:300]
        raise _refused(field, f"not a schema a grammar can follow: {why}") from None
    if tool_call:
        opening = xgr.Grammar.from_ebnf('root ::= "<tool_call>" "\\n"?')
        grammar = xgr.Grammar.concat(opening, grammar, xgr.Grammar.from_ebnf('root ::= "\\n"? "</tool_call>"'))
    text = str(grammar)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise _refused(field, f"its grammar is {len(text)} characters; at most {MAX_GRAMMAR_CHARS}")
    return text
