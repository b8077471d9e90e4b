"""visualizations/ on synthetic records built here: figure structure, colours by kind, escaping
of token text, whitespace markers, and empty inputs."""

import dataclasses
import enum
import subprocess
import sys
from types import SimpleNamespace

import plotly.graph_objects as go
import pytest

from engine import metrics
from engine.acceptance import TokenKind
from engine.trace import EmittedToken, PrefillChunk, RunInfo, Step, TopToken, Trace, trace_from_json, trace_to_json
from visualizations import (
    accepted_histogram,
    itl_distribution_chart,
    itl_over_time_chart,
    legend_html,
    mtp_tree_figure,
    per_position_chart,
    residual_chart,
    serving_timeline,
    target_top_table,
    theory_chart,
    theory_chart_for,
    verify_curve_chart,
    token_stream_html,
    tokens_vs_steps_chart,
    trace_timeline,
    ttft_chart,
    verify_table,
    verify_view,
)
from visualizations.mtp_tree import tree_paths
from visualizations.style import KIND_COLORS, PHASE_COLORS
from visualizations.tokens import TOKEN_CSS
from visualizations.timeline import request_times, serving_step

SCRIPT = "<script>alert(1)</script>"
IMG = "<img src=x onerror=alert(1)>"


def make_step(index, drafts=(), accepted=0, last="x", greedy=False, end_s=None, drafter="draft-model"):
    """A consistent step: drafts are (text, draft_prob, target_prob); the first `accepted` are
    kept, then `last` is emitted as the recovered token (or the bonus after a full accept)."""
    k = len(drafts)
    examined = min(k, accepted + 1)
    if greedy:
        accept_probs = tuple(1.0 if i < accepted else 0.0 for i in range(examined))
        uniforms = ()
    else:
        accept_probs = tuple(min(1.0, tp / dp) for _, dp, tp in drafts[:examined])
        uniforms = tuple(0.5 * a if i < accepted else 0.99 for i, a in enumerate(accept_probs))
    rejected = accepted < k
    kind = TokenKind.RECOVERED if rejected else TokenKind.BONUS
    top = (TopToken(7, last, 0.4), TopToken(50 + accepted, drafts[accepted][0] if rejected else "z", 0.3),
           TopToken(3, " ", 0.1), TopToken(4, "\n", 0.1), TopToken(5, SCRIPT, 0.05))
    emitted = tuple(
        EmittedToken(100 + i, text, TokenKind.ACCEPTED, tp, ()) for i, (text, _, tp) in enumerate(drafts[:accepted])
    ) + (EmittedToken(7, last, kind, 0.4, top),)
    residual = () if greedy or not rejected else (TopToken(7, last, 0.6), TopToken(8, "<b>y</b>", 0.3),
                                                    TopToken(9, "\n", 0.1))
    return Step(
        index=index, drafter=drafter, k=k, draft_token_ids=tuple(50 + i for i in range(k)),
        draft_texts=tuple(t for t, _, _ in drafts), draft_probs=tuple(dp for _, dp, _ in drafts),
        target_probs=tuple(tp for _, _, tp in drafts), accept_probs=accept_probs, accept_uniforms=uniforms,
        sample_uniform=None if greedy else 0.42, accepted=accepted, emitted=emitted, residual_top=residual,
        draft_top=(), kv_len_before=10 + index, kv_len_after=11 + index, draft_s=0.004 * k, verify_s=0.02,
        end_s=0.1 + 0.03 * index if end_s is None else end_s,
    )


def first_step():
    return dataclasses.replace(make_step(0, last="Hello"), drafter="prefill", verify_s=0.1, draft_s=0.0)


DRAFTS = (("a", 0.9, 0.95), ("b", 0.8, 0.2), ("c", 0.7, 0.1))


@pytest.fixture
def run():
    """Step 0, a step with a rejection at position 2, a fully accepted step, a greedy step."""
    return [
        first_step(),
        make_step(1, DRAFTS, accepted=1, last=" r"),
        make_step(2, (("d", 0.5, 0.6), ("e", 0.5, 0.9)), accepted=2, last="\n"),
        make_step(3, DRAFTS, accepted=0, last="g", greedy=True),
    ]


def kinds_in(html):
    """Token kinds in the order they appear (the legend's samples are left out)."""
    stream = html.split('class="sdl-stream"', 1)[1]
    return [part.split('"', 1)[0].split()[0] for part in stream.split('class="sdl-')[1:]
            if not part.startswith("step")]


# token stream


def test_token_stream_kinds_and_order(run):
    html = token_stream_html(run, legend=False)
    assert kinds_in(html) == [
        "target",  # step 0
        "accepted", "rejected", "rejected", "recovered",  # rejected drafts sit before the recovered token
        "accepted", "accepted", "bonus",
        "rejected", "rejected", "rejected", "recovered",
    ]
    assert html.count("data-step=") == len(run)


def test_token_stream_colours_by_kind(run):
    html = token_stream_html(run, legend=False)
    assert html.startswith(f"<style>{TOKEN_CSS}</style>")
    for kind in ("accepted", "recovered", "bonus", "rejected", "target", "drafted"):
        rule = TOKEN_CSS.split(f".sdl-{kind}{{", 1)[1].split("}", 1)[0]
        assert KIND_COLORS[kind] in rule
    assert "line-through" in TOKEN_CSS.split(".sdl-rejected{", 1)[1].split("}", 1)[0]
    assert html.count('class="sdl-rejected"') == 2  # the first rejections (steps 1 and 3)
    assert html.count('class="sdl-rejected sdl-unexamined"') == 3  # the drafts after them


def test_token_stream_tooltips(run):
    html = token_stream_html(run, legend=False)
    assert "draft prob 0.900" in html and "target prob 0.950" in html
    assert "accept prob min(1, target/draft) 0.250" in html  # 0.2 / 0.8 at the rejection
    assert "uniform draw 0.990" in html
    assert "not examined" in html
    assert "greedy" in html


def test_token_stream_escapes_token_text():
    step = make_step(1, ((SCRIPT, 0.9, 0.9), (IMG, 0.9, 0.1)), accepted=1, last=IMG, drafter='"><script>x')
    html = token_stream_html([first_step(), step], pending=make_step(2, ((SCRIPT, 0.5, 0.5),)))
    assert "<script" not in html and "<img" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;img␣src=x␣onerror=alert(1)&gt;" in html
    assert "&quot;&gt;&lt;script&gt;x" in html  # the drafter name, inside a title attribute


def test_token_stream_whitespace_markers():
    step = dataclasses.replace(first_step(), emitted=(EmittedToken(1, " hi\n\tthere", TokenKind.BONUS, 0.5, ()),))
    html = token_stream_html([step], legend=False)
    assert "␣hi↵<br>⇥there" in html


def test_token_stream_plain_steps_are_target_tokens():
    steps = [first_step()] + [make_step(i, (), drafter="none") for i in range(1, 4)]
    assert set(kinds_in(token_stream_html(steps, legend=False))) == {"target"}


def test_token_stream_pending_draft_and_empty(run):
    html = token_stream_html(run[:1], pending=run[1], legend=False)
    assert kinds_in(html) == ["target", "drafted", "drafted", "drafted"]
    assert "awaiting the target&#x27;s verdict" in html
    assert 'class="sdl-legend"' in token_stream_html([])
    assert kinds_in(token_stream_html([], legend=False)) == []


def test_legend_uses_design_words():
    legend = legend_html()
    for word in ("accepted", "rejected", "recovered", "bonus", "a drafted token kept", "a drafted token discarded"):
        assert word in legend


def test_replayed_trace_renders_the_same(run):
    info = RunInfo(model="m", method="draft-model", drafter="draft-model", k=3, adaptive=False, temperature=1.0,
                   top_k=0, top_p=1.0, seed=0, max_new_tokens=16, prefill_chunk=0, device="cpu", dtype="float32",
                   prompt_text="hi", prompt_token_ids=(1, 2))
    trace = Trace(info=info, prefill=(PrefillChunk(0, 0, 2, 0.0, 0.05),), steps=tuple(run), stop_reason="eos")
    replay = trace_from_json(trace_to_json(trace))
    assert token_stream_html(replay.steps) == token_stream_html(trace.steps)


# verify table


def test_verify_table_rows(run):
    table = verify_table(run[1])
    assert list(table.columns) == ["position", "draft token", "draft prob", "target prob", "accept prob",
                                   "uniform draw", "verdict"]
    assert table["verdict"].tolist() == ["accepted", "rejected", "not examined"]
    assert table["accept prob"].tolist()[:2] == [1.0, 0.25]
    assert table["accept prob"].isna().tolist() == [False, False, True]
    assert table["uniform draw"].tolist()[:2] == [0.5, 0.99]


def test_verify_table_greedy_and_plain(run):
    greedy = verify_table(run[3])
    assert greedy["uniform draw"].isna().all()
    assert greedy["verdict"].tolist() == ["rejected", "not examined", "not examined"]
    assert verify_table(run[0]).empty


def test_verify_table_shows_whitespace_as_text():
    step = make_step(1, ((" \n", 0.5, 0.5), (SCRIPT, 0.5, 0.5)), accepted=0)
    assert verify_table(step)["draft token"].tolist() == ["␣↵", SCRIPT]  # a table cell is text, not HTML


def test_target_top_at_rejection(run):
    top = target_top_table(run[1])
    assert list(top.columns) == ["rank", "token", "target prob", "role"]
    assert len(top) == 5
    assert top["role"].tolist()[:2] == ["recovered", "rejected draft"]
    assert top["token"].tolist()[2:4] == ["␣", "↵"]
    assert target_top_table(run[2])["role"].tolist()[0] == "bonus"
    assert target_top_table(run[0])["role"].tolist()[0] == "target"


def test_residual_chart(run):
    fig = residual_chart(run[1])
    (bar,) = fig.data
    assert bar.type == "bar"
    assert list(bar.y) == [0.6, 0.3, 0.1]
    assert list(bar.marker.color) == [KIND_COLORS["recovered"], "#8C8C8C", "#8C8C8C"]
    assert list(fig.layout.xaxis.ticktext) == ["␣r", "&lt;b&gt;y&lt;/b&gt;", "↵"]
    assert fig.layout.xaxis.title.text == "token" and fig.layout.yaxis.title.text == "probability"


@pytest.mark.parametrize("index, reason", [(2, "every draft was accepted"), (3, "greedy"), (0, "drafted nothing")])
def test_residual_chart_without_residual(run, index, reason):
    fig = residual_chart(run[index])
    assert not fig.data and reason in fig.layout.annotations[0].text


def test_verify_view_bundles_the_three(run):
    view = verify_view(run[1])
    assert len(view.table) == 3 and len(view.target_top) == 5 and isinstance(view.residual, go.Figure)


# acceptance charts


def test_per_position_chart_matches_metrics(run):
    fig = per_position_chart(run)
    (bar,) = fig.data
    assert list(bar.y) == metrics.per_position_acceptance(run)
    assert list(bar.x) == [1, 2, 3]
    assert fig.layout.xaxis.title.text == "draft position"


def test_accepted_histogram_counts(run):
    (bar,) = accepted_histogram(run).data
    assert list(bar.x) == [0, 1, 2, 3] and list(bar.y) == [1, 1, 1, 0]


def test_tokens_vs_steps_two_traces(run):
    baseline = [first_step()] + [make_step(i, (), drafter="none") for i in range(1, 6)]
    fig = tokens_vs_steps_chart(run, baseline)
    assert [t.name for t in fig.data] == ["speculative", "baseline"]
    assert list(fig.data[0].y) == [1, 3, 6, 7]
    assert list(fig.data[1].y) == [1, 2, 3, 4, 5, 6]
    assert fig.layout.xaxis.title.text == "target step" and fig.layout.yaxis.title.text == "output tokens"


def test_theory_chart_with_measured_point():
    fig = theory_chart(0.8, 0.05, k_max=8, measured_k=4, measured_tokens_per_step=3.1, measured_speedup=2.2)
    assert [(t.type, t.mode, t.name) for t in fig.data] == [
        ("scatter", "lines", "theory"), ("scatter", "markers", "measured")] * 2
    assert fig.data[0].y[4] == pytest.approx(metrics.expected_tokens_per_step(0.8, 4))
    assert fig.data[2].y[4] == pytest.approx(metrics.predicted_speedup(0.8, 4, 0.05))
    assert fig.data[1].y == (3.1,) and fig.data[3].y == (2.2,)
    assert fig.layout.xaxis.title.text == "draft length k"
    assert fig.layout.yaxis2.title.text == "speedup vs plain decoding"


def test_theory_chart_for_a_run(run):
    fig = theory_chart_for(run, measured_speedup=1.5)
    assert len(fig.data) == 4
    assert fig.data[1].x == (3,) and fig.data[1].y == (metrics.mean_acceptance_length(run),)
    assert theory_chart(1.0, 0.1).data[0].y[3] == 4.0  # a = 1: every draft accepted


def test_theory_chart_with_a_measured_verify_curve_adds_the_costed_prediction():
    curve = [20.0, 30.0, 31.0, 32.0, 30.0]  # T = 1..5: verifying costs 1.5x .. 1.6x one token
    fig = theory_chart(0.8, 0.05, k_max=8, verify_ms=curve)
    names = [t.name for t in fig.data]
    assert names == ["theory (verification free)", "theory (verification free)", "theory (measured verify cost)"]
    costed = fig.data[2]
    assert list(costed.x) == [0, 1, 2, 3, 4]  # only the k whose T = k + 1 the curve covers
    assert costed.y[4] == pytest.approx(metrics.predicted_speedup(0.8, 4, 0.05, 1.5))
    assert costed.y[0] == pytest.approx(1.0) and fig.data[1].line.dash == "dot"


def test_verify_curve_chart_marks_the_current_k():
    curve = [20.0, 20.2, 20.4, 21.0, 22.0, 23.0]
    fig = verify_curve_chart(curve, k=4, label="embedded, bfloat16")
    line, point = fig.data
    assert list(line.x) == [1, 2, 3, 4, 5, 6] and line.y[0] == 1.0 and line.y[4] == pytest.approx(1.1)
    assert point.x == (5,) and point.y == (pytest.approx(1.1),) and "k = 4" in point.name
    assert "embedded, bfloat16" in fig.layout.title.text
    assert any(s.y0 == 1.0 for s in fig.layout.shapes)  # the "verification free" line
    assert len(verify_curve_chart(curve, k=None).data) == 1
    assert len(verify_curve_chart(curve, k=16).data) == 1  # T = 17 not measured: no marker
    empty = verify_curve_chart([], k=4)
    assert not empty.data and empty.layout.annotations


@pytest.mark.parametrize("chart", [per_position_chart, accepted_histogram, theory_chart_for])
def test_acceptance_charts_without_drafts(chart):
    for steps in ([], [first_step(), make_step(1, (), drafter="none")]):
        fig = chart(steps)
        assert not fig.data and fig.layout.annotations
    assert tokens_vs_steps_chart([], []).data == ()


# timelines

REQUESTS = [
    {"request_id": "chat-1", "cls": "short", "arrival_s": 0.0, "first_token_s": 0.1,
     "token_times_s": [0.1, 0.2, 0.3, 0.9, 1.0]},
    {"request_id": SCRIPT, "cls": "long", "arrival_s": 0.25, "first_token_s": 0.9, "token_times_s": [0.9, 1.0]},
    {"request_id": "late", "cls": "short", "arrival_s": 0.95, "first_token_s": None, "token_times_s": []},
]
STEPS = [
    {"index": 0, "start_s": 0.0, "end_s": 0.1, "items": [
        {"request_id": "chat-1", "kind": "prefill", "start": 0, "end": 20, "tokens": 20}]},
    {"index": 1, "start_s": 0.1, "end_s": 0.2, "items": [
        {"request_id": "chat-1", "kind": "decode", "start": None, "end": None, "tokens": 1}]},
    {"index": 2, "start_s": 0.3, "end_s": 0.6, "items": [
        {"request_id": "chat-1", "kind": "decode", "start": 21, "end": 22, "tokens": 1},
        {"request_id": SCRIPT, "kind": "prefill", "start": 0, "end": 256, "tokens": 256}]},
    {"index": 3, "start_s": 0.6, "end_s": 0.9, "items": [
        {"request_id": SCRIPT, "kind": "prefill", "start": 256, "end": 300, "tokens": 44}]},
]


def test_serving_timeline_structure():
    fig = serving_timeline(STEPS, REQUESTS)
    assert [(t.type, t.name) for t in fig.data] == [
        ("bar", "prefill"), ("bar", "decode"), ("scatter", "arrival"), ("scatter", "first token"),
        ("bar", "prefill"), ("bar", "decode")]
    prefill, decode = fig.data[0], fig.data[1]
    assert prefill.marker.color == PHASE_COLORS["prefill"] and decode.marker.color == PHASE_COLORS["decode"]
    assert list(prefill.base) == [0.0, 0.3, 0.6]
    assert list(prefill.x) == pytest.approx([0.1, 0.3, 0.3])
    assert "prefill tokens [0, 256)" in prefill.hovertext[1] and "1 decode tokens" in prefill.hovertext[1]
    assert len(fig.data[3].x) == 2  # "late" has no first token yet
    composition_prefill, composition_decode = fig.data[4], fig.data[5]
    assert list(composition_prefill.y) == [20, 0, 256, 44]
    assert list(composition_decode.base) == [20, 0, 256, 44]  # stacked on the prefill tokens
    assert fig.layout.xaxis2.title.text == "time since start (s)"
    assert fig.layout.yaxis.title.text == "request"


def test_serving_timeline_lanes_escaped_in_arrival_order():
    fig = serving_timeline(STEPS, REQUESTS)
    lanes = list(fig.layout.yaxis.categoryarray)
    assert lanes == ["late (short)", "&lt;script&gt;alert(1)&lt;/script&gt; (long)", "chat-1 (short)"]
    text = fig.to_json()
    assert "<script>" not in text.replace("\\u003c", "<").replace("\\u003e", ">")


class Kind(enum.Enum):  # plain enums (not str-valued) are read by value too
    PREFILL = "prefill"
    DECODE = "decode"


class Cls(enum.Enum):
    LONG = "long"


def test_serving_records_from_objects():
    item = SimpleNamespace(request_id=3, kind=Kind.DECODE, start=None, end=None, tokens=1)
    step = serving_step(SimpleNamespace(index=5, start_s=1, end_s=2, items=[item]))
    assert step.items[0].request_id == "3" and step.items[0].kind == "decode" and step.tokens("decode") == 1
    with pytest.raises(ValueError, match="tokens"):
        serving_step({"index": 0, "start_s": 0, "end_s": 1, "items": [{"request_id": 1, "kind": "decode"}]})
    assert request_times(dict(REQUESTS[0], cls=Cls.LONG)).cls == "long"
    assert request_times(REQUESTS[0]).ttft_s == pytest.approx(0.1)
    assert request_times(REQUESTS[2]).ttft_s is None


def test_serving_timeline_from_engine_serving_records():
    records = pytest.importorskip("engine.serving.records")
    step = records.ServeStep(0, 0.0, 0.2, (records.StepItem("doc", records.ItemKind.PREFILL, 0, 64),
                                           records.StepItem("chat", records.ItemKind.DECODE, 9, 10)))
    doc = records.RequestRecord("doc", records.RequestClass.LONG, 0.0, 64, 0.2, (0.2, 0.3), (5, 6), "eos")
    fig = serving_timeline([step], [doc])
    assert list(fig.data[0].y) == ["doc (long)"] and list(fig.data[1].y) == ["chat"]
    assert list(fig.data[4].y) == [64] and list(fig.data[5].y) == [1]
    assert list(itl_over_time_chart({"run": [doc]}).data[0].y) == pytest.approx([100.0])


def test_serving_timeline_empty_and_partial():
    assert serving_timeline([], []).layout.annotations
    fig = serving_timeline(STEPS[:1])  # steps before any request record
    assert list(fig.layout.yaxis.categoryarray) == ["chat-1"]


def test_trace_timeline(run):
    prefill = [PrefillChunk(0, 0, 16, 0.0, 0.04), PrefillChunk(1, 16, 20, 0.04, 0.02)]
    fig = trace_timeline(run, prefill)
    assert [(t.type, t.name) for t in fig.data] == [
        ("bar", "prefill"), ("bar", "1 draft"), ("bar", "2 verify"), ("scatter", "tokens emitted")]
    assert list(fig.data[0].base) == [0.0, 0.04]
    assert len(fig.data[1].x) == 3 and len(fig.data[2].x) == 3  # step 0 has no draft or verify bar
    assert list(fig.data[3].text) == ["1", "2", "3", "1"]
    assert fig.data[1].base[0] + fig.data[1].x[0] == pytest.approx(fig.data[2].base[0])  # draft, then verify
    assert fig.layout.xaxis.title.text == "time since the request started (s)"
    assert trace_timeline([], []).layout.annotations


def test_trace_timeline_baseline_has_no_draft_bars():
    steps = [first_step()] + [make_step(i, (), drafter="none") for i in range(1, 4)]
    fig = trace_timeline(steps)
    assert [t.name for t in fig.data] == ["target step (plain decoding)", "tokens emitted"]
    assert len(fig.data[0].x) == 3
    assert list(fig.layout.yaxis.categoryarray) == ["output", "target step (plain decoding)"]


# TTFT and ITL

OTHER = [dict(r, first_token_s=r["first_token_s"] and r["first_token_s"] / 2,
              token_times_s=[t / 2 for t in r["token_times_s"]]) for r in REQUESTS]
RUNS = {"none": REQUESTS, "decode-first, chunk 256": OTHER}


def test_ttft_chart_groups_settings():
    fig = ttft_chart(RUNS)
    assert [(t.type, t.name) for t in fig.data] == [("bar", "none"), ("bar", "decode-first, chunk 256")]
    assert list(fig.data[0].y) == pytest.approx([100.0, 650.0])
    assert fig.layout.barmode == "group" and fig.layout.yaxis.title.text == "TTFT (ms)"


def test_itl_over_time_side_by_side():
    fig = itl_over_time_chart(RUNS)
    assert [a.text for a in fig.layout.annotations] == ["none", "decode-first, chunk 256"]
    assert {t.xaxis for t in fig.data} == {"x", "x2"}
    first = fig.data[0]
    # chat-1's 0.6 s gap is a stall (over 3 times the setting's median gap): the line breaks before it
    assert list(first.x) == [0.2, 0.3, None, 0.9, 1.0] and first.y[2] is None
    assert [first.y[i] for i in (0, 1, 3, 4)] == pytest.approx([100.0, 100.0, 600.0, 100.0])
    assert [t.showlegend for t in fig.data[:2]] == [True, True] and fig.data[3].showlegend is False
    assert fig.layout.yaxis.title.text == "ITL per token (ms)"


def test_itl_distribution_per_setting_and_class():
    fig = itl_distribution_chart(RUNS)
    assert [(t.type, t.name) for t in fig.data] == [("box", "long"), ("box", "short")]
    short = fig.data[1]
    assert list(short.x) == ["none"] * 4 + ["decode-first, chunk 256"] * 4
    assert fig.layout.boxmode == "group"


@pytest.mark.parametrize("chart", [ttft_chart, itl_over_time_chart, itl_distribution_chart])
def test_latency_charts_empty(chart):
    assert chart({}).layout.annotations


def test_latency_charts_before_any_token():
    waiting = {"none": [REQUESTS[2]]}
    assert not ttft_chart(waiting).data and not itl_distribution_chart(waiting).data
    assert [len(t.x) for t in itl_over_time_chart(waiting).data] == [0]


# MTP tree

HEADS = [[(" the", 0.6), (" a", 0.3)], [(" cat", 0.5), (SCRIPT, 0.2)], [(" sat", 0.7), ("\n", 0.1)]]


def test_mtp_tree_full_and_shaped():
    assert len(tree_paths(HEADS)) == 2 + 4 + 8
    assert tree_paths(HEADS, tree=[(1, 1, 0)]) == [(1,), (1, 1), (1, 1, 0)]
    with pytest.raises(ValueError, match="outside"):
        tree_paths(HEADS, tree=[(0, 2)])


def test_mtp_tree_figure_highlights_verified_path():
    fig = mtp_tree_figure(HEADS, accepted_path=(0, 1), tree=[(0, 0, 0), (0, 1, 0), (1,)], root_text=" sat")
    edges, path_edges, nodes, path_nodes, root = fig.data
    assert path_edges.line.color == KIND_COLORS["accepted"] and edges.line.color != KIND_COLORS["accepted"]
    assert list(path_nodes.text) == ["␣the", "&lt;script&gt;alert(1)&lt;/script&gt;"]
    assert path_nodes.marker.color == KIND_COLORS["accepted"]
    assert sorted(nodes.text) == ["␣a", "␣cat", "␣sat", "␣sat"]
    assert len([x for x in path_edges.x if x is not None]) == 4  # two edges on the path
    assert root.text == ("␣sat",)
    assert list(fig.layout.xaxis.ticktext) == ["context", "head 1", "head 2", "head 3"]


def test_mtp_tree_empty_and_too_large():
    assert mtp_tree_figure([]).layout.annotations
    with pytest.raises(ValueError, match="limit"):
        mtp_tree_figure([[("t", 0.1)] * 10] * 4)


def test_visualizations_import_no_model_and_no_gradio():
    code = "import sys, visualizations; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('gradio', 'transformers') or m in ('engine.models', 'engine.decoding')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=str(__import__("conftest").ROOT))
    assert out.stdout.strip() == "[]"
