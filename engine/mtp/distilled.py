"""The distilled draft model: a small causal LM of the target's own architecture made of the
target's first L decoder layers and a copy of its final norm (trained by `python -m engine.train
draft-model` to match the target's next-token distribution), sharing the target's embedding and
LM head.

Only the trained layers and norm are stored (engine/weights/<name>/); the shared modules are
the target's own objects at load time (no second copy). Loaded through the draft spec
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
    """A model of the target's class with copies of its first `layers` decoder layers and of its
    final norm, sharing its embedding, rotary embedding and LM head (the same modules)."""
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
    draft.model.norm = copy.deepcopy(base.model.norm)  # layer L's outputs differ in scale from layer N's
    draft.model.rotary_emb = base.model.rotary_emb
    draft.model.layers = torch.nn.ModuleList(copy.deepcopy(layer) for layer in base.model.layers[:layers])
    draft.lm_head = base.get_output_embeddings()
    if any(t.is_meta for t in [*draft.parameters(), *draft.buffers()]):
        raise InputError(f"cannot build a distilled draft for {type(base).__name__} (unexpected modules)")
    return draft.eval()


def trained_modules(draft: torch.nn.Module) -> torch.nn.ModuleDict:
    """What training changes and the weights file stores: the decoder layers and the norm."""
    return torch.nn.ModuleDict({"layers": draft.model.layers, "norm": draft.model.norm})


def load_distilled(spec: str, folder: Path, target: LoadedModel) -> LoadedModel:
    card = read_card(folder, KIND)
    if card["vocab_size"] != target.vocab_size or card["hidden_size"] != target.model.config.hidden_size:
        raise InputError(f"the draft model in {folder} does not fit {target.spec!r} (hidden size or vocabulary)")
    draft = build_draft(target, card["layers"])
    trained_modules(draft).load_state_dict(load_weights(folder, target.device, target.dtype), strict=True)
    return LoadedModel(spec, draft.requires_grad_(False), target.tokenizer, target.device, target.dtype)
