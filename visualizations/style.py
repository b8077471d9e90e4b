"""Colours and figure styling shared by every view, so one word has one colour everywhere.

The palette is Okabe & Ito's (2008), chosen to stay distinguishable with the common forms of
colour blindness. Token kinds use DESIGN.md's words; "target" marks a token the target emitted
without a draft (the prefill's first token, or a plain decoding step), "drafted" a draft still
awaiting its verdict.
"""

from __future__ import annotations

import html
import math

import plotly.graph_objects as go

ORANGE = "#E69F00"
SKY_BLUE = "#56B4E9"
BLUISH_GREEN = "#009E73"
BLUE = "#0072B2"
VERMILLION = "#D55E00"
REDDISH_PURPLE = "#CC79A7"
GREY = "#8C8C8C"

KIND_COLORS = {
    "accepted": BLUISH_GREEN,
    "rejected": VERMILLION,
    "recovered": ORANGE,
    "bonus": BLUE,
    "target": GREY,
    "drafted": SKY_BLUE,
}
PHASE_COLORS = {"prefill": ORANGE, "decode": BLUE, "draft": SKY_BLUE, "verify": BLUE, "target": GREY,
                "cached": BLUISH_GREEN}  # cached: prompt tokens reused from the prefix cache
CLASS_COLORS = {"long": VERMILLION, "short": BLUISH_GREEN}
SERIES_COLORS = (BLUE, ORANGE, BLUISH_GREEN, REDDISH_PURPLE, SKY_BLUE, VERMILLION)
# plotly.js's own plain white defaults: a named template like "plotly_white" is deep-copied into
# every figure, which took ~10 ms per figure here, most of a step's render time.
TEMPLATE = "none"
LEGEND_BELOW_PX = 130  # bottom margin for tick labels, the x axis title and three rows of legend (a phone)
LABEL_PX_PER_CHAR = 7.5  # plotly's default 12 px sans-serif, its wider characters
AXIS_TITLE_PX = 36  # a y axis title, its standoff and the tick marks


def class_color(cls: str) -> str:
    return CLASS_COLORS.get(cls, REDDISH_PURPLE)


def styled(fig: go.Figure, title: str, x_title: str, y_title: str) -> go.Figure:
    fig.update_layout(title=title, template=TEMPLATE, margin=dict(l=60, r=20, t=60, b=50))
    fig.update_xaxes(title_text=x_title)
    fig.update_yaxes(title_text=y_title)
    return fig


def lane_margin(labels, title: bool = True) -> int:
    """A left margin (px) wide enough for the longest y tick label and the axis title, so
    no label is clipped (the axes also set automargin, which measures the real text).

    >>> lane_margin(["chat-0 (short)", "document (long)"])
    149
    """
    longest = max((len(html.unescape(label)) for label in labels), default=0)
    return math.ceil(longest * LABEL_PX_PER_CHAR) + (AXIS_TITLE_PX if title else 12)


def legend_below(fig: go.Figure) -> go.Figure:
    """The legend in rows along the figure's bottom edge, under the x axis title: beside the
    plot it would take a third of a phone's width, above it it would wrap into the titles."""
    fig.update_layout(legend=dict(orientation="h", xref="container", x=0.0, xanchor="left", yref="container",
                                  y=0.0, yanchor="bottom"), margin_t=60, margin_b=LEGEND_BELOW_PX)
    return fig


def note_figure(title: str, message: str) -> go.Figure:
    """A figure with no data and a centred message, for views that have nothing to show yet."""
    fig = go.Figure()
    fig.update_layout(title=title, template=TEMPLATE, xaxis_visible=False, yaxis_visible=False)
    fig.add_annotation(text=message, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    return fig


def tint(color: str, share: float = 0.25) -> str:
    """`color` mixed with white: `share` of the colour, the rest white (a readable background).

    >>> tint("#009E73")
    '#BFE7DC'
    """
    channels = (int(color[i : i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{round(255 - (255 - c) * share):02X}" for c in channels)
