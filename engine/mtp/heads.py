"""Medusa-style MTP heads (Cai et al. 2024, Medusa-1) on the target's final hidden state.

Head i (0-based) reads the hidden state h_t at the position whose logits chose the next token
x_{t+1}, and predicts x_{t+2+i}: one residual block h + SiLU(W h + b) per head, then the target's
own LM head (shared, frozen). W and b start at zero, so an untrained head is the identity: it repeats
the target's own prediction there (the token just chosen); training moves it ahead. Only the
blocks are stored.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from engine.models import LoadedModel
from engine.mtp.weights import load_weights, read_card_for

KIND = "mtp-heads"


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # the identity at initialisation
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MTPHeads(nn.Module):
    def __init__(self, hidden_size: int, heads: int):
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock(hidden_size) for _ in range(heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., H) final hidden states -> (..., heads, H) inputs of the shared LM head."""
        return torch.stack([block(hidden) for block in self.blocks], dim=-2)


def load_heads(folder: Path, target: LoadedModel) -> tuple[MTPHeads, dict]:
    """Heads trained for this target's hidden size, on its device and dtype, and their card."""
    card = read_card_for(folder, KIND, target, "MTP heads")
    heads = MTPHeads(card["hidden_size"], card["heads"])
    heads.load_state_dict(load_weights(folder, "cpu", torch.float32))
    return heads.to(target.device, target.dtype).eval().requires_grad_(False), card
