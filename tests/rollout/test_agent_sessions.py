"""Agent sessions in-process: the hash chain, tool-call parsing, the prefix tree's token exactness
and forks, and sessions becoming groups through the plain controller and the in-memory buffer.
The generations are scripted here (which tokens the engine made does not matter to the tree); the
gateway's tests run the same code against a real engine and a real OpenAI client."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from rollout.agent.messages import IMAGES, conversation_keys, parse_tool_calls
from rollout.agent.prefix_tree import SessionTree, trajectory_path
from rollout.agent.render import TemplateRenderer
from rollout.agent.sessions import (
    AgentSessions,
    Conflict,
    Cut,
    NoSlot,
    NotFound,
    SessionError,
    SessionsConfig,
    cut_at_stop,
)
from rollout.ports import Generation
from rollout.sampling import SamplingParams
from sample_buffer.codec import decode_group
from sample_buffer.config import BufferConfig
from sample_buffer.memory import MemoryBuffer
from sample_buffer.trajectory import FinishReason
from sample_buffer.vision import PromptImage
from services.controller.config import ControllerConfig
from services.controller.controller import AsyncController
from tests.rollout.test_chat_turns import TEMPLATES, base_tokenizer, tokenizer_for  # noqa: F401 (a fixture)

TOOLS_TEMPLATE = (Path(__file__).resolve().parents[2] / "examples" / "agent" / "chatml_tools.jinja").read_text()
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 17, "b": 25}}\n</tool_call>'


def generated(tok, text: str, end: int | None, version: int = 0) -> Generation:
    ids = tok.encode(text, add_special_tokens=False) + ([end] if end is not None else [])
    return Generation(ids, [-0.5] * len(ids), [version] * len(ids), FinishReason.STOP)


def reply_of(tok, gen: Generation) -> dict:
    return parse_tool_calls(tok.decode(gen.output_ids, skip_special_tokens=True)).message()


def play(tree: SessionTree, tok, end: int, turns: list[tuple[list[dict], str]], tools=None):
    """Each turn: the messages the agent sends, then the text the policy answers."""
    prepared = []
    for messages, answer in turns:
        p = tree.prepare(messages, tools)
        gen = generated(tok, answer, end)
        tree.record(p.node, gen, conversation_keys([*messages, reply_of(tok, gen)], tools)[-1])
        prepared.append(p)
    return prepared


# ---------------------------------------------------------------- messages
def test_the_key_reads_what_the_model_saw_not_how_the_client_spelled_it():
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    respaced = {**call, "id": "other-id", "function": {"name": "add", "arguments": '{"b":2,"a":1}'}}
    a = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    b = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "", "tool_calls": [respaced]},
    ]
    assert conversation_keys(a) == conversation_keys(b)
    edited = [a[0], {**a[1], "tool_calls": [{**call, "function": {"name": "add", "arguments": '{"a": 1, "b": 3}'}}]}]
    assert (
        conversation_keys(edited)[0] == conversation_keys(a)[0]
        and conversation_keys(edited)[1] != conversation_keys(a)[1]
    )
    assert conversation_keys(a, TOOLS) != conversation_keys(a)  # tools change the system prompt


def test_the_same_words_beside_another_picture_are_another_conversation():
    def shown(*hashes: str) -> dict:
        return {"role": "user", "content": "which digit?", IMAGES: [PromptImage(b"", h, 4) for h in hashes]}

    keys = [conversation_keys([m])[0] for m in (shown("a"), shown("b"), shown(), shown("a", "b"))]
    assert len(set(keys)) == 4 and keys[0] == conversation_keys([shown("a")])[0]


def test_tool_calls_are_parsed_and_broken_ones_stay_text():
    parsed = parse_tool_calls(
        f'Let me add.\n{CALL}\n<tool_call>\n{{"name": "add", "arguments": {{"a": 1}}}}\n</tool_call>'
    )
    assert parsed.content == "Let me add."
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [{"a": 17, "b": 25}, {"a": 1}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed.tool_calls)
    broken = "<tool_call>{not json}</tool_call>"
    assert parse_tool_calls(broken).content == broken and parse_tool_calls(broken).tool_calls == []


# ---------------------------------------------------------------- the prefix tree
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_a_session_is_the_template_of_the_whole_conversation(base_tokenizer, name):  # noqa: F811
    tok, end = tokenizer_for(base_tokenizer, name)
    renderer = TemplateRenderer(tok)
    tree = SessionTree(renderer)
    user = [{"role": "user", "content": "What is 17 + 25?"}]
    a1, a2 = "Let me add them: 17 + 25 = 42.", "It is 42."
    m2 = [*user, {"role": "assistant", "content": a1}, {"role": "user", "content": "Sure?"}]
    first, second = play(tree, tok, end, [(user, a1), (m2, a2)])
    assert second.reused == len(first.input_ids) + len(tok.encode(a1, add_special_tokens=False)) + 1
    [tip] = tree.tips()
    path = trajectory_path(tip)
    whole = [*m2, {"role": "assistant", "content": a2}]
    expected = renderer.text(whole, None, False)
    assert tok.decode(path.token_ids, skip_special_tokens=False) == expected[: len(tok.decode(path.token_ids))]
    gens = [generated(tok, a, end).output_ids for a in (a1, a2)]
    assert [path.token_ids[s : s + len(g)] for s, g in zip(path.turn_starts, gens, strict=True)] == gens
    assert sum(path.loss_mask) == sum(map(len, gens)) and len(path.behavior_logprobs) == sum(path.loss_mask)


def test_a_tool_using_session_is_token_exact_and_reuses_its_prefix(smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    renderer = TemplateRenderer(tok, TOOLS_TEMPLATE)
    tree = SessionTree(renderer)
    m1 = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "17 + 25?"}]
    p1 = tree.prepare(m1, TOOLS)
    g1 = generated(tok, CALL, end)
    reply = reply_of(tok, g1)
    assert reply["content"] == "" and reply["tool_calls"][0]["function"]["name"] == "add"
    tree.record(p1.node, g1, conversation_keys([*m1, reply], TOOLS)[-1])
    # The agent sends the call back in the OpenAI shape (content null, its own call id), then the result.
    sent_back = {"role": "assistant", "content": None, "tool_calls": [{**reply["tool_calls"][0], "id": "x"}]}
    m2 = [*m1, sent_back, {"role": "tool", "tool_call_id": "x", "content": "42"}]
    p2 = tree.prepare(m2, TOOLS)
    assert (
        p2.reused == len(p1.input_ids) + len(g1.output_ids) and p2.rendered < 30
    )  # the tool result and the generation prompt
    g2 = generated(tok, "It is 42.", end)
    tree.record(p2.node, g2, conversation_keys([*m2, reply_of(tok, g2)], TOOLS)[-1], temperature=0.7)
    [tip] = tree.tips()
    path = trajectory_path(tip)
    assert path.turn_temperatures == [1.0, 0.7]  # each turn's own: the trainer takes its log-probs at it
    # What the template gives for the whole conversation, generated turns as generated (the template
    # renders the call exactly as the policy wrote it here).
    whole = renderer.text([*m2, {"role": "assistant", "content": "It is 42."}], TOOLS, False)
    assert tok.decode(path.token_ids, skip_special_tokens=False) + "\n" == whole
    assert path.token_ids[: len(p2.input_ids)] == p2.input_ids


def test_an_edited_history_forks_into_two_exact_trajectories_sharing_the_prefix(base_tokenizer):  # noqa: F811
    tok, end = tokenizer_for(base_tokenizer, "qwen2")
    tree = SessionTree(TemplateRenderer(tok))
    user = [{"role": "user", "content": "Pick a number."}]
    turn = [*user, {"role": "assistant", "content": "7"}]
    play(tree, tok, end, [(user, "7"), ([*turn, {"role": "user", "content": "Higher."}], "9")])
    again = tree.prepare([*turn, {"role": "user", "content": "Higher."}])  # a retry of the same request
    assert again.rendered == 0 and tree.forks == 0
    play(tree, tok, end, [([*turn, {"role": "user", "content": "Lower."}], "3")])  # the agent rewrote its feedback
    assert tree.forks == 1
    a, b = (trajectory_path(t) for t in tree.tips())
    shared = a.turn_starts[1] - len(
        tok.encode("<|im_end|>\n<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n")
    )
    assert a.token_ids[:shared] == b.token_ids[:shared] and a.token_ids != b.token_ids
    assert tok.decode(a.token_ids).endswith("Higher.<|im_end|>\n<|im_start|>assistant\n9<|im_end|>")
    assert tok.decode(b.token_ids).endswith("Lower.<|im_end|>\n<|im_start|>assistant\n3<|im_end|>")
    # An edit of the first message shares nothing: a new root, rendered whole.
    play(tree, tok, end, [([{"role": "user", "content": "Pick a letter."}], "q")])
    assert tree.forks == 2 and len(tree.roots) == 2 and len(tree.tips()) == 3


def test_a_template_that_rewrites_history_starts_a_new_root(base_tokenizer):  # noqa: F811
    tok, end = tokenizer_for(base_tokenizer, "qwen2")
    # Like Qwen3's: an earlier assistant turn is rendered without its reasoning.
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'].split('</think>')[-1] if m['role'] == 'assistant' and not loop.last else m['content'] }}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tree = SessionTree(TemplateRenderer(tok))
    user = [{"role": "user", "content": "2 + 2?"}]
    play(
        tree,
        tok,
        end,
        [
            (user, "<think>easy</think>4"),
            (
                [*user, {"role": "assistant", "content": "<think>easy</think>4"}, {"role": "user", "content": "Sure?"}],
                "Yes",
            ),
        ],
    )
    assert len(tree.roots) == 2 and tree.forks == 1  # rendered whole: exact for what the engine was given


def test_a_stop_string_cuts_text_and_tokens_where_it_completes(smollm2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    gen = generated(tok, "one, two. three, four.", None)
    cut, text, hit = cut_at_stop(tok, gen, ["three", "four"])
    assert hit and text == "one, two. " and cut.finish_reason == FinishReason.STOP
    assert tok.decode(cut.output_ids).startswith("one, two. three") and "four" not in tok.decode(cut.output_ids)
    assert len(cut.behavior_logprobs) == len(cut.token_versions) == len(cut.output_ids)
    assert cut_at_stop(tok, gen, ["five"]) == (gen, "one, two. three, four.", False)


def test_a_stop_string_at_the_end_of_a_long_answer_is_found_in_a_few_decodes(smollm2):
    """Every token prefix was decoded to find where the stop string completes: 4,096 decodes of up to
    4,096 tokens (2 s on the event loop). Bisection: a dozen, cut at the same token as the scan."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    gen = generated(tok, "la " * 4000 + "THE END", None)
    decodes = []

    class Counting:
        def decode(self, ids, **kw):
            decodes.append(len(ids))
            return tok.decode(ids, **kw)

    cut, text, hit = cut_at_stop(Counting(), gen, ["END"])
    assert hit and text == "la " * 4000 + "THE " and len(decodes) <= 2 + 13
    first = next(k for k in range(1, len(gen.output_ids) + 1) if tok.decode(gen.output_ids[:k]).endswith("END"))
    assert len(cut.output_ids) == first


# ---------------------------------------------------------------- sessions and groups
class Scripted:
    """The Generate port: answers each request with the next scripted text."""

    def __init__(self, tok, end, answers, version=0) -> None:
        self.tok, self.end, self.answers, self.version, self.calls = tok, end, list(answers), version, []

    async def generate(self, input_ids, sampling, *, request_id, route, timeout_s, top_logprobs=0, on_tokens=None):
        self.calls.append((list(input_ids), sampling, route))
        gen = generated(self.tok, self.answers.pop(0), self.end, self.version)
        for t in gen.output_ids if on_tokens else ():
            on_tokens([t])
        return gen


def make_sessions(tok, end, answers, *, groups_per_step=1, async_ratio=0, **cfg):
    ctl = AsyncController(ControllerConfig(async_ratio=async_ratio, groups_per_step=groups_per_step))
    buf = MemoryBuffer(BufferConfig(filter_zero_variance=False))
    engine = Scripted(tok, end, answers)
    config = SessionsConfig(admit_timeout_s=0.3, **cfg)
    return AgentSessions(config, TemplateRenderer(tok), engine, admission=ctl, sink=buf), ctl, buf


async def chat(sessions, session, messages):
    prepared = sessions.prepare(session, messages, None)
    return await sessions.chat(session, messages, None, prepared, [SamplingParams(max_new_tokens=8)], [])


def test_sessions_of_one_group_go_to_the_buffer_once_all_ended(base_tokenizer):  # noqa: F811
    tok, end = tokenizer_for(base_tokenizer, "qwen2")

    async def main():
        sessions, ctl, buf = make_sessions(tok, end, ["4", "5", "four"])
        a = await sessions.create("alice", "g1", 2)
        b = await sessions.create("alice", "g1", 2)
        user = [{"role": "user", "content": "2 + 2?"}]
        await chat(sessions, a, user)
        await chat(sessions, b, user)
        await chat(sessions, b, [*user, {"role": "assistant", "content": "5"}, {"role": "user", "content": "No."}])
        with pytest.raises(SessionError, match="reward"):
            await sessions.end(a)
        sessions.set_reward(a, 1.0)
        first = await sessions.end(a)
        waiting = (await buf.stats())["depth"]
        second = await sessions.end(b, reward=0.0)
        got = await buf.get(1, version=0, max_staleness=0, timeout_s=1.0)
        return first, waiting, second, got, ctl, sessions, engine_routes(sessions)

    def engine_routes(sessions):
        return {route for _, _, route in sessions.engine.calls}

    first, waiting, second, got, ctl, sessions, routes = asyncio.run(main())
    assert (first, waiting, second) == ("waiting", 0, "put")
    [group] = [decode_group(g) for g in got.groups]
    rewards = sorted((t.reward, len(t.metadata["turn_starts"])) for t in group.trajectories)
    assert rewards == [(0.0, 2), (1.0, 1)] and group.group_id == "g1"
    assert ctl.counters["admitted"] == 1 and len(routes) == 2  # one slot per group; a session keeps its engine
    assert sessions.counters["groups_put"] == 1 and not sessions.sessions


def test_a_session_is_its_keys_alone_and_groups_are_checked(base_tokenizer):  # noqa: F811
    tok, end = tokenizer_for(base_tokenizer, "qwen2")

    async def main():
        sessions, _, _ = make_sessions(tok, end, [], groups_per_step=4)
        s = await sessions.create("alice", "g", 2)
        with pytest.raises(NotFound):
            sessions.get(s.session_id, "mallory")
        with pytest.raises(Conflict, match="cannot be joined"):
            await sessions.create("mallory", "g", 2)
        with pytest.raises(Conflict, match="group_size"):
            await sessions.create("alice", "g", 3)
        await sessions.create("alice", "g", 2)
        with pytest.raises(Conflict, match="already has its 2"):
            await sessions.create("alice", "g", 2)
        with pytest.raises(SessionError, match="group_size"):
            await sessions.create("alice", None, 0)

    asyncio.run(main())


def test_no_slot_under_the_bound_is_refused_and_an_idle_group_gives_its_slot_back(base_tokenizer):  # noqa: F811
    tok, end = tokenizer_for(base_tokenizer, "qwen2")

    async def main():
        sessions, ctl, _ = make_sessions(tok, end, [], groups_per_step=1, async_ratio=0, idle_s=0.05)
        await sessions.create("alice")  # the one slot
        with pytest.raises(NoSlot):
            await sessions.create("alice")
        await asyncio.sleep(0.1)
        abandoned = await sessions.expire_idle()
        again = await sessions.create("alice")  # the slot came back
        return abandoned, again, ctl

    abandoned, again, ctl = asyncio.run(main())
    assert abandoned == 1 and again.group.admitted and ctl.counters["admit_refused"] >= 1


def test_sessions_joining_a_group_that_waits_for_its_slot_wait_with_it(base_tokenizer):  # noqa: F811
    tok, end = tokenizer_for(base_tokenizer, "qwen2")

    async def main():
        sessions, ctl, _ = make_sessions(tok, end, [], groups_per_step=1, async_ratio=0)
        sessions.config.admit_timeout_s = 2.0
        blocker = await sessions.create("alice")  # holds the one slot
        first = asyncio.create_task(sessions.create("alice", "g", 2))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(sessions.create("alice", "g", 2))
        await asyncio.sleep(0.05)
        waiting = not first.done() and not second.done()
        assert await sessions.end(blocker, reward=0.0) == "empty"  # nothing generated: its slot comes back
        a, b = await first, await second
        return waiting, a, b, ctl

    waiting, a, b, ctl = asyncio.run(main())
    assert waiting and a.group is b.group and len(a.group.sessions) == 2
    assert ctl.counters["admitted"] == 2  # the blocker's and g's: one slot per group, not per session


def test_a_cut_generation_is_neither_answered_nor_trained(base_tokenizer):  # noqa: F811
    tok, end = tokenizer_for(base_tokenizer, "qwen2")

    async def main():
        sessions, _, _ = make_sessions(tok, end, ["half an ans"])
        real = sessions.engine.generate

        async def aborted(*args, **kw):  # a weight update in abort mode ends it early
            g = await real(*args, **kw)
            return Generation(g.output_ids, g.behavior_logprobs, g.token_versions, FinishReason.ABORT)

        sessions.engine.generate = aborted
        s = await sessions.create("alice")
        with pytest.raises(Cut, match="abort"):
            await chat(sessions, s, [{"role": "user", "content": "hi"}])
        return s, sessions

    s, sessions = asyncio.run(main())
    assert s.tree.tips() == [] and s.requests == 0 and sessions.counters["generations_cut"] == 1


def test_a_group_that_never_fills_gives_its_slot_back_once_idle(base_tokenizer):  # noqa: F811
    tok, end = tokenizer_for(base_tokenizer, "qwen2")

    async def main():
        sessions, ctl, _ = make_sessions(tok, end, ["4"], idle_s=0.1)
        s = await sessions.create("alice", "g", 3)  # the agent made one of its three sessions, then died
        await chat(sessions, s, [{"role": "user", "content": "2 + 2?"}])
        assert await sessions.end(s, reward=1.0) == "waiting"
        before = await sessions.expire_idle()
        await asyncio.sleep(0.15)
        return before, await sessions.expire_idle(), ctl.capacity(), sessions

    before, after, capacity, sessions = asyncio.run(main())
    assert (before, after) == (0, 1) and capacity == 1 and sessions.counters["groups_abandoned"] == 1


def test_a_group_the_buffer_refuses_is_counted_and_its_slot_released(base_tokenizer):  # noqa: F811
    tok, end = tokenizer_for(base_tokenizer, "qwen2")

    class Broken:
        async def put(self, group):
            raise TimeoutError("the buffer did not answer")

    async def main():
        sessions, ctl, _ = make_sessions(tok, end, ["4"])
        sessions.sink = Broken()
        s = await sessions.create("alice")
        await chat(sessions, s, [{"role": "user", "content": "2 + 2?"}])
        with pytest.raises(SessionError, match="lost"):
            await sessions.end(s, reward=1.0)
        return ctl.capacity(), sessions

    capacity, sessions = asyncio.run(main())
    assert capacity == 1 and sessions.counters["groups_failed"] == 1 and not sessions.groups


def test_tool_calls_are_read_only_where_tools_were_offered(base_tokenizer):  # noqa: F811
    tok, end = tokenizer_for(base_tokenizer, "qwen2")

    async def main():
        sessions, _, _ = make_sessions(tok, end, [CALL, CALL])
        s = await sessions.create("alice")
        user = [{"role": "user", "content": "17 + 25?"}]
        plain = await chat(sessions, s, user)
        offered = await sessions.chat(
            s, user, TOOLS, sessions.prepare(s, user, TOOLS), [SamplingParams(max_new_tokens=8)], []
        )
        return plain, offered

    plain, offered = asyncio.run(main())
    assert plain.choices[0].finish_reason == "stop" and "tool_calls" not in plain.choices[0].message
    assert offered.choices[0].finish_reason == "tool_calls" and offered.choices[0].message["tool_calls"]


# ---------------------------------------------------------------- streamed text
def test_streamed_text_is_never_taken_back(base_tokenizer):  # noqa: F811
    """Fed a token at a time, the stream holds back half characters, a tail that may start a stop
    string, and (with tools) a tool call; what it sent plus the rest is the answer's text."""
    from rollout.agent.text_stream import TextStream

    tok, _ = tokenizer_for(base_tokenizer, "qwen2")

    def feed(text: str, stop: list[str], tools: bool) -> tuple[list[str], TextStream]:
        stream = TextStream(tok, stop, tools)
        return [stream.push([t]) for t in tok.encode(text)], stream

    sent, s = feed("café, then END and more", ["END"], False)
    assert "".join(sent) == "café, then " and s.done  # nothing of the stop string or after it
    assert all("\ufffd" not in piece for piece in sent)  # é is two bytes: never sent half
    assert s.rest("café, then ") == ""
    sent, s = feed('Let me add. <tool_call>{"name": "add", "arguments": {}}</tool_call>', [], True)
    assert "".join(sent) == "Let me add." and s.rest("Let me add.") == ""
    held, _ = feed("a <tool", [], True)
    assert "".join(held) == "a"  # "<tool" may become a call: held until it is known
    sent, s = feed("a <tool box", [], True)
    assert "".join(sent) + s.rest("a <tool box") == "a <tool box"  # it did not: all of it, in the end


def test_streamed_text_in_any_chunks_is_the_answer_cut_at_its_first_stop(base_tokenizer):  # noqa: F811
    """Fuzzed (hypothesis): text of many scripts and stop strings, fed in chunks of any size. What
    was sent is never taken back, holds no stop string, and with the rest is the answer cut at its
    first stop; the held tail is shorter than the longest stop."""
    from hypothesis import given
    from hypothesis import strategies as st

    from rollout.agent.text_stream import TextStream
    from tests.services.test_fuzz import fuzz

    tok, _ = tokenizer_for(base_tokenizer, "qwen2")
    pieces = st.sampled_from(["a", " b", "é", "中文", "🙂", "\n", "END", "EN", "<tool", "  ", "x y", "..."])

    @fuzz(150)
    @given(data=st.data())
    def run(data):
        text = "".join(data.draw(st.lists(pieces, max_size=30)))
        stop = data.draw(st.lists(st.sampled_from(["END", "中", "🙂\n", ". .", "x"]), max_size=3))
        ids = tok.encode(text)
        whole = tok.decode(ids, skip_special_tokens=True)
        cuts = [whole.find(s) for s in stop if s in whole]
        final = whole[: min(cuts)] if cuts else whole
        stream, sent, i = TextStream(tok, stop, tools=False), "", 0
        while i < len(ids):
            k = data.draw(st.integers(1, 4))
            sent += stream.push(ids[i : i + k])
            assert final.startswith(sent), (sent, final)
            i += k
        held = len(final) - len(sent)
        assert held == 0 if cuts else held < max(map(len, stop), default=1), (sent, final)
        assert sent + stream.rest(final) == final

    run()


def test_a_long_stream_decodes_each_token_a_bounded_number_of_times(base_tokenizer):  # noqa: F811
    """Each push decodes its new tokens and the few before them, not the answer so far: a 2,000-token
    stream fed a token at a time decoded the whole answer every push (about 2 million ids) before."""
    from rollout.agent.text_stream import TextStream

    tok, _ = tokenizer_for(base_tokenizer, "qwen2")
    decoded = []

    class Counting:
        def decode(self, ids, **kw):
            decoded.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok.encode("The answer is 42, then 中文 and more; " * 200)[:2000]
    stream = TextStream(Counting(), ["STOP HERE"], tools=True)
    sent = "".join(stream.push([t]) for t in ids)
    assert sum(decoded) < 8 * len(ids), sum(decoded)
    assert tok.decode(ids).startswith(sent) and len(tok.decode(ids)) - len(sent) < len("STOP HERE")


def test_a_decode_that_rewrites_earlier_text_makes_the_stream_start_again_not_grow():
    """A tokenizer whose decode of more tokens changes the text before them (spaces cleaned up before
    punctuation): the stream decodes the whole answer again once, then goes on a few tokens at a time."""
    from rollout.agent.text_stream import TextStream

    vocab = ["x", " ", ".", "y", "z"]
    decoded = []

    class Cleaning:
        def decode(self, ids, **kw):
            decoded.append(len(ids))
            return "".join(vocab[i] for i in ids).replace(" .", ".")

    stream = TextStream(Cleaning(), [], tools=False)
    sent = [stream.push([i]) for i in [0, 1, 2] + [3, 4] * 200]
    assert sent[:2] == ["x", " "] and stream.text.startswith("x.yz")  # re-read whole once the "." came
    assert max(decoded) <= 3 + 1 and sum(decoded) < 6 * len(stream.ids), (max(decoded), sum(decoded))
