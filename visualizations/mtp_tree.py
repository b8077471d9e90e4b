"""The MTP heads' proposals as a tree, with the path the target verified highlighted.

Head i proposes the token at draft position i + 1, as a top-k list of (token text, draft prob).
A node is a path of ranks: (0, 2) is head 1's top-1 followed by head 2's top-3. Without a tree
shape every combination is drawn (Medusa's full tree); a tree shape (a list of such paths, as
the MTP drafter keeps it as data) draws only those nodes and their ancestors.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import product

import plotly.graph_objects as go

from visualizations.style import GREY, KIND_COLORS, note_figure, styled
from visualizations.text import plotly_text

Proposal = tuple[str, float]  # (token text, draft prob)
Path = tuple[int, ...]  # the rank chosen at each head, from the first head on
MAX_NODES = 400  # beyond this a tree is unreadable; pass a tree shape instead


def tree_paths(heads: Sequence[Sequence[Proposal]], tree: Sequence[Sequence[int]] | None = None,
               accepted_path: Sequence[int] = ()) -> list[Path]:
    """Every node's path, parents before children (depth-first order); the accepted path and all
    ancestors are always included.

    >>> tree_paths([[("a", .6), ("b", .3)], [("c", .5), ("d", .4)]], tree=[(0, 1)])
    [(0,), (0, 1)]
    >>> len(tree_paths([[("a", .6), ("b", .3)], [("c", .5), ("d", .4)]]))
    6
    """
    if tree is None:
        leaves = [p for d in range(1, len(heads) + 1) for p in product(*(range(len(h)) for h in heads[:d]))]
    else:
        leaves = [tuple(p) for p in tree]
    nodes = {tuple(p[:d]) for p in [*leaves, tuple(accepted_path)] for d in range(1, len(p) + 1)}
    for path in nodes:
        if len(path) > len(heads) or any(not 0 <= r < len(heads[d]) for d, r in enumerate(path)):
            raise ValueError(f"tree path {path} is outside the heads' proposals")
    if len(nodes) > MAX_NODES:
        raise ValueError(f"the tree has {len(nodes)} nodes (limit {MAX_NODES}); pass a tree shape")
    return sorted(nodes)


def _layout(paths: list[Path]) -> dict[Path, tuple[int, float]]:
    """(x, y) per node: x is the depth, leaves sit on consecutive rows, a parent centres on its
    children. The root is ()."""
    children: dict[Path, list[Path]] = {(): []}
    for p in paths:
        children.setdefault(p, [])
        children[p[:-1]].append(p)
    ys: dict[Path, float] = {}
    next_row = 0
    for p in sorted(children, reverse=True):  # children before parents
        if children[p]:
            ys[p] = sum(ys[c] for c in children[p]) / len(children[p])
        else:
            ys[p] = next_row
            next_row += 1
    return {p: (len(p), ys[p]) for p in children}


def mtp_tree_figure(heads: Sequence[Sequence[Proposal]], accepted_path: Sequence[int] = (),
                    tree: Sequence[Sequence[int]] | None = None, root_text: str = "context") -> go.Figure:
    """The proposal tree, left to right; nodes and edges on the accepted path in the accepted
    colour, marker size by draft prob. `root_text` labels the root (e.g. the last output token)."""
    title = "MTP heads' proposals (verified path highlighted)"
    if not heads or not any(heads):
        return note_figure(title, "No MTP proposals in this step")
    paths = tree_paths(heads, tree, accepted_path)
    pos = _layout(paths)
    on_path = {tuple(accepted_path[:d]) for d in range(len(accepted_path) + 1)}
    fig = go.Figure()
    for highlighted in (False, True):
        xs, ys = [], []
        for p in paths:
            if (p in on_path) == highlighted:
                xs += [pos[p[:-1]][0], pos[p][0], None]
                ys += [pos[p[:-1]][1], pos[p][1], None]
        fig.add_trace(go.Scatter(
            x=xs, y=ys, mode="lines", hoverinfo="skip", showlegend=False,
            line=dict(color=KIND_COLORS["accepted"] if highlighted else GREY, width=4 if highlighted else 1),
        ))
    for highlighted in (False, True):
        nodes = [p for p in paths if (p in on_path) == highlighted]
        proposals = [heads[len(p) - 1][p[-1]] for p in nodes]
        fig.add_trace(go.Scatter(
            x=[pos[p][0] for p in nodes], y=[pos[p][1] for p in nodes], mode="markers+text",
            name="accepted path" if highlighted else "proposed",
            text=[plotly_text(text) for text, _ in proposals], textposition="middle right",
            marker=dict(color=KIND_COLORS["accepted"] if highlighted else GREY,
                        size=[8 + 20 * prob for _, prob in proposals]),
            hovertext=[f"head {len(p)} rank {p[-1] + 1}: {plotly_text(text)}, draft prob {prob:.3f}"
                       for p, (text, prob) in zip(nodes, proposals)],
            hoverinfo="text",
        ))
    fig.add_trace(go.Scatter(
        x=[0], y=[pos[()][1]], mode="markers+text", name="context", text=[plotly_text(root_text)],
        textposition="middle left", marker=dict(color="#333", size=12, symbol="square"), hoverinfo="text",
        hovertext=[plotly_text(root_text)],
    ))
    fig.update_xaxes(tickmode="array", tickvals=list(range(len(heads) + 1)),
                     ticktext=["context"] + [f"head {i + 1}" for i in range(len(heads))],
                     range=[-0.6, len(heads) + 0.8])
    fig.update_yaxes(visible=False)
    return styled(fig, title, "draft position (MTP head)", "")
