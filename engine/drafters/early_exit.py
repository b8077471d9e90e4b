"""early-exit (self-speculative): the target's first L layers + final norm + LM head draft.

The drafter is a view of the target that shares its modules (no second copy of any weight);
it keeps its own KV cache for those L layers. A model not trained for early exit drafts poorly
from shallow layers: low acceptance here is the lesson, not a bug (LayerSkip, Elhoushi et al.
2024, trains for it).
"""

from __future__ import annotations

import copy

import torch

from engine.drafters.base import DraftProposal, DrafterSpec, register
from engine.drafters.cached_lm import CachedLM
from engine.errors import InputError
from engine.models import LoadedModel
from engine.sampling import SamplingConfig


def shallow_view(model: torch.nn.Module, layers: int) -> torch.nn.Module:
    """A model object running only the first `layers` decoder layers of `model`, sharing every
    parameter with it."""
    inner = copy.copy(model.model)
    inner._modules = dict(inner._modules)
    inner.layers = torch.nn.ModuleList(list(model.model.layers[:layers]))
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    inner.config = config
    outer = copy.copy(model)
    outer._modules = dict(outer._modules)
    outer.model = inner
    outer.config = config
    return outer


class EarlyExitDrafter:
    name = "early-exit"

    def __init__(self, target: LoadedModel, exit_layer: int, stop: float = 0.0):
        n = target.model.config.num_hidden_layers
        if not 1 <= exit_layer <= n - 1:
            raise InputError(f"exit layer must be in 1..{n - 1} for this model (got {exit_layer})")
        self.exit_layer = exit_layer
        self.stop = stop  # DrafterSpec.draft_stop
        self.lm = CachedLM(shallow_view(target.model, exit_layer), target.device, target.vocab_size)

    def propose(self, context: list[int], k: int, sampling: SamplingConfig, rng: torch.Generator) -> DraftProposal:
        ids, probs = self.lm.draft(context, k, sampling, rng, self.stop)
        return DraftProposal(ids, probs, {"exit_layer": self.exit_layer})

    def observe(self, context: list[int], accepted: int, hidden: torch.Tensor) -> None:
        """Nothing to do: the next propose() crops the cache to what the target kept."""


@register("early-exit")
def _build(target: LoadedModel, spec: DrafterSpec) -> EarlyExitDrafter:
    layers = spec.exit_layer or max(1, target.model.config.num_hidden_layers // 4)
    return EarlyExitDrafter(target, layers, spec.draft_stop)
