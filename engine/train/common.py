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
from engine.models import LoadedModel, cpu_bf16_flags
from engine.mtp.weights import CARD_FILE
from engine.train.data import Dataset, Example


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def fast_bfloat16(device: torch.device | str) -> bool:
    """Whether bfloat16 autocast speeds training up on this device: on CUDA and on CPUs with
    bfloat16 matrix instructions; elsewhere torch emulates bfloat16, far slower than float32 (on an
    AVX2-only Zen 3 a module training step ran over 5 minutes, against 5.6 s in float32; the
    corpus's forward pass 7x slower: tools/train_speed.py), so training runs in float32 there.

    >>> fast_bfloat16("cuda"), fast_bfloat16("cpu") == bool(cpu_bf16_flags())
    (True, True)
    """
    kind = torch.device(device).type
    return kind == "cuda" or (kind == "cpu" and bool(cpu_bf16_flags()))


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


DRAFT_VOCAB_SIZE = 8192  # tokens in a shipped drafting vocabulary (before the request's own join at run time)


def drafting_vocabulary(answers: list[torch.Tensor], vocab_size: int, size: int = DRAFT_VOCAB_SIZE) -> torch.Tensor:
    """The tokens a trained drafter scores at run time (engine/drafters/vocab.py): the `size`
    tokens the target emits most often in the training answers (FR-Spec, Zhao et al. 2025),
    sorted; ties, and the rest of a short list, go to the lower ids (BPE merge order: the more
    frequent pieces). `answers`: each answer's emitted tokens."""
    counts = torch.bincount(torch.cat([a.long() for a in answers] or [torch.zeros(0, dtype=torch.long)]),
                            minlength=vocab_size)[:vocab_size]
    ranked = torch.sort(counts, descending=True, stable=True).indices
    return torch.sort(ranked[:min(size, vocab_size)]).values


def vocabulary_coverage(ids: torch.Tensor, sequences: list[tuple[torch.Tensor, int]], vocab_size: int) -> dict:
    """How many answer tokens of these (ids, prompt_len) sequences a drafter with this
    vocabulary could propose at all: with the subset alone, and with the request's own earlier
    tokens joining it (what run time does)."""
    base = torch.zeros(vocab_size, dtype=torch.bool)
    base[ids] = True
    inside = with_context = total = 0
    for seq, prompt_len in sequences:
        seq = seq.long()
        seen = base.clone()
        seen[seq[:prompt_len]] = True
        for token in seq[prompt_len:].tolist():
            inside += bool(base[token])
            with_context += bool(seen[token])
            seen[token] = True
            total += 1
    if not total:
        return {"heldout_coverage": None, "heldout_coverage_with_context": None}
    return {"heldout_coverage": round(inside / total, 4), "heldout_coverage_with_context": round(with_context / total, 4)}


def write_vocabulary(folder: Path, train: list[tuple[torch.Tensor, int]], heldout: list[tuple[torch.Tensor, int]],
                     vocab_size: int, command: str | None = None) -> dict:
    """Save the drafting vocabulary beside trained weights and record it in their card: its size
    and how many held-out answer tokens a drafter could propose with it. `train` / `heldout`:
    (ids, prompt_len) of each answered prompt; `command`: what wrote it, when not the training run."""
    ids = drafting_vocabulary([seq[prompt_len:] for seq, prompt_len in train], vocab_size)
    entry = {
        "file": VOCAB_FILE, "tokens": int(ids.numel()),
        "made_of": f"the {DRAFT_VOCAB_SIZE} tokens the target emits most often in the training answers; at run time "
                   "the request's own tokens (prompt and output so far) join them",
        **vocabulary_coverage(ids, heldout, vocab_size),
    } | ({"command": command} if command else {})
    save_vocabulary(folder, ids)
    card_path = Path(folder) / CARD_FILE
    card = json.loads(card_path.read_text())
    card["draft_vocabulary"] = entry
    card_path.write_text(json.dumps(card, indent=2) + "\n")
    return entry


def answered(examples) -> list[tuple[torch.Tensor, int]]:
    """(ids, prompt_len) of each example (engine/train/data.py's Example, or a corpus Sequence)."""
    return [(e.ids, e.prompt_len) for e in examples]


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
