"""The distilled draft model: a small causal LM of the target's own architecture made of the
target's first L decoder layers (trained by `python -m engine.train draft-model` to match the
target's next-token distribution), sharing the target's embedding, final norm and LM head.

Only the L trained layers are stored (engine/weights/<name>/); the shared modules are the
target's own objects at load time (no second copy). Loaded through the draft spec
"distilled:<name or folder>" (engine.models.load_model), so `--method draft-model` uses it like
any other draft model, with its own KV cache.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from engine.errors import InputError
from engine.models import LoadedModel
from engine.mtp.weights import load_weights, read_card

KIND = "draft-model"


def build_draft(target: LoadedModel, layers: int) -> torch.nn.Module:
    """A model of the target's class with copies of its first `layers` decoder layers, sharing
    its embedding, final norm, rotary embedding and LM head (the same modules)."""
    base = target.model
    n = base.config.num_hidden_layers
    if not 1 <= layers < n:
        raise InputError(f"a distilled draft needs 1..{n - 1} layers of this target (got {layers})")
    config = copy.deepcopy(base.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    with torch.device("meta"):
        draft = type(base)(config)
    draft.model.embed_tokens = base.model.embed_tokens
    draft.model.norm = base.model.norm
    draft.model.rotary_emb = base.model.rotary_emb
    draft.model.layers = torch.nn.ModuleList(copy.deepcopy(layer) for layer in base.model.layers[:layers])
    draft.lm_head = base.get_output_embeddings()
    if any(t.is_meta for t in [*draft.parameters(), *draft.buffers()]):
        raise InputError(f"cannot build a distilled draft for {type(base).__name__} (unexpected modules)")
    return draft.eval()


def layer_weights(draft: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained (stored) parameters: the decoder layers only."""
    return {f"layers.{k}": v for k, v in draft.model.layers.state_dict().items()}


def load_distilled(spec: str, folder: Path, target: LoadedModel) -> LoadedModel:
    card = read_card(folder, KIND)
    if card["vocab_size"] != target.vocab_size or card["hidden_size"] != target.model.config.hidden_size:
        raise InputError(f"the draft model in {folder} does not fit {target.spec!r} (hidden size or vocabulary)")
    draft = build_draft(target, card["layers"])
    weights = load_weights(folder, target.device, target.dtype)
    layers = {k.removeprefix("layers."): v for k, v in weights.items()}
    draft.model.layers.load_state_dict(layers, strict=True)
    return LoadedModel(spec, draft.requires_grad_(False), target.tokenizer, target.device, target.dtype)
