"""prompt-lookup: draft by copying what followed the last n-gram's previous occurrence.

No model: the draft distribution is one-hot (Saxena 2023, "Prompt Lookup Decoding"; the same
idea as transformers' prompt_lookup_num_tokens).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.drafters.base import DraftProposal, DrafterSpec, register
from engine.errors import InputError
from engine.models import LoadedModel
from engine.sampling import SamplingConfig

MAX_NGRAM = 16


def find_candidates(context: list[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the context's last n
    tokens, trying n from ngram_max down to ngram_min.

    >>> find_candidates([5, 6, 7, 8, 5, 6], k=2, ngram_max=2, ngram_min=1)
    [7, 8]
    >>> find_candidates([1, 2, 3], k=2, ngram_max=2, ngram_min=1)
    []
    """
    for n in range(min(ngram_max, len(context) - 1), ngram_min - 1, -1):
        tail = context[-n:]
        # most recent match first: recent text is the likeliest to repeat
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == tail:
                follow = context[start + n : start + n + k]
                if follow:
                    return follow
    return []


class PromptLookupDrafter:
    name = "prompt-lookup"

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max <= MAX_NGRAM:
            raise InputError(
                f"prompt-lookup needs 1 <= ngram-min <= ngram-max <= {MAX_NGRAM} "
                f"(got min {ngram_min}, max {ngram_max})"
            )
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, rng: torch.Generator) -> DraftProposal:
        ids = find_candidates(context, k, self.ngram_max, self.ngram_min)
        return DraftProposal(torch.tensor(ids, dtype=torch.long), None)

    def observe(self, context: list[int], accepted: int, hidden: torch.Tensor) -> None:
        """Stateless: the context is searched afresh each step."""


class LookupFirst:
    """Another drafter, with prompt lookup tried first (DrafterSpec.lookup_first): where the
    context's last n..ngram_max tokens occurred before, the step drafts what followed them and
    the drafter does not run; elsewhere the drafter drafts. With `join` and a drafter that drafts
    a tree, the drafter always runs and the lookup's drafts join its tree as a branch
    (joined_tree). It is told every step either way (observe), so its caches stay in step. Its
    name is the drafter's."""

    def __init__(self, drafter, ngram_min: int, ngram_max: int, join: bool = False):
        self.drafter = drafter
        self.name = drafter.name
        self.tree = getattr(drafter, "tree", None)  # the drafter's tree shape, if it drafts trees
        self.feature_layers = tuple(getattr(drafter, "feature_layers", ()))  # what its observe reads
        self.ngram_min, self.ngram_max = ngram_min, min(ngram_max, MAX_NGRAM)
        self.join = join
        self.looked_up = self.drafted = self.joined = 0  # steps each source proposed; trees a lookup joined

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, rng: torch.Generator) -> DraftProposal:
        ids = find_candidates(context, k, self.ngram_max, self.ngram_min)
        if ids and not (self.join and self.tree is not None and sampling.greedy):
            self.looked_up += 1
            return DraftProposal(torch.tensor(ids, dtype=torch.long), None, source="prompt-lookup")
        self.drafted += 1
        proposal = self.drafter.propose(context, k, sampling, rng)
        if ids and proposal.parents is not None:
            self.joined += 1
            return joined_tree(proposal, ids)
        return proposal

    def observe(self, context: list[int], accepted: int, hidden: torch.Tensor) -> None:
        self.drafter.observe(context, accepted, hidden)


def joined_tree(proposal: DraftProposal, ids: list[int]) -> DraftProposal:
    """A tree proposal with the chain `ids` added as a branch from the root: the chain follows the
    tree's nodes while they hold its tokens, and goes on as new nodes (one-hot drafts, after the
    tree's, so parents still come first) where the tree has no such child. A tree with new nodes
    has no ranks (a lookup draft has no rank among the drafter's candidates; the playground's
    heads-tree view, which places nodes by rank, leaves such a step out).

    >>> tree = DraftProposal(torch.tensor([7, 8, 9]), None, parents=(-1, 0, -1))
    >>> joined = joined_tree(tree, [7, 5, 6])
    >>> joined.token_ids.tolist(), joined.parents
    ([7, 8, 9, 5, 6], (-1, 0, -1, 0, 3))
    >>> joined_tree(tree, [7, 8]).parents  # already in the tree: nothing added
    (-1, 0, -1)
    """
    tokens, parents = proposal.token_ids.tolist(), list(proposal.parents)
    children = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
    node, added = -1, []
    for token in ids:
        child = children.get((node, token))
        if child is None:
            child = len(tokens)
            tokens.append(token)
            parents.append(node)
            added.append(child)
        node = child
    if not added:
        return proposal
    probs = proposal.probs
    if probs is not None:
        probs = torch.cat([probs, torch.nn.functional.one_hot(
            torch.tensor([tokens[i] for i in added]), probs.shape[-1]).to(probs.dtype)])
    return replace(proposal, token_ids=torch.tensor(tokens, dtype=torch.long), probs=probs,
                   parents=tuple(parents), ranks=())


@register("prompt-lookup")
def _build(target: LoadedModel, spec: DrafterSpec) -> PromptLookupDrafter:
    return PromptLookupDrafter(spec.ngram_max, spec.ngram_min)
