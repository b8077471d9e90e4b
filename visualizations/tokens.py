"""The token stream as HTML: output tokens coloured by kind, rejected drafts struck through where
they were proposed, a boundary at each target step, and a tooltip with the probabilities.

Each stream carries its own small <style> block (TOKEN_CSS, classes prefixed sdl-), so it renders
the same wherever it is placed (a gr.HTML, a saved page) without inline styles on every token.
Step 0 (the prefill's first token) and plain decoding steps (k = 0) show as "target" tokens.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from engine.acceptance import TokenKind
from engine.trace import EmittedToken, Step
from visualizations.style import KIND_COLORS, tint
from visualizations.text import html_token

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
])


def legend_html() -> str:
    """One line naming each colour with DESIGN.md's words."""
    items = [f'<span class="sdl-{kind}">{kind}</span> {html.escape(meaning)}'
             for kind, meaning in KIND_MEANINGS.items()]
    items.append('<span class="sdl-step">&nbsp;</span>a target step begins')
    return f'<div class="sdl-legend">{" &middot; ".join(items)}</div>'


def token_stream_html(steps: Sequence[Step], pending: Step | None = None, legend: bool = True) -> str:
    """The output so far, step by step, after one <style> block (TOKEN_CSS); `pending` is a
    step whose drafts are shown before its verdict (the playground's first half of a step).
    All token text is escaped."""
    body = [_step_html(step) for step in steps]
    if pending is not None:
        body.append(_pending_html(pending))
    stream = f'<div class="sdl-stream">{"<wbr>".join(body)}</div>'
    return f"<style>{TOKEN_CSS}</style>" + (legend_html() if legend else "") + stream


def _span(text: str, kind: str, tip: str, unexamined: bool = False) -> str:
    classes = f"sdl-{kind} sdl-unexamined" if unexamined else f"sdl-{kind}"
    return f'<span class="{classes}" title="{html.escape(tip)}">{html_token(text)}</span>'


def _step_html(step: Step) -> str:
    plain = step.index == 0 or step.k == 0
    parts = []
    for i, tok in enumerate(step.emitted):
        if tok.kind is TokenKind.RECOVERED:
            # the discarded drafts sit where they were proposed: before the token that replaced them
            for j in range(step.accepted, step.k):
                parts.append(_span(step.draft_texts[j], "rejected", _draft_tip(step, j), j > step.accepted))
        if plain:
            parts.append(_span(tok.text, "target", _target_tip(step, tok)))
        elif tok.kind is TokenKind.ACCEPTED:
            parts.append(_span(tok.text, "accepted", _draft_tip(step, i)))
        else:
            parts.append(_span(tok.text, tok.kind.value, _last_tip(step, tok)))
    title = (f"step {step.index} · {step.drafter} · k={step.k} · accepted {step.accepted}"
             f" · emitted {len(step.emitted)}")
    return (f'<span class="sdl-step" data-step="{step.index}" title="{html.escape(title)}">'
            f'{"<wbr>".join(parts)}</span>')


def _pending_html(step: Step) -> str:
    parts = [
        _span(text, "drafted", f"step {step.index} · drafted at position {j + 1}\n"
                               f"draft prob {step.draft_probs[j]:.3f}\nawaiting the target's verdict")
        for j, text in enumerate(step.draft_texts)
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
