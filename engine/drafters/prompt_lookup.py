"""prompt-lookup: draft by copying what followed the last n-gram's previous occurrence.

No model: the draft distribution is one-hot (Saxena 2023, "Prompt Lookup Decoding"; the same
idea as transformers' prompt_lookup_num_tokens).
"""

from __future__ import annotations

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
    the drafter does not run; elsewhere the drafter drafts. It is told every step either way
    (observe), so its caches stay in step. Its name is the drafter's."""

    def __init__(self, drafter, ngram_min: int, ngram_max: int):
        self.drafter = drafter
        self.name = drafter.name
        self.tree = getattr(drafter, "tree", None)  # the drafter's tree shape, if it drafts trees
        self.feature_layers = tuple(getattr(drafter, "feature_layers", ()))  # what its observe reads
        self.ngram_min, self.ngram_max = ngram_min, min(ngram_max, MAX_NGRAM)
        self.looked_up = self.drafted = 0  # steps each source proposed

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, rng: torch.Generator) -> DraftProposal:
        ids = find_candidates(context, k, self.ngram_max, self.ngram_min)
        if ids:
            self.looked_up += 1
            return DraftProposal(torch.tensor(ids, dtype=torch.long), None, source="prompt-lookup")
        self.drafted += 1
        return self.drafter.propose(context, k, sampling, rng)

    def observe(self, context: list[int], accepted: int, hidden: torch.Tensor) -> None:
        self.drafter.observe(context, accepted, hidden)


@register("prompt-lookup")
def _build(target: LoadedModel, spec: DrafterSpec) -> PromptLookupDrafter:
    return PromptLookupDrafter(spec.ngram_max, spec.ngram_min)
