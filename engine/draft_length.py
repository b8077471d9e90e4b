"""Draft lengths fitted to the machine: each step drafts as far as pays on this machine's verify curve.

A fixed k asks every step to verify k drafts. What that costs depends on the machine
(engine.verify_curve): on a GPU, or bfloat16 on a CPU with bfloat16 instructions, a forward over
k + 1 tokens costs about one plain step for any k here; on an AVX2 CPU in float32 it is flat up to
4 tokens and then jumps (5 tokens ~1.4x one). What a draft is worth depends on the drafter and the
text: prompt lookup in copied text is accepted far down the chain, a small model's guesses in open
chat seldom past the first two.

DraftLengthFit chooses each step's draft length m <= k as the one with the most expected tokens
per unit of cost,

    E(m) / (v(m + 1) + m d),   E(m) = 1 + sum_{i=1..m} a_1 a_2 ... a_i,

where v is the measured verify curve (a multiple of a one-token forward), d this run's measured
drafting time per drafted token (in the same unit) and a_i this run's acceptance rate at draft
position i, given that position i was examined (accepted / examined so far, shrunk towards the
rate of position i - 1 with the weight of PRIOR_WEIGHT examinations; PRIOR_RATE before any
record). A position never examined so takes the rate of the one before it: a source whose drafts
are all accepted is tried further down the chain. Each source of drafts (prompt lookup, the model drafter behind
lookup_first) keeps its own rates and drafting cost. It never chooses m = 0: it decides how far
to speculate, not whether.

Exact: the length is chosen from earlier steps and the drafter's own output, never from this
step's target, so greedy output is plain decoding's and sampled output keeps the target's
distribution (as with any draft length). Chains only: a tree's depth is left as asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

PRIOR_RATE = 0.5  # the acceptance rate assumed for the first draft position before any record
PRIOR_WEIGHT = 2.0  # how many examinations a position's prior (the rate before it) is worth


@dataclass
class SourceStats:
    """One source's record in this run: per draft position (0-based) how often it was examined
    (every draft before it accepted) and accepted, and its drafting time."""

    examined: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    drafted: int = 0

    def rates(self, n: int) -> list[float]:
        """The acceptance rates of positions 0..n-1: each one's record, shrunk towards the rate
        of the position before it (PRIOR_RATE for the first), worth PRIOR_WEIGHT examinations.
        A position never examined takes the rate before it, so a source whose drafts are all
        accepted is tried further down the chain."""
        out, prior = [], PRIOR_RATE
        for i in range(n):
            seen = self.examined[i] if i < len(self.examined) else 0
            kept = self.accepted[i] if i < len(self.accepted) else 0
            prior = (kept + prior * PRIOR_WEIGHT) / (seen + PRIOR_WEIGHT)
            out.append(prior)
        return out

    def record(self, drafted: int, accepted: int, draft_s: float) -> None:
        examined = min(drafted, accepted + 1)  # drafts after the first rejection were never examined
        grow = drafted - len(self.examined)
        if grow > 0:
            self.examined += [0] * grow
            self.accepted += [0] * grow
        for i in range(examined):
            self.examined[i] += 1
        for i in range(accepted):
            self.accepted[i] += 1
        self.draft_s += draft_s
        self.drafted += drafted


class DraftLengthFit:
    """Per-step draft lengths for one run (see the module docstring).

    >>> flat = DraftLengthFit([20.0] * 9)            # a flat curve: verifying 8 costs one step
    >>> flat.best("lookup", 8)                        # untried: the prior pays all the way down
    8
    >>> steep = DraftLengthFit([20.0, 20.2, 20.4, 20.6, 28.0, 28.4, 28.8, 32.0, 37.0])
    >>> steep.best("lookup", 8)                       # the 5-token forward costs 1.4x: stop at 3
    3
    >>> for _ in range(30):
    ...     steep.record("lookup", drafted=8, accepted=8, draft_s=0.0)
    >>> steep.best("lookup", 8)                       # always accepted: 8 tokens (1.6x), not 9 (1.85x)
    7
    """

    def __init__(self, verify_ms: Sequence[float]):
        if not verify_ms or verify_ms[0] <= 0:
            raise ValueError("a verify curve starting at one token is needed")
        self.verify_ms = tuple(verify_ms)
        self.sources: dict[str, SourceStats] = {}

    def cost(self, tokens: int) -> float:
        """A forward over `tokens` tokens, in one-token forwards (the curve's measurement)."""
        return self.verify_ms[tokens - 1] / self.verify_ms[0]

    def draft_cost(self, source: str) -> float:
        """This source's drafting time per drafted token so far, in one-token forwards (0 before
        it drafted)."""
        stats = self.sources.get(source)
        if stats is None or not stats.drafted:
            return 0.0
        return stats.draft_s / stats.drafted / (self.verify_ms[0] / 1000)

    def values(self, source: str, top: int) -> list[float]:
        """Expected tokens per unit of cost of a step that drafts m = 1..top tokens from this source."""
        stats = self.sources.get(source) or SourceStats()
        per_draft = self.draft_cost(source)
        out, expected, reach = [], 1.0, 1.0
        for m, rate in enumerate(stats.rates(top), start=1):
            reach *= rate
            expected += reach
            out.append(expected / (self.cost(m + 1) + m * per_draft))
        return out

    def best(self, source: str, k: int) -> int:
        """The draft length in 1..k (within the measured curve) worth most for this source; ties
        go to the shorter."""
        values = self.values(source, max(1, min(k, len(self.verify_ms) - 1)))
        return 1 + max(range(len(values)), key=lambda i: (values[i] - 1e-12 * i))

    def cap(self, k: int, sources: Sequence[str]) -> int:
        """The longest draft any of these sources (or one not seen yet) would be given: what to
        ask the drafter for before it is known which source drafts."""
        return max(self.best(s, k) for s in {*sources, *self.sources})

    def record(self, source: str, drafted: int, accepted: int, draft_s: float) -> None:
        if drafted:
            self.sources.setdefault(source, SourceStats()).record(drafted, accepted, draft_s)


def fits(drafter) -> bool:
    """Whether fit_k applies to this drafter: a chain drafter (a tree's depth is left as asked)."""
    return drafter is not None and getattr(drafter, "tree", None) is None
