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


class Fusion(torch.nn.Module):
    """EAGLE-3's fused features (Li et al. 2025), added to DeepSeek's design: the target's hidden
    states at a few earlier depths (`feature_layers`: i is the state after i decoder layers,
    transformers' hidden_states[i]), each RMS-normalised, projected F*H -> H and added to the final hidden state that
    depth 1 reads. Low layers still say which token sits at a position (what a one-layer drafter
    needs to look back at what followed the same token), middle ones carry what the last layer
    has already turned into a next-token guess. The projection starts at zero, so a module trained
    without features starts out drafting exactly as before."""

    def __init__(self, hidden: int, feature_layers: tuple[int, ...], norm: torch.nn.Module):
        super().__init__()
        self.feature_layers = tuple(int(i) for i in feature_layers)
        self.norms = torch.nn.ModuleList(copy.deepcopy(norm) for _ in self.feature_layers)
        for n in self.norms:
            torch.nn.init.ones_(n.weight)
        self.proj = torch.nn.Linear(len(self.feature_layers) * hidden, hidden, bias=False)
        torch.nn.init.zeros_(self.proj.weight)

    def forward(self, hidden: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """hidden (..., H), features (..., F * H) -> (..., H) in hidden's dtype."""
        parts = features.to(self.proj.weight.dtype).chunk(len(self.norms), dim=-1)
        fused = self.proj(torch.cat([n(p) for n, p in zip(self.norms, parts)], -1))
        return (hidden.to(fused.dtype) + fused).to(hidden.dtype)


def check_feature_layers(feature_layers: tuple[int, ...], layers: int) -> None:
    """Feature layers are states before the final one: 0 (the embeddings) .. layers - 1."""
    if any(not 0 <= i < layers for i in feature_layers):
        raise InputError(f"feature layers are 0..{layers - 1} for this target (got {list(feature_layers)})")


def build_module(target: LoadedModel, layers: int = 1, feature_layers: tuple[int, ...] = ()) -> torch.nn.Module:
    """A new MTP module for the target (initialised from its last layer and final norm), its
    layers float32 on the target's device; the shared embedding and LM head are the target's
    modules (never move or cast the whole module: that would change the target's). With
    feature_layers the module also has a `fusion` (EAGLE-3's fused features, zero at first),
    else `fusion` is None."""
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
    module.fusion = None
    if feature_layers:
        check_feature_layers(feature_layers, len(decoder.layers))
        module.fusion = Fusion(hidden, feature_layers, decoder.norm).to(target.device, torch.float32)
    return module


def trained_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What training changes and the weights file stores: the MTP layers (and the fusion)."""
    fusion = {} if module.fusion is None else {f"fusion.{k}": v for k, v in module.fusion.state_dict().items()}
    return {f"layers.{k}": v for k, v in module.layers.state_dict().items()} | fusion


def load_trained(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Puts a weights file's tensors (trained_state's names) into a module built with the same
    layers and feature layers."""
    module.layers.load_state_dict({k.removeprefix("layers."): v for k, v in state.items() if k.startswith("layers.")},
                                  strict=True)
    fusion = {k.removeprefix("fusion."): v for k, v in state.items() if k.startswith("fusion.")}
    if (module.fusion is None) != (not fusion):
        raise InputError("the weights and the card disagree on the fused features")
    if module.fusion is not None:
        module.fusion.load_state_dict(fusion, strict=True)


def load_module(folder: Path, target: LoadedModel) -> tuple[torch.nn.Module, dict]:
    """A trained module for this target, on its device and dtype, and its card."""
    card = read_card_for(folder, KIND, target, "MTP module")
    module = build_module(target, card["layers"], tuple(card.get("feature_layers", ())))
    load_trained(module, load_weights(folder, "cpu", torch.float32))
    module.layers.to(target.device, target.dtype).requires_grad_(False)
    if module.fusion is not None:
        module.fusion.to(target.device, target.dtype).requires_grad_(False)
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
