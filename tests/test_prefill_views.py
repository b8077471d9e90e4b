"""The chunked-prefill tab's views on synthetic records: A and B timelines on shared axes, lane
labels with room, TTFT without colliding text, ITL over time broken at a stall, a summary table
narrow enough for a desktop page; and the playground's run timeline naming plain decoding
steps as such."""

import html
from types import SimpleNamespace

import pytest

from engine.acceptance import TokenKind
from engine.serving.records import ItemKind, RequestClass, RequestRecord, ServeStep, StepItem
from engine.trace import EmittedToken, PrefillChunk, Step
from visualizations import (
    itl_over_time_chart,
    serving_summary_table,
    serving_timeline,
    timeline_axes,
    trace_timeline,
    ttft_chart,
)
from visualizations.latency import STALL_FACTOR, SUMMARY_COLUMNS, itl_series
from visualizations.style import LABEL_PX_PER_CHAR
from visualizations.timeline import PLAIN_LANE, request_times

WORKLOAD = [  # what the tab's workload gives: every request, arrived or not
    SimpleNamespace(request_id="chat-0", cls=RequestClass.SHORT, arrival_s=0.0),
    SimpleNamespace(request_id="chat-1", cls=RequestClass.SHORT, arrival_s=0.05),
    SimpleNamespace(request_id="document", cls=RequestClass.LONG, arrival_s=1.0),
]


def request(rid, cls, arrival, times):
    return RequestRecord(rid, cls, arrival, 10, times[0], tuple(times), tuple(range(len(times))), "max_new_tokens")


def decode_steps(start_s, step_s, count, ids, first_index=0):
    return [ServeStep(first_index + n, start_s + n * step_s, start_s + (n + 1) * step_s,
                      tuple(StepItem(rid, ItemKind.DECODE, 10 + n, 11 + n) for rid in ids)) for n in range(count)]


def unchunked_run():
    """Setting A: the document's 2000-token prompt in one 8 s step; the chats stall through it."""
    steps = [ServeStep(0, 0.0, 0.2, (StepItem("chat-0", ItemKind.PREFILL, 0, 10),
                                     StepItem("chat-1", ItemKind.PREFILL, 0, 10))),
             ServeStep(1, 0.2, 0.3, (StepItem("chat-0", ItemKind.DECODE, 10, 11),
                                     StepItem("chat-1", ItemKind.DECODE, 10, 11))),
             ServeStep(2, 1.0, 9.0, (StepItem("document", ItemKind.PREFILL, 0, 2000),))]
    steps += decode_steps(9.0, 0.1, 5, ["chat-0", "chat-1", "document"], first_index=3)
    after = [9.1, 9.2, 9.3, 9.4, 9.5]
    return steps, [request("chat-0", RequestClass.SHORT, 0.0, [0.2, 0.3, *after]),
                   request("chat-1", RequestClass.SHORT, 0.05, [0.2, 0.3, *after]),
                   request("document", RequestClass.LONG, 1.0, [9.0, *after])]


def chunked_run():
    """Setting B: the document in 256-token chunks beside the chats' decodes; it ends sooner."""
    steps = [ServeStep(0, 0.0, 0.2, (StepItem("chat-0", ItemKind.PREFILL, 0, 10),
                                     StepItem("chat-1", ItemKind.PREFILL, 0, 10)))]
    times = [0.2]
    for n in range(8):
        start = 1.0 + n
        steps.append(ServeStep(n + 1, start, start + 1.0, (StepItem("chat-0", ItemKind.DECODE, 10 + n, 11 + n),
                                                           StepItem("chat-1", ItemKind.DECODE, 10 + n, 11 + n),
                                                           StepItem("document", ItemKind.PREFILL, 256 * n,
                                                                    min(2000, 256 * (n + 1))))))
        times.append(start + 1.0)
    return steps, [request("chat-0", RequestClass.SHORT, 0.0, times),
                   request("chat-1", RequestClass.SHORT, 0.05, times),
                   request("document", RequestClass.LONG, 1.0, [9.0])]


# shared axes


def test_a_and_b_timelines_share_lanes_time_and_step_size():
    runs = [unchunked_run(), chunked_run()]
    axes = timeline_axes(runs, WORKLOAD)
    a, b = (serving_timeline(steps, reqs, title=title, axes=axes) for (steps, reqs), title in zip(runs, "AB"))
    assert a.layout.title.text == "A" and b.layout.title.text == "B"
    assert list(a.layout.yaxis.categoryarray) == list(b.layout.yaxis.categoryarray) == [
        "document (long)", "chat-1 (short)", "chat-0 (short)"]  # arrival order, top to bottom
    assert a.layout.yaxis.range == b.layout.yaxis.range
    assert a.layout.xaxis.range == b.layout.xaxis.range == a.layout.xaxis2.range
    start, end = a.layout.xaxis.range
    assert start <= 0 and end >= 9.5  # both runs fit: A ends at 9.5 s, B at 9.0 s
    assert a.layout.yaxis2.range == b.layout.yaxis2.range and a.layout.yaxis2.range[1] >= 2000
    alone = serving_timeline(*runs[1])  # on its own, B's axes fit B only
    assert alone.layout.xaxis.range[1] < end and alone.layout.yaxis2.range[1] < 2000


def test_lanes_stay_put_while_a_run_goes():
    """Before the document arrives its lane is already there (from the workload), empty."""
    steps, reqs = unchunked_run()
    axes = timeline_axes([(steps[:2], reqs[:2])], WORKLOAD)
    fig = serving_timeline(steps[:2], reqs[:2], axes=axes)
    assert list(fig.layout.yaxis.categoryarray)[0] == "document (long)"
    assert "document (long)" not in [y for trace in fig.data[:4] for y in trace.y]


def test_the_tab_draws_both_settings_on_shared_axes():
    from ui.prefill import shared_timelines

    workload = SimpleNamespace(requests=tuple(WORKLOAD))
    started = [(f"{side}: setting", SimpleNamespace(steps=steps, requests_so_far=lambda reqs=reqs: reqs))
               for side, (steps, reqs) in zip("AB", [unchunked_run(), chunked_run()])]
    a, b = shared_timelines(workload, started)
    assert a.layout.xaxis.range == b.layout.xaxis.range
    assert a.layout.yaxis.categoryarray == b.layout.yaxis.categoryarray
    assert shared_timelines(workload, started[:1])[1] is None  # B not started yet


# labels neither clipped nor colliding


@pytest.mark.parametrize("rid", ["document", "a-much-longer-request-name", "<b>x</b>"])
def test_lane_labels_get_a_margin_wide_enough(rid):
    steps, reqs = chunked_run()
    reqs = [request(rid if r.request_id == "document" else r.request_id, r.cls, r.arrival_s, r.token_times_s)
            for r in reqs]
    fig = serving_timeline(steps, reqs)
    longest = max(len(html.unescape(label)) for label in fig.layout.yaxis.categoryarray)
    assert fig.layout.margin.l >= longest * LABEL_PX_PER_CHAR + 20  # the label and the axis title
    assert fig.layout.yaxis.automargin is True


def legend_in_bottom_margin(fig):
    """The legend sits on the figure's bottom edge, below every plot and title."""
    legend = fig.layout.legend
    return (legend.orientation == "h" and legend.yref == "container" and legend.y == 0 and legend.yanchor == "bottom"
            and fig.layout.margin.b >= 100 and all(a.y is None or a.y >= 0 for a in fig.layout.annotations))


def test_ttft_values_are_in_the_hover_not_in_text_on_the_bars():
    runs = {"A: none (no chunking)": unchunked_run()[1], "B: decode-first, chunk 256": chunked_run()[1]}
    fig = ttft_chart(runs)
    assert not fig.layout.annotations
    for trace in fig.data:
        assert trace.text is None and trace.texttemplate is None
        assert all("TTFT" in h and "ms" in h for h in trace.hovertext)
    assert list(fig.data[0].x) == ["chat-0<br>(short)", "chat-1<br>(short)", "document<br>(long)"]
    assert fig.layout.xaxis.automargin is True and legend_in_bottom_margin(fig)


def test_timeline_and_itl_legends_stay_clear_of_the_titles():
    assert legend_in_bottom_margin(serving_timeline(*chunked_run()))
    fig = itl_over_time_chart({"A": unchunked_run()[1], "B": chunked_run()[1]})
    assert legend_in_bottom_margin(fig)
    titles = [a for a in fig.layout.annotations if a.text in ("A", "B")]
    assert len(titles) == 2 and len({a.y for a in titles}) == 2  # stacked panels, one title each


# ITL over time


def test_itl_series_breaks_at_a_stall_only():
    steady = request_times(request("r", RequestClass.SHORT, 0.0, [0.0, 0.1, 0.2, 0.3]))
    assert itl_series(steady, 0.1) == ([0.1, 0.2, 0.3], pytest.approx([100.0, 100.0, 100.0]))
    stalled = request_times(request("r", RequestClass.SHORT, 0.0, [0.0, 0.1, 0.2, 5.2, 5.3]))
    xs, ys = itl_series(stalled, 0.1)
    assert xs == [0.1, 0.2, None, 5.2, 5.3] and ys[2] is None and ys[3] == pytest.approx(5000.0)
    at_threshold = request_times(request("r", RequestClass.SHORT, 0.0, [0.0, 0.1, 0.1 + STALL_FACTOR * 0.1]))
    assert None not in itl_series(at_threshold, 0.1)[0]


def test_itl_over_time_shows_the_stall_as_a_gap_on_shared_axes():
    fig = itl_over_time_chart({"A": unchunked_run()[1], "B": chunked_run()[1]})
    chat_a = fig.data[0]  # A, chat-0: 0.3 -> 9.1 s without a token while the document prefilled
    assert list(chat_a.x) == [0.3, None, 9.1, 9.2, 9.3, 9.4, 9.5]
    assert chat_a.y[1] is None and chat_a.y[2] == pytest.approx(8800.0)
    assert chat_a.mode == "lines+markers"  # the stall's point still shows, alone
    chat_b = fig.data[3]  # B, chat-0: a token every second, steadily
    assert None not in chat_b.x
    assert {t.xaxis for t in fig.data} == {"x", "x2"} and fig.layout.xaxis.range == fig.layout.xaxis2.range
    assert fig.layout.xaxis.range[0] == 0 and fig.layout.xaxis.range[1] >= 9.5
    assert fig.layout.yaxis.range == fig.layout.yaxis2.range  # one ITL scale for both settings
    assert fig.layout.yaxis.range[0] == 0 and fig.layout.yaxis.range[1] >= 8800


# summary table


def summary_of(max_ms: float) -> dict:
    return {"steps": 65, "token_budget": 261, "output_tokens_per_s": 6.789, "decode_traffic_active": True,
            "by_class": {"short": {"itl_ms_p50": 149.23, "itl_ms_p99": max_ms - 10, "itl_ms_max": max_ms},
                         "long": {"ttft_ms_p50": 14047.4}}}


def test_summary_table_fits_a_desktop_page():
    table = serving_summary_table({"A: none (no chunking)": summary_of(7726.4),
                                   "B: decode-first, chunk 256": summary_of(8054.0)})
    assert list(table.columns) == list(SUMMARY_COLUMNS) and len(table.columns) <= 10
    assert all("(ms)" in c or "ITL" not in c for c in table.columns)  # units in the headers
    assert table.iloc[0].tolist() == ["A: none (no chunking)", 65, 261, 149, 7716, 7726, 14047, 6.8, "yes", "off"]
    with_cache = summary_of(100.0) | {"prefix_cache": {"on": True, "reused_share": 0.8312}}
    assert serving_summary_table({"A": with_cache}).iloc[0]["prompt tokens reused (%)"] == "83"
    # each column as wide as its longest header word or cell (headers wrap), 8 px a character
    # and 24 px of padding: well inside a 1440 px page's ~1400 px content width
    width = sum(24 + 8 * max(max(len(w) for w in str(c).split()), *(len(str(v)) for v in table[c]))
                for c in table.columns)
    assert width <= 1100


def test_the_tabs_summary_columns_fit_a_desktop_page():
    from ui.prefill import SUMMARY_WIDTHS

    assert len(SUMMARY_WIDTHS) == len(SUMMARY_COLUMNS)
    assert sum(int(w.removesuffix("px")) for w in SUMMARY_WIDTHS) <= 1200  # a 1440 px page's content: ~1210 px


def test_summary_table_without_a_long_request():
    s = summary_of(100.0)
    s["by_class"]["long"] = {"ttft_ms_p50": None}
    assert serving_summary_table({"A": s}).iloc[0]["long TTFT p50 (ms)"] is None


# the playground's run timeline


def step(index, k=0, drafter="none", accepted=0):
    emitted = tuple(EmittedToken(i, "x", TokenKind.ACCEPTED if i < accepted else TokenKind.BONUS, 0.5, ())
                    for i in range(accepted + 1))
    return Step(index=index, drafter=drafter, k=k, draft_token_ids=tuple(range(k)), draft_texts=("x",) * k,
                draft_probs=(1.0,) * k, target_probs=(0.5,) * k, accept_probs=(0.5,) * k, accept_uniforms=(),
                sample_uniform=None, accepted=accepted, emitted=emitted, residual_top=(), draft_top=(),
                kv_len_before=10 + index, kv_len_after=11 + index, draft_s=0.002 * k, verify_s=0.02,
                end_s=0.1 + 0.03 * index)


PREFILL = [PrefillChunk(0, 0, 16, 0.0, 0.05)]


def lanes(fig):
    return list(fig.layout.yaxis.categoryarray)


def test_plain_decoding_steps_are_target_steps_not_verify():
    steps = [step(0, drafter="prefill")] + [step(i) for i in range(1, 4)]
    fig = trace_timeline(steps, PREFILL)
    assert lanes(fig) == ["output", PLAIN_LANE, "prefill"]  # no empty draft row, no "verify"
    assert [t.name for t in fig.data] == ["prefill", PLAIN_LANE, "tokens emitted"]
    plain = fig.data[1]
    assert len(plain.x) == 3 and all("plain decoding" in h and "verif" not in h for h in plain.hovertext)
    assert fig.layout.margin.l >= len(PLAIN_LANE) * LABEL_PX_PER_CHAR


def test_speculative_runs_keep_draft_and_verify_lanes():
    steps = [step(0, drafter="prefill"), step(1, k=3, drafter="prompt-lookup", accepted=2),
             step(2, k=0, drafter="prompt-lookup"), step(3, k=3, drafter="prompt-lookup", accepted=3)]
    fig = trace_timeline(steps, PREFILL)
    assert lanes(fig) == ["output", PLAIN_LANE, "2 verify", "1 draft", "prefill"]
    by_name = {t.name: t for t in fig.data}
    assert len(by_name["1 draft"].x) == 2 and len(by_name["2 verify"].x) == 2
    assert by_name[PLAIN_LANE].hovertext == ("step 2: prompt-lookup drafted nothing, one target forward, 20.0 ms",)
    always_drafting = trace_timeline([steps[0], steps[1], steps[3]], PREFILL)
    assert lanes(always_drafting) == ["output", "2 verify", "1 draft", "prefill"]


def test_reused_prefix_shows_as_a_mark_on_its_lane_and_hatched_in_the_step_chart():
    steps = [ServeStep(0, 0.0, 1.0, (StepItem("q0", ItemKind.PREFILL, 0, 900),)),
             ServeStep(1, 2.0, 2.1, (StepItem("q1", ItemKind.CACHED, 0, 896), StepItem("q1", ItemKind.PREFILL, 896, 905)))]
    reqs = [request("q0", RequestClass.LONG, 0.0, [1.0]), request("q1", RequestClass.LONG, 2.0, [2.1])]
    fig = serving_timeline(steps, reqs)
    mark = next(t for t in fig.data if t.name == "reused (prefix cache)" and t.type == "scatter")
    assert list(mark.x) == [2.0]
    assert "[0, 896) reused from the prefix cache, not computed" in mark.hovertext[0]
    hatched = next(t for t in fig.data if t.name == "reused (prefix cache)" and t.type == "bar")
    assert list(hatched.y) == [0, 896] and hatched.marker.pattern.shape == "/"
    prefill = next(t for t in fig.data if t.name == "prefill" and t.type == "bar" and t.orientation != "h")
    assert list(prefill.y) == [900, 9]  # computed tokens only
    assert steps[1].tokens == 9
    assert fig.layout.yaxis2.range[1] >= 905  # the axis holds computed + reused
    plain = serving_timeline(steps[:1], reqs[:1])
    assert not any(t.name == "reused (prefix cache)" for t in plain.data)  # no legend entry without a cache
