"""Metric definitions, once, for everyone (DESIGN.md; vLLM's conventions).

Step 0 of a trace is the prefill's first token; acceptance metrics read the verification
steps (index >= 1), latency metrics read every emitted token.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from engine.trace import PrefillChunk, Step, depths


def verify_steps(steps: Sequence[Step]) -> list[Step]:
    return [s for s in steps if s.index > 0]


def drafted_tokens(steps: Sequence[Step]) -> int:
    return sum(s.k for s in verify_steps(steps))


def accepted_tokens(steps: Sequence[Step]) -> int:
    return sum(s.accepted for s in verify_steps(steps))


def draft_acceptance_rate(steps: Sequence[Step]) -> float | None:
    """accepted / drafted over all verification steps; None when nothing was drafted."""
    drafted = drafted_tokens(steps)
    return accepted_tokens(steps) / drafted if drafted else None


def per_token_acceptance(steps: Sequence[Step]) -> float | None:
    """Estimate of Leviathan et al.'s alpha (the chance one drafted token is accepted): accepted /
    examined, where drafts after a step's first rejection were never examined. It feeds the
    speedup formula; accepted / drafted (draft_acceptance_rate) is lower for k > 1 because it
    counts the unexamined drafts as failures.

    >>> from types import SimpleNamespace as S
    >>> per_token_acceptance([S(index=1, k=4, accepted=1), S(index=2, k=4, accepted=4)])
    0.8333333333333334
    """
    vs = verify_steps(steps)
    accepted = sum(s.accepted for s in vs)
    examined = accepted + sum(1 for s in vs if s.accepted < s.k)
    return accepted / examined if examined else None


def mean_acceptance_length(steps: Sequence[Step]) -> float | None:
    """Output tokens per verification step (counts the recovered/bonus token): 1.0 for plain
    decoding, up to k + 1."""
    vs = verify_steps(steps)
    return sum(len(s.emitted) for s in vs) / len(vs) if vs else None


def draft_depth(step: Step) -> int:
    """How many draft positions a step examined in sequence: k for a chain, the depth of its
    deepest draft for a tree (whose k counts nodes, several at one position)."""
    return max(depths(step.draft_parents)) if step.draft_parents else step.k


def per_position_acceptance(steps: Sequence[Step]) -> list[float]:
    """[i]: accepted at draft position i / steps that drafted position i (for a tree, position i
    is depth i + 1: accepted there when the accepted path reaches that depth)."""
    reached = [(draft_depth(s), s.accepted) for s in verify_steps(steps)]  # (depth drafted, accepted)
    longest = max((d for d, _ in reached), default=0)
    rates = []
    for i in range(longest):
        drafted = [a for d, a in reached if d > i]
        rates.append(sum(1 for a in drafted if a > i) / len(drafted))
    return rates


def cost_ratio(steps: Sequence[Step], baseline_step_s: float | None) -> float | None:
    """c = time of one drafting of k tokens / k / time of one plain target step.

    baseline_step_s is the median plain decode step time measured in the same run; without it,
    the verify time of this run's steps stands in (a step verifying k+1 tokens costs a little
    more than a plain step, so c is slightly underestimated)."""
    drafting = [s.draft_s / s.k for s in verify_steps(steps) if s.k > 0]
    if not drafting:
        return None
    ref = baseline_step_s or statistics.median(s.verify_s for s in verify_steps(steps))
    return statistics.median(drafting) / ref if ref > 0 else None


def expected_tokens_per_step(a: float, k: int) -> float:
    """Expected tokens a target step emits at acceptance rate a and draft length k
    (Leviathan et al. 2023, eq. 1): (1 - a^(k+1)) / (1 - a).

    >>> round(expected_tokens_per_step(0.8, 4), 4)
    3.3616
    """
    if a >= 1:
        return float(k + 1)
    return (1 - a ** (k + 1)) / (1 - a)


def predicted_speedup(a: float, k: int, c: float, verify_cost: float = 1.0) -> float:
    """Leviathan et al. 2023, Theorem 3.8: (1 - a^(k+1)) / ((1 - a)(k c + 1)).

    The theorem assumes verifying k + 1 tokens costs one plain step. verify_cost is the measured
    cost of that forward as a multiple of one step (engine.verify_curve), which replaces the 1:
    (1 - a^(k+1)) / ((1 - a)(k c + verify_cost)).

    >>> round(predicted_speedup(0.8, 4, 0.05), 3)
    2.801
    >>> round(predicted_speedup(0.8, 4, 0.05, verify_cost=1.6), 3)
    1.868
    """
    return expected_tokens_per_step(a, k) / (k * c + verify_cost)


@dataclass(frozen=True)
class StepEconomics:
    """Why speculation wins or loses on this machine, from a run's own measurements: a target
    step costs drafting (k drafts x c) plus one verification forward over k + 1 tokens (its
    measured cost v, a multiple of a one-token forward), and emits tokens_per_step tokens. A plain
    step costs 1 and emits 1, so decoding is predicted tokens_per_step / (k c + v) times faster.

    >>> e = StepEconomics(tokens_per_step=3.0, k=4, draft_cost=0.2, verify_cost=1.05)
    >>> round(e.step_cost, 2), round(e.predicted_speedup, 2)
    (1.25, 2.4)
    """

    tokens_per_step: float  # output tokens per target step (mean acceptance length, measured)
    k: int  # drafts verified per step (mean, rounded; a tree's node count)
    draft_cost: float  # drafting one step's k tokens, in plain steps (k x c)
    verify_cost: float  # the verification forward over k + 1 tokens, in plain steps (measured curve)

    @property
    def step_cost(self) -> float:
        return self.draft_cost + self.verify_cost

    @property
    def predicted_speedup(self) -> float:
        return self.tokens_per_step / self.step_cost


def step_economics(steps: Sequence[Step], verify_ms: Sequence[float],
                   baseline_step_s: float | None = None) -> StepEconomics | None:
    """The run's StepEconomics; None for plain decoding, or without a verify curve that reaches
    k + 1 tokens. The plain step is baseline_step_s (measured side by side) or else the curve's
    one-token forward."""
    tau = mean_acceptance_length(steps)
    drafted = [s.k for s in verify_steps(steps) if s.k > 0]
    if tau is None or not drafted or not verify_ms:
        return None
    k = round(statistics.mean(drafted))
    cost = verify_cost(verify_ms, k + 1)
    c = cost_ratio(steps, baseline_step_s or verify_ms[0] / 1000)
    if cost is None or c is None:
        return None
    return StepEconomics(tau, k, k * c, cost)


def reusable_prefix_tokens(prompt_tokens: int, shared_tokens: int, block_size: int) -> int:
    """Prompt tokens a block-granular prefix cache can reuse when the first `shared_tokens` are
    already cached: whole blocks only, and never the prompt's last token (its logits choose the
    first output token, so it is always computed). engine.serving.prefix_cache follows this rule.

    >>> reusable_prefix_tokens(930, 905, 32), reusable_prefix_tokens(64, 64, 32)
    (896, 32)
    """
    return max(0, min(shared_tokens, prompt_tokens - 1)) // block_size * block_size


def prefill_cost(requested_tokens: int, reused_tokens: int) -> float:
    """Blended prefill cost: prompt tokens computed / prompt tokens requested (1.0 without a
    prefix cache).

    >>> prefill_cost(1000, 750)
    0.25
    """
    return (requested_tokens - reused_tokens) / requested_tokens


def prefill_chunks(prompt_tokens: int, reused_tokens: int, chunk_size: int) -> int:
    """Steps a prompt's prefill takes under chunked prefill with chunks of `chunk_size` tokens
    (a full budget each step), once `reused_tokens` come from the prefix cache.

    >>> prefill_chunks(930, 0, 256), prefill_chunks(930, 896, 256)
    (4, 1)
    """
    return -(-(prompt_tokens - reused_tokens) // chunk_size)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def token_times(steps: Sequence[Step]) -> list[float]:
    """Emission time of every output token (a step emitting n tokens emits them together)."""
    return [s.end_s for s in steps for _ in s.emitted]


def ttft_s(steps: Sequence[Step]) -> float | None:
    return steps[0].end_s if steps else None


def itl_per_token_s(steps: Sequence[Step]) -> list[float]:
    """Gaps between consecutive output tokens: a step emitting n tokens adds one gap, then
    n-1 zeros."""
    times = token_times(steps)
    return [b - a for a, b in zip(times, times[1:])]


def itl_per_step_s(steps: Sequence[Step]) -> list[float]:
    """Gaps between consecutive steps that emitted tokens."""
    times = [s.end_s for s in steps if s.emitted]
    return [b - a for a, b in zip(times, times[1:])]


def verify_cost(verify_ms: Sequence[float], tokens: int) -> float | None:
    """Cost of a forward over `tokens` tokens / over one, from a verify curve (ms for T = 1, 2, ...).

    >>> verify_cost([20.0, 20.5, 21.0, 21.5, 22.0], 5), verify_cost([20.0], 5), verify_cost([], 1)
    (1.1, None, None)
    """
    if not verify_ms or not 1 <= tokens <= len(verify_ms):
        return None
    return verify_ms[tokens - 1] / verify_ms[0]


def summary(steps: Sequence[Step], prefill: Sequence[PrefillChunk], baseline_step_s: float | None = None,
            verify_ms: Sequence[float] = ()) -> dict:
    """The metrics object of the CLI JSON and the UI readouts. verify_ms (the run's measured
    verify curve, RunInfo.verify_ms) adds the prediction with the measured verification cost."""
    n_tokens = sum(len(s.emitted) for s in steps)
    wall = steps[-1].end_s if steps else 0.0
    itl = itl_per_token_s(steps)
    decode_s = wall - ttft_s(steps) if steps else 0.0
    rate = draft_acceptance_rate(steps)
    # Leviathan's alpha and formula describe chains; a tree's k counts nodes, not a draft length
    tree = any(s.draft_parents for s in verify_steps(steps))
    alpha = None if tree else per_token_acceptance(steps)
    c = cost_ratio(steps, baseline_step_s)
    k_values = [s.k for s in verify_steps(steps) if s.k > 0]
    mean_k = statistics.mean(k_values) if k_values else 0
    cost = verify_cost(verify_ms, round(mean_k) + 1) if k_values else None  # T = k + 1
    return {
        "output_tokens": n_tokens,
        "target_steps": len(steps),
        "prefill_chunks": len(prefill),
        "wall_s": wall,
        "tokens_per_s": n_tokens / wall if wall > 0 else None,
        "decode_tokens_per_s": (n_tokens - 1) / decode_s if decode_s > 0 else None,
        "ttft_ms": ttft_s(steps) * 1000 if steps else None,
        "itl_ms_p50": _ms(percentile(itl, 50)),
        "itl_ms_p90": _ms(percentile(itl, 90)),
        "itl_step_ms_p50": _ms(percentile(itl_per_step_s(steps), 50)),
        "drafted_tokens": drafted_tokens(steps),
        "accepted_tokens": accepted_tokens(steps),
        "draft_acceptance_rate": rate,
        "per_token_acceptance": alpha,
        "mean_acceptance_length": mean_acceptance_length(steps),
        "per_position_acceptance": per_position_acceptance(steps),
        "cost_ratio": c,
        "predicted_speedup": predicted_speedup(alpha, round(mean_k), c) if alpha is not None and c is not None else None,
        "verify_cost": cost,
        "predicted_speedup_measured_verify": (
            predicted_speedup(alpha, round(mean_k), c, cost) if None not in (alpha, c, cost) else None
        ),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000
