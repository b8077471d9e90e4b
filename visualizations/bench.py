"""Benchmark and quality-gate views, from their JSON objects (engine.bench.report, the
`bench --json` object; engine.bench.gate, the `gate --json` object).

Every number is read from those objects, so a chart agrees with the tables and the CLI.
"""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go

from visualizations.style import GREY, SERIES_COLORS, VERMILLION, note_figure, styled
from visualizations.text import plotly_label, show_whitespace

ENGINE_COLOR, TRANSFORMERS_COLOR = SERIES_COLORS[0], SERIES_COLORS[1]


def _rows(report: dict) -> list[dict]:
    return report["results"] + report["transformers"]


def speed_chart(report: dict) -> go.Figure:
    """Median tokens/s per method (engine and transformers), labelled with the speedup over the
    engine's baseline measured in the same run."""
    title = "Tokens per second (median over prompts and repeats)"
    rows = [r for r in _rows(report) if r["tokens_per_s_median"] is not None]
    if not rows:
        return note_figure(title, "No timed runs")
    fig = go.Figure()
    for impl, color in (("engine", ENGINE_COLOR), ("transformers", TRANSFORMERS_COLOR)):
        mine = [r for r in rows if r["implementation"] == impl]
        if mine:
            fig.add_trace(go.Bar(
                x=[plotly_label(r["method"]).replace(":", "<br>") for r in mine],  # transformers:<argument>
                y=[r["tokens_per_s_median"] for r in mine],
                name=impl, marker_color=color,
                text=[f"{r['speedup']:.2f}x" if r["speedup"] is not None else "" for r in mine],
                textposition="outside", hovertemplate="%{x}: %{y:.1f} tokens/s (%{text})<extra></extra>",
            ))
    return styled(fig, title, "method", "tokens/s")


def speedup_chart(report: dict) -> go.Figure:
    """Measured speedup beside the speedup Leviathan et al.'s formula predicts from the measured
    acceptance and cost ratio, per drafting method."""
    title = "Measured vs predicted speedup"
    rows = [r for r in report["results"] if r["predicted_speedup"] is not None]
    if not rows:
        return note_figure(title, "No drafting method with acceptance data")
    names = [plotly_label(r["method"]) for r in rows]
    fig = go.Figure([
        go.Bar(x=names, y=[r["speedup"] for r in rows], name="measured", marker_color=ENGINE_COLOR),
        go.Bar(x=names, y=[r["predicted_speedup"] for r in rows], name="predicted", marker_color=GREY),
    ])
    fig.add_hline(y=1.0, line_dash="dot", line_color=VERMILLION, annotation_text="baseline")
    fig.update_layout(barmode="group")
    return styled(fig, title, "method", "speedup over baseline")


def acceptance_chart(report: dict) -> go.Figure:
    """Per-position acceptance (accepted at draft position i / steps that drafted it), one line
    per drafting method."""
    title = "Acceptance by draft position"
    rows = [r for r in report["results"] if r["per_position_acceptance"]]
    if not rows:
        return note_figure(title, "No drafted tokens")
    fig = go.Figure()
    for n, r in enumerate(rows):
        rates = r["per_position_acceptance"]
        fig.add_trace(go.Scatter(
            x=list(range(1, len(rates) + 1)), y=rates, mode="lines+markers", name=plotly_label(r["method"]),
            line_color=SERIES_COLORS[n % len(SERIES_COLORS)],
        ))
    fig.update_yaxes(range=[0, 1.05], tickformat=".0%")
    fig.update_xaxes(dtick=1)
    return styled(fig, title, "draft position", "accepted / drafted")


def bench_charts(report: dict) -> dict[str, go.Figure]:
    """Every benchmark chart by file name."""
    return {"speed": speed_chart(report), "speedup": speedup_chart(report), "acceptance": acceptance_chart(report)}


def gate_chart(gate: dict) -> go.Figure:
    """Sampling gate: TV distance per output position for each prompt, against the threshold;
    greedy gate: the first divergent position per prompt (none when all outputs are identical)."""
    if gate["mode"] == "greedy":
        title = "Greedy gate: first divergence per prompt"
        diverged = [p for p in gate["prompts"] if p["divergence"]]
        if not diverged:
            return note_figure(title, f"All {len(gate['prompts'])} outputs are identical to the baseline's")
        fig = go.Figure(go.Bar(
            x=[plotly_label(p["prompt"]) for p in diverged], y=[p["divergence"]["position"] for p in diverged],
            marker_color=VERMILLION, hovertemplate="%{x}: diverged at output token %{y}<extra></extra>",
        ))
        return styled(fig, title, "prompt", "first divergent output position")
    title = "Sampling gate: TV distance per position (baseline vs method)"
    fig = go.Figure()
    for n, p in enumerate(gate["prompts"]):
        fig.add_trace(go.Scatter(
            x=list(range(len(p["tv"]))), y=p["tv"], mode="lines+markers", name=plotly_label(p["prompt"]),
            line_color=SERIES_COLORS[n % len(SERIES_COLORS)],
        ))
    fig.add_hline(y=gate["threshold"], line_dash="dash", line_color=VERMILLION,
                  annotation_text=f"threshold {gate['threshold']:.3f} (false alarm {gate['alpha']:g})")
    fig.update_yaxes(rangemode="tozero")
    return styled(fig, title, "output position", "total-variation distance")


def _token(ref: dict | None) -> str:
    return "(ended)" if ref is None else f"{show_whitespace(ref['text'])!r} ({ref['token_id']})"


def gate_table(gate: dict) -> pd.DataFrame:
    """One row per prompt: the verdict and what decided it (token text with visible whitespace,
    quoted; the table component escapes it)."""
    rows = []
    for p in gate["prompts"]:
        if gate["mode"] == "greedy":
            d = p["divergence"]
            detail = "identical" if d is None else (
                f"position {d['position']}: baseline {_token(d['baseline'])}, method {_token(d['method'])}, "
                f"target logit gap {_gap(d['target_logit_gap'])} (top-2 margin {d['target_top2_margin']:.3f})"
            )
        else:
            diffs = ", ".join(
                f"{show_whitespace(x['token']['text'])!r} {x['baseline_freq']:.2f} vs {x['method_freq']:.2f}"
                for x in p["differences"]
            )
            detail = f"max TV {max(p['tv']):.3f} at position {p['worst_position']} ({diffs})"
        rows.append({"prompt": p["prompt"], "verdict": "pass" if p["passed"] else "FAIL", "detail": detail})
    return pd.DataFrame(rows, columns=["prompt", "verdict", "detail"])


def _gap(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.3f}"
