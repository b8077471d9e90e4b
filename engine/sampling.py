"""Sampling transforms and sampling, shared by the target and every drafter.

The same `probs_from_logits` is applied to draft and target logits before acceptance, so the
speculative rule compares like with like (DESIGN.md, Acceptance).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.errors import InputError

MAX_TOP_K = 1_000_000


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 means greedy (argmax); > 0 samples
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the smallest set whose mass reaches top_p; 1.0 keeps all
    seed: int = 0  # seeds the uniform draws of a run (sampling is reproducible)

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature):
            raise InputError("temperature must be a number >= 0")
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0 (got {self.temperature})")
        if self.temperature > 100:
            raise InputError(f"temperature must be <= 100 (got {self.temperature})")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k <= MAX_TOP_K:
            raise InputError(f"top-k must be an integer >= 0 (got {self.top_k})")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise InputError(f"top-p must be in (0, 1] (got {self.top_p})")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise InputError(f"seed must be a non-negative integer (got {self.seed})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Turn logits (..., V) into the distribution tokens are drawn from, (..., V) float32.

    Greedy decoding decides by argmax; its probabilities are the plain softmax (temperature 1),
    kept for display. Sampling applies temperature, then top-k, then top-p, as transformers does.

    >>> cfg = SamplingConfig(temperature=1.0, top_k=2)
    >>> [round(p, 3) for p in probs_from_logits(torch.tensor([0.0, 1.0, 2.0]), cfg).tolist()]
    [0.0, 0.269, 0.731]
    """
    logits = logits.float()
    if cfg.greedy:
        return torch.softmax(logits, dim=-1)
    logits = logits / cfg.temperature
    vocab = logits.shape[-1]
    if 0 < cfg.top_k < vocab:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # mass strictly before each token; a token is kept while that mass is below top_p
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def sample(probs: torch.Tensor, uniform: float) -> int:
    """Draw one token from probs (V,) by inverting its CDF at `uniform` in [0, 1).

    The draw is passed in, so tests can force any outcome and traces can replay it.

    >>> sample(torch.tensor([0.25, 0.5, 0.25]), 0.1), sample(torch.tensor([0.25, 0.5, 0.25]), 0.7)
    (0, 1)
    """
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = uniform * cdf[-1].item()
    idx = int(torch.searchsorted(cdf, torch.tensor([target], dtype=cdf.dtype), right=True).item())
    idx = min(idx, probs.shape[-1] - 1)
    while probs[idx] <= 0 and idx > 0:  # never land on a zero-probability token at the edge
        idx -= 1
    return idx


def choose(probs: torch.Tensor, logits: torch.Tensor, cfg: SamplingConfig, uniform: float) -> int:
    """The token plain decoding emits: argmax when greedy, else a draw from probs."""
    if cfg.greedy:
        return int(torch.argmax(logits).item())
    return sample(probs, uniform)
