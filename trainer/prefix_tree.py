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
sampling temperature it was scored at (and the grammar that masked it) is shared too, so every
log-prob stays each sequence's own.
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

    nodes: list[Node]  # parents before their children
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


def _keys(seqs: list[list[int]], temps: list[list[float]] | None, tags: list[list[int]] | None) -> list[tuple]:
    """What makes two sequences' tokens one: the ids and, where given, each token's temperature and
    grammar tag (so that a shared token's log-prob is every sharer's own)."""
    columns = [c for c in (temps, tags) if c is not None]
    if not columns:
        return [tuple(s) for s in seqs]
    return [tuple(zip(s, *(c[i] for c in columns))) for i, s in enumerate(seqs)]


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
    seqs: list[list[int]],
    width: int,
    temps: torch.Tensor | None = None,
    share: bool = True,
    tags: torch.Tensor | None = None,
) -> PackLayout:
    """``seqs`` (token id lists) in one packed row; ``temps`` [b, >= longest] their tokens' sampling
    temperatures (None: all 1); ``tags`` [b, >= longest] their grammar tags (``TrainBatch.grammar_tags``;
    None: none); ``width``: the per-sequence tensors' width (>= the longest)."""
    temp_rows = None if temps is None else [temps[i, : len(s)].tolist() for i, s in enumerate(seqs)]
    tag_rows = None if tags is None else [tags[i, : len(s)].tolist() for i, s in enumerate(seqs)]
    keys = _keys(seqs, temp_rows, tag_rows)
    # an empty sequence has no node (its token_index row stays 0, beyond its end)
    nodes = _build_nodes(keys) if share else [Node(i, 0, len(s), -1) for i, s in enumerate(seqs) if s]
    # In the row: roots, then the other nodes, each by how many keys they attend to and then by
    # length (longest first): the order trainer/varlen.py batches them in, so that a batch of
    # nodes of one length is a contiguous block of the row (attended as a view, nothing gathered).
    offset = 0
    for n in sorted(nodes, key=lambda n: (n.parent >= 0, -n.end, -len(n))):
        n.offset, offset = offset, offset + len(n)
    # built as Python lists and made tensors once: a micro-batch has hundreds of nodes
    ids: list[int] = []
    positions: list[int] = []
    prev: list[int] = []
    first: list[int] = []  # packed positions of the roots' first tokens
    packed_temps: list[float] = []
    child_of: list[dict] = [{} for _ in nodes]  # a node's children by their first key
    roots: dict = {}
    for j, n in sorted(enumerate(nodes), key=lambda jn: jn[1].offset):  # in row order
        ids += seqs[n.seq][n.start : n.end]
        positions += range(n.start, n.end)
        if temp_rows is not None:
            packed_temps += temp_rows[n.seq][n.start : n.end]
        if n.parent < 0:
            prev += [0] + list(range(n.offset, n.offset + len(n) - 1))
            first.append(n.offset)
            roots[keys[n.seq][0]] = j
        else:
            parent = nodes[n.parent]
            prev += [parent.offset + len(parent) - 1] + list(range(n.offset, n.offset + len(n) - 1))
            child_of[n.parent][keys[n.seq][n.start]] = j
    index = [[0] * width for _ in seqs]
    for n in nodes if not share else ():
        index[n.seq][: len(n)] = range(n.offset, n.offset + len(n))
    for i, k in enumerate(keys if share else ()):
        if not k:
            continue
        j, row = roots[k[0]], index[i]
        while True:
            n = nodes[j]
            end = min(n.end, len(k))
            row[n.start : end] = range(n.offset, n.offset + end - n.start)
            if n.end >= len(k):
                break
            j = child_of[j][k[n.end]]
    is_first = torch.zeros(offset, dtype=torch.bool)
    is_first[first] = True
    return PackLayout(
        nodes,
        torch.tensor(ids, dtype=torch.long),
        torch.tensor(positions, dtype=torch.long),
        torch.tensor(index, dtype=torch.long),
        torch.tensor(prev, dtype=torch.long),
        is_first,
        None if temp_rows is None else torch.tensor(packed_temps),
    )
