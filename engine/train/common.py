"""What both trainers share: seeding, the learning-rate schedule, the training vocabulary and
the card's common fields."""

from __future__ import annotations

import math
import platform
import random

import torch
import transformers

from engine.models import LoadedModel
from engine.train.data import Dataset, Example


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def cosine_lr(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of lr.

    >>> [round(cosine_lr(s, 100, 1.0, 10), 2) for s in (0, 9, 10, 99)]
    [0.1, 1.0, 1.0, 0.1]
    """
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - 1 - warmup)
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train_vocabulary(examples: list[Example], top: int = 4) -> torch.Tensor:
    """The tokens the training data mentions: its sequences and the target's `top` likeliest
    tokens at every position, sorted. Heads are trained with the softmax over these only (4 heads
    x the full vocabulary costs too much on a small CPU); they are evaluated over the full one."""
    ids = torch.cat([torch.cat([e.ids.long(), e.top_ids[:, :top].long().flatten()]) for e in examples])
    return torch.unique(ids)


def card_base(kind: str, target: LoadedModel, data: Dataset, command: str) -> dict:
    return {
        "kind": kind,
        "target": target.spec,
        "hidden_size": int(target.model.config.get_text_config().hidden_size),
        "vocab_size": target.vocab_size,
        "storage": "float16 safetensors: trained parameters only; embedding, final norm and LM head come from the target",
        "command": command,
        "data": {
            **data.info,
            "train_sequences": len(data.split("train")),
            "heldout_sequences": len(data.split("heldout")),
            "train_tokens": data.tokens("train"),
            "heldout_tokens": data.tokens("heldout"),
        },
        "environment": {
            "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads(), "machine": platform.machine(),
        },
    }
