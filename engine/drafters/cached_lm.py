"""A causal LM with its own KV cache kept in step with a token sequence.

Drafters that run a model (a draft model, the target's first layers) keep their cache synced to
the context they are given: whatever the target rejected is cropped away (rollback), whatever
it emitted that the drafter has not seen (a recovered or bonus token) is fed in (refill).
"""

from __future__ import annotations

import torch
from engine.drafters.vocab import DraftVocabulary
from engine.kv import growing_cache
from engine.sampling import SamplingConfig, choose, probs_from_logits


class CachedLM:
    def __init__(self, model: torch.nn.Module, device: str, vocab: int, vocabulary: DraftVocabulary | None = None):
        self.model = model
        self.device = device
        self.vocab = vocab  # the target's vocabulary size; draft logits are padded/cut to it
        self.vocabulary = vocabulary  # score only these tokens (None: the model's whole LM head)
        self.cache = growing_cache()
        self.cached_ids: list[int] = []

    def sync(self, seq: list[int]) -> list[int]:
        """Crop the cache to the longest common prefix with seq (keeping at least one token to
        feed); return the tokens still to feed."""
        common = 0
        limit = min(len(self.cached_ids), len(seq) - 1)
        while common < limit and self.cached_ids[common] == seq[common]:
            common += 1
        if common < len(self.cached_ids):
            self.cache.crop(common - len(self.cached_ids))
            del self.cached_ids[common:]
        return seq[common:]

    @torch.inference_mode()
    def next_logits(self, seq: list[int]) -> torch.Tensor:
        """Logits (V,) for the token after seq, reusing the cache."""
        todo = self.sync(seq)
        ids = torch.tensor([todo], device=self.device)
        if self.vocabulary is not None:  # the decoder only, then the subset of the LM head
            out = self.model.model(input_ids=ids, cache=self.cache, use_cache=True)
            self.cached_ids.extend(todo)
            return self.vocabulary.logits(out.last_hidden_state[0, -1])
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=1)
        self.cached_ids.extend(todo)
        logits = out.logits[0, -1].float()
        if logits.shape[0] != self.vocab:  # same tokenizer, lm_head padded differently
            logits = torch.nn.functional.pad(logits, (0, max(0, self.vocab - logits.shape[0])), value=-1e9)
            logits = logits[: self.vocab]
        return logits

    def draft(
        self, context: list[int], k: int, sampling: SamplingConfig, rng: torch.Generator, stop: float = 0.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to k tokens drafted autoregressively: ids (k',) and their draft_probs (k', V). With
        stop > 0 the chain ends after a draft whose own probability is below it (see
        engine.drafters.base.DrafterSpec.draft_stop)."""
        ids: list[int] = []
        probs = []
        for _ in range(k):
            logits = self.next_logits(context + ids)
            p = probs_from_logits(logits, sampling)
            ids.append(choose(p, logits, sampling, float(torch.rand((), generator=rng))))
            probs.append(p)
            if float(p[ids[-1]]) < stop:
                break
        if not ids:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, self.vocab)
        return torch.tensor(ids), torch.stack(probs)
