"""Timelines: prefill chunks and decode steps on a time axis.

`serving_timeline` draws a multi-request serving run: one lane per request, a bar for each item
a step scheduled for it (every item of a step spans the step's time, since a step is one batched
forward), arrival and first-token markers, and below it each step's composition (prefill tokens
and decode tokens). `trace_timeline` draws one request's Trace: prefill chunks, then each
step's draft and verify phases and the tokens it emitted.

Serving records are read by field name, from dicts or from any object with these attributes
(engine.serving.records' ServeStep, StepItem and RequestRecord), enums by value, and may be
partial while a run is in progress:

- step: {"index", "start_s", "end_s", "items": [{"request_id", "kind": "prefill" | "decode",
  "start", "end", "tokens"}]}; start/end is the prompt token range [start, end) of a prefill
  chunk (None is allowed for a decode).
- request: {"request_id", "cls": "long" | "short", "arrival_s", "first_token_s" (None until the
  first token), "token_times_s": [...]}.

Times are seconds since the run started.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from engine.trace import PrefillChunk, Step
from visualizations.style import PHASE_COLORS, TEMPLATE, VERMILLION, note_figure, styled
from visualizations.text import plotly_label, plotly_text

KINDS = ("prefill", "decode")
_REQUIRED = object()


@dataclass(frozen=True)
class ScheduledItem:
    request_id: str
    kind: str  # "prefill" or "decode"
    start: int | None  # prefill: prompt token range [start, end)
    end: int | None
    tokens: int


@dataclass(frozen=True)
class ServingStep:
    index: int
    start_s: float
    end_s: float
    items: tuple[ScheduledItem, ...]

    def tokens(self, kind: str) -> int:
        return sum(item.tokens for item in self.items if item.kind == kind)


@dataclass(frozen=True)
class RequestTimes:
    request_id: str
    cls: str  # "long" or "short" prompt
    arrival_s: float
    first_token_s: float | None
    token_times_s: tuple[float, ...]

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive output tokens (per token: tokens emitted together add zeros).

        >>> request_times({"request_id": 1, "cls": "short", "arrival_s": 0.0, "first_token_s": 0.5,
        ...                "token_times_s": [0.5, 0.75, 1.0]}).itl_s
        [0.25, 0.25]
        """
        times = self.token_times_s
        return [b - a for a, b in zip(times, times[1:])]


def _field(record, name: str, default=_REQUIRED):
    if isinstance(record, Mapping):
        value = record.get(name, default)
    else:
        value = getattr(record, name, default)
    if value is _REQUIRED:
        raise ValueError(f"{type(record).__name__} record has no field {name!r}")
    return value


def _name(value) -> str:
    """An enum member's value (the serving records use enums), or the string itself."""
    return str(getattr(value, "value", value))


def scheduled_item(record) -> ScheduledItem:
    return ScheduledItem(
        request_id=str(_field(record, "request_id")), kind=_name(_field(record, "kind")),
        start=_field(record, "start", None), end=_field(record, "end", None), tokens=int(_field(record, "tokens")),
    )


def serving_step(record) -> ServingStep:
    """A ServingStep from a dict or record with the fields in the module docstring."""
    return ServingStep(
        index=int(_field(record, "index")), start_s=float(_field(record, "start_s")),
        end_s=float(_field(record, "end_s")), items=tuple(scheduled_item(i) for i in _field(record, "items")),
    )


def request_times(record) -> RequestTimes:
    """A RequestTimes from a dict or record with the fields in the module docstring."""
    first = _field(record, "first_token_s", None)
    return RequestTimes(
        request_id=str(_field(record, "request_id")), cls=_name(_field(record, "cls")),
        arrival_s=float(_field(record, "arrival_s")), first_token_s=None if first is None else float(first),
        token_times_s=tuple(float(t) for t in _field(record, "token_times_s", ())),
    )


def lane_label(request_id: str, cls: str | None = None) -> str:
    """A request's label in figures (escaped: ids may come from a user's workload file)."""
    return f"{plotly_label(request_id)} ({plotly_label(cls)})" if cls else plotly_label(request_id)


def serving_timeline(steps: Sequence, requests: Sequence = ()) -> go.Figure:
    """Lanes per request (prefill and decode bars, arrival and first-token markers) over the
    steps' composition. `steps` and `requests` hold dicts or records (module docstring)."""
    title = "Serving timeline: prefill chunks and decodes per request"
    run_steps = [serving_step(s) for s in steps]
    reqs = [request_times(r) for r in requests]
    if not run_steps and not reqs:
        return note_figure(title, "No steps yet")
    classes = {r.request_id: r.cls for r in reqs}
    lanes = [r.request_id for r in sorted(reqs, key=lambda r: r.arrival_s)]
    lanes += list(dict.fromkeys(i.request_id for s in run_steps for i in s.items if i.request_id not in classes))
    label = {rid: lane_label(rid, classes.get(rid)) for rid in lanes}

    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.72, 0.28], vertical_spacing=0.06)
    for kind in KINDS:
        items = [(s, i) for s in run_steps for i in s.items if i.kind == kind]
        fig.add_trace(go.Bar(
            orientation="h", base=[s.start_s for s, _ in items], x=[s.end_s - s.start_s for s, _ in items],
            y=[label[i.request_id] for _, i in items], hovertext=[_item_hover(s, i) for s, i in items],
            hoverinfo="text", name=kind, legendgroup=kind, marker=dict(color=PHASE_COLORS[kind], line_width=0.5,
                                                                        line_color="white"),
        ), row=1, col=1)
    fig.add_trace(go.Scatter(
        x=[r.arrival_s for r in reqs], y=[label[r.request_id] for r in reqs], mode="markers", name="arrival",
        marker=dict(symbol="triangle-right", size=11, color="#333"),
        hovertext=[f"{label[r.request_id]} arrives at {r.arrival_s:.3f} s" for r in reqs], hoverinfo="text",
    ), row=1, col=1)
    firsts = [r for r in reqs if r.first_token_s is not None]
    fig.add_trace(go.Scatter(
        x=[r.first_token_s for r in firsts], y=[label[r.request_id] for r in firsts], mode="markers",
        name="first token", marker=dict(symbol="star", size=12, color=VERMILLION),
        hovertext=[f"{label[r.request_id]}: first token, TTFT {r.ttft_s * 1000:.1f} ms" for r in firsts],
        hoverinfo="text",
    ), row=1, col=1)
    base = [0] * len(run_steps)
    for kind in KINDS:
        counts = [s.tokens(kind) for s in run_steps]
        fig.add_trace(go.Bar(
            x=[(s.start_s + s.end_s) / 2 for s in run_steps], width=[s.end_s - s.start_s for s in run_steps],
            y=counts, base=list(base), name=kind, legendgroup=kind, showlegend=False,
            marker=dict(color=PHASE_COLORS[kind], line_width=0.5, line_color="white"),
            hovertext=[_step_hover(s) for s in run_steps], hoverinfo="text",
        ), row=2, col=1)
        base = [b + c for b, c in zip(base, counts)]
    fig.update_yaxes(title_text="request", categoryorder="array", categoryarray=[label[r] for r in reversed(lanes)],
                     row=1, col=1)
    fig.update_yaxes(title_text="tokens in step", row=2, col=1)
    fig.update_xaxes(title_text="time since start (s)", row=2, col=1)
    fig.update_layout(title=title, template=TEMPLATE, barmode="overlay", bargap=0.3)
    return fig


def _item_hover(step: ServingStep, item: ScheduledItem) -> str:
    what = f"prefill tokens [{item.start}, {item.end})" if item.kind == "prefill" else "decode"
    return f"{lane_label(item.request_id)}: {what}, {item.tokens} tokens<br>{_step_hover(step)}"


def _step_hover(step: ServingStep) -> str:
    return (f"step {step.index}: {step.start_s * 1000:.1f}–{step.end_s * 1000:.1f} ms, "
            f"{step.tokens('prefill')} prefill + {step.tokens('decode')} decode tokens")


def trace_timeline(steps: Sequence[Step], prefill: Sequence[PrefillChunk] = ()) -> go.Figure:
    """One request: prefill chunks, each step's draft and verify phases (placed to end when the
    step's tokens were emitted; the record-keeping between them is folded into verify), and a
    marker per step labelled with the number of tokens it emitted. Step 0's verify is the
    prefill itself, so it shows only as its emitted token."""
    title = "Prefill chunks and decode steps"
    if not steps and not prefill:
        return note_figure(title, "No steps yet")
    verify = [s for s in steps if s.index > 0]
    drafting = [s for s in verify if s.k > 0]
    lanes = (
        ("prefill", "prefill", [(c.start_s, c.duration_s, f"chunk {c.index}: prompt tokens [{c.start}, {c.end}), "
                                                          f"{c.duration_s * 1000:.1f} ms") for c in prefill]),
        ("1 draft", "draft", [(s.end_s - s.verify_s - s.draft_s, s.draft_s,
                               f"step {s.index}: {plotly_label(s.drafter)} drafted {s.k}, {s.draft_s * 1000:.1f} ms")
                              for s in drafting]),
        ("2 verify", "verify", [(s.end_s - s.verify_s, s.verify_s,
                                 f"step {s.index}: verified {s.k}, accepted {s.accepted}, "
                                 f"{s.verify_s * 1000:.1f} ms") for s in verify]),
    )
    fig = go.Figure()
    for lane, phase, spans in lanes:
        fig.add_trace(go.Bar(
            orientation="h", base=[b for b, _, _ in spans], x=[d for _, d, _ in spans], y=[lane] * len(spans),
            hovertext=[h for _, _, h in spans], hoverinfo="text", name=lane,
            marker=dict(color=PHASE_COLORS[phase], line_width=0.5, line_color="white"),
        ))
    fig.add_trace(go.Scatter(
        x=[s.end_s for s in steps], y=["output"] * len(steps), mode="markers+text", name="tokens emitted",
        text=[str(len(s.emitted)) for s in steps], textposition="top center",
        marker=dict(color=VERMILLION, size=[6 + 3 * len(s.emitted) for s in steps]),
        hovertext=[f"step {s.index} emitted {len(s.emitted)}: "
                   + plotly_text("".join(t.text for t in s.emitted)) for s in steps], hoverinfo="text",
    ))
    fig.update_yaxes(categoryorder="array", categoryarray=["output", "2 verify", "1 draft", "prefill"])
    fig.update_layout(barmode="overlay", bargap=0.4)
    return styled(fig, title, "time since the request started (s)", "")
