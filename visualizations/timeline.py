"""Timelines: prefill chunks and decode steps on a time axis.

`serving_timeline` draws a multi-request serving run: one lane per request, a bar for each item
a step scheduled for it (every item of a step spans the step's time, since a step is one batched
forward), arrival and first-token markers, and below it each step's composition (prefill tokens
and decode tokens); timelines compared side by side share their axes (`timeline_axes`).
`trace_timeline` draws one request's Trace: prefill chunks, then each step's draft and verify
phases (or, where nothing was drafted, a plain target step) and the tokens it emitted.

Serving records are read by field name, from dicts or from any object with these attributes
(engine.serving.records' ServeStep, StepItem and RequestRecord), enums by value, and may be
partial while a run is in progress:

- step: {"index", "start_s", "end_s", "items": [{"request_id", "kind": "prefill" | "decode" |
  "cached", "start", "end", "tokens"}]}; start/end is the prompt token range [start, end) of a
  prefill chunk or of a prefix reused from the prefix cache (computed by no step: a mark on the
  request's lane where it started, and hatched on top of that step's tokens in the step chart);
  None is allowed for a decode.
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
from visualizations.style import (
    PHASE_COLORS,
    TEMPLATE,
    VERMILLION,
    lane_margin,
    legend_below,
    note_figure,
    styled,
)
from visualizations.text import plotly_label, plotly_text

KINDS = ("prefill", "decode")  # what a step computes
CACHED = "cached"  # prompt tokens a request reused from the prefix cache: computed by no step
KIND_NAMES = {"cached": "reused (prefix cache)", "prefill": "prefill", "decode": "decode"}
PLAIN_LANE = "target step (plain decoding)"  # a decode step with no drafts: nothing to verify
_REQUIRED = object()


@dataclass(frozen=True)
class ScheduledItem:
    request_id: str
    kind: str  # "prefill", "decode" or "cached"
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


@dataclass(frozen=True)
class TimelineAxes:
    """What serving timelines shown side by side share, so they compare by eye: the same lanes
    in the same order, the same time range and the same range of tokens per step."""

    lanes: tuple[tuple[str, str], ...]  # (request_id, lane label), top to bottom
    end_s: float  # the time axis runs from 0 to here
    step_tokens: int  # the composition panel's axis runs from 0 to here


def timeline_axes(runs: Sequence[tuple[Sequence, Sequence]], requests: Sequence = ()) -> TimelineAxes:
    """Axes that fit every run, each given as (steps, requests); `requests` (e.g. the workload's)
    adds lanes for requests that have not arrived yet, so the lanes stay put while a run goes.
    Lanes are in order of arrival; requests seen only in steps come last.

    >>> axes = timeline_axes([([{"index": 0, "start_s": 0, "end_s": 2.5, "items": []}],
    ...                        [{"request_id": "b", "cls": "short", "arrival_s": 0.5}])],
    ...                      [{"request_id": "a", "cls": "long", "arrival_s": 0.0}])
    >>> axes.lanes, axes.end_s
    ((('a', 'a (long)'), ('b', 'b (short)')), 2.5)
    """
    steps = [serving_step(s) for run_steps, _ in runs for s in run_steps]
    reqs = [request_times(r) for r in requests] + [request_times(r) for _, run_reqs in runs for r in run_reqs]
    classes = {r.request_id: r.cls for r in reqs}
    ids = [r.request_id for r in sorted(reqs, key=lambda r: r.arrival_s)] + [
        i.request_id for s in steps for i in s.items]
    times = [s.end_s for s in steps] + [r.arrival_s for r in reqs] + [t for r in reqs for t in r.token_times_s]
    return TimelineAxes(
        lanes=tuple((rid, lane_label(rid, classes.get(rid))) for rid in dict.fromkeys(ids)),
        end_s=max(times, default=0.0),
        step_tokens=max((sum(s.tokens(kind) for kind in (*KINDS, CACHED)) for s in steps), default=0),
    )


def serving_timeline(steps: Sequence, requests: Sequence = (), title: str = "Serving timeline",
                     axes: TimelineAxes | None = None) -> go.Figure:
    """Lanes per request (prefill and decode bars, arrival and first-token markers) over the
    steps' composition. `steps` and `requests` hold dicts or records (module docstring). Give
    the same `axes` (timeline_axes) to timelines that are compared; by default they fit this run."""
    title = plotly_label(title)
    run_steps = [serving_step(s) for s in steps]
    reqs = [request_times(r) for r in requests]
    if not run_steps and not reqs:
        return note_figure(title, "No steps yet")
    axes = axes or timeline_axes([(run_steps, reqs)])
    label = dict(axes.lanes)
    label.update((i.request_id, lane_label(i.request_id)) for s in run_steps for i in s.items
                 if i.request_id not in label)

    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.72, 0.28], vertical_spacing=0.08)
    for kind in KINDS:
        items = [(s, i) for s in run_steps for i in s.items if i.kind == kind]
        fig.add_trace(go.Bar(
            orientation="h", base=[s.start_s for s, _ in items], x=[s.end_s - s.start_s for s, _ in items],
            y=[label[i.request_id] for _, i in items], hovertext=[_item_hover(s, i) for s, i in items],
            hoverinfo="text", name=KIND_NAMES[kind], legendgroup=kind,
            marker=dict(color=PHASE_COLORS[kind], line_width=0.5, line_color="white"),
        ), row=1, col=1)
    reused = [(s, i) for s in run_steps for i in s.items if i.kind == CACHED]
    if reused:  # no time of its own: a mark where the request started, its size in the step chart below
        fig.add_trace(go.Scatter(
            x=[s.start_s for s, _ in reused], y=[label[i.request_id] for _, i in reused], mode="markers",
            name=KIND_NAMES[CACHED], legendgroup=CACHED,
            marker=dict(symbol="square", size=13, color=PHASE_COLORS[CACHED], line=dict(width=1, color="white")),
            hovertext=[_item_hover(s, i) for s, i in reused], hoverinfo="text",
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
    for kind in (*KINDS, CACHED):  # reused tokens on top, hatched: covered by the step, not computed
        counts = [s.tokens(kind) for s in run_steps]
        if kind == CACHED and not any(counts):
            continue
        fig.add_trace(go.Bar(
            x=[(s.start_s + s.end_s) / 2 for s in run_steps], width=[s.end_s - s.start_s for s in run_steps],
            y=counts, base=list(base), name=KIND_NAMES[kind], legendgroup=kind, showlegend=False,
            marker=dict(color=PHASE_COLORS[kind], line_width=0.5, line_color="white",
                        pattern_shape="/" if kind == CACHED else ""),
            hovertext=[_step_hover(s) for s in run_steps], hoverinfo="text",
        ), row=2, col=1)
        base = [b + c for b, c in zip(base, counts)]
    lanes = [lane for _, lane in axes.lanes]
    lanes += [lane for lane in dict.fromkeys(label.values()) if lane not in lanes]
    pad = 0.02 * axes.end_s or 0.01
    fig.update_xaxes(range=[-pad, axes.end_s + pad])
    fig.update_yaxes(title_text="request", categoryorder="array", categoryarray=lanes[::-1],
                     range=[-0.5, len(lanes) - 0.5], automargin=True, row=1, col=1)
    fig.update_yaxes(title_text="tokens in step", range=[0, 1.05 * axes.step_tokens or 1], automargin=True,
                     row=2, col=1)
    fig.update_xaxes(title_text="time since start (s)", row=2, col=1)
    fig.update_layout(title=title, template=TEMPLATE, barmode="overlay", bargap=0.3,
                      margin=dict(l=lane_margin(lanes), r=16))
    return legend_below(fig)


def _item_hover(step: ServingStep, item: ScheduledItem) -> str:
    what = {"prefill": f"prefill tokens [{item.start}, {item.end})",
            "cached": f"prompt tokens [{item.start}, {item.end}) reused from the prefix cache, not computed"}.get(
        item.kind, "decode")
    return f"{lane_label(item.request_id)}: {what}, {item.tokens} tokens<br>{_step_hover(step)}"


def _step_hover(step: ServingStep) -> str:
    reused = step.tokens(CACHED)
    return (f"step {step.index}: {step.start_s * 1000:.1f}–{step.end_s * 1000:.1f} ms, "
            f"{step.tokens('prefill')} prefill + {step.tokens('decode')} decode tokens"
            + (f"; {reused} prompt tokens reused from the prefix cache (not computed)" if reused else ""))


def trace_timeline(steps: Sequence[Step], prefill: Sequence[PrefillChunk] = ()) -> go.Figure:
    """One request: prefill chunks, each step's draft and verify phases (placed to end when the
    step's tokens were emitted; the record-keeping between them is folded into verify), and a
    marker per step labelled with the number of tokens it emitted. Step 0's verify is the
    prefill itself, so it shows only as its emitted token. A step that drafted nothing (plain
    decoding, or a drafter with no proposal) verified nothing: it is a plain target step, on a
    lane of its own. Only lanes with something on them are drawn."""
    title = "Prefill chunks and decode steps"
    if not steps and not prefill:
        return note_figure(title, "No steps yet")
    decode = [s for s in steps if s.index > 0]
    drafting = [s for s in decode if s.k > 0]
    lanes = (
        ("prefill", "prefill", [(c.start_s, c.duration_s, f"chunk {c.index}: prompt tokens [{c.start}, {c.end}), "
                                                          f"{c.duration_s * 1000:.1f} ms") for c in prefill]),
        ("1 draft", "draft", [(s.end_s - s.verify_s - s.draft_s, s.draft_s,
                               f"step {s.index}: {plotly_label(s.drafter)} drafted {s.k}, {s.draft_s * 1000:.1f} ms")
                              for s in drafting]),
        ("2 verify", "verify", [(s.end_s - s.verify_s, s.verify_s,
                                 f"step {s.index}: verified {s.k}, accepted {s.accepted}, "
                                 f"{s.verify_s * 1000:.1f} ms") for s in drafting]),
        (PLAIN_LANE, "target", [(s.end_s - s.verify_s, s.verify_s, _plain_hover(s)) for s in decode if s.k == 0]),
    )
    fig = go.Figure()
    for lane, phase, spans in lanes:
        if not spans:
            continue
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
    shown = [lane for lane, _, spans in lanes if spans]
    fig.update_yaxes(categoryorder="array", categoryarray=["output", *reversed(shown)], automargin=True)
    fig.update_layout(barmode="overlay", bargap=0.4)
    styled(fig, title, "time since the request started (s)", "")
    fig.update_layout(margin=dict(l=lane_margin(["output", *shown], title=False)))
    return fig


def _plain_hover(step: Step) -> str:
    why = "plain decoding" if step.drafter == "none" else f"{plotly_label(step.drafter)} drafted nothing"
    return f"step {step.index}: {why}, one target forward, {step.verify_s * 1000:.1f} ms"
