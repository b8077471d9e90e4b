"""The verdict card: did speculative decoding pay off on this machine, and why (HTML).

Shown right under the playground's buttons: after Compare the measured side-by-side result
(tokens/s of both, speedup, tokens per target step, identical or not) with the explanation
from the run's own measured costs; after a single run an estimate from the same costs; and any
message about the run (an error, settings that changed) in the same place.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

from engine.metrics import StepEconomics
from visualizations.style import BLUISH_GREEN, GREY, VERMILLION, tint

WIN, LOSS = 1.05, 0.95  # speedups outside [LOSS, WIN] count as a win or a loss; between: break-even
CARD_CSS = (
    "border-radius:8px;padding:12px 16px;margin:4px 0;line-height:1.45;color:#111;"
    "font-family:var(--font, system-ui, sans-serif);"
)


@dataclass(frozen=True)
class Verdict:
    """A Compare's outcome: medians over `rounds` interleaved runs of each side."""

    method: str
    rounds: int
    baseline_tokens_per_s: float
    speculative_tokens_per_s: float
    tokens_per_step: float | None  # the speculative runs' output tokens per target step
    output_tokens: int
    identical: bool | None  # greedy: every round's output equals the baseline's; None when sampled
    diverge_at: int | None = None  # the first differing output token, when not identical
    decode_speedup: float | None = None  # after the first token (prefill excluded)
    economics: StepEconomics | None = None
    lossy: bool = False

    @property
    def speedup(self) -> float:
        return self.speculative_tokens_per_s / self.baseline_tokens_per_s


def _tone(speedup: float) -> str:
    return VERMILLION if speedup < LOSS else BLUISH_GREEN if speedup > WIN else GREY


def _cell(label: str, value: str, elem: str) -> str:
    return (f'<div class="speclab-cell" data-cell="{elem}" style="min-width:150px;flex:1">'
            f'<div style="font-size:0.8em;color:#555">{escape(label)}</div>'
            f'<div style="font-size:1.25em;font-weight:600">{value}</div></div>')


def explanation(economics: StepEconomics | None, speedup: float, measured: str = "measured",
                estimate: bool = False) -> str:
    """One paragraph: tokens per step against what a step costs, the prediction from those
    measured parts, and the measured speedup beside it (plain text, escaped by the caller).

    >>> e = StepEconomics(tokens_per_step=1.26, k=4, draft_cost=0.40, verify_cost=1.05)
    >>> explanation(e, 0.82)[:60]
    'Why it lost: each target step emitted 1.26 tokens on average'
    """
    if economics is None:
        return ("No prediction: this run has no verify-curve point for its k + 1 tokens (the curve is "
                "measured for up to 17 tokens when the model loads).")
    e = economics
    outcome = ("lose", "lost") if speedup < LOSS else ("win", "won") if speedup > WIN else ("break even", "broke even")
    lead = f"Why it would {outcome[0]}" if estimate else f"Why it {outcome[1]}"
    parts = (f"{lead}: each target step emitted {e.tokens_per_step:.2f} tokens on average, and cost "
             f"{e.step_cost:.2f} plain steps: drafting {e.k} token{'' if e.k == 1 else 's'} {e.draft_cost:.2f} + "
             f"verifying {e.k + 1} tokens in one forward {e.verify_cost:.2f} (this machine's measured verify curve). "
             f"Predicted from those parts: {e.tokens_per_step:.2f} / {e.step_cost:.2f} = "
             f"{e.predicted_speedup:.2f}x" + ("." if estimate else f"; {measured}: {speedup:.2f}x."))
    if speedup < LOSS:
        parts += (" Speculation pays only when a step emits more tokens than it costs: a cheaper drafter "
                  "(prompt lookup drafts for almost nothing), text the drafter predicts well (copying, "
                  "editing), or a flat verify curve (bfloat16 here, a GPU).")
    elif e.predicted_speedup > speedup * 1.15:
        parts += (" The measured figure is lower: it includes the prefill, which speculation does not speed "
                  "up, and the engine's own per-step work.")
    return parts


def verdict_card_html(v: Verdict) -> str:
    color = _tone(v.speedup)
    word = "faster" if v.speedup > WIN else "slower" if v.speedup < LOSS else "about as fast"
    headline = (f'<span style="font-size:2.2em;font-weight:700;color:{color}" data-speedup="{float(v.speedup)!r}">'
                f"{v.speedup:.2f}&times;</span> <span style=\"font-size:1.2em\">{word} than plain decoding with "
                f"<b>{escape(v.method)}</b></span>")
    if v.identical is None:
        same = "sampled: same distribution, different draws"
    elif v.identical:
        same = f'<span style="color:{BLUISH_GREEN}">&#10003; identical</span> ({v.output_tokens} tokens)'
    else:
        same = f'<span style="color:{VERMILLION}">&#10007; differs</span> from token {v.diverge_at}'
    tps = "" if v.tokens_per_step is None else f"{v.tokens_per_step:.2f} <span style=\"font-size:0.7em\">vs 1.00</span>"
    cells = "".join([
        _cell("plain decoding (baseline)", f"{v.baseline_tokens_per_s:.1f} tokens/s", "baseline"),
        _cell(f"speculative ({v.method})", f"{v.speculative_tokens_per_s:.1f} tokens/s", "speculative"),
        _cell("tokens per target step", tps, "tokens-per-step"),
        _cell("output vs plain decoding", same, "identical"),
    ])
    decode = f", decode only {v.decode_speedup:.2f}x" if v.decode_speedup else ""
    how = (f"Medians of {v.rounds} run{'s' if v.rounds != 1 else ''} of each side, interleaved "
           f"(baseline, speculative, then the other order), end to end with the prefill{decode}.")
    lossy = ('<div style="font-weight:700;color:#900">LOSSY acceptance: the output distribution is not the '
             "target's</div>") if v.lossy else ""
    measured = "measured (decode only)" if v.decode_speedup else "measured"
    why = explanation(v.economics, v.decode_speedup or v.speedup, measured)
    return (f'<div class="speclab-verdict" style="{CARD_CSS}background:{tint(color, 0.12)};'
            f'border:2px solid {color}">'
            f"<div>{headline}</div>{lossy}"
            f'<div style="display:flex;flex-wrap:wrap;gap:8px 16px;margin:8px 0">{cells}</div>'
            f'<div class="speclab-why">{escape(why)}</div>'
            f'<div style="font-size:0.8em;color:#555;margin-top:4px">{escape(how)}</div></div>')


def estimate_card_html(method: str, economics: StepEconomics | None) -> str:
    """After a single speculative run: the predicted speedup from its measured parts (not a
    side-by-side measurement: Compare measures that)."""
    if economics is None:
        return ""
    e = economics
    color = _tone(e.predicted_speedup)
    text = explanation(e, e.predicted_speedup, estimate=True)
    return (f'<div class="speclab-verdict speclab-estimate" style="{CARD_CSS}background:{tint(color, 0.08)};'
            f'border:1px dashed {color}">'
            f'<div><b>Estimated vs plain decoding: {e.predicted_speedup:.2f}&times;</b> with {escape(method)} '
            f"(from this run's measured parts; press <i>Compare with baseline</i> to measure it side by side)</div>"
            f'<div class="speclab-why" style="font-size:0.9em">{escape(text)}</div></div>')


def notice_html(message: str, kind: str = "error") -> str:
    """A message in place of the verdict: an error ("error") or a note ("info"). Escaped."""
    color = VERMILLION if kind == "error" else GREY
    icon = "&#9888;" if kind == "error" else "&#8505;"
    return (f'<div class="speclab-notice speclab-{escape(kind)}" style="{CARD_CSS}background:{tint(color, 0.10)};'
            f'border:1px solid {color}">{icon} {escape(message)}</div>')
