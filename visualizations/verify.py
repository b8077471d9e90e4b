"""One target step's verification, opened up: a row per drafted position with the numbers the
verdict came from, the target's top-5 where the step's last token was emitted, and the residual
distribution norm(max(0, target_probs - draft_probs)) that a recovered token is sampled from.

Table cells hold plain text (whitespace made visible, not HTML-escaped: a DataFrame is not HTML);
figure labels are escaped for plotly.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import plotly.graph_objects as go

from engine.acceptance import TokenKind
from engine.trace import Step
from visualizations.style import GREY, KIND_COLORS, note_figure, styled
from visualizations.text import plotly_text, show_whitespace

VERIFY_COLUMNS = ["position", "draft token", "draft prob", "target prob", "accept prob", "uniform draw", "verdict"]
TOP_COLUMNS = ["rank", "token", "target prob", "role"]


@dataclass(frozen=True)
class VerifyView:
    table: pd.DataFrame  # verify_table(step)
    target_top: pd.DataFrame  # target_top_table(step)
    residual: go.Figure  # residual_chart(step)


def verify_view(step: Step) -> VerifyView:
    return VerifyView(verify_table(step), target_top_table(step), residual_chart(step))


def verdict(step: Step, position: int) -> str:
    """accepted, rejected (the first rejection) or not examined (after it), for draft
    position `position` (0-based)."""
    if position < step.accepted:
        return "accepted"
    return "rejected" if position == step.accepted else "not examined"


def verify_table(step: Step) -> pd.DataFrame:
    """One row per drafted position (1-based). accept prob is min(1, target/draft) as the
    sampling rule used it (greedy: 1 where draft == target argmax, else 0); blank where the
    position was not examined. uniform draw is blank for greedy steps."""
    rows = [
        [
            j + 1,
            show_whitespace(step.draft_texts[j]),
            step.draft_probs[j],
            step.target_probs[j],
            step.accept_probs[j] if j < len(step.accept_probs) else None,
            step.accept_uniforms[j] if j < len(step.accept_uniforms) else None,
            verdict(step, j),
        ]
        for j in range(step.k)
    ]
    return pd.DataFrame(rows, columns=VERIFY_COLUMNS)


def target_top_table(step: Step) -> pd.DataFrame:
    """The target's top-5 where the step's last token was emitted: at the first rejection (the
    recovered token) or after the last draft (the bonus token). role names the emitted token
    (recovered, bonus, or target for a step without drafts) and the rejected draft."""
    if not step.emitted:
        return pd.DataFrame([], columns=TOP_COLUMNS)
    last = step.emitted[-1]
    emitted_role = last.kind.value if step.k and step.index else "target"
    rejected = step.draft_token_ids[step.accepted] if step.accepted < step.k else None

    def role(token_id: int) -> str:
        if token_id == last.token_id:
            return emitted_role
        return "rejected draft" if token_id == rejected else ""

    rows = [[rank + 1, show_whitespace(t.text), t.prob, role(t.token_id)] for rank, t in enumerate(last.top)]
    return pd.DataFrame(rows, columns=TOP_COLUMNS)


def residual_chart(step: Step) -> go.Figure:
    """Bars of the residual's top tokens at the first rejection; the recovered token is coloured.
    Greedy steps and steps without a rejection have no residual and get a note instead."""
    title = "Residual distribution norm(max(0, target − draft))"
    if not step.residual_top:
        if step.k == 0:
            reason = "this step drafted nothing"
        elif step.sample_uniform is None:
            reason = "greedy: the target's argmax is emitted"
        else:
            reason = "every draft was accepted"
        return note_figure(title, f"No residual: {reason}")
    recovered = next((t.token_id for t in step.emitted if t.kind is TokenKind.RECOVERED), None)
    labels = [plotly_text(t.text) for t in step.residual_top]
    colors = [KIND_COLORS["recovered"] if t.token_id == recovered else GREY for t in step.residual_top]
    fig = go.Figure(go.Bar(
        x=list(range(len(labels))), y=[t.prob for t in step.residual_top], marker_color=colors,
        hovertext=[f"{label}: {t.prob:.3f}" for label, t in zip(labels, step.residual_top)], hoverinfo="text",
        name="residual",
    ))
    fig.update_xaxes(tickmode="array", tickvals=list(range(len(labels))), ticktext=labels)
    return styled(fig, f"{title} at position {step.accepted + 1}", "token", "probability")

