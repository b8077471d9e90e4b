"""What both trainers share: seeding, the learning-rate schedule, the training vocabulary and
the card's common fields."""

from __future__ import annotations

import json
import math
import platform
import random
from pathlib import Path

import torch
import transformers

from engine.drafters.vocab import VOCAB_FILE, save_vocabulary
from engine.models import LoadedModel
from engine.mtp.weights import CARD_FILE
from engine.train.data import Dataset, Example


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


CALIBRATION_STEPS = 5  # with a time budget: steps timed before the schedule's length is fixed


def budget_steps(steps: int, minutes: float, step: int, elapsed: float) -> int:
    """The schedule's length: `steps`, or with a time budget (minutes > 0), once CALIBRATION_STEPS
    steps are timed, as many steps as fit the budget at their pace.

    >>> budget_steps(100, 0.0, 5, 10.0), budget_steps(100, 1.0, 4, 1.0), budget_steps(100, 1.0, 5, 10.0)
    (100, 100, 30)
    """
    if minutes <= 0 or step != CALIBRATION_STEPS:
        return steps
    return max(CALIBRATION_STEPS + 1, int(minutes * 60 / (elapsed / CALIBRATION_STEPS)))


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


FIRST_IDS = 8192  # the tokenizer's first ids join every drafting vocabulary (BPE merge order ~ frequency)


def drafting_vocabulary(examples: list[Example], first_ids: int = FIRST_IDS) -> torch.Tensor:
    """The tokens a trained drafter scores at run time (engine/drafters/vocab.py): the training
    vocabulary plus the tokenizer's first `first_ids` ids, sorted."""
    return torch.unique(torch.cat([train_vocabulary(examples), torch.arange(first_ids)]))


def write_vocabulary(folder: Path, data: Dataset, vocab_size: int) -> dict:
    """Save the drafting vocabulary beside trained weights and record it in their card: its size
    and how many held-out target tokens it holds (a drafter can never propose the others)."""
    ids = drafting_vocabulary(data.split("train"))
    ids = ids[ids < vocab_size]
    held = torch.cat([e.ids[e.prompt_len:].long() for e in data.split("heldout")] or [torch.zeros(0, dtype=torch.long)])
    inside = torch.isin(held, ids)
    entry = {
        "file": VOCAB_FILE, "tokens": int(ids.numel()), "first_ids": FIRST_IDS,
        "made_of": "the training data's tokens and the target's top-4 at every position, plus the first ids",
        "heldout_coverage": round(float(inside.float().mean()), 4) if held.numel() else None,
    }
    save_vocabulary(folder, ids)
    card_path = Path(folder) / CARD_FILE
    card = json.loads(card_path.read_text())
    card["draft_vocabulary"] = entry
    card_path.write_text(json.dumps(card, indent=2) + "\n")
    return entry


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
