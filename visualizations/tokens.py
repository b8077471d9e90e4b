"""The token stream as HTML: output tokens coloured by kind, rejected drafts struck through where
they were proposed (or hidden), a boundary at each target step, and a tooltip with the
probabilities; and the output line, the text the user gets, to show above it.

Each stream carries its own small <style> block (TOKEN_CSS, classes prefixed sdl-), so it renders
the same wherever it is placed (a gr.HTML, a saved page) without inline styles on every token.
Step 0 (the prefill's first token) and plain decoding steps (k = 0) show as "target" tokens.

Reading it: an output token's newline breaks the line after its ↵, as the output does; a draft's
newline is a ↵ alone (the draft is not output, and a break per struck newline made long runs
unreadable). A token never wraps inside itself. Special tokens (<|im_end|>) are small grey chips,
and a character a byte-level tokenizer split over several tokens is one span holding the character.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import replace
from itertools import accumulate, groupby

from engine.acceptance import TokenKind
from engine.trace import EmittedToken, Step, decode_tokens
from visualizations.style import KIND_COLORS, tint
from visualizations.text import ByteRun, byte_runs, html_token, piece_parts

KIND_MEANINGS = {
    "accepted": "a drafted token kept",
    "rejected": "a drafted token discarded",
    "recovered": "sampled from the residual at the first rejection",
    "bonus": "sampled from the target when every draft was accepted",
    "target": "emitted by the target without a draft (prefill, plain decoding)",
    "drafted": "proposed by the drafter, awaiting the target's verdict",
}
_BOXED = "border-radius:3px;padding:0 1px;margin:0 1px;color:#111"


def _rule(selector: str, declarations: str) -> str:
    return f".{selector}{{{declarations}}}"


def _boxed(kind: str, border: str = "border-bottom:3px solid") -> str:
    return _rule(f"sdl-{kind}", f"{_BOXED};background:{tint(KIND_COLORS[kind])};{border} {KIND_COLORS[kind]}")


# One style block, placed once at the top of each stream (and exported for a page's own CSS).
TOKEN_CSS = "".join([
    _rule("sdl-stream", "font-family:ui-monospace,monospace;line-height:2;overflow-wrap:anywhere"),
    _rule("sdl-legend", "font-size:0.85em;line-height:2"),
    _rule("sdl-step", "border-left:2px solid #999;padding-left:2px;margin-left:2px"),
    _rule("sdl-pending", f"border-left:2px dashed {KIND_COLORS['drafted']}"),
    _boxed("accepted"),
    _boxed("recovered"),
    _boxed("bonus"),
    _boxed("drafted", "border:1px dashed"),
    _rule("sdl-rejected", f"margin:0 1px;color:{KIND_COLORS['rejected']};"
                          "text-decoration:line-through;text-decoration-thickness:2px"),
    _rule("sdl-unexamined", "opacity:0.55"),
    _rule("sdl-target", f"margin:0 1px;border-bottom:1px dotted {KIND_COLORS['target']}"),
    _rule("sdl-step>span", "white-space:nowrap"),  # break between tokens, never inside one
    # inside a token's span, which keeps its kind's colours
    _rule("sdl-special", "font-size:0.72em;border-radius:8px;padding:0 5px;margin:0 2px;background:#E6E6E6;"
                         "color:#444;white-space:nowrap;vertical-align:0.1em"),
    _rule("sdl-bytes", "font-size:0.72em;color:#444;border:1px dashed #8C8C8C;border-radius:3px;padding:0 2px"),
    _rule("sdl-output", "white-space:pre-wrap;overflow-wrap:anywhere;line-height:1.6;padding:6px 10px;"
                        "border-left:3px solid #8C8C8C;background:#F7F7F7;color:#111"),
    _rule("sdl-empty", "color:#6B6B6B;font-style:italic"),
])


def legend_html(show_rejected: bool = True) -> str:
    """One line naming each colour with DESIGN.md's words (saying so when rejected drafts are hidden)."""
    items = [f'<span class="sdl-{kind}">{kind}</span> {html.escape(meaning)}'
             for kind, meaning in KIND_MEANINGS.items() if show_rejected or kind != "rejected"]
    items.append('<span class="sdl-step">&nbsp;</span>a target step begins')
    items.append('<span class="sdl-special">&lt;|im_end|&gt;</span> a special token (control, not text)')
    if not show_rejected:
        items.append("rejected drafts hidden")
    return f'<div class="sdl-legend">{" &middot; ".join(items)}</div>'


def output_line_html(steps: Sequence[Step]) -> str:
    """The text the user gets, after one <style> block (TOKEN_CSS): the output tokens decoded as
    a whole (a character split over byte tokens comes out whole), newlines as line breaks, and
    each special token as a small chip where it was emitted (<|im_end|> at the end). Escaped."""
    tokens = [t for s in steps for t in s.emitted]
    if not tokens:
        return f'<style>{TOKEN_CSS}</style><div class="sdl-output sdl-empty">No output yet</div>'
    parts = []
    for special, group in groupby(tokens, key=lambda t: t.special):
        if special:
            parts.extend(f'<span title="special token {t.token_id}: control, not part of the text">'
                         f"{_special(t.text)}</span>" for t in group)
        else:
            parts.append(html.escape(decode_tokens(group)))
    return f'<style>{TOKEN_CSS}</style><div class="sdl-output">{"".join(parts)}</div>'


def token_stream_html(steps: Sequence[Step], pending: Step | None = None, legend: bool = True,
                      show_rejected: bool = True) -> str:
    """The output so far, step by step, after one <style> block (TOKEN_CSS); `pending` is a
    step whose drafts are shown before its verdict (the playground's first half of a step);
    without `show_rejected` the struck-through rejected drafts are left out, leaving the output
    tokens by kind and the step boundaries. All token text is escaped."""
    body = [_step_html(step, runs, show_rejected) for step, runs in zip(steps, _runs_by_step(steps))]
    if pending is not None:
        body.append(_pending_html(pending))
    stream = f'<div class="sdl-stream">{"<wbr>".join(body)}</div>'
    return f"<style>{TOKEN_CSS}</style>" + (legend_html(show_rejected) if legend else "") + stream


def _runs_by_step(steps: Sequence[Step]) -> list[list[ByteRun]]:
    """Each step's output tokens grouped into whole characters (text.byte_runs), indices within
    the step. A character split across two steps shows its first bytes in the first step."""
    starts = list(accumulate((len(s.emitted) for s in steps), initial=0))
    tokens = [t for s in steps for t in s.emitted]
    runs = byte_runs([None if t.special else t.utf8 for t in tokens], cuts=set(starts))
    per_step: list[list[ByteRun]] = [[] for _ in steps]
    step = 0
    for run in runs:
        while run.start >= starts[step + 1]:
            step += 1
        per_step[step].append(replace(run, start=run.start - starts[step], end=run.end - starts[step]))
    return per_step


def _draft_span(step: Step, j: int, kind: str, tip: str, unexamined: bool = False) -> str:
    """Draft j's span: its newlines are markers only (a draft is not output), and a draft that is
    part of a character shows its bytes (drafts are not merged: a tree's are not a sequence)."""
    classes = f"sdl-{kind} sdl-unexamined" if unexamined else f"sdl-{kind}"
    raw = bytes(step.draft_raw_bytes[j]) if step.draft_raw_bytes else b""
    if raw:
        tip += f"\npart of a character: bytes {_hex(raw)}"
        head, text, tail = piece_parts(raw)
        content = _bytes_chip(head) + html_token(text, line_breaks=False) + _bytes_chip(tail)
    else:
        content = html_token(step.draft_texts[j], line_breaks=False)
    return f'<span class="{classes}" title="{html.escape(tip)}">{content}</span>'


def _special(text: str) -> str:
    """A special token's chip: small, grey, never wrapped."""
    return f'<span class="sdl-special">{html_token(text, line_breaks=False)}</span>'


def _hex(raw: bytes) -> str:
    return raw.hex(" ").upper()


def _bytes_chip(raw: bytes) -> str:
    """Bytes of a character not shown whole here, in hex (empty for none)."""
    return f'<span class="sdl-bytes">{_hex(raw)}</span>' if raw else ""


def _step_html(step: Step, runs: Sequence[ByteRun], show_rejected: bool) -> str:
    plain = step.index == 0 or step.k == 0
    parts = []
    for run in runs:
        tokens = step.emitted[run.start:run.end]
        last, i = tokens[-1], run.end - 1
        if show_rejected and any(t.kind is TokenKind.RECOVERED for t in tokens):
            # the discarded drafts sit where they were proposed: before the token that replaced them
            for j in range(step.accepted, step.k):
                parts.append(_draft_span(step, j, "rejected", _draft_tip(step, j), j > step.accepted))
        kind = "target" if plain else last.kind.value
        if plain:
            tip = _target_tip(step, last)
        elif last.kind is TokenKind.ACCEPTED:
            tip = _draft_tip(step, i)
        else:
            tip = _last_tip(step, last)
        if last.special:
            tip = f"special token {last.token_id}: control, not text\n{tip}"
            content = _special(last.text)
        else:
            if len(tokens) > 1 or run.dangling or run.carried:
                tip = f"{_bytes_tip(run, tokens)}\n{tip}"
            content = html_token(run.text) + _bytes_chip(run.dangling)
        parts.append(f'<span class="sdl-{kind}" title="{html.escape(tip)}">{content}</span>')
    title = (f"step {step.index} · {step.drafter} · k={step.k} · accepted {step.accepted}"
             f" · emitted {len(step.emitted)}")
    return (f'<span class="sdl-step" data-step="{step.index}" title="{html.escape(title)}">'
            f'{"<wbr>".join(parts)}</span>')


def _bytes_tip(run: ByteRun, tokens: Sequence[EmittedToken]) -> str:
    """Which tokens' bytes make the characters shown (a byte-level tokenizer splits some)."""
    lines = [f"{run.text!r}: bytes of {len(tokens)} token{'s' if len(tokens) > 1 else ''} decoded together"
             if run.text else "part of a character: its other bytes come in a later output token"]
    if run.carried:
        lines.append(f"completes bytes {_hex(run.carried)} of an earlier token")
    lines += [f"token {t.token_id} ({t.kind.value}): bytes {_hex(t.utf8)}" for t in tokens]
    if run.dangling:
        lines.append(f"bytes {_hex(run.dangling)} wait for the rest of their character")
    return "\n".join(lines)


def _pending_html(step: Step) -> str:
    parts = [
        _draft_span(step, j, "drafted", f"step {step.index} · drafted at position {j + 1}\n"
                                        f"draft prob {step.draft_probs[j]:.3f}\nawaiting the target's verdict")
        for j in range(step.k)
    ]
    return f'<span class="sdl-step sdl-pending" data-step="{step.index}">{"<wbr>".join(parts)}</span>'


def _draft_tip(step: Step, j: int) -> str:
    verdict = "accepted" if j < step.accepted else "rejected"
    lines = [f"step {step.index} · {verdict} · drafted at position {j + 1}",
             f"draft prob {step.draft_probs[j]:.3f}", f"target prob {step.target_probs[j]:.3f}"]
    if j >= len(step.accept_probs):
        lines.append("not examined: an earlier draft was rejected")
    elif step.sample_uniform is None:
        lines.append("greedy: equals the target's argmax" if verdict == "accepted"
                     else "greedy: differs from the target's argmax")
    else:
        lines.append(f"accept prob min(1, target/draft) {step.accept_probs[j]:.3f}")
        lines.append(f"uniform draw {step.accept_uniforms[j]:.3f}")
    return "\n".join(lines)


def _last_tip(step: Step, tok: EmittedToken) -> str:
    greedy = step.sample_uniform is None
    if tok.kind is TokenKind.RECOVERED:
        how = ("the target's argmax where the draft differed" if greedy
               else "sampled from norm(max(0, target - draft))")
        head = f"recovered at position {step.accepted + 1}: {how}"
    else:
        how = "the target's argmax" if greedy else "sampled from the target"
        head = f"bonus after all {step.k} drafts were accepted: {how}"
    lines = [f"step {step.index} · {head}", f"target prob {tok.prob:.3f}"]
    if not greedy:
        lines.append(f"uniform draw {step.sample_uniform:.3f}")
    return "\n".join(lines)


def _target_tip(step: Step, tok: EmittedToken) -> str:
    where = "the prefill's first token" if step.index == 0 else "a plain decoding step (no draft)"
    return f"step {step.index} · target: {where}\ntarget prob {tok.prob:.3f}"
