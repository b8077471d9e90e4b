"""Acceptance charts: per-position acceptance, accepted drafts per step, output tokens against
target steps, and the theory curves (Leviathan et al. 2023) with the measured point on them.

Every number comes from engine.metrics, so the charts agree with the CLI and the benchmarks.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from itertools import accumulate

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine import metrics
from engine.trace import Step
from visualizations.style import GREY, KIND_COLORS, SERIES_COLORS, TEMPLATE, VERMILLION, note_figure, styled

K_MAX = 16  # the theory curves run over k = 0..K_MAX (engine.decoding.MAX_K)
CAPTION_GAP_PX = 62  # the theory chart's caption starts this far below the plot (under the x-axis title)
CAPTION_LINE_PX = 17  # and takes this much height per line
PLOT_HEIGHT_PX = 370  # the theory chart's height above its bottom margin (plotly's default 450 less its 80)


def per_position_chart(steps: Sequence[Step]) -> go.Figure:
    """Bar i: accepted at draft position i / steps that drafted position i (a tree's depth i)."""
    title = "Acceptance by draft position"
    rates = metrics.per_position_acceptance(steps)
    if not rates:
        return note_figure(title, "No drafted tokens yet")
    drafted = [sum(1 for s in metrics.verify_steps(steps) if metrics.draft_depth(s) > i) for i in range(len(rates))]
    positions = list(range(1, len(rates) + 1))
    fig = go.Figure(go.Bar(
        x=positions, y=rates, marker_color=KIND_COLORS["accepted"], name="acceptance",
        customdata=drafted, hovertemplate="position %{x}: %{y:.0%} of %{customdata} steps<extra></extra>",
    ))
    fig.update_yaxes(range=[0, 1], tickformat=".0%")
    fig.update_xaxes(dtick=1)
    return styled(fig, title, "draft position", "accepted / drafted")


def accepted_histogram(steps: Sequence[Step]) -> go.Figure:
    """How many verification steps kept 0, 1, ..., k drafts (steps that drafted nothing are left out)."""
    title = "Accepted drafts per step"
    counts = Counter(s.accepted for s in metrics.verify_steps(steps) if s.k > 0)
    if not counts:
        return note_figure(title, "No drafted tokens yet")
    xs = list(range(max(s.k for s in steps) + 1))
    fig = go.Figure(go.Bar(x=xs, y=[counts[x] for x in xs], marker_color=KIND_COLORS["accepted"], name="steps"))
    fig.update_xaxes(dtick=1)
    return styled(fig, title, "drafts accepted in the step", "steps")


def tokens_vs_steps_chart(speculative: Sequence[Step], baseline: Sequence[Step] = ()) -> go.Figure:
    """Cumulative output tokens after each target step (step 0: the prefill's first token); the
    baseline emits one token per step, speculative decoding up to k + 1."""
    fig = go.Figure()
    runs = (("speculative", speculative, SERIES_COLORS[0]), ("baseline", baseline, SERIES_COLORS[1]))
    for name, steps, color in runs:
        if steps:
            fig.add_trace(go.Scatter(
                x=[s.index for s in steps], y=list(accumulate(len(s.emitted) for s in steps)),
                mode="lines+markers", name=name, line_color=color,
            ))
    return styled(fig, "Output tokens vs target steps", "target step", "output tokens")


def theory_chart(
    acceptance_rate: float,
    cost_ratio: float,
    *,
    k_max: int = K_MAX,
    measured_k: int | None = None,
    measured_tokens_per_step: float | None = None,
    measured_speedup: float | None = None,
    verify_ms: Sequence[float] = (),
) -> go.Figure:
    """Two panels over k = 0..k_max at acceptance rate a and draft cost ratio c: expected tokens
    per target step (1 - a^(k+1)) / (1 - a), and predicted speedup
    (1 - a^(k+1)) / ((1 - a)(k c + 1)). Measured values, when given, are drawn at measured_k.

    verify_ms (this machine's verify curve, ms of one forward over T = 1, 2, ... tokens) adds the
    prediction with the measured cost of verifying k + 1 tokens in place of "verification costs
    one step", over the k the curve covers. A caption under the plots (theory_caption) says which
    prediction is which at measured_k, beside the measured speedup."""
    ks = list(range(k_max + 1))
    fig = make_subplots(rows=1, cols=2, subplot_titles=("Expected tokens per step", "Predicted speedup"))
    curves = (
        [metrics.expected_tokens_per_step(acceptance_rate, k) for k in ks],
        [metrics.predicted_speedup(acceptance_rate, k, cost_ratio) for k in ks],
    )
    measured = (measured_tokens_per_step, measured_speedup)
    for col, (curve, point) in enumerate(zip(curves, measured), start=1):
        fig.add_trace(go.Scatter(
            x=ks, y=curve, mode="lines", name="theory" if not verify_ms else "theory (verification free)",
            legendgroup="theory", showlegend=col == 1, line_color=SERIES_COLORS[0],
            line_dash="dot" if verify_ms and col == 2 else None,
        ), row=1, col=col)
        if col == 2 and verify_ms:
            costly = [k for k in ks if metrics.verify_cost(verify_ms, k + 1) is not None]
            fig.add_trace(go.Scatter(
                x=costly, y=[metrics.predicted_speedup(acceptance_rate, k, cost_ratio,
                                                       metrics.verify_cost(verify_ms, k + 1)) for k in costly],
                mode="lines", name="theory (measured verify cost)", line_color=SERIES_COLORS[2],
            ), row=1, col=2)
        if point is not None and measured_k is not None:
            fig.add_trace(go.Scatter(
                x=[measured_k], y=[point], mode="markers", name="measured", legendgroup="measured",
                showlegend=col == 1, marker=dict(color=VERMILLION, size=12, symbol="diamond"),
            ), row=1, col=col)
    fig.update_xaxes(title_text="draft length k", dtick=2)
    fig.update_yaxes(title_text="tokens per target step", row=1, col=1)
    fig.update_yaxes(title_text="speedup vs plain decoding", row=1, col=2)
    caption = theory_caption(acceptance_rate, cost_ratio, measured_k, measured_tokens_per_step=measured_tokens_per_step,
                             measured_speedup=measured_speedup, verify_ms=verify_ms)
    fig.add_annotation(text="<br>".join(caption), name="caption", showarrow=False, xref="paper", yref="paper",
                       x=0, y=0, xanchor="left", yanchor="top", yshift=-CAPTION_GAP_PX, align="left",
                       font=dict(size=12))
    bottom = CAPTION_GAP_PX + 20 + CAPTION_LINE_PX * len(caption)
    fig.update_layout(
        template=TEMPLATE,
        title=f"Theory at acceptance rate a = {acceptance_rate:.2f}, draft cost ratio c = {cost_ratio:.3f}",
        margin=dict(b=bottom), height=PLOT_HEIGHT_PX + bottom,  # the caption adds height, not squeezes the plots
    )
    return fig


def theory_caption(
    acceptance_rate: float,
    cost_ratio: float,
    k: int | None,
    *,
    measured_tokens_per_step: float | None = None,
    measured_speedup: float | None = None,
    verify_ms: Sequence[float] = (),
) -> list[str]:
    """The theory chart's caption, one plotly text line each: which predicted speedup is which
    at the run's k, and the measured one beside them, so a prediction of 1.4x next to a measured
    0.67x is explained on the chart itself: the theorem assumes verifying k + 1 tokens costs one
    plain step, and this machine's verify curve says what it costs here.

    >>> print("\\n".join(theory_caption(0.8, 0.05, 4, measured_speedup=0.67, verify_ms=[20.0, 30.0, 31.0, 32.0, 32.0])))
    At k = 4:
    • 2.80× predicted if verifying 5 tokens cost one step (Leviathan et al. 2023; blue dotted line)
    • 1.87× predicted with this machine's verify cost: 5 tokens cost 1.60 steps (green line)
    • 0.67× measured against plain decoding, wall clock (red diamond)
    """
    free_line = "blue dotted line" if verify_ms else "blue line"
    if k is None:
        lines = ["Predicted speedup:",
                 f"• if verifying k + 1 tokens cost one plain step (Leviathan et al. 2023; {free_line})"]
        if verify_ms:
            lines.append("• with this machine's measured cost of verifying k + 1 tokens (green line)")
        return lines
    free = metrics.predicted_speedup(acceptance_rate, k, cost_ratio)
    lines = [f"At k = {k}:", f"• {free:.2f}× predicted if verifying {k + 1} tokens cost one step "
                             f"(Leviathan et al. 2023; {free_line})"]
    cost = metrics.verify_cost(verify_ms, k + 1) if verify_ms else None
    if cost is not None:
        costed = metrics.predicted_speedup(acceptance_rate, k, cost_ratio, cost)
        lines.append(f"• {costed:.2f}× predicted with this machine's verify cost: {k + 1} tokens cost "
                     f"{cost:.2f} steps (green line)")
    else:
        why = f"its verify curve stops before {k + 1} tokens" if verify_ms else "no verify curve was measured"
        lines.append(f"• no prediction with this machine's verify cost: {why}")
    lines.append(f"• {measured_speedup:.2f}× measured against plain decoding, wall clock (red diamond)"
                 if measured_speedup is not None else
                 "• no measured speedup yet: it needs a plain decoding run to compare with")
    if measured_tokens_per_step is not None:
        expected = metrics.expected_tokens_per_step(acceptance_rate, k)
        lines.append(f"• {measured_tokens_per_step:.2f} tokens per step measured, {expected:.2f} expected "
                     f"at a = {acceptance_rate:.2f}")
    return lines


def theory_chart_for(
    steps: Sequence[Step], *, baseline_step_s: float | None = None, measured_speedup: float | None = None,
    k_max: int = K_MAX, verify_ms: Sequence[float] = (),
) -> go.Figure:
    """theory_chart for a run: a (the per-token acceptance estimate), c, the run's mean k and its mean acceptance length from
    engine.metrics; measured_speedup is the wall-clock ratio against a baseline run, if any;
    verify_ms the run's measured verify curve (RunInfo.verify_ms)."""
    rate = metrics.per_token_acceptance(steps)
    c = metrics.cost_ratio(steps, baseline_step_s)
    if rate is None or c is None:
        return note_figure("Theory", "No drafted tokens yet: the curves need an acceptance rate")
    k = round(statistics.mean(s.k for s in metrics.verify_steps(steps) if s.k > 0))
    return theory_chart(rate, c, k_max=max(k_max, k), measured_k=k,
                        measured_tokens_per_step=metrics.mean_acceptance_length(steps),
                        measured_speedup=measured_speedup, verify_ms=verify_ms)


def verify_curve_chart(verify_ms: Sequence[float], k: int | None = None, label: str = "") -> go.Figure:
    """This machine's verify curve: one target forward over T tokens as a multiple of one token,
    T = 1, 2, ... (a step that verifies k drafts is T = k + 1). Flat (near 1) is the premise of
    speculation; the dashed line is "verification costs one step". k marks the current draft length."""
    title = "Verify curve: cost of one forward over T tokens / over 1" + (f" ({label})" if label else "")
    if not verify_ms:
        return note_figure(title, "No verify curve: this run was recorded without one")
    ts = list(range(1, len(verify_ms) + 1))
    ratios = [m / verify_ms[0] for m in verify_ms]
    fig = go.Figure(go.Scatter(
        x=ts, y=ratios, mode="lines+markers", name="measured", line_color=SERIES_COLORS[0],
        customdata=list(verify_ms), hovertemplate="T = %{x}: %{y:.2f}× (%{customdata:.1f} ms)<extra></extra>",
    ))
    fig.add_hline(y=1.0, line_dash="dash", line_color=GREY, annotation_text="verification free",
                  annotation_position="bottom right")
    if k is not None and 1 <= k + 1 <= len(ratios):
        fig.add_trace(go.Scatter(
            x=[k + 1], y=[ratios[k]], mode="markers", name=f"this run: k = {k} (T = {k + 1})",
            marker=dict(color=VERMILLION, size=13, symbol="diamond"),
        ))
    fig.update_xaxes(dtick=2)
    fig.update_yaxes(rangemode="tozero")
    return styled(fig, title, "tokens in the forward (T = k + 1)", "cost / one-token forward")
