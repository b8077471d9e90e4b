"""Token trees: several drafted continuations verified in one target forward (Medusa, SpecInfer).

A tree of n drafted tokens is given by `parents`: parents[i] is the index of draft i's parent,
-1 for the last context token (the root); parents come before children. A chain of k drafts is
the tree (-1, 0, 1, ..., k-2). Each draft attends to the cached context, its ancestors and
itself, at position (context length - 1 + its depth), so every root-to-leaf path is scored as
if it had been verified alone. Greedy verification walks from the root to the child matching the
target's argmax; the KV cache then keeps only that path.

Tree shapes for MTP heads are data (trees.yaml): each node is a path of ranks in the heads' top-k
lists, (0, 2) = head 1's top-1 followed by head 2's top-3 (Medusa's notation).
"""

from __future__ import annotations

import functools
import heapq
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from engine.acceptance import Acceptance
from engine.errors import InputError
from engine.kv import GrowingLayer
from engine.trace import depths  # (kept there: metrics and views read trees without torch's model code)

TREES_FILE = Path(__file__).with_name("trees.yaml")


def prune(parents: tuple[int, ...], max_depth: int) -> tuple[list[int], tuple[int, ...]]:
    """The drafts at depth <= max_depth: their indices, and the parents renumbered among them.

    >>> prune((-1, 0, -1, 2, 1), 2)
    ([0, 1, 2, 3], (-1, 0, -1, 2))
    """
    keep = [i for i, d in enumerate(depths(parents)) if d <= max_depth]
    new_index = {old: new for new, old in enumerate(keep)}
    return keep, tuple(-1 if parents[i] < 0 else new_index[parents[i]] for i in keep)


def ancestor_mask(parents: tuple[int, ...]) -> torch.Tensor:
    """(n+1, n+1) bool: row r may attend to column c. Row 0 is the root (the last context token),
    row i+1 is draft i; each sees itself and its ancestors.

    >>> ancestor_mask((-1, -1, 0)).int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    """
    n = len(parents)
    mask = torch.eye(n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(parents):
        mask[i + 1] |= mask[p + 1]
    return mask


def tree_inputs(parents: tuple[int, ...], past: int, device: str, dtype: torch.dtype) -> dict:
    """position_ids (1, n+1) and an additive attention mask (1, 1, n+1, past+n+1) for a target
    forward over [root, drafts...] appended to a cache holding `past` tokens."""
    positions = torch.tensor([[past] + [past + d for d in depths(parents)]], device=device)
    allowed = torch.cat([torch.ones(len(parents) + 1, past, dtype=torch.bool), ancestor_mask(parents)], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return {"position_ids": positions, "attention_mask": mask[None, None].to(device)}


def greedy_accept_tree(
    draft_ids: torch.Tensor, parents: tuple[int, ...], target_logits: torch.Tensor
) -> tuple[Acceptance, tuple[int, ...]]:
    """Greedy verification of a tree: from the root, follow the child whose token is the target's
    argmax, as long as one exists. Returns the acceptance and the accepted drafts' indices
    (root to leaf). target_logits (n+1, V): row 0 scores the token after the context, row i+1
    the token after draft i and its ancestors. On a chain this is `greedy_accept`.

    >>> logits = torch.tensor([[0., 5, 0], [0, 0, 5], [5, 0, 0], [0, 0, 5]])  # argmax 1, 2, 0, 2
    >>> a, path = greedy_accept_tree(torch.tensor([2, 1, 0]), (-1, -1, 1), logits)  # 1 then 0: a leaf
    >>> path, a.accepted, a.next_token, a.rejected_at
    ((1, 2), 2, 2, None)
    >>> a, path = greedy_accept_tree(torch.tensor([2, 1, 1]), (-1, -1, 1), logits)  # 1, then 1 != 0
    >>> path, a.accepted, a.next_token, a.rejected_at
    ((1,), 1, 0, 1)
    """
    argmax = torch.argmax(target_logits, dim=-1).tolist()  # (n+1,)
    tokens = draft_ids.tolist()
    children: dict[int, list[int]] = {-1: []}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)
        children.setdefault(i, [])
    node, path, accept_probs = -1, [], []
    while children[node]:
        match = next((i for i in children[node] if tokens[i] == argmax[node + 1]), None)
        accept_probs.append(0.0 if match is None else 1.0)
        if match is None:
            break
        path.append(match)
        node = match
    rejected_at = len(path) if children[node] else None
    return Acceptance(len(path), int(argmax[node + 1]), tuple(accept_probs), rejected_at), tuple(path)


@torch.inference_mode()
def keep_path(cache: DynamicCache, past: int, path: tuple[int, ...]) -> None:
    """After a tree forward appended [root, drafts...] to a cache of `past` tokens, keep the root
    and the accepted drafts (in path order) and drop every other branch."""
    keep = [past] + [past + 1 + i for i in path]
    for layer in cache.layers:
        if type(layer) not in (DynamicLayer, GrowingLayer):
            raise InputError(f"tree verification needs a plain KV cache (this model uses {type(layer).__name__})")
        index = torch.tensor(keep, device=layer.keys.device)
        # the kept entries written over the tree's in place, then the rest cut: a growing layer
        # keeps its buffer (engine/kv.py), a plain one its tensor
        end = past + len(keep)
        layer.keys[..., past:end, :] = layer.keys.index_select(-2, index)
        layer.values[..., past:end, :] = layer.values.index_select(-2, index)
        layer.keys, layer.values = layer.keys[..., :end, :], layer.values[..., :end, :]


def best_tree(rank_accuracy: list[list[float]], nodes: int) -> tuple[list[tuple[int, ...]], float]:
    """The `nodes` rank paths with the highest chance of being accepted whole, taking each
    head's accuracy at each rank as independent (Medusa's construction), and the expected
    tokens per step of that tree (1 + the sum of those chances). rank_accuracy[d][r]: how often
    head d's rank-r candidate is the right token.

    >>> best_tree([[0.6, 0.2], [0.5, 0.1]], 3)
    ([(0,), (0, 0), (1,)], 2.1)
    """
    paths = best_paths(rank_accuracy, nodes)
    chance = [math.prod(rank_accuracy[d][r] for d, r in enumerate(p)) for p in paths]
    return paths, round(1 + sum(chance), 4)


def order_paths(paths) -> tuple[tuple[int, ...], ...]:
    """Rank paths in the order trees list their nodes: by depth, then by ranks (parents first).

    >>> order_paths([(1,), (0, 0), (0,)])
    ((0,), (1,), (0, 0))
    """
    return tuple(sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p)))


def parents_of(paths: tuple[tuple[int, ...], ...]) -> tuple[int, ...]:
    """Each path's parent index in `paths` (-1 for depth 1); parents must be listed first.

    >>> parents_of(((0,), (1,), (0, 0), (1, 0)))
    (-1, -1, 0, 1)
    """
    index = {p: i for i, p in enumerate(paths)}
    missing = [p for p in paths if len(p) > 1 and index.get(p[:-1], len(paths)) >= index[p]]
    if missing:
        raise ValueError(f"tree path {list(missing[0])} is not listed after its parent")
    return tuple(index[p[:-1]] if len(p) > 1 else -1 for p in paths)


def rank_width(paths, depth: int) -> int:
    """How many candidates depth `depth` (1-based) must offer for these paths.

    >>> rank_width([(0,), (2,), (0, 1)], 1), rank_width([(0,), (2,), (0, 1)], 2), rank_width([(0,)], 2)
    (3, 2, 0)
    """
    return 1 + max((p[depth - 1] for p in paths if len(p) >= depth), default=-1)


def best_paths(ranked: list[list[float]], nodes: int) -> list[tuple[int, ...]]:
    """The `nodes` rank paths with the highest product of probabilities, where ranked[d] holds
    depth d+1's candidate probabilities in descending order and the same at every node (MTP
    heads: each head's distribution ignores the path). Parents come before their children; a
    child never outranks its parent, so the set is a tree. A dynamic tree for heads (for the
    module, whose distributions depend on the path, NativeMTP.draft_dynamic grows it).

    >>> best_paths([[0.6, 0.3], [0.9, 0.05]], 4)
    [(0,), (0, 0), (1,), (1, 0)]
    """
    heap = [(-p, (r,)) for r, p in enumerate(ranked[0])] if ranked else []
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < nodes:
        neg, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < len(ranked):
            for r, p in enumerate(ranked[len(path)]):
                heapq.heappush(heap, (neg * p, path + (r,)))
    return chosen


@dataclass(frozen=True)
class DynamicTree:
    """A tree chosen at every step (EAGLE-2): the `nodes` jointly likeliest drafts, at most k
    deep, each depth expanding its `beam` likeliest nodes into their `beam` likeliest tokens."""

    name: str
    nodes: int
    beam: int
    description: str = ""


@dataclass(frozen=True)
class TreeShape:
    """A named tree for MTP heads: each node a path of ranks, parents listed before children."""

    name: str
    paths: tuple[tuple[int, ...], ...]

    @property
    def parents(self) -> tuple[int, ...]:
        return parents_of(self.paths)

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)


def _shape(name: str, entry: dict) -> TreeShape | DynamicTree:
    if "dynamic" in entry:
        nodes, beam = int(entry["dynamic"]["nodes"]), int(entry["dynamic"]["beam"])
        if not (1 <= nodes <= 64 and 1 <= beam <= 16):
            raise ValueError(f"tree {name!r}: a dynamic tree has 1..64 nodes and a beam of 1..16")
        return DynamicTree(name, nodes, beam, entry.get("description", ""))
    ordered = order_paths(tuple(int(r) for r in p) for p in entry["paths"])
    for p in ordered:
        if not p or min(p) < 0 or (len(p) > 1 and p[:-1] not in ordered):
            raise ValueError(f"tree {name!r}: node {list(p)} is empty, negative or lacks its parent")
    return TreeShape(name, ordered)


@functools.cache
def tree_shapes() -> dict[str, TreeShape | DynamicTree]:
    data = yaml.safe_load(TREES_FILE.read_text())
    return {name: _shape(name, entry) for name, entry in data["trees"].items()}


def tree_shape(name: str) -> TreeShape | DynamicTree:
    shapes = tree_shapes()
    if name not in shapes:
        raise InputError(f"unknown tree shape {name!r} ({', '.join(shapes)})")
    return shapes[name]
