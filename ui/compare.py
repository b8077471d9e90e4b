"""Compare: plain decoding (the baseline) against speculative decoding on the same prompt and
settings, in interleaved rounds (baseline then speculative, then the other order), so a slow
moment of a shared machine does not land on one side only; the verdict takes medians."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from engine.metrics import StepEconomics, mean_acceptance_length, step_economics, summary, verify_steps
from engine.session import RunSession
from visualizations.verdict import Verdict

MAX_ROUNDS = 5
DEFAULT_ROUNDS = 3


def round_order(index: int) -> tuple[bool, bool]:
    """Which side runs first in round `index` (True: speculative): the order alternates.

    >>> [round_order(i) for i in range(3)]
    [(False, True), (True, False), (False, True)]
    """
    return (False, True) if index % 2 == 0 else (True, False)


@dataclass
class Comparison:
    """Every round's runs; the first round's pair is streamed live and stands for the comparison
    in the views (its speculative run becomes the playground's current run)."""

    rounds: int
    baselines: list[RunSession] = field(default_factory=list)
    speculatives: list[RunSession] = field(default_factory=list)

    @property
    def baseline(self) -> RunSession | None:
        return self.baselines[0] if self.baselines else None

    @property
    def speculative(self) -> RunSession | None:
        return self.speculatives[0] if self.speculatives else None

    def sessions(self) -> list[RunSession]:
        return [*self.baselines, *self.speculatives]

    def stopped(self) -> bool:
        return any(s.stop_reason == "stopped" for s in self.sessions())

    def complete_pairs(self) -> list[tuple[RunSession, RunSession]]:
        """(baseline, speculative) of every round where both ran to their end."""
        return [(b, s) for b, s in zip(self.baselines, self.speculatives)
                if b.finished and s.finished and "stopped" not in (b.stop_reason, s.stop_reason)
                and b.steps and s.steps]


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v]
    return statistics.median(values) if values else None


def plain_step_s(c: Comparison) -> float | None:
    """The median plain decoding step of the baseline runs (the unit the drafting cost c uses)."""
    steps = [s.verify_s for b, _ in c.complete_pairs() for s in verify_steps(b.steps)]
    return statistics.median(steps) if steps else None


def economics(c: Comparison) -> StepEconomics | None:
    pairs = c.complete_pairs()
    if not pairs:
        return None
    spec = pairs[0][1]
    return step_economics(spec.steps, spec.info.verify_ms, plain_step_s(c))


def _first_difference(base: tuple[int, ...], spec: tuple[int, ...]) -> int | None:
    if base == spec:
        return None
    return next((i for i, (a, b) in enumerate(zip(base, spec)) if a != b), min(len(base), len(spec)))


def verdict(c: Comparison) -> Verdict | None:
    """The comparison's outcome over its complete rounds; None until one round is complete."""
    pairs = c.complete_pairs()
    if not pairs:
        return None
    base = [summary(b.steps, b.prefill) for b, _ in pairs]
    spec = [summary(s.steps, s.prefill) for _, s in pairs]
    base_tps, spec_tps = _median([m["tokens_per_s"] for m in base]), _median([m["tokens_per_s"] for m in spec])
    if not base_tps or not spec_tps:
        return None
    decode = _median([s["decode_tokens_per_s"] / b["decode_tokens_per_s"] for b, s in zip(base, spec)
                      if s["decode_tokens_per_s"] and b["decode_tokens_per_s"]])
    reference = pairs[0][0].trace().output_token_ids
    greedy = pairs[0][1].request is None or pairs[0][1].request.decode.sampling.greedy
    diverge = [_first_difference(reference, s.trace().output_token_ids) for _, s in pairs]
    diverge += [_first_difference(reference, b.trace().output_token_ids) for b, _ in pairs[1:]]
    first_diff = min((d for d in diverge if d is not None), default=None)
    return Verdict(
        method=pairs[0][1].info.method,
        rounds=len(pairs),
        baseline_tokens_per_s=base_tps,
        speculative_tokens_per_s=spec_tps,
        tokens_per_step=_median([mean_acceptance_length(s.steps) for _, s in pairs]),
        output_tokens=len(reference),
        identical=(first_diff is None) if greedy else None,
        diverge_at=first_diff if greedy else None,
        decode_speedup=decode,
        economics=economics(c),
        lossy=pairs[0][1].info.lossy,
    )
