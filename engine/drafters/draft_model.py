"""draft-model: a separate small causal LM sharing the target's tokenizer."""

from __future__ import annotations

import torch

from engine.drafters.base import DraftProposal, DrafterSpec, register
from engine.drafters.cached_lm import CachedLM
from engine.drafters.vocab import TRAINED, DraftVocabulary, check_choice, load_vocabulary
from engine.errors import InputError
from engine.models import DISTILLED_PREFIX, LoadedModel, load_model, resolve_draft
from engine.mtp.weights import resolve_weights
from engine.sampling import SamplingConfig


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    t_vocab, d_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if t_vocab != d_vocab:
        raise InputError(
            f"draft model {draft.name!r} has a different vocabulary ({len(d_vocab)} tokens) from "
            f"target {target.name!r} ({len(t_vocab)} tokens); speculative decoding needs one tokenizer"
        )


class DraftModelDrafter:
    name = "draft-model"

    def __init__(self, target: LoadedModel, draft: LoadedModel, vocabulary: torch.Tensor | None = None,
                 stop: float = 0.0):
        check_same_vocabulary(target, draft)
        self.stop = stop  # DrafterSpec.draft_stop
        self.draft_model = draft
        scorer = None if vocabulary is None else DraftVocabulary(
            vocabulary, draft.model.get_output_embeddings(), target.vocab_size)
        self.lm = CachedLM(draft.model, draft.device, target.vocab_size, scorer)

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, rng: torch.Generator) -> DraftProposal:
        ids, probs = self.lm.draft(context, k, sampling, rng, self.stop)
        return DraftProposal(ids, probs)

    def observe(self, context: list[int], accepted: int, hidden: torch.Tensor) -> None:
        """The cache needs nothing (the next propose() crops it to what the target kept); a
        drafting vocabulary takes in the request's new tokens."""
        if self.lm.vocabulary is not None:
            self.lm.vocabulary.include(context)


@register("draft-model")
def _build(target: LoadedModel, spec: DrafterSpec) -> DraftModelDrafter:
    dtype = str(target.dtype).removeprefix("torch.")
    name = resolve_draft(target.spec, spec.draft)
    draft = load_model(name, device=target.device, dtype=dtype)
    vocabulary = None
    if check_choice(spec.draft_vocab) == TRAINED and name.startswith(DISTILLED_PREFIX):
        vocabulary = load_vocabulary(resolve_weights(name[len(DISTILLED_PREFIX):]))
    return DraftModelDrafter(target, draft, vocabulary, spec.draft_stop)
