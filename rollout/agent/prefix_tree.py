"""Prefix aggregation: an agent session's requests as a tree of token segments.

An agent sends its whole conversation with every request. Rendered from scratch each time, its
earlier assistant turns would be re-tokenized (not the tokens the policy generated) and every
request would pay for the whole history again. Instead each session keeps a tree:

- a **prompt node** holds the tokens a request added (the rendered new messages and the
  generation prompt, loss mask 0), keyed by the hash chain of the request's messages;
- a **generation node** under it holds what the engine generated for that prompt (loss mask 1,
  behaviour log-probs, policy versions), keyed by the chain extended with the assistant message
  the gateway answered with.

A request whose messages extend a generation node's conversation is rendered as the template's
difference after it (``rollout/agent/render.py``) and hangs below it; one that repeats a prompt
reuses it. An agent that edits its history finds no node for the edited message and starts a
new branch from the deepest one it still shares (a new root, rendered whole, when it shares
none). Each generation node nothing continues is the tip of one trajectory: the segments on its
path, in order, are exactly what the engine consumed and produced.

A prompt that shows images holds them, with its ids both as the model reads them (``ids``: each
image's placeholder expanded) and as the engines take them (``sent``: one placeholder each); a
request sends the ``sent`` spelling of its whole path with the path's images, and a trajectory
records the expanded one with the images' hashes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from rollout.agent.messages import conversation_keys
from rollout.agent.render import Rendered, TemplateRenderer
from rollout.chat_turns import NotAPrefix
from rollout.ports import Generation
from sample_buffer.trajectory import FinishReason
from sample_buffer.vision import PromptImage


@dataclass
class PromptNode:
    key: str
    parent: GenerationNode | None
    ids: list[int]  # the tokens this request added (loss mask 0), images expanded
    text: str  # the template's text of the whole conversation, generation prompt included
    children: list[GenerationNode] = field(default_factory=list)
    sent: list[int] | None = None  # ``ids`` with one placeholder per image (None: no images)
    images: tuple[PromptImage, ...] = ()  # the images this request added, in order

    @classmethod
    def of(cls, key: str, parent: GenerationNode | None, r: Rendered) -> PromptNode:
        return cls(key, parent, r.ids, r.text, sent=r.sent, images=r.images)


@dataclass
class GenerationNode:
    key: str
    parent: PromptNode
    generation: Generation
    temperature: float = 1.0  # what it was sampled at (its log-probs are at it)
    grammar: tuple[str, str] | None = None  # the grammar it was decoded under (its log-probs are masked)
    children: list[PromptNode] = field(default_factory=list)


@dataclass(frozen=True)
class Prepared:
    """A request ready to generate: its prompt node and the whole prompt's token ids."""

    node: PromptNode
    input_ids: list[int]  # as the model reads them (images expanded)
    rendered: int  # tokens rendered for this request
    reused: int  # tokens taken from the tree (earlier prompts and generations)

    def request(self) -> tuple[list[int], tuple[bytes, ...]]:
        """What the engine is sent: the whole prompt with one placeholder per image, and the images."""
        return path_ids(self.node, sent=True), tuple(im.raw for im in path_images(self.node))


class SessionTree:
    """One agent session's conversations, rendered once and shared where they share a prefix."""

    def __init__(self, renderer: TemplateRenderer) -> None:
        self.renderer = renderer
        self.roots: list[PromptNode] = []
        self._prompts: dict[str, PromptNode] = {}
        self._generations: dict[str, GenerationNode] = {}
        self.forks = 0  # requests that started a new branch off (or beside) an existing one
        self.tokens = 0  # held: every prompt node's and generation's tokens

    def prepare(self, messages: list[dict], tools: list | None = None) -> Prepared:
        """The prompt for ``messages``: a known one, an extension of a known generation, or a new root."""
        keys = conversation_keys(messages, tools)
        if (node := self._prompts.get(keys[-1])) is not None:
            ids = path_ids(node)
            return Prepared(node, ids, 0, len(ids))
        for j in range(len(messages) - 2, -1, -1):  # the deepest generated assistant turn this request shares
            base = self._generations.get(keys[j])
            if base is None:
                continue
            try:
                rendered = self.renderer.after(base.parent.text, base.generation.output_ids, messages, j, tools)
            except NotAPrefix:
                break  # rendered whole below: a new root
            node = PromptNode.of(keys[-1], base, rendered)
            ids = path_ids(node)
            return Prepared(node, ids, len(rendered.ids), len(ids) - len(rendered.ids))
        rendered = self.renderer.whole(messages, tools)
        return Prepared(PromptNode.of(keys[-1], None, rendered), rendered.ids, len(rendered.ids), 0)

    def prepare_ids(self, ids: list[int]) -> Prepared:
        """A raw prompt (``/v1/completions``): its own root, reused when the same ids come again."""
        key = "ids:" + hashlib.sha256(repr(ids).encode()).hexdigest()[:32]
        if (node := self._prompts.get(key)) is not None:
            return Prepared(node, list(ids), 0, len(ids))
        return Prepared(PromptNode(key, None, list(ids), ""), list(ids), len(ids), 0)

    def _attach(self, node: PromptNode) -> PromptNode:
        """``node`` in the tree, once: a request's choices share it, and of two requests of the same
        messages the first one's is kept. Nothing enters before its generation is recorded, so a
        request refused (too long, over a limit) or cut leaves nothing behind."""
        if (known := self._prompts.get(node.key)) is not None:
            return known
        siblings = self.roots if node.parent is None else node.parent.children
        self.forks += bool(siblings)  # something else already continued this turn (or began beside it)
        siblings.append(node)
        self._prompts[node.key] = node
        self.tokens += len(node.ids)
        return node

    def record(
        self,
        prompt: PromptNode,
        generation: Generation,
        key: str | None = None,
        temperature: float = 1.0,
        grammar: tuple[str, str] | None = None,
    ) -> GenerationNode:
        """What the engine generated for ``prompt`` at ``temperature`` (under ``grammar``, a
        ``SamplingParams.grammar()``, if any); ``key``: the conversation's
        key once the agent appends the assistant message it was answered with
        (``conversation_keys``), so that a request continuing it finds it. None: nothing continues
        it (a raw completion)."""
        prompt = self._attach(prompt)
        node = GenerationNode(key or "", prompt, generation, temperature, grammar)
        prompt.children.append(node)
        self.tokens += len(generation.output_ids)
        if key:
            self._generations.setdefault(key, node)  # n choices alike: the first one is continued
        return node

    def tips(self) -> list[GenerationNode]:
        """Generation nodes nothing continues: one trajectory each."""
        out, stack = [], list(reversed(self.roots))
        while stack:
            prompt = stack.pop()
            for gen in prompt.children:
                continued = [p for p in gen.children if p.children]
                if not continued:
                    out.append(gen)
                stack.extend(reversed(gen.children))
        return out


def _prompts(node: PromptNode) -> list[PromptNode]:
    """The prompt nodes from the root down to ``node``."""
    out: list[PromptNode] = []
    prompt: PromptNode | None = node
    while prompt is not None:
        out.append(prompt)
        prompt = None if prompt.parent is None else prompt.parent.parent
    return out[::-1]


def path_ids(node: PromptNode, sent: bool = False) -> list[int]:
    """The token ids from the root to the end of ``node`` (``sent``: as the engines take them)."""
    ids: list[int] = []
    for prompt in _prompts(node):
        if prompt.parent is not None:
            ids += prompt.parent.generation.output_ids
        ids += prompt.sent if sent and prompt.sent is not None else prompt.ids
    return ids


def path_images(node: PromptNode) -> list[PromptImage]:
    """The images shown from the root to the end of ``node``, in order."""
    return [im for prompt in _prompts(node) for im in prompt.images]


@dataclass(frozen=True)
class Path:
    """A trajectory's tokens: everything from its root to a generation tip."""

    token_ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    token_versions: list[int]
    turn_starts: list[int]  # where each generation begins
    turn_temperatures: list[float]  # what each was sampled at
    finish_reason: FinishReason
    images: tuple[PromptImage, ...] = ()  # in the order their placeholders stand in token_ids
    turn_grammars: tuple = ()  # each turn's grammar ([field, text]) or None: free

    def grammar_metadata(self) -> dict:
        """``turn_grammars`` for the trajectory's metadata where any turn had one."""
        return {"turn_grammars": list(self.turn_grammars)} if any(self.turn_grammars) else {}


def trajectory_path(tip: GenerationNode) -> Path:
    chain: list[GenerationNode] = []
    gen: GenerationNode | None = tip
    while gen is not None:
        chain.append(gen)
        gen = gen.parent.parent
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    starts: list[int] = []
    temperatures: list[float] = []
    grammars: list[list[str] | None] = []
    images: list[PromptImage] = []
    for g in reversed(chain):
        images += g.parent.images
        ids += g.parent.ids
        mask += [0] * len(g.parent.ids)
        starts.append(len(ids))
        temperatures.append(g.temperature)
        grammars.append(None if g.grammar is None else list(g.grammar))
        out = g.generation
        ids += out.output_ids
        mask += [1] * len(out.output_ids)
        logprobs += out.behavior_logprobs
        versions += out.token_versions
    finish = tip.generation.finish_reason
    return Path(ids, mask, logprobs, versions, starts, temperatures, finish, tuple(images), tuple(grammars))
