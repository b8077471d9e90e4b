"""A DeepSeek-V3-style MTP module trained here, for a target that ships no MTP layers.

DeepSeek-V3 (DeepSeek-AI 2024, section 2.2) predicts further tokens with sequential modules: at
depth d, position i, RMSNorm of the previous depth's hidden state h^{d-1}_i (d = 1: the target's
final hidden state) and RMSNorm of the embedding of token x_{i+d} (the token just chosen there)
are concatenated, projected 2H -> H, and passed through one decoder block of the target's own
kind with its own KV cache; the target's LM head (shared, frozen) turns the result into the
distribution of x_{i+d+1}. Unlike Medusa heads (engine/mtp/heads.py), every depth knows the token
chosen before it.

The module is transformers' own MtpModel (the class a target with native MTP layers loads, so
engine/mtp/native.py drives both alike), built around the target with `layers` MTP layers: per
layer enorm, hnorm, eh_proj, a decoder block of the target's class and a post norm standing in
for the target's final norm. One layer is reused across depths (depth d runs layer (d-1) mod L,
as vLLM does when k exceeds the layers). Only the layers are stored (engine/weights/mtp-module/,
float16, with card.json); embedding, LM head and rotary embedding are the target's.

Initialisation (training starts from the target's own parts): the block is a copy of the
target's last decoder layer, the post norm a copy of its final norm, and eh_proj passes the
normalised hidden state through ([0 | I]), so before training the module maps h to roughly what
the target's last layer would.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from engine.errors import InputError
from engine.models import LoadedModel
from engine.mtp.weights import load_weights, read_card_for

KIND = "mtp-module"
DRAFT_ATTENTION = "sdpa"  # training's attention; load_module gives a batch-invariant target's module its kernels


class _Main:
    """What transformers' MtpModel reads of its main model, with a config that declares `layers`
    MTP layers (the target's own config is left alone: it declares none)."""

    def __init__(self, model: torch.nn.Module, layers: int):
        self.config = copy.deepcopy(model.config)
        self.config.num_mtp_layers = layers
        self.config._attn_implementation = DRAFT_ATTENTION
        self._model = model
        self.lm_head = model.get_output_embeddings()

    def get_decoder(self):
        return self._model.get_decoder()

    def get_input_embeddings(self):
        return self._model.get_input_embeddings()


def build_module(target: LoadedModel, layers: int = 1) -> torch.nn.Module:
    """A new MTP module for the target (initialised from its last layer and final norm), its
    layers float32 on the target's device; the shared embedding and LM head are the target's
    modules (never move or cast the whole module: that would change the target's)."""
    from transformers.modeling_layers import MtpModel

    if not 1 <= layers <= 8:
        raise InputError(f"an MTP module has 1..8 layers (got {layers})")
    base = target.model
    decoder = base.get_decoder()
    if not hasattr(decoder, "layers") or not hasattr(decoder, "norm"):
        raise InputError(f"cannot build an MTP module for {type(base).__name__} (no decoder layers / final norm)")
    module = MtpModel(_Main(base, layers), layers)
    hidden = base.config.get_text_config().hidden_size
    with torch.no_grad():
        for layer in module.layers:
            layer.mtp_block.load_state_dict(decoder.layers[-1].state_dict())
            layer.post_norm.load_state_dict(decoder.norm.state_dict())
            layer.eh_proj.weight.zero_()
            layer.eh_proj.weight[:, hidden:].copy_(torch.eye(hidden))
    module.layers.to(target.device, torch.float32)  # (only the layers: the rest is the target's own)
    return module


def trained_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What training changes and the weights file stores: the MTP layers only."""
    return {f"layers.{k}": v for k, v in module.layers.state_dict().items()}


def load_module(folder: Path, target: LoadedModel) -> tuple[torch.nn.Module, dict]:
    """A trained module for this target, on its device and dtype, and its card."""
    card = read_card_for(folder, KIND, target, "MTP module")
    module = build_module(target, card["layers"])
    state = {k.removeprefix("layers."): v for k, v in load_weights(folder, "cpu", torch.float32).items()}
    module.layers.load_state_dict(state, strict=True)
    module.layers.to(target.device, target.dtype).requires_grad_(False)
    if target.batch_invariant:
        # the target's fast CPU kernels (prepacked products, blocked attention): drafting need
        # not be batch-invariant (the target's verification decides), but these are the faster
        # kernels here: SDPA over 1K cached keys costs 5x the invariant attention for one query
        from engine.invariant import make_invariant
        from engine.mtp.native import full_attention

        make_invariant(module)
        if full_attention(module.config):
            module.create_masks_for_mtp_layer = _causal_masks  # (this instance only)
    return module.eval(), card


def _causal_masks(layer_idx, inputs_embeds, mtp_cache, position_ids) -> dict:
    """A drafting depth's rows attend causally over its own cache with the new rows last (a chain's
    depth, and each branch of a tree, one batch entry per branch), which the batch-invariant
    attention reads from no mask at all (engine.invariant._visible): MtpModel.forward_layer would
    otherwise build a boolean mask at every depth of every draft (about 0.1 ms each on a 2-core
    CPU) for the attention to turn back into the same causal plan. The drafts are bitwise the same
    (tests/test_mtp.py)."""
    return {"attention_mask": None}
