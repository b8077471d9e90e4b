"""A drafting vocabulary: the drafter's LM head scores only a subset of the target's tokens.

On a small model the LM head is a large share of a draft's cost (SmolLM2-135M: 49,152 x 576
weights, a fifth of the whole target), and most of its rows are tokens a drafter almost never
gets right. Scoring only the tokens that actually occur (FR-Spec, Zhao et al. 2025, ranks them
by frequency) makes every drafted token cheaper. It changes what the drafter can propose, never
what is emitted: the target verifies over its full vocabulary, a draft's probabilities are zero
outside the subset, and the standard acceptance rule is exact for any draft distribution.

The subset ships beside trained weights (engine/weights/<name>/draft_vocabulary.safetensors):
the tokens the target emits most often in its self-distilled training answers, ranked by count
(engine.train.common.drafting_vocabulary). At run time the request's own tokens join it
(`include`): a prompt brings rare words (names, code identifiers, another language) that answers
copy, and a fixed frequency cut would never let the drafter propose them.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.drafters.int8 import int8_weight
from engine.errors import InputError
from engine.invariant import PackedWeight, product

VOCAB_FILE = "draft_vocabulary.safetensors"
FULL, TRAINED = "full", "trained"  # DrafterSpec.draft_vocab: every token, or the shipped subset
CHOICES = (TRAINED, FULL)


class DraftVocabulary:
    """Scores hidden states against the LM head rows of `ids` (and of the request's own tokens,
    `include`) only; logits come back over the full vocabulary with -inf outside the subset (so
    probabilities there are exactly 0)."""

    def __init__(self, ids: torch.Tensor, lm_head: torch.nn.Module, vocab_size: int, int8: bool = False):
        ids = torch.unique(ids.long())
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
            raise InputError(f"a drafting vocabulary must hold token ids in 0..{vocab_size - 1}")
        weight = lm_head.weight
        self.ids = ids.to(weight.device)
        self.weight = weight.detach()[self.ids].contiguous()  # (S, H): a copy, read every draft
        bias = getattr(lm_head, "bias", None)
        self.bias = None if bias is None else bias.detach()[self.ids]
        self.vocab_size = vocab_size
        self._packed = PackedWeight()  # 16-bit CPU weights: kept in oneDNN's layout instead of reordered per call
        # int8: a drafting step's few rows multiply by an int8 copy of the rows (engine/drafters/int8.py)
        self._int8 = int8_weight(self.weight) if int8 and self.bias is None else None
        self._head = (weight.detach(), None if bias is None else bias.detach())
        self.member = torch.zeros(vocab_size, dtype=torch.bool)  # ids and extra ids
        self.member[ids] = True
        self.extra_ids = self.ids[:0]  # the request's own tokens outside ids (include)
        self.extra_weight, self.extra_bias = self.weight[:0], None if bias is None else self.bias[:0]
        self._seen = 0  # context tokens already looked at

    def __len__(self) -> int:
        return int(self.ids.numel() + self.extra_ids.numel())

    def include(self, context: list[int]) -> None:
        """Score the context's tokens too (the prompt and the output so far); call it with the
        growing context: only tokens past the last call are looked at."""
        new = torch.tensor(context[self._seen:], dtype=torch.long)
        self._seen = len(context)
        new = new[(new >= 0) & (new < self.vocab_size)]
        new = torch.unique(new[~self.member[new]])
        if not new.numel():
            return
        self.member[new] = True
        self.extra_ids = torch.cat([self.extra_ids, new.to(self.ids.device)])
        head, bias = self._head
        # float32: a 16-bit product on a CPU is a oneDNN kernel made for each new shape (~0.3 ms),
        # and this one's shape changes whenever a request brings another token
        self.extra_weight = head[self.extra_ids].float()
        self.extra_bias = None if bias is None else bias[self.extra_ids].float()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., H) -> float32 logits (..., V), -inf outside the subset."""
        rows = hidden.reshape(-1, hidden.shape[-1])
        full = torch.full((rows.shape[0], self.vocab_size), float("-inf"), device=rows.device)
        if self._int8 is not None and self._int8.takes(rows):
            scored = self._int8(rows)
        else:
            scored = product(rows, self.weight, self.bias, self._packed)
        full.index_copy_(-1, self.ids, scored.float())
        if self.extra_ids.numel():  # a few hundred rows, in float32 (include); drafts need no bitwise invariance
            extra = F.linear(rows.float(), self.extra_weight, self.extra_bias).to(rows.dtype)  # rounded as the head's
            full.index_copy_(-1, self.extra_ids, extra.float())
        return full.reshape(*hidden.shape[:-1], self.vocab_size)


def save_vocabulary(folder: Path, ids: torch.Tensor) -> None:
    save_file({"ids": torch.unique(ids.long()).to(torch.int32).contiguous()}, Path(folder) / VOCAB_FILE)


def load_vocabulary(folder: Path) -> torch.Tensor | None:
    """The subset shipped in a weights folder (None when it has none: score every token)."""
    path = Path(folder) / VOCAB_FILE
    if not path.is_file():
        return None
    try:
        return load_file(path)["ids"].long()
    except Exception as err:  # safetensors raises its own error types for a damaged file
        raise InputError(f"unreadable drafting vocabulary {path} ({err.__class__.__name__})") from None


def check_choice(choice: str) -> str:
    if choice not in CHOICES:
        raise InputError(f"draft vocabulary must be one of {', '.join(CHOICES)} (got {choice!r})")
    return choice
