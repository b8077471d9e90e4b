"""TTFT and ITL charts and the summary table for serving runs, several settings (e.g. two
policies or chunk sizes) compared in one view.

`runs` maps a setting's label (e.g. "decode-first, chunk 256") to its requests: dicts or records
with the request fields of visualizations.timeline. TTFT = first token - arrival; ITL is per
token (DESIGN.md): the gap between consecutive output tokens of one request.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from visualizations.style import SERIES_COLORS, TEMPLATE, class_color, legend_below, note_figure, styled
from visualizations.text import plotly_label
from visualizations.timeline import RequestTimes, lane_label, request_times

STALL_FACTOR = 3  # a gap longer than this many typical gaps (the setting's median) is a stall
ROW_PX = 230  # height of one setting's panel in the ITL-over-time figure
SUMMARY_COLUMNS = ("setting", "engine steps", "token budget", "short ITL p50 (ms)", "short ITL p99 (ms)",
                   "short ITL max (ms)", "long TTFT p50 (ms)", "output tokens/s", "decodes during prefill",
                   "prompt tokens reused (%)")


def _runs(runs: Mapping[str, Sequence]) -> dict[str, list[RequestTimes]]:
    return {plotly_label(label): [request_times(r) for r in reqs] for label, reqs in runs.items()}


def ttft_chart(runs: Mapping[str, Sequence]) -> go.Figure:
    """TTFT per request, one bar group per request and one colour per setting. Each request's
    label takes two short lines and the values are in the hover, so no text collides."""
    title = "Time to first token per request"
    settings = _runs(runs)
    if not any(r.ttft_s is not None for reqs in settings.values() for r in reqs):
        return note_figure(title, "No first tokens yet")
    fig = go.Figure()
    for n, (label, reqs) in enumerate(settings.items()):
        done = [r for r in reqs if r.ttft_s is not None]
        fig.add_trace(go.Bar(
            x=[_two_lines(r) for r in done], y=[r.ttft_s * 1000 for r in done], name=label,
            marker_color=SERIES_COLORS[n % len(SERIES_COLORS)],
            hovertext=[f"{label}<br>{lane_label(r.request_id, r.cls)}: TTFT {r.ttft_s * 1000:,.0f} ms" for r in done],
            hoverinfo="text",
        ))
    fig.update_layout(barmode="group")
    styled(fig, title, "request", "TTFT (ms)")
    fig.update_xaxes(automargin=True)
    fig.update_yaxes(automargin=True)
    return legend_below(fig)


def _two_lines(r: RequestTimes) -> str:
    return f"{plotly_label(r.request_id)}<br>({plotly_label(r.cls)})"


def itl_series(r: RequestTimes, typical_s: float | None) -> tuple[list, list]:
    """x (the later token's time, s) and y (ITL, ms) of one request, with a None before each
    stall (a gap over STALL_FACTOR typical gaps): a line drawn through them breaks there rather
    than run across a stretch where no token came.

    >>> itl_series(request_times({"request_id": "r", "cls": "short", "arrival_s": 0, "first_token_s": 0,
    ...                           "token_times_s": [0, 1, 2, 10, 11]}), 1.0)
    ([1.0, 2.0, None, 10.0, 11.0], [1000.0, 1000.0, None, 8000.0, 1000.0])
    """
    xs: list = []
    ys: list = []
    for time_s, gap in zip(r.token_times_s[1:], r.itl_s):
        if typical_s and gap > STALL_FACTOR * typical_s and xs:
            xs.append(None)
            ys.append(None)
        xs.append(time_s)
        ys.append(gap * 1000)
    return xs, ys


def itl_over_time_chart(runs: Mapping[str, Sequence]) -> go.Figure:
    """One panel per setting, stacked on shared time and ITL axes (so they compare by eye and
    fit a phone): each request's ITL at the time of the later token, coloured by request class
    (long or short prompt). A stall breaks the line (itl_series)."""
    title = "Inter-token latency over time"
    settings = _runs(runs)
    if not settings:
        return note_figure(title, "No runs yet")
    fig = make_subplots(rows=len(settings), cols=1, shared_xaxes=True, subplot_titles=list(settings),
                        vertical_spacing=0.12)
    shown: set[str] = set()
    for row, reqs in enumerate(settings.values(), start=1):
        gaps = [gap for r in reqs for gap in r.itl_s]
        typical = statistics.median(gaps) if gaps else None
        for r in reqs:
            xs, ys = itl_series(r, typical)
            fig.add_trace(go.Scatter(
                x=xs, y=ys, mode="lines+markers", name=plotly_label(r.cls), legendgroup=r.cls,
                showlegend=r.cls not in shown, line_color=class_color(r.cls), marker_size=4,
                hovertext=lane_label(r.request_id, r.cls), hoverinfo="text+x+y",
            ), row=row, col=1)
            shown.add(r.cls)
    # explicit shared ranges: gradio's plotly.js (3.3) leaves a y axis that `matches` another empty
    top = max((gap for reqs in settings.values() for r in reqs for gap in r.itl_s), default=0.0) * 1000
    end = max((t for reqs in settings.values() for r in reqs for t in r.token_times_s), default=0.0)
    fig.update_yaxes(title_text="ITL per token (ms)", automargin=True, range=[0, 1.05 * top or 1])
    fig.update_xaxes(range=[0, 1.02 * end or 1])
    fig.update_xaxes(title_text="time since start (s)", row=len(settings), col=1)
    fig.update_layout(title=title, template=TEMPLATE, height=140 + ROW_PX * len(settings), margin=dict(l=70, r=16))
    return legend_below(fig)


def itl_distribution_chart(runs: Mapping[str, Sequence]) -> go.Figure:
    """ITL per token as a box per setting and request class, settings side by side."""
    title = "Inter-token latency by setting"
    settings = _runs(runs)
    classes = sorted({r.cls for reqs in settings.values() for r in reqs if r.itl_s})
    if not classes:
        return note_figure(title, "No inter-token gaps yet")
    fig = go.Figure()
    for cls in classes:
        xs, ys = [], []
        for label, reqs in settings.items():
            gaps = [gap * 1000 for r in reqs if r.cls == cls for gap in r.itl_s]
            xs += [label] * len(gaps)
            ys += gaps
        fig.add_trace(go.Box(x=xs, y=ys, name=plotly_label(cls), marker_color=class_color(cls), boxmean=True))
    fig.update_layout(boxmode="group")
    styled(fig, title, "setting", "ITL per token (ms)")
    fig.update_xaxes(automargin=True)
    fig.update_yaxes(automargin=True)
    return legend_below(fig)


def serving_summary_table(summaries: Mapping[str, Mapping]) -> pd.DataFrame:
    """One row per setting from engine.serving's summary() dicts: the numbers the comparison is
    about (the chats' ITL tail shows a stall, lesson 2), units in the headers, latencies in
    whole ms, so it fits a desktop page without sideways scrolling."""
    rows = []
    for label, s in summaries.items():
        short, long = s["by_class"]["short"], s["by_class"]["long"]
        rows.append([label, s["steps"], s["token_budget"], _ms(short["itl_ms_p50"]), _ms(short["itl_ms_p99"]),
                     _ms(short["itl_ms_max"]), _ms(long["ttft_ms_p50"]), _round(s["output_tokens_per_s"]),
                     "yes" if s["decode_traffic_active"] else "no", _reused(s.get("prefix_cache"))])
    return pd.DataFrame(rows, columns=list(SUMMARY_COLUMNS), dtype=object)  # object: None stays empty


def _reused(cache: Mapping | None) -> str:
    """The share of prompt tokens served from the prefix cache, or "off"."""
    if not cache or not cache.get("on"):
        return "off"
    return f"{round(100 * cache['reused_share'])}" if cache.get("reused_share") is not None else ""


def _ms(value: float | None) -> int | None:
    return None if value is None else round(value)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)
