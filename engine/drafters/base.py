"""The Drafter protocol, the proposal it returns, and the registry of drafters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.errors import InputError
from engine.models import LoadedModel
from engine.sampling import SamplingConfig


@dataclass(frozen=True)
class DraftProposal:
    token_ids: torch.Tensor  # (k',) drafted tokens, k' <= k (a drafter may find nothing to propose)
    probs: torch.Tensor | None  # (k', V) draft_probs after the shared transform; None: one-hot
    extra: dict = field(default_factory=dict)  # drafter-specific detail kept in the trace


class Drafter(Protocol):
    name: str

    def propose(
        self, context: list[int], k: int, sampling: SamplingConfig, rng: torch.Generator
    ) -> DraftProposal:
        """Draft up to k tokens continuing `context` (prompt + output so far)."""
        ...

    def observe(self, context: list[int], accepted: int, hidden: torch.Tensor) -> None:
        """Told after the prefill (accepted = 0) and after each step: the new context, how many
        drafts were kept, and the target's final hidden state (H,) at the position whose logits
        chose the last token of context (MTP heads draft from it; others may ignore it)."""
        ...


@dataclass(frozen=True)
class DrafterSpec:
    """What a run asks for; each drafter reads the fields it needs."""

    method: str
    draft: str | None = None  # draft-model: preset, folder or hub id of the draft model
    ngram_max: int = 3  # prompt-lookup: longest n-gram matched
    ngram_min: int = 1  # prompt-lookup: shortest n-gram matched
    exit_layer: int = 0  # early-exit: layers used (0: a quarter of the target's layers)
    tree: str | None = None  # mtp: tree shape name (None: chain drafting)


DrafterFactory = Callable[[LoadedModel, DrafterSpec], Drafter]
_REGISTRY: dict[str, DrafterFactory] = {}


def register(method: str) -> Callable[[DrafterFactory], DrafterFactory]:
    def deco(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[method] = factory
        return factory

    return deco


def drafter_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def build_drafter(target: LoadedModel, spec: DrafterSpec) -> Drafter | None:
    """The drafter for spec.method; None for plain decoding ("baseline")."""
    if spec.method == "baseline":
        return None
    factory = _REGISTRY.get(spec.method)
    if factory is None:
        raise InputError(f"unknown method {spec.method!r} (baseline, {', '.join(_REGISTRY)})")
    return factory(target, spec)
