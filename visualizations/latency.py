"""TTFT and ITL charts for serving runs, several settings (e.g. two policies or chunk sizes)
compared in one figure.

`runs` maps a setting's label (e.g. "decode-first, chunk 256") to its requests: dicts or records
with the request fields of visualizations.timeline. TTFT = first token - arrival; ITL is per
token (DESIGN.md): the gap between consecutive output tokens of one request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from visualizations.style import SERIES_COLORS, TEMPLATE, class_color, note_figure, styled
from visualizations.text import plotly_label
from visualizations.timeline import RequestTimes, lane_label, request_times


def _runs(runs: Mapping[str, Sequence]) -> dict[str, list[RequestTimes]]:
    return {plotly_label(label): [request_times(r) for r in reqs] for label, reqs in runs.items()}


def ttft_chart(runs: Mapping[str, Sequence]) -> go.Figure:
    """TTFT per request, one bar group per request and one colour per setting."""
    title = "Time to first token per request"
    settings = _runs(runs)
    if not any(r.ttft_s is not None for reqs in settings.values() for r in reqs):
        return note_figure(title, "No first tokens yet")
    fig = go.Figure()
    for n, (label, reqs) in enumerate(settings.items()):
        done = [r for r in reqs if r.ttft_s is not None]
        fig.add_trace(go.Bar(
            x=[lane_label(r.request_id, r.cls) for r in done], y=[r.ttft_s * 1000 for r in done], name=label,
            marker_color=SERIES_COLORS[n % len(SERIES_COLORS)],
        ))
    fig.update_layout(barmode="group")
    return styled(fig, title, "request", "TTFT (ms)")


def itl_over_time_chart(runs: Mapping[str, Sequence]) -> go.Figure:
    """One panel per setting, side by side on a shared ITL axis: each request's ITL at the time
    of the later token, coloured by request class (long or short prompt)."""
    title = "Inter-token latency over time"
    settings = _runs(runs)
    if not settings:
        return note_figure(title, "No runs yet")
    fig = make_subplots(rows=1, cols=len(settings), shared_yaxes=True, subplot_titles=list(settings))
    shown: set[str] = set()
    for col, reqs in enumerate(settings.values(), start=1):
        for r in reqs:
            fig.add_trace(go.Scatter(
                x=list(r.token_times_s[1:]), y=[gap * 1000 for gap in r.itl_s], mode="lines+markers",
                name=plotly_label(r.cls), legendgroup=r.cls, showlegend=r.cls not in shown,
                line_color=class_color(r.cls), marker_size=4,
                hovertext=lane_label(r.request_id, r.cls), hoverinfo="text+x+y",
            ), row=1, col=col)
            shown.add(r.cls)
        fig.update_xaxes(title_text="time since start (s)", row=1, col=col)
    fig.update_yaxes(title_text="ITL per token (ms)", row=1, col=1)
    fig.update_layout(title=title, template=TEMPLATE)
    return fig


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
    return styled(fig, title, "setting", "ITL per token (ms)")
