"""The token stream a learner reads and the output line shown above it: rejected drafts hidden on
request, special tokens as chips, newlines, characters a byte-level tokenizer split over several
tokens merged back (visualizations.tokens, visualizations.text.byte_runs); the trace fields that
carry what the views need (old and hostile trace files); the embedded SmolLM2 tokenizer's real
byte tokens; and the theory chart's caption."""

import html
import json

import pytest

from engine import metrics
from engine.acceptance import TokenKind
from engine.errors import InputError
from engine.trace import (
    MAX_TOKEN_BYTES,
    EmittedToken,
    PrefillChunk,
    RunInfo,
    Step,
    Trace,
    decode_tokens,
    trace_from_json,
    trace_to_json,
)
from visualizations import output_line_html, theory_chart, theory_chart_for, token_stream_html
from visualizations.text import byte_runs
from visualizations.tokens import TOKEN_CSS

A, R, B = TokenKind.ACCEPTED, TokenKind.RECOVERED, TokenKind.BONUS
FFFD = "\ufffd"
SCRIPT = "<script>alert(1)</script>"


def tok(text, kind=B, token_id=7, raw=b"", special=False):
    return EmittedToken(token_id, text, kind, 0.5, (), special=special, raw_bytes=tuple(raw))


def piece(raw, kind=B, token_id=9):
    """A byte token as the engine records it: its text alone is U+FFFD, its bytes are kept."""
    return tok(FFFD, kind, token_id, raw)


def step(index, emitted, drafts=(), draft_raw=()):
    """A consistent greedy step: the accepted tokens among `emitted` are the first drafts."""
    k = len(drafts)
    accepted = sum(t.kind is A for t in emitted)
    examined = min(k, accepted + 1)
    return Step(
        index=index, drafter="prefill" if index == 0 else ("draft-model" if k else "none"), k=k,
        draft_token_ids=tuple(50 + j for j in range(k)), draft_texts=tuple(drafts), draft_probs=(0.5,) * k,
        target_probs=(0.5,) * k, accept_probs=tuple(1.0 if j < accepted else 0.0 for j in range(examined)),
        accept_uniforms=(), sample_uniform=None, accepted=accepted, emitted=tuple(emitted), residual_top=(),
        draft_top=(), kv_len_before=10 + index, kv_len_after=11 + index, draft_s=0.001 * k, verify_s=0.02,
        end_s=0.1 + 0.03 * index, draft_raw_bytes=tuple(tuple(raw) for raw in draft_raw),
    )


def stream_of(page):
    return page.split('class="sdl-stream"', 1)[1]


def kinds_in(page):
    """The first class of each span in the stream, in order (step boundaries left out)."""
    return [part.split('"', 1)[0].split()[0] for part in stream_of(page).split('class="sdl-')[1:]
            if not part.startswith("step")]


def steps_of(page):
    """The stream's HTML per target step."""
    return stream_of(page).split("data-step=")[1:]


def body_of(page):
    return page.split("</style>", 1)[1]


def css_rule(selector):
    return TOKEN_CSS.split(f".{selector}{{", 1)[1].split("}", 1)[0]


# the output line


def test_output_line_is_the_output_decoded_whole_with_special_tokens_as_chips():
    steps = [
        step(0, [tok("Hi")]),
        step(1, [piece(b"\xf0\x9f", A), piece(b"\x98", A), piece(b"\x80", B)], drafts=("?", "?")),
        step(2, [tok(" & <b>x</b>\n\tok", A), tok("<|im_end|>", B, token_id=2, special=True)], drafts=(" &",)),
    ]
    page = output_line_html(steps)
    body = body_of(page)
    assert page.startswith(f"<style>{TOKEN_CSS}</style>") and "white-space:pre-wrap" in css_rule("sdl-output")
    assert "Hi😀 &amp; &lt;b&gt;x&lt;/b&gt;\n\tok" in body  # the real text: no markers, no <br>, escaped
    assert FFFD not in body and "<b>" not in body and "␣" not in body and "↵" not in body and "<br>" not in body
    assert body.endswith('<span title="special token 2: control, not part of the text">'
                         '<span class="sdl-special">&lt;|im_end|&gt;</span></span></div>')
    text = html.unescape(body.split(">", 1)[1].split("<span", 1)[0])
    assert text == decode_tokens([t for s in steps for t in s.emitted], special=False)


def test_output_line_when_nothing_is_out_yet_and_a_character_cut_off():
    assert "No output yet" in output_line_html([])
    cut = output_line_html([step(0, [tok("a"), piece(b"\xe2\x9c", B)])])
    assert body_of(cut).split(">", 1)[1].startswith(f"a{FFFD}<")  # what the tokenizer's decode gives too


# hiding rejected drafts


def test_hiding_rejected_drafts_leaves_the_output_tokens_and_the_step_boundaries():
    """Like the large MTP tree run: a few kept tokens among many struck drafts."""
    many = tuple(f"d{j}" for j in range(8))
    steps = [step(0, [tok("Hello")]), step(1, [tok(" d0", A, 50), tok(" r", R)], drafts=many),
             step(2, [tok(" a", A), tok(" b", B)], drafts=(" a",)), step(3, [tok(" c", R)], drafts=many)]
    shown = token_stream_html(steps, legend=False)
    hidden = token_stream_html(steps, show_rejected=False)
    assert kinds_in(shown).count("rejected") == 7 + 8
    assert kinds_in(hidden) == ["target", "accepted", "recovered", "accepted", "bonus", "recovered"]
    assert len(steps_of(hidden)) == len(steps_of(shown)) == 4
    assert "d3" not in stream_of(hidden) and "␣r" in stream_of(hidden)
    assert "rejected drafts hidden" in hidden and "a drafted token discarded" not in hidden
    assert "rejected drafts hidden" not in token_stream_html(steps)  # the default shows them, as before


# special tokens and newlines


def test_special_tokens_are_small_chips_that_do_not_break():
    steps = [step(0, [tok("Hi")]), step(1, [tok(".", A), tok("<|im_end|>", B, token_id=2, special=True)],
                                         drafts=(".",))]
    stream = stream_of(token_stream_html(steps, legend=False))
    token = stream.split("data-step=")[2].split('class="sdl-bonus"', 1)[1]
    assert token.split(">", 1)[1].startswith('<span class="sdl-special">&lt;|im_end|&gt;</span></span>')
    tip = token.split(">", 1)[0]  # the kind's span keeps its colours and says why it was emitted
    assert "special token 2: control, not text" in tip and "bonus after all 1 drafts were accepted" in tip
    rule = css_rule("sdl-special")
    assert "font-size:0.72em" in rule and "border-radius" in rule and "white-space:nowrap" in rule
    assert "white-space:nowrap" in css_rule("sdl-step>span")  # no token, special or not, wraps inside itself
    assert "<br>" not in stream


def test_only_an_output_newline_breaks_the_line():
    steps = [step(0, [tok("Hi")]), step(1, [tok("a\n", A), tok("b", R)], drafts=("a\n", "\n\n"))]
    stream = stream_of(token_stream_html(steps, pending=step(2, [tok("c", B)], drafts=("\n",)), legend=False))
    assert stream.count("<br>") == 1 and "a↵<br>" in stream  # the output's own newline
    assert ">↵↵</span>" in stream  # the rejected draft: markers only
    assert stream.split("sdl-pending", 1)[1].count("↵") == 1  # the pending draft: a marker, no break


# byte tokens merged into their characters


def test_a_character_split_over_tokens_of_one_step_is_one_span():
    emoji = [piece(b"\xf0\x9f", A, 10813), piece(b"\x98", A, 242), piece(b"\x80", B, 218)]
    page = token_stream_html([step(0, [tok("Hi")]), step(1, emoji, drafts=("?", "?"))], legend=False)
    assert kinds_in(page) == ["target", "bonus"]  # one span, the kind of the token that completed it
    span = steps_of(page)[1].split('class="sdl-bonus"', 1)[1].split("</span>", 1)[0]
    assert span.endswith(">😀") and FFFD not in page
    for line in ("&#x27;😀&#x27;: bytes of 3 tokens decoded together", "token 10813 (accepted): bytes F0 9F",
                 "token 242 (accepted): bytes 98", "token 218 (bonus): bytes 80"):
        assert line in span


def test_rejected_drafts_sit_before_a_merged_recovered_character():
    steps = [step(0, [tok("Hi")]), step(1, [piece(b"\xe2\x9c", A), piece(b"\x93", R)], drafts=("?", "x"))]
    page = token_stream_html(steps, legend=False)
    assert kinds_in(page) == ["target", "rejected", "recovered"] and "✓</span>" in page


def test_a_character_split_across_steps_shows_its_first_bytes_then_the_character():
    steps = [step(0, [tok("Hi")]), step(1, [tok(" a", A), piece(b"\xf0\x9f", B)], drafts=(" a",)),
             step(2, [piece(b"\x98\x80", B)])]
    page = token_stream_html(steps, legend=False)
    first, second = steps_of(page)[1:]
    assert '<span class="sdl-bytes">F0 9F</span>' in first and "😀" not in first
    assert "😀" in second and "completes bytes F0 9F of an earlier token" in second
    assert FFFD not in page and "sdl-bytes{" in TOKEN_CSS
    assert body_of(output_line_html(steps)).split(">", 1)[1].startswith("Hi a😀<")


def test_merged_text_is_escaped_and_invalid_bytes_show_as_replacement():
    markup = [piece(b"<img src=x onerror=alert(1)>\xf0\x9f", A), piece(b"\x98\x80" + SCRIPT.encode(), B)]
    steps = [step(0, [tok("Hi")]), step(1, markup, drafts=("?",)), step(2, [piece(b"\xff", B)]),
             step(3, [tok("\ud800", B)])]  # a lone surrogate: only a hand-made trace holds one
    for page in (token_stream_html(steps), output_line_html(steps)):
        assert "<img" not in page and "<script" not in page
        assert "&lt;img␣src=x␣onerror=alert(1)&gt;😀&lt;script&gt;" in page or \
            "&lt;img src=x onerror=alert(1)&gt;😀&lt;script&gt;" in page
        assert FFFD in page


def test_drafts_that_are_part_of_a_character_show_their_bytes():
    """Drafts are not merged (a tree's drafts are no sequence): a piece shows its whole characters
    as text and the bytes of the ones it splits in hex."""
    drafts, raw = ("x", f" {FFFD}", FFFD), (b"", b" \xf0\x9f", b"\x98")
    steps = [step(0, [tok("Hi")]), step(1, [tok("x", A), tok("y", R)], drafts=drafts, draft_raw=raw)]
    page = token_stream_html(steps, pending=step(2, [tok("z")], drafts=(FFFD,), draft_raw=(b"\x80!",)), legend=False)
    assert FFFD not in page and kinds_in(page)[1:] == ["accepted", "rejected", "bytes", "rejected", "bytes",
                                                      "recovered", "drafted", "bytes"]
    assert '>␣<span class="sdl-bytes">F0 9F</span></span>' in page and "part of a character: bytes 20 F0 9F" in page
    assert '><span class="sdl-bytes">98</span></span>' in page and "part of a character: bytes 98" in page
    assert '><span class="sdl-bytes">80</span>!</span>' in page  # the end of a character, then a whole one


@pytest.mark.parametrize("pieces, cuts, expected", [
    ([], (), []),
    ([b"a", b" b"], (), [(0, 1, "a", b"", b""), (1, 2, " b", b"", b"")]),
    ([b"\xe6\x97", b"\xa5\xe6", b"\x9c\xac"], (), [(0, 3, "日本", b"", b"")]),  # a token ends one, starts the next
    ([b"\xf0", b"\x9f", b"\x98\x80"], {1, 2},
     [(0, 1, "", b"\xf0", b""), (1, 2, "", b"\x9f", b"\xf0"), (2, 3, "😀", b"", b"\xf0\x9f")]),
    ([b"\xe6", None, b"\x97\xa5"], (),  # a special token stands alone, outside the text
     [(0, 1, "", b"\xe6", b""), (1, 2, "", b"", b""), (2, 3, "日", b"", b"\xe6")]),
    ([b"\xff", b"a"], (), [(0, 1, FFFD, b"", b""), (1, 2, "a", b"", b"")]),  # not UTF-8: replaced, not held
    ([b"a", b"\xe2\x9c"], (), [(0, 1, "a", b"", b""), (1, 2, "", b"\xe2\x9c", b"")]),  # cut off at the end
])
def test_byte_runs(pieces, cuts, expected):
    assert [(r.start, r.end, r.text, r.dangling, r.carried) for r in byte_runs(pieces, cuts)] == expected


# trace files


def trace_of(steps):
    info = RunInfo(model="m", method="draft-model", drafter="draft-model", k=2, adaptive=False, temperature=0.0,
                   top_k=0, top_p=1.0, seed=0, max_new_tokens=16, prefill_chunk=0, device="cpu", dtype="float32",
                   prompt_text="hi", prompt_token_ids=(1, 2))
    return Trace(info=info, prefill=(PrefillChunk(0, 0, 2, 0.0, 0.05),), steps=tuple(steps), stop_reason="eos")


BYTES_RUN = [step(0, [tok("Hi")]), step(1, [piece(b"\xe6\x97", A), piece(b"\xa5", B)], drafts=("?",)),
             step(2, [tok("<|im_end|>", B, token_id=2, special=True)])]


def test_new_token_fields_round_trip_and_old_traces_load_with_defaults():
    trace = trace_of(BYTES_RUN)
    replay = trace_from_json(trace_to_json(trace))
    assert replay == trace and replay.text == "Hi日<|im_end|>"
    assert token_stream_html(replay.steps) == token_stream_html(trace.steps)
    old = json.loads(trace_to_json(trace_of([step(0, [tok("Hi")]), step(1, [tok(" a", A), tok("!", B)], (" a",))])))
    for s in old["steps"]:  # as saved before the fields existed
        del s["draft_raw_bytes"]
        for t in s["emitted"]:
            del t["special"], t["raw_bytes"]
    loaded = trace_from_json(json.dumps(old))
    assert all(t.raw_bytes == () and t.special is False for s in loaded.steps for t in s.emitted)
    assert loaded.steps[1].draft_raw_bytes == () and loaded.text == "Hi a!"
    assert "Hi a!" in output_line_html(loaded.steps)


@pytest.mark.parametrize("field, junk, message", [
    ("raw_bytes", [256], "raw bytes"),
    ("raw_bytes", [-1], "raw bytes"),
    ("raw_bytes", [0] * (MAX_TOKEN_BYTES + 1), "raw bytes"),
    ("raw_bytes", ["a"], "must be an integer"),
    ("raw_bytes", [True], "must be an integer"),
    ("raw_bytes", "e697", "must be a list"),
    ("special", "yes", "true or false"),
    ("special", 1, "true or false"),
])
def test_junk_token_fields_are_refused(field, junk, message):
    data = json.loads(trace_to_json(trace_of(BYTES_RUN)))
    data["steps"][1]["emitted"][0][field] = junk
    with pytest.raises(InputError, match=message):
        trace_from_json(json.dumps(data))


@pytest.mark.parametrize("junk, message", [
    ([[], []], "draft_raw_bytes per drafted position"),  # step 1 drafted one token
    ([[300]], "raw bytes"),
    ([[0] * (MAX_TOKEN_BYTES + 1)], "raw bytes"),
    ([5], "must be a list"),
])
def test_junk_draft_bytes_are_refused(junk, message):
    data = json.loads(trace_to_json(trace_of(BYTES_RUN)))
    data["steps"][1]["draft_raw_bytes"] = junk
    with pytest.raises(InputError, match=message):
        trace_from_json(json.dumps(data))


# the embedded model's tokenizer


@pytest.mark.embedded
def test_smollm2_keeps_some_characters_whole_and_splits_others_into_byte_tokens(embedded):
    encode = lambda text: embedded.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    for whole in ("é", "—", "→"):
        (token_id,) = encode(whole)
        assert embedded.token_text(token_id) == whole and embedded.partial_bytes(token_id) == ()
    for split in ("😀", "日", "✓"):
        ids = encode(split)
        assert len(ids) > 1 and all(embedded.token_text(i) == FFFD for i in ids)
        assert all(embedded.partial_bytes(i) for i in ids)
        assert b"".join(embedded.token_bytes(i) for i in ids) == split.encode()
    assert embedded.token_bytes(encode(" the")[0]) == b" the"
    im_end = embedded.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in embedded.special_ids and embedded.eos_token_ids <= embedded.special_ids
    assert embedded.partial_bytes(im_end) == () and encode("Hi")[0] not in embedded.special_ids


@pytest.mark.embedded
def test_real_byte_tokens_merge_in_the_stream_and_the_output_line(embedded):
    """Tokens recorded as the engine records them (engine.decoding._emitted), from SmolLM2's ids."""
    import torch

    from engine.decoding import _emitted

    text = "Hi 😀 日本 ✓"
    im_end = embedded.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = embedded.tokenizer.encode(text, add_special_tokens=False) + [im_end]
    rows = torch.full((len(ids), embedded.vocab_size), 1.0 / embedded.vocab_size)
    emitted = _emitted(embedded, ids, [B] * len(ids), rows)
    assert sum(1 for t in emitted if t.raw_bytes) >= 7 and emitted[-1].special
    one_per_step = [step(i, [t]) for i, t in enumerate(emitted)]  # the hardest case: every split crosses a step
    in_two_steps = [step(0, emitted[:4]), step(1, emitted[4:])]
    for steps in (one_per_step, in_two_steps):
        body = body_of(output_line_html(steps))
        assert html.unescape(body.split(">", 1)[1].split("<span", 1)[0]) == text
        assert text == embedded.tokenizer.decode(ids, skip_special_tokens=True)
        stream = stream_of(token_stream_html(steps))
        assert FFFD not in stream and "sdl-special" in stream
        assert all(ch in stream for ch in "😀日本✓")
    assert trace_of(one_per_step).text == text + "<|im_end|>"


@pytest.mark.embedded
def test_a_real_run_shows_the_characters_it_copied(embedded):
    """Prompt lookup copying emoji and CJK: the engine records byte tokens, the views merge them,
    and the output line is what the tokenizer decodes."""
    from engine.decoding import DecodeConfig, generate
    from engine.drafters import DrafterSpec, build_drafter

    ids = embedded.encode("Repeat this line exactly: I love Tokyo 🗼 and 日本 ✓ 😀")
    drafter = build_drafter(embedded, DrafterSpec("prompt-lookup"))
    steps = [e for e in generate(embedded, ids, DecodeConfig(max_new_tokens=40, k=4), drafter) if isinstance(e, Step)]
    out = [t.token_id for s in steps for t in s.emitted]
    assert any(t.raw_bytes for s in steps for t in s.emitted), "the copy should hold byte tokens"
    body = body_of(output_line_html(steps))
    assert html.unescape(body.split(">", 1)[1].split("<span", 1)[0]) == \
        embedded.tokenizer.decode(out, skip_special_tokens=True)
    assert FFFD not in token_stream_html(steps) and FFFD not in body
    trace = trace_of(steps)
    assert trace_from_json(trace_to_json(trace)) == trace and trace.text == embedded.tokenizer.decode(out)


# the theory chart's caption


def caption_of(fig):
    (caption,) = [a for a in fig.layout.annotations if a.name == "caption"]
    return caption


def test_theory_caption_says_which_prediction_is_which():
    """The issue's case: about 1.4x predicted, 0.67x measured, verification costing 1.6 steps."""
    curve = [20.0, 30.0, 31.0, 32.0, 33.0]
    fig = theory_chart(0.55, 0.12, measured_k=4, measured_tokens_per_step=2.1, measured_speedup=0.67, verify_ms=curve)
    caption = caption_of(fig)
    free = metrics.predicted_speedup(0.55, 4, 0.12)
    cost = metrics.verify_cost(curve, 5)
    costed = metrics.predicted_speedup(0.55, 4, 0.12, cost)
    assert 1.3 < free < 1.5 and costed < 1.0
    lines = caption.text.split("<br>")
    assert lines == [
        "At k = 4:",
        f"• {free:.2f}× predicted if verifying 5 tokens cost one step (Leviathan et al. 2023; blue dotted line)",
        f"• {costed:.2f}× predicted with this machine's verify cost: 5 tokens cost {cost:.2f} steps (green line)",
        "• 0.67× measured against plain decoding, wall clock (red diamond)",
        f"• 2.10 tokens per step measured, {metrics.expected_tokens_per_step(0.55, 4):.2f} expected at a = 0.55",
    ]
    # the curves the caption names are the ones drawn
    assert fig.data[2].line.dash == "dot" and fig.data[2].y[4] == pytest.approx(free)
    assert fig.data[3].name == "theory (measured verify cost)" and fig.data[3].y[4] == pytest.approx(costed)
    assert fig.data[4].y == (0.67,) and fig.data[4].marker.symbol == "diamond"
    # under the plots, with room made for it
    assert caption.yref == "paper" and caption.y == 0 and caption.yanchor == "top" and caption.yshift < -40
    assert fig.layout.margin.b >= 40 + 15 * len(lines) and fig.layout.height > 450


def test_theory_caption_without_a_verify_curve_or_a_measured_speedup():
    text = caption_of(theory_chart(0.8, 0.05, measured_k=3)).text
    assert "(Leviathan et al. 2023; blue line)" in text and "no verify curve was measured" in text
    assert "no measured speedup yet: it needs a plain decoding run" in text
    short = caption_of(theory_chart(0.8, 0.05, measured_k=8, verify_ms=[20.0, 21.0])).text
    assert "its verify curve stops before 9 tokens" in short
    general = caption_of(theory_chart(0.8, 0.05, verify_ms=[20.0, 21.0])).text
    assert "green line" in general and "At k" not in general


def test_theory_chart_for_a_run_captions_its_own_numbers():
    steps = [step(0, [tok("Hi")]), step(1, [tok("a", A), tok("b", A), tok("c", B)], drafts=("a", "b")),
             step(2, [tok("d", R)], drafts=("x", "y"))]
    curve = [20.0, 24.0, 28.0]
    text = caption_of(theory_chart_for(steps, measured_speedup=0.8, verify_ms=curve)).text
    a, c = metrics.per_token_acceptance(steps), metrics.cost_ratio(steps, None)
    assert text.startswith("At k = 2:")
    assert f"{metrics.predicted_speedup(a, 2, c):.2f}× predicted if verifying 3 tokens" in text
    assert f"{metrics.predicted_speedup(a, 2, c, 1.4):.2f}× predicted with this machine's verify cost" in text
    assert "3 tokens cost 1.40 steps" in text and "0.80× measured" in text
