"""Weighted turns between task domains: which domain's prompt starts next, which fills a batch slot.

Smooth weighted round robin (nginx's): each draw adds every domain's weight to its credit, the
domain with the most credit is drawn and pays 1. With weights normalised to sum 1, a domain's
credit after n draws is ``weight × n - times drawn``, and the draws follow the weights at every
prefix of the sequence, not only on average: after n draws each domain was drawn less than one
time away from ``weight × n``, so any run of n draws (a batch) holds it less than two away
(``tests/sample_buffer/test_domains.py`` checks both). Undoing a draw keeps that; a refund (a slot
another domain filled) owes the domain at most one draw more. The rollout loop draws prompts with
it; the buffer draws the slots of a batch.
"""

from __future__ import annotations


class WeightedTurns:
    def __init__(self, weights: dict[str, float]) -> None:
        if not weights or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ValueError(f"weights: non-negative numbers with a positive sum expected, got {weights}")
        self.credit = dict.fromkeys(weights, 0.0)
        self.weights: dict[str, float] = {}
        self.reweight(weights)

    def reweight(self, weights: dict[str, float]) -> None:
        """New weights for the same domains (the credits carry over: no burst, no gap)."""
        total = sum(weights.values())
        self.weights = {d: weights[d] / total for d in self.credit}

    def draw(self, among: set[str] | None = None) -> str:
        """The next domain; ``among``: only these may be drawn (the others' credit grows all the same)."""
        for d, w in self.weights.items():
            self.credit[d] += w
        pool = [d for d in self.credit if self.weights[d] > 0 and (among is None or d in among)]
        if not pool:
            raise ValueError(f"no domain with a weight among {sorted(among or ())}")
        pick = max(pool, key=lambda d: self.credit[d])  # ties: the first listed
        self.credit[pick] -= 1.0
        return pick

    def undo(self, domain: str) -> None:
        """Take back a draw of ``domain`` as if it had not been made (a batch slot left unfilled)."""
        self.credit[domain] += 1.0
        for d, w in self.weights.items():
            self.credit[d] -= w

    def refund(self, domain: str, most: float = 1.0) -> None:
        """Give ``domain`` back a draw another domain used instead, owing it at most ``most`` draws: slots
        it could not fill for long are not all paid back in a burst when it recovers."""
        self.credit[domain] = min(self.credit[domain] + 1.0, max(self.credit[domain], most))
