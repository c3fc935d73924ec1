"""A micro-batch's sequences laid out as one packed row, with shared prefixes stored once.

Sequences that begin with the same tokens (a GRPO group's prompt, an agent's history up to a
fork) can share those tokens' activations: with ``share`` the row holds each run of shared tokens
once, as a node of a prefix tree, and every token attends causally within its node and to all of
its ancestors' tokens (``trainer/varlen.py``). Without ``share`` each sequence is its own node:
plain packing. Position ids count from each sequence's start, so a node's tokens sit where they
sit in every sequence that holds them.

The tree is rebuilt here from the token ids rather than carried by the buffer: what a trajectory
recorded is what is trained, whatever produced it (a group, a gateway session, an environment's
turns), and branches cannot disagree on the tokens they share. A token is shared only where the
sampling temperature it was scored at is shared too, so every log-prob stays each sequence's own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Node:
    """A run of tokens: ``seq``'s tokens [start, end); ``start`` is also its depth (its ancestors'
    token count), so its tokens' positions are start, start + 1, ..."""

    seq: int
    start: int
    end: int
    parent: int  # -1: a root
    offset: int = 0  # where its first token sits in the packed row

    def __len__(self) -> int:
        return self.end - self.start


@dataclass
class PackLayout:
    """Where every token of every sequence sits in one packed row of ``T`` tokens."""

    nodes: list[Node]
    ids: torch.Tensor  # [T] the packed token ids
    positions: torch.Tensor  # [T] each token's position in its sequences
    token_index: torch.Tensor  # [b, width] packed position of sequence i's token t (0 beyond its end)
    prev_index: torch.Tensor  # [T] packed position of the token before each one (0 for a root's first)
    first: torch.Tensor  # [T] bool: a root's first token, which nothing predicts
    temps: torch.Tensor | None  # [T] the temperature each packed token was sampled at (None: all 1)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    def starts(self) -> dict[int, tuple[int, int]]:
        """Where each sequence starts, (row 0, column): plain packing only (a shared prefix has no
        single place)."""
        assert all(n.parent < 0 for n in self.nodes), "sequences share prefixes: they have no single place"
        return {n.seq: (0, n.offset) for n in self.nodes}


def _keys(seqs: list[list[int]], temps: list[list[float]] | None) -> list[tuple]:
    if temps is None:
        return [tuple(s) for s in seqs]
    return [tuple(zip(s, t)) for s, t in zip(seqs, temps)]


def _common(a: tuple, b: tuple) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def tree_tokens(seqs: list[list[int]]) -> int:
    """How many tokens ``seqs`` fill once their shared prefixes are stored once: the sum of their
    lengths less each one's common prefix with its predecessor in sorted order."""
    keys = sorted(tuple(s) for s in seqs)
    return sum(len(k) - (_common(keys[j - 1], k) if j else 0) for j, k in enumerate(keys))


def _build_nodes(keys: list[tuple]) -> list[Node]:
    """The prefix tree of ``keys``, built from them in sorted order: each sequence shares with the
    tree what it shares with its predecessor, the deepest common prefix any earlier one offers."""
    nodes: list[Node] = []
    children: list[list[int]] = []
    stack: list[int] = []  # the nodes along the previous sequence's path
    prev = None
    for i in sorted(range(len(keys)), key=keys.__getitem__):
        k = keys[i]
        common = 0 if prev is None else _common(keys[prev], k)
        while stack and nodes[stack[-1]].start >= common:
            stack.pop()
        if stack and nodes[stack[-1]].end > common:  # the shared part ends inside it: split it there
            top = nodes[stack[-1]]
            lower = Node(top.seq, common, top.end, stack[-1])
            nodes.append(lower)
            children.append(children[stack[-1]])
            for c in children[-1]:
                nodes[c].parent = len(nodes) - 1
            children[stack[-1]] = [len(nodes) - 1]
            top.end = common
        if len(k) > common:
            nodes.append(Node(i, common, len(k), stack[-1] if stack else -1))
            children.append([])
            if stack:
                children[stack[-1]].append(len(nodes) - 1)
            stack.append(len(nodes) - 1)
        prev = i
    # depth-first order: a node's descendants follow it (a group's prompt, then its answers)
    order: list[int] = []
    todo = [n for n in reversed(range(len(nodes))) if nodes[n].parent < 0]
    while todo:
        n = todo.pop()
        order.append(n)
        todo.extend(reversed(children[n]))
    new = {old: j for j, old in enumerate(order)}
    out = [nodes[n] for n in order]
    for n in out:
        n.parent = new[n.parent] if n.parent >= 0 else -1
    return out


def build_layout(
    seqs: list[list[int]], width: int, temps: torch.Tensor | None = None, share: bool = True
) -> PackLayout:
    """``seqs`` (token id lists) in one packed row; ``temps`` [b, >= longest] their tokens' sampling
    temperatures (None: all 1); ``width``: the per-sequence tensors' width (>= the longest)."""
    temp_rows = None if temps is None else [temps[i, : len(s)].tolist() for i, s in enumerate(seqs)]
    keys = _keys(seqs, temp_rows)
    nodes = _build_nodes(keys) if share else [Node(i, 0, len(s), -1) for i, s in enumerate(seqs)]
    offset = 0
    for n in nodes:
        n.offset, offset = offset, offset + len(n)
    total = offset
    ids = torch.empty(total, dtype=torch.long)
    positions = torch.empty(total, dtype=torch.long)
    prev = torch.zeros(total, dtype=torch.long)
    first = torch.zeros(total, dtype=torch.bool)
    packed_temps = None if temps is None else torch.ones(total)
    child_of: list[dict] = [{} for _ in nodes]  # a node's children by their first key
    roots: dict = {}
    for j, n in enumerate(nodes):
        span = slice(n.offset, n.offset + len(n))
        ids[span] = torch.as_tensor(seqs[n.seq][n.start : n.end], dtype=torch.long)
        positions[span] = torch.arange(n.start, n.end)
        prev[span] = torch.arange(n.offset - 1, n.offset + len(n) - 1)
        if packed_temps is not None:
            packed_temps[span] = torch.as_tensor(temp_rows[n.seq][n.start : n.end])
        if n.parent < 0:
            prev[n.offset], first[n.offset] = 0, True
            roots[keys[n.seq][0]] = j
        else:
            parent = nodes[n.parent]
            prev[n.offset] = parent.offset + len(parent) - 1
            child_of[n.parent][keys[n.seq][n.start]] = j
    token_index = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, k in enumerate(keys):
        if not share:
            token_index[i, : len(k)] = torch.arange(nodes[i].offset, nodes[i].offset + len(k))
            continue
        j, parts = roots[k[0]], []
        while True:
            n = nodes[j]
            parts.append(torch.arange(n.offset, n.offset + min(n.end, len(k)) - n.start))
            if n.end >= len(k):
                break
            j = child_of[j][k[n.end]]
        token_index[i, : len(k)] = torch.cat(parts)
    return PackLayout(nodes, ids, positions, token_index, prev, first, packed_temps)
